"""Op-level checks: torch.library.opcheck on every op, float64 gradcheck of the functional API, and the
statistics (mean / rstd) the forward ops return.

opcheck runs the schema, autograd-registration, fake-tensor and AOT-dispatch (dynamic shapes) checks, i.e.
what torch.compile and torch.export rely on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

import layernorm_ext
from layernorm_ext.ops import residual_out_dtype

ops = torch.ops.layernorm_ext

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16


@dataclass(frozen=True)
class Case:
    """One set of forward arguments. ``param_dtype`` None means no weight (and no bias)."""

    name: str
    x_dtype: torch.dtype
    lead: tuple[int, ...]
    normalized_shape: tuple[int, ...]
    param_dtype: torch.dtype | None = None
    bias: bool = True
    residual_dtype: torch.dtype | None = None
    residual_in_fp32: bool = False
    memory_efficient: bool = False
    non_contiguous: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return self.lead + self.normalized_shape


CASES: list[Case] = [
    Case("fp32_plain", F32, (5,), (16,)),
    Case("fp32_affine_3d", F32, (3, 4), (16,), param_dtype=F32),
    Case("fp32_weight_only", F32, (6,), (12,), param_dtype=F32, bias=False),
    Case("fp64_affine_multidim", F64, (2, 3), (4, 5), param_dtype=F64),
    Case("bf16_mixed_resid_fp32", BF16, (7,), (24,), param_dtype=F32, residual_dtype=BF16, residual_in_fp32=True),
    Case("bf16_affine_resid", BF16, (4,), (32,), param_dtype=BF16, residual_dtype=BF16),
    Case("fp16_resid_promote_memeff", F16, (3,), (20,), param_dtype=F16, residual_dtype=F32, memory_efficient=True),
    Case("fp32_memeff", F32, (9,), (10,), param_dtype=F32, memory_efficient=True),
    Case("fp32_memeff_noweight", F32, (4,), (8,), memory_efficient=True),
    Case("fp64_resid_multidim_memeff", F64, (3,), (2, 6), param_dtype=F64, residual_dtype=F64, memory_efficient=True),
    Case("fp32_empty_rows", F32, (0,), (8,), param_dtype=F32),
    Case("fp32_empty_rows_resid", F32, (0, 3), (8,), param_dtype=F32, residual_dtype=F32),
    Case("fp32_non_contiguous", F32, (6,), (8,), param_dtype=F32, non_contiguous=True),
]


def _rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, offset: float = 0.0) -> Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) + offset).to(dtype)


@dataclass
class FwdArgs:
    x: Tensor
    weight: Tensor | None
    bias: Tensor | None
    residual: Tensor | None


def make_fwd_args(case: Case, rms: bool, requires_grad: bool, seed: int = 0) -> FwdArgs:
    gen = torch.Generator().manual_seed(seed)
    if case.non_contiguous:
        # Every other column of a wider tensor: a strided (non-contiguous) view.
        wide = case.lead + case.normalized_shape[:-1] + (2 * case.normalized_shape[-1],)
        x = _rand(wide, case.x_dtype, gen, 0.5)[..., ::2]
        assert not x.is_contiguous()
    else:
        x = _rand(case.shape, case.x_dtype, gen, 0.5)
    weight = bias = residual = None
    if case.param_dtype is not None:
        weight = _rand(case.normalized_shape, case.param_dtype, gen, 1.0)
        if case.bias and not rms:
            bias = _rand(case.normalized_shape, case.param_dtype, gen)
    if case.residual_dtype is not None:
        residual = _rand(case.shape, case.residual_dtype, gen)
    if requires_grad:
        for t in (x, weight, bias, residual):
            if t is not None:
                t.requires_grad_(True)
    return FwdArgs(x, weight, bias, residual)


def fwd_call(
    case: Case, a: FwdArgs, rms: bool, rms_eps: float | None = None
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    shape = list(case.normalized_shape)
    if rms:
        return ops.rms_norm_fwd.default, (
            a.x, shape, a.weight, rms_eps, a.residual, case.residual_in_fp32, case.memory_efficient,
        )
    return ops.layer_norm_fwd.default, (
        a.x, shape, a.weight, a.bias, 1e-5, a.residual, case.residual_in_fp32, case.memory_efficient,
    )


def _opcheck(op: Any, args: tuple[Any, ...]) -> None:
    results = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in results.values()), results


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_opcheck_forward(case: Case, rms: bool) -> None:
    op, args = fwd_call(case, make_fwd_args(case, rms, requires_grad=True), rms)
    _opcheck(op, args)


def saves_output(case: Case) -> bool:
    """Whether the forward of ``case`` saves its output for backward (memory_efficient without a residual)."""
    return case.memory_efficient and case.residual_dtype is None


def bwd_call(case: Case, rms: bool, requires_grad: bool = False) -> tuple[Any, tuple[Any, ...], list[Tensor]]:
    """The backward op of ``case`` and its arguments, from a forward run of the op. With ``requires_grad`` every
    differentiable argument (grad_out, saved, weight, bias, grad_residual_out) requires grad (mean / rstd,
    non-differentiable outputs of the forward, do not). Returns the op, the args and the grad-requiring ones."""
    a = make_fwd_args(case, rms, requires_grad=False)
    op, args = fwd_call(case, a, rms)
    outs = op(*args)
    out, residual_out, rstd = outs[0], outs[1], outs[-1]
    mean = None if rms else outs[2]
    gen = torch.Generator().manual_seed(1)
    grad_out = _rand(tuple(out.shape), out.dtype, gen)
    has_residual = a.residual is not None
    saved_is_output = saves_output(case)
    saved = out if saved_is_output else (residual_out if has_residual else a.x)
    grad_residual_out = _rand(tuple(residual_out.shape), residual_out.dtype, gen) if has_residual else None
    weight, bias = a.weight, a.bias
    diff: list[Tensor] = []
    if requires_grad:

        def leaf(t: Tensor | None) -> Tensor | None:
            if t is None:
                return None
            t = t.detach().requires_grad_()
            diff.append(t)
            return t

        grad_out, saved, weight, bias, grad_residual_out = (
            leaf(t) for t in (grad_out, saved, weight, bias, grad_residual_out)
        )
    shape = list(case.normalized_shape)
    if rms:
        args = (grad_out, saved, rstd, shape, weight, saved_is_output, grad_residual_out)
        return ops.rms_norm_bwd.default, args, diff
    return (
        ops.layer_norm_bwd.default,
        (grad_out, saved, mean, rstd, shape, weight, bias, saved_is_output, grad_residual_out),
        diff,
    )


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_opcheck_backward(case: Case, rms: bool) -> None:
    op, args, _ = bwd_call(case, rms)
    _opcheck(op, args)


# ---- gradcheck (float64) -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GradCase:
    name: str
    lead: tuple[int, ...]
    normalized_shape: tuple[int, ...]
    weight: bool
    bias: bool
    memory_efficient: bool
    zero_weight_entry: bool = False


GRAD_CASES: list[GradCase] = [
    GradCase("plain", (3,), (5,), weight=False, bias=False, memory_efficient=False),
    GradCase("affine", (2, 3), (4,), weight=True, bias=True, memory_efficient=False),
    GradCase("weight_only_multidim", (3,), (2, 3), weight=True, bias=False, memory_efficient=False),
    GradCase("memeff_affine", (4,), (5,), weight=True, bias=True, memory_efficient=True),
    GradCase("memeff_plain", (3,), (6,), weight=False, bias=False, memory_efficient=True),
    GradCase("memeff_zero_weight", (3,), (5,), weight=True, bias=True, memory_efficient=True, zero_weight_entry=True),
]


MaybeTensor = Tensor | None


def _grad_inputs(case: GradCase, rms: bool, residual: bool) -> tuple[Tensor, MaybeTensor, MaybeTensor, MaybeTensor]:
    gen = torch.Generator().manual_seed(2)
    shape = case.lead + case.normalized_shape
    x = _rand(shape, F64, gen, 0.3).requires_grad_()
    r = _rand(shape, F64, gen).requires_grad_() if residual else None
    w = b = None
    if case.weight:
        w = _rand(case.normalized_shape, F64, gen, 1.0)
        if case.zero_weight_entry:
            w.view(-1)[1] = 0.0
        w.requires_grad_()
    if case.bias and not rms:
        b = _rand(case.normalized_shape, F64, gen).requires_grad_()
    return x, r, w, b


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.name)
def test_gradcheck_functional(case: GradCase, rms: bool, residual: bool) -> None:
    x, r, w, b = _grad_inputs(case, rms, residual)
    ns = case.normalized_shape
    me = case.memory_efficient
    fn: Callable[..., Any]
    if rms and residual:
        fn = lambda x, r, w: layernorm_ext.add_rms_norm(x, r, ns, w, 1e-6, memory_efficient=me)  # noqa: E731
        inputs: tuple[Any, ...] = (x, r, w)
    elif rms:
        fn = lambda x, w: layernorm_ext.rms_norm(x, ns, w, 1e-6, memory_efficient=me)  # noqa: E731
        inputs = (x, w)
    elif residual:
        fn = lambda x, r, w, b: layernorm_ext.add_layer_norm(x, r, ns, w, b, 1e-5, memory_efficient=me)  # noqa: E731
        inputs = (x, r, w, b)
    else:
        fn = lambda x, w, b: layernorm_ext.layer_norm(x, ns, w, b, 1e-5, memory_efficient=me)  # noqa: E731
        inputs = (x, w, b)
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_gradcheck_module_params(rms: bool) -> None:
    """Gradients reach the module's parameters (FusedLayerNorm / FusedRMSNorm) in float64."""
    torch.manual_seed(3)
    mod: torch.nn.Module
    if rms:
        mod = layernorm_ext.FusedRMSNorm((2, 3), eps=1e-6, dtype=F64, memory_efficient=True)
    else:
        mod = layernorm_ext.FusedLayerNorm((2, 3), dtype=F64, memory_efficient=True)
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    params = tuple(mod.parameters())
    x = torch.randn(3, 2, 3, dtype=F64, requires_grad=True)

    def fn(x: Tensor, *ps: Tensor) -> Tensor:
        return torch.func.functional_call(mod, dict(zip([n for n, _ in mod.named_parameters()], ps)), (x,))

    assert torch.autograd.gradcheck(fn, (x, *[p.detach().requires_grad_() for p in params]), atol=1e-7)


# ---- statistics ----------------------------------------------------------------------------------------------


STAT_CASES = [c for c in CASES if c.name != "fp32_non_contiguous"] + [
    Case("fp32_offset_large_cols", F32, (5,), (700,), param_dtype=F32),
    Case("fp16_resid_fp32", F16, (4,), (64,), residual_dtype=F16, residual_in_fp32=True),
]


def _stat_tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-12, "atol": 1e-12} if dtype == F64 else {"rtol": 2e-5, "atol": 1e-6}


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("case", STAT_CASES, ids=lambda c: c.name)
def test_stats_outputs(case: Case, rms: bool) -> None:
    a = make_fwd_args(case, rms, requires_grad=False, seed=4)
    h_dtype = a.x.dtype if a.residual is None else residual_out_dtype(a.x, a.residual, case.residual_in_fp32)
    # eps=None (the dtype's epsilon) only where float32 and float64 agree on what that means; the default for
    # half-precision rows is checked against torch by test_rms_norm_default_eps_matches_torch.
    rms_eps = None if h_dtype in (F32, F64) else 1e-6
    op, args = fwd_call(case, a, rms, rms_eps)
    outs = op(*args)
    assert len(outs) == (3 if rms else 4)
    residual_out = outs[1]

    if a.residual is not None:
        h = a.x.to(h_dtype) + a.residual.to(h_dtype)
        assert residual_out.dtype == h_dtype
        assert residual_out.shape == a.x.shape
        torch.testing.assert_close(residual_out, h, rtol=0, atol=0)
        if not case.residual_in_fp32:
            assert h_dtype == (a.x + a.residual).dtype
    else:
        h = a.x
        assert residual_out.shape == (0,)

    stat_dtype = F64 if h_dtype == F64 else F32
    lead = tuple(case.lead)
    dims = tuple(range(len(lead), h.dim()))
    hd = h.double()
    if rms:
        (rstd,) = outs[2:]
        eps = torch.finfo(stat_dtype).eps if rms_eps is None else rms_eps  # ATen: eps of the compute dtype
        ref_rstd = torch.rsqrt(hd.pow(2).mean(dim=dims) + eps) if hd.numel() else torch.empty(lead, dtype=F64)
    else:
        mean, rstd = outs[2:]
        assert mean.dtype == stat_dtype, (mean.dtype, stat_dtype)
        assert tuple(mean.shape) == lead
        if hd.numel():
            var, ref_mean = torch.var_mean(hd, dim=dims, correction=0)
        else:  # var_mean warns about zero degrees of freedom on empty input
            var = ref_mean = torch.empty(lead, dtype=F64)
        ref_rstd = torch.rsqrt(var + 1e-5)
        torch.testing.assert_close(mean.double(), ref_mean, **_stat_tol(stat_dtype))
    assert rstd.dtype == stat_dtype, (rstd.dtype, stat_dtype)
    assert tuple(rstd.shape) == lead
    torch.testing.assert_close(rstd.double(), ref_rstd, **_stat_tol(stat_dtype))


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_stats_rms_explicit_eps(rms: bool) -> None:
    """eps is applied inside the square root: a large eps changes rstd exactly as the formula says."""
    gen = torch.Generator().manual_seed(5)
    x = _rand((6, 9), F64, gen, 0.2)
    eps = 0.25
    if rms:
        (_, _, rstd) = ops.rms_norm_fwd(x, [9], None, eps)
        ref = torch.rsqrt(x.pow(2).mean(-1) + eps)
    else:
        (_, _, _, rstd) = ops.layer_norm_fwd(x, [9], None, None, eps)
        var, _ = torch.var_mean(x, dim=-1, correction=0)
        ref = torch.rsqrt(var + eps)
    torch.testing.assert_close(rstd, ref, rtol=1e-13, atol=0)


@pytest.mark.parametrize("dtype", [F32, F64, BF16, F16], ids=str)
def test_rms_norm_default_eps_matches_torch(dtype: torch.dtype) -> None:
    """eps=None means what it means in torch.nn.functional.rms_norm / torch.nn.RMSNorm for the same dtype.

    Rows of small magnitude make the eps visible: with mean(x^2) = 4e-4, an eps of 2^-7 (bfloat16's
    epsilon) instead of 2^-23 changes the output by a factor of about 4.5.
    """
    gen = torch.Generator().manual_seed(6)
    x = (0.02 * torch.randn(4, 64, generator=gen, dtype=F64)).to(dtype)
    r = (0.01 * torch.randn(4, 64, generator=gen, dtype=F64)).to(dtype)
    tol = {"rtol": 2 * torch.finfo(dtype).eps, "atol": 1e-5}  # two roundings apart at most
    torch.testing.assert_close(layernorm_ext.rms_norm(x, 64), torch.nn.functional.rms_norm(x, [64]), **tol)
    out, _ = layernorm_ext.add_rms_norm(x, r, 64)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x + r, [64]), **tol)
    theirs = torch.nn.RMSNorm(64, dtype=dtype)
    ours = layernorm_ext.FusedRMSNorm(64, dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), **tol)
