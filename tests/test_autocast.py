"""Under torch.autocast our functional and module APIs behave like torch's own norms in the same situation.

The expected dtypes are computed in each test by running torch.nn.functional.layer_norm / rms_norm and
torch.nn.LayerNorm / RMSNorm (residual variants: ``h = x + r`` then the torch norm) under the same autocast;
nothing is hard-coded. On CPU autocast leaves the norms alone; on CUDA ATen runs them in float32, and so must we.
Values (outputs and gradients) follow the suite's rule: no worse than ATen against a float64 reference.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import layernorm_ext
from conftest import assert_no_worse_than_aten

# ATen's own warning when its rms_norm gets a float32 weight with a half-precision input.
pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
AUTOCAST_DTYPES = [BF16, F16]
N = 40
# The functional cases pass an explicit RMSNorm eps, so that they test autocast alone; the module cases use the
# modules' default eps (None), as users do.
RMS_EPS = 1e-6

# fn(x, residual, weight, bias) -> one tensor or (out, residual_out)
NormFn = Callable[[Tensor, Tensor | None, Tensor | None, Tensor | None], Tensor | tuple[Tensor, ...]]


@dataclass(frozen=True)
class Variant:
    name: str
    ours: NormFn
    torch_fn: NormFn
    residual: bool
    bias: bool


def _torch_add_layer_norm(x: Tensor, r: Tensor | None, w: Tensor | None, b: Tensor | None) -> tuple[Tensor, Tensor]:
    assert r is not None
    h = x + r
    return F.layer_norm(h, [N], w, b), h


def _torch_add_rms_norm(x: Tensor, r: Tensor | None, w: Tensor | None, b: Tensor | None) -> tuple[Tensor, Tensor]:
    assert r is not None
    h = x + r
    return F.rms_norm(h, [N], w, RMS_EPS), h


VARIANTS: list[Variant] = [
    Variant(
        "layer_norm",
        lambda x, r, w, b: layernorm_ext.layer_norm(x, N, w, b),
        lambda x, r, w, b: F.layer_norm(x, [N], w, b),
        residual=False,
        bias=True,
    ),
    Variant(
        "rms_norm",
        lambda x, r, w, b: layernorm_ext.rms_norm(x, N, w, RMS_EPS),
        lambda x, r, w, b: F.rms_norm(x, [N], w, RMS_EPS),
        residual=False,
        bias=False,
    ),
    Variant(
        "add_layer_norm",
        lambda x, r, w, b: layernorm_ext.add_layer_norm(x, r, N, w, b),  # type: ignore[arg-type]
        _torch_add_layer_norm,
        residual=True,
        bias=True,
    ),
    Variant(
        "add_rms_norm",
        lambda x, r, w, b: layernorm_ext.add_rms_norm(x, r, N, w, RMS_EPS),  # type: ignore[arg-type]
        _torch_add_rms_norm,
        residual=True,
        bias=False,
    ),
]

# (input dtype, weight/bias dtype or None for no affine parameters). The residual has the input's dtype.
DTYPE_CASES: list[tuple[torch.dtype, torch.dtype | None]] = [
    (F32, F32),
    (F32, None),
    (BF16, F32),
    (BF16, BF16),
    (F16, F32),
    (F16, None),
]


def _as_list(o: Tensor | tuple[Tensor, ...]) -> list[Tensor]:
    return list(o) if isinstance(o, tuple) else [o]


def _make_leaves(
    device: str, x_dtype: torch.dtype, p_dtype: torch.dtype | None, residual: bool, bias: bool, seed: int
) -> list[Tensor | None]:
    gen = torch.Generator().manual_seed(seed)

    def rnd(shape: Sequence[int], dtype: torch.dtype, offset: float = 0.0) -> Tensor:
        t = torch.randn(tuple(shape), generator=gen, dtype=F64) + offset
        return t.to(device=device, dtype=dtype).requires_grad_()

    x = rnd((3, 5, N), x_dtype, 0.3)
    r = rnd((3, 5, N), x_dtype) if residual else None
    w = rnd((N,), p_dtype, 1.0) if p_dtype is not None else None
    b = rnd((N,), p_dtype) if (p_dtype is not None and bias) else None
    return [x, r, w, b]


def _fresh(leaves: Sequence[Tensor | None], dtype: torch.dtype | None = None) -> list[Tensor | None]:
    return [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in leaves]


def _fwd_bwd(
    fn: NormFn, leaves: list[Tensor | None], cotangents: list[Tensor], autocast: tuple[str, torch.dtype] | None
) -> tuple[list[Tensor], list[Tensor | None]]:
    if autocast is None:
        outs = _as_list(fn(*leaves))  # type: ignore[arg-type]
    else:
        with torch.autocast(autocast[0], dtype=autocast[1]):
            outs = _as_list(fn(*leaves))  # type: ignore[arg-type]
    torch.autograd.backward(outs, [c.to(o.dtype) for c, o in zip(cotangents, outs, strict=True)])
    return [o.detach() for o in outs], [None if t is None else t.grad for t in leaves]


def check_against_torch(device: str, autocast_dtype: torch.dtype, variant: Variant, x_dtype: torch.dtype,
                        p_dtype: torch.dtype | None, seed: int = 0) -> None:
    leaves = _make_leaves(device, x_dtype, p_dtype, variant.residual, variant.bias, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    n_out = 2 if variant.residual else 1
    cotangents = [torch.randn((3, 5, N), generator=gen, dtype=F64).to(device) for _ in range(n_out)]
    ac = (device, autocast_dtype)
    aten_outs, aten_grads = _fwd_bwd(variant.torch_fn, _fresh(leaves), cotangents, ac)
    ours_outs, ours_grads = _fwd_bwd(variant.ours, _fresh(leaves), cotangents, ac)

    # The dtypes torch gives are the contract (assert_no_worse_than_aten also checks them).
    assert [o.dtype for o in ours_outs] == [o.dtype for o in aten_outs]
    assert [None if g is None else g.dtype for g in ours_grads] == [None if g is None else g.dtype for g in aten_grads]

    # float64 reference: torch's computation on the inputs the norm actually sees, in float64. Under autocast
    # the residual sum is torch's ``x + r`` (rounded to its dtype) before the norm.
    ref_leaves = _fresh(leaves, F64)
    if variant.residual:
        h_dtype = aten_outs[1].dtype
        x64, r64 = ref_leaves[0], ref_leaves[1]
        assert x64 is not None and r64 is not None
        _, _, w64, b64 = ref_leaves

        def ref_fn(x: Tensor, r: Tensor | None, w: Tensor | None, b: Tensor | None) -> tuple[Tensor, ...]:
            assert r is not None
            h = x + r
            # Round the sum to the dtype torch's h has (straight-through for the gradient).
            h = h + (h.detach().to(h_dtype).to(F64) - h.detach())
            return variant.torch_fn(h, torch.zeros_like(h), w, b)  # type: ignore[return-value]

        ref_outs, ref_grads = _fwd_bwd(ref_fn, [x64, r64, w64, b64], cotangents, None)
    else:
        # Cotangents rounded like the ones the low-precision runs see.
        ref_outs, ref_grads = _fwd_bwd(
            variant.torch_fn, ref_leaves, [c.to(aten_outs[0].dtype).to(F64) for c in cotangents], None
        )

    names = ["out", "residual_out"]
    for i, (o, a, r) in enumerate(zip(ours_outs, aten_outs, ref_outs, strict=True)):
        assert_no_worse_than_aten(o, a, r, f"{variant.name} {names[i]}")
    grad_names = ["grad_input", "grad_residual", "grad_weight", "grad_bias"]
    for name, o, a, r in zip(grad_names, ours_grads, aten_grads, ref_grads, strict=True):
        if a is None:
            assert o is None, name
            continue
        assert o is not None and r is not None, name
        assert_no_worse_than_aten(o, a, r, f"{variant.name} {name}", slack=2.0)


@pytest.mark.parametrize("dtypes", DTYPE_CASES, ids=lambda d: f"x_{d[0]}_p_{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("autocast_dtype", AUTOCAST_DTYPES, ids=["bf16", "fp16"])
def test_functional_autocast_cpu(
    autocast_dtype: torch.dtype, variant: Variant, dtypes: tuple[torch.dtype, torch.dtype | None]
) -> None:
    check_against_torch("cpu", autocast_dtype, variant, *dtypes)


@pytest.mark.cuda
@pytest.mark.parametrize("dtypes", DTYPE_CASES, ids=lambda d: f"x_{d[0]}_p_{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("autocast_dtype", AUTOCAST_DTYPES, ids=["bf16", "fp16"])
def test_functional_autocast_cuda(
    autocast_dtype: torch.dtype, variant: Variant, dtypes: tuple[torch.dtype, torch.dtype | None]
) -> None:
    check_against_torch("cuda", autocast_dtype, variant, *dtypes)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_cuda_autocast_policy_is_atens(op: str) -> None:
    """Ours has a CUDA autocast kernel exactly where the running torch's ATen op has one (rms_norm has one from
    torch 2.13 on; under 2.11 an H200 run returned bfloat16 from ATen and float32 from ours). Read off the
    dispatcher, so it runs without a GPU."""

    def autocasts(name: str) -> bool:
        return "AutocastCUDA: registered" in torch._C._dispatch_dump(name)

    assert autocasts(f"layernorm_ext::{op}_fwd") == autocasts(f"aten::{op}")


# ---- modules -----------------------------------------------------------------------------------------------------


def _module_pair(rms: bool, device: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(torch's module, ours) with the same non-trivial float32 parameters."""
    theirs: torch.nn.Module
    ours: torch.nn.Module
    if rms:
        theirs, ours = torch.nn.RMSNorm(N, device=device), layernorm_ext.FusedRMSNorm(N, device=device)
    else:
        theirs, ours = torch.nn.LayerNorm(N, device=device), layernorm_ext.FusedLayerNorm(N, device=device)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_((0.5 * torch.randn(p.shape, generator=gen)).to(p))
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


class _TorchResidual(torch.nn.Module):
    """torch's unfused pre-norm step: ``h = x + r; (norm(h), h)``."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
        h = x + r
        return self.norm(h), h


class _RoundedResidualReference(torch.nn.Module):
    """float64 reference of the pre-norm step, with the sum rounded to ``h_dtype`` (straight-through)."""

    def __init__(self, norm: torch.nn.Module, h_dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = norm
        self.h_dtype = h_dtype

    def forward(self, x: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
        h = x + r
        h = h + (h.detach().to(self.h_dtype).to(h.dtype) - h.detach())
        return self.norm(h), h


def check_modules(device: str, autocast_dtype: torch.dtype, rms: bool, x_dtype: torch.dtype, residual: bool) -> None:
    theirs, ours = _module_pair(rms, device)
    torch_mod: torch.nn.Module = _TorchResidual(theirs) if residual else theirs
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(4, 6, N, generator=gen, dtype=F64).add_(0.4).to(device=device, dtype=x_dtype)
    r = torch.randn(4, 6, N, generator=gen, dtype=F64).to(device=device, dtype=x_dtype)
    inputs = [x, r] if residual else [x]
    cot = [torch.randn(4, 6, N, generator=gen, dtype=F64).to(device) for _ in range(len(inputs))]

    def run(mod: torch.nn.Module, autocast: bool, dtype: torch.dtype | None = None) -> tuple[list[Tensor], ...]:
        leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in inputs]
        with torch.autocast(device, dtype=autocast_dtype, enabled=autocast):
            outs = _as_list(mod(*leaves))
        torch.autograd.backward(outs, [c.to(o.dtype) for c, o in zip(cot, outs, strict=True)])
        grads = [t.grad for t in leaves] + [p.grad for p in mod.parameters()]
        mod.zero_grad(set_to_none=True)
        return [o.detach() for o in outs], grads  # type: ignore[misc]

    aten_outs, aten_grads = run(torch_mod, True)
    ours_outs, ours_grads = run(ours, True)
    assert [o.dtype for o in ours_outs] == [o.dtype for o in aten_outs]
    assert [g.dtype for g in ours_grads] == [g.dtype for g in aten_grads]

    ref_norm = copy.deepcopy(theirs).to(F64)
    ref_mod = _RoundedResidualReference(ref_norm, aten_outs[1].dtype) if residual else ref_norm
    ref_outs, ref_grads = run(ref_mod, False, F64)
    names = ["out", "residual_out"][: len(ours_outs)]
    names += ["grad_input", "grad_residual"][: len(inputs)] + [n for n, _ in ours.named_parameters()]
    triples = zip(ours_outs + ours_grads, aten_outs + aten_grads, ref_outs + ref_grads, strict=True)
    for name, (o, a, ref) in zip(names, triples, strict=True):
        assert_no_worse_than_aten(o, a, ref, name, slack=1.0 if name in ("out", "residual_out") else 2.0)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("x_dtype", [F32, BF16, F16], ids=["x_fp32", "x_bf16", "x_fp16"])
@pytest.mark.parametrize("rms", [False, True], ids=["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("autocast_dtype", AUTOCAST_DTYPES, ids=["bf16", "fp16"])
def test_modules_autocast_cpu(autocast_dtype: torch.dtype, rms: bool, x_dtype: torch.dtype, residual: bool) -> None:
    check_modules("cpu", autocast_dtype, rms, x_dtype, residual)


@pytest.mark.cuda
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("x_dtype", [F32, BF16, F16], ids=["x_fp32", "x_bf16", "x_fp16"])
@pytest.mark.parametrize("rms", [False, True], ids=["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("autocast_dtype", AUTOCAST_DTYPES, ids=["bf16", "fp16"])
def test_modules_autocast_cuda(autocast_dtype: torch.dtype, rms: bool, x_dtype: torch.dtype, residual: bool) -> None:
    check_modules("cuda", autocast_dtype, rms, x_dtype, residual)


@pytest.mark.parametrize("rms", [False, True], ids=["LayerNorm", "RMSNorm"])
def test_linear_then_norm_autocast(device: str, rms: bool) -> None:
    """The common case: a Linear under autocast feeds a float32 norm module (its output is low precision)."""
    theirs, ours = _module_pair(rms, device)
    lin = torch.nn.Linear(N, N, device=device)
    x = torch.randn(8, N, generator=torch.Generator().manual_seed(13)).to(device)
    results = []
    for norm in (theirs, ours):
        with torch.autocast(device, dtype=BF16):
            y = norm(lin(x))
        y.float().square().sum().backward()
        grads = [lin.weight.grad, *[p.grad for p in norm.parameters()]]
        lin.zero_grad(set_to_none=True)
        norm.zero_grad(set_to_none=True)
        results.append((y.detach(), grads))
    (y_t, g_t), (y_o, g_o) = results
    assert y_o.dtype == y_t.dtype
    torch.testing.assert_close(y_o, y_t)
    for go, gt in zip(g_o, g_t, strict=True):
        assert go is not None and gt is not None and go.dtype == gt.dtype
        torch.testing.assert_close(go, gt, rtol=2e-2, atol=2e-2 * float(gt.abs().max()))
