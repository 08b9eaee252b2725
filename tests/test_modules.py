"""FusedLayerNorm / FusedRMSNorm against torch.nn.LayerNorm / torch.nn.RMSNorm.

The modules subclass torch's, so everything but ``forward`` must be exactly torch's (attributes, parameters,
initialization, extra_repr, state_dict); ``forward`` (and the parameter gradients) must pass the suite's
accuracy rule against the torch module, and ``memory_efficient=True`` must not change the gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from conftest import DTYPE_PAIRS, assert_no_worse_than_aten
from test_functional import aten_lacks_mixed_layer_norm
from layernorm_ext import FusedLayerNorm, FusedRMSNorm

# ATen's CPU rms_norm warns that it cannot use its fused path for mixed dtypes (bf16 input, fp32 weight).
pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")

Module = torch.nn.LayerNorm | torch.nn.RMSNorm

SHAPES: list[int | tuple[int, ...] | list[int] | torch.Size] = [8, (4, 6), [5], torch.Size([3, 4])]



def _pair_id(pair: tuple[torch.dtype, torch.dtype]) -> str:
    return f"{str(pair[0])[6:]}-{str(pair[1])[6:]}"


def _randn(shape: Sequence[int], gen: torch.Generator, dtype: torch.dtype, device: str, scale: float = 1.0,
           shift: float = 0.0) -> Tensor:
    return (torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * scale + shift).to(device, dtype)


def _make_pair(
    kind: str, normalized_shape: int | tuple[int, ...], *, elementwise_affine: bool = True, bias: bool = True,
    eps: float | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32,
    memory_efficient: bool = False,
) -> tuple[Module, Module]:
    """(ours, torch's) with the same constructor arguments."""
    if kind == "ln":
        ln_eps = 1e-5 if eps is None else eps
        ours: Module = FusedLayerNorm(normalized_shape, ln_eps, elementwise_affine, bias, device=device, dtype=dtype,
                                      memory_efficient=memory_efficient)
        ref: Module = torch.nn.LayerNorm(normalized_shape, ln_eps, elementwise_affine, bias, device=device,
                                         dtype=dtype)
    else:
        ours = FusedRMSNorm(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype,
                            memory_efficient=memory_efficient)
        ref = torch.nn.RMSNorm(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
    return ours, ref


def _randomize(module: Module, gen: torch.Generator) -> None:
    """Weights around 1 (away from 0), biases around 0: values init would never give."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            shift = 1.0 if name == "weight" else 0.0
            p.copy_(_randn(p.shape, gen, p.dtype, str(p.device), scale=0.5, shift=shift))


def _grads(module: Module) -> dict[str, Tensor]:
    return {name: p.grad for name, p in module.named_parameters()}  # type: ignore[misc]


# ---- attributes, parameters, state_dict ------------------------------------------------------------------


def test_isinstance() -> None:
    assert isinstance(FusedLayerNorm(8), torch.nn.LayerNorm)
    assert isinstance(FusedRMSNorm(8), torch.nn.RMSNorm)
    assert isinstance(FusedLayerNorm(8), torch.nn.Module)


@pytest.mark.parametrize("normalized_shape", SHAPES, ids=str)
@pytest.mark.parametrize("elementwise_affine", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("eps", [None, 1e-3])
def test_layer_norm_attributes_match_torch(
    normalized_shape: int | Sequence[int], elementwise_affine: bool, bias: bool, eps: float | None
) -> None:
    ours, ref = _make_pair("ln", normalized_shape, elementwise_affine=elementwise_affine, bias=bias, eps=eps)
    _check_same_module_surface(ours, ref)
    assert isinstance(ours.normalized_shape, tuple)
    assert ours.eps == (1e-5 if eps is None else eps)
    assert (ours.bias is None) == (not (elementwise_affine and bias))


@pytest.mark.parametrize("normalized_shape", SHAPES, ids=str)
@pytest.mark.parametrize("elementwise_affine", [True, False])
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_rms_norm_attributes_match_torch(
    normalized_shape: int | Sequence[int], elementwise_affine: bool, eps: float | None
) -> None:
    ours, ref = _make_pair("rms", normalized_shape, elementwise_affine=elementwise_affine, eps=eps)
    _check_same_module_surface(ours, ref)
    assert isinstance(ours.normalized_shape, tuple)
    assert ours.eps == eps


def _check_same_module_surface(ours: Module, ref: Module) -> None:
    assert ours.normalized_shape == ref.normalized_shape
    assert type(ours.normalized_shape) is type(ref.normalized_shape)
    assert ours.eps == ref.eps
    assert ours.elementwise_affine == ref.elementwise_affine
    assert (ours.weight is None) == (ref.weight is None)
    assert (getattr(ours, "bias", None) is None) == (getattr(ref, "bias", None) is None)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in ref.named_buffers()]
    for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        assert isinstance(p, torch.nn.Parameter), name
        assert p.requires_grad == q.requires_grad, name
        assert p.shape == q.shape and p.dtype == q.dtype and p.device == q.device, name
        assert torch.equal(p, q), f"{name}: init differs"
    assert ours.extra_repr() == ref.extra_repr()
    sd_ours, sd_ref = ours.state_dict(), ref.state_dict()
    assert list(sd_ours) == list(sd_ref)
    for key in sd_ref:
        assert torch.equal(sd_ours[key], sd_ref[key]), key


@pytest.mark.parametrize("kind", ["ln", "ln_nobias", "rms"])
@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
def test_state_dict_loads_both_ways(kind: str, direction: str) -> None:
    gen = torch.Generator().manual_seed(1)
    bias = kind != "ln_nobias"
    ours, ref = _make_pair("rms" if kind == "rms" else "ln", (4, 6), bias=bias)
    src, dst = (ref, ours) if direction == "torch_to_ours" else (ours, ref)
    _randomize(src, gen)
    result = dst.load_state_dict(src.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for (name, p), (_, q) in zip(src.named_parameters(), dst.named_parameters()):
        assert torch.equal(p, q), name
    # A state_dict of the other bias setting is refused alike (strict).
    if kind.startswith("ln"):
        other_ours, other_ref = _make_pair("ln", (4, 6), bias=not bias)
        with pytest.raises(RuntimeError, match="Missing key|Unexpected key"):
            ours.load_state_dict(other_ref.state_dict(), strict=True)
        with pytest.raises(RuntimeError, match="Missing key|Unexpected key"):
            ref.load_state_dict(other_ours.state_dict(), strict=True)


# ---- forward / backward against the torch module ---------------------------------------------------------


def _call(module: Module, x: Tensor) -> Tensor:
    """module(x); for torch's LayerNorm where ATen's CUDA kernel takes no float32 parameters with a half input, the
    stand-in of tests/test_functional.py: its float32 layer_norm of the exactly upcast input, rounded back."""
    if type(module) is torch.nn.LayerNorm and aten_lacks_mixed_layer_norm(x, module.weight, module.bias):
        return module(x.float()).to(x.dtype)
    return module(x)


def _run(module: Module, x: Tensor, grad: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = _call(module, x)
    out.backward(grad)
    assert x.grad is not None
    return out.detach(), x.grad, _grads(module)


def _check_against_torch(ours: Module, ref: Module, x: Tensor, grad: Tensor, what: str) -> None:
    ref64 = _double_copy(ref, x.dtype)
    out, dx, dparams = _run(ours, x, grad)
    out_a, dx_a, dparams_a = _run(ref, x, grad)
    out_r, dx_r, dparams_r = _run(ref64, x.double(), grad.double())
    assert_no_worse_than_aten(out, out_a, out_r, f"{what} out")
    assert_no_worse_than_aten(dx, dx_a, dx_r, f"{what} grad_input")
    assert list(dparams) == list(dparams_a)
    for name in dparams:
        assert dparams[name].dtype == dparams_a[name].dtype, name
        assert_no_worse_than_aten(dparams[name], dparams_a[name], dparams_r[name], f"{what} grad_{name}")


def _double_copy(ref: Module, input_dtype: torch.dtype) -> Module:
    """torch's module in float64 with the same parameter values and the same effective eps (RMSNorm's
    eps=None means the eps of the input's compute dtype, float32 for half inputs, not float64's)."""
    compute_dtype = torch.float64 if input_dtype == torch.float64 else torch.float32
    eps = ref.eps if ref.eps is not None else torch.finfo(compute_dtype).eps
    device = next((t.device for t in ref.state_dict().values()), torch.device("cpu"))  # the inputs' device
    ref64: Module
    if isinstance(ref, torch.nn.LayerNorm):
        ref64 = torch.nn.LayerNorm(ref.normalized_shape, eps, ref.elementwise_affine, ref.bias is not None,
                                   device=device, dtype=torch.float64)
    else:
        ref64 = torch.nn.RMSNorm(ref.normalized_shape, eps, ref.elementwise_affine, device=device,
                                 dtype=torch.float64)
    ref64.load_state_dict({k: v.double() for k, v in ref.state_dict().items()})
    return ref64


_FWD_CASES = [
    (kind, pair)
    for kind in ["ln", "ln_nobias", "ln_noaffine", "rms", "rms_noaffine"]
    for pair in DTYPE_PAIRS
    # without parameters a mixed pair is the same case as its input dtype alone
    if not ("noaffine" in kind and pair[0] != pair[1])
]


@pytest.mark.parametrize(("kind", "pair"), _FWD_CASES, ids=[f"{k}-{_pair_id(p)}" for k, p in _FWD_CASES])
@pytest.mark.parametrize("normalized_shape", [(48,), (4, 12)], ids=str)
def test_forward_backward_match_torch(
    device: str, kind: str, pair: tuple[torch.dtype, torch.dtype], normalized_shape: tuple[int, ...]
) -> None:
    x_dtype, p_dtype = pair
    gen = torch.Generator().manual_seed(2)
    base = kind.split("_")[0]
    ours, ref = _make_pair(base, normalized_shape, elementwise_affine="noaffine" not in kind,
                           bias="nobias" not in kind, device=device, dtype=p_dtype)
    _randomize(ours, gen)
    ref.load_state_dict(ours.state_dict())
    shape = (3, 5, *normalized_shape)
    x = _randn(shape, gen, x_dtype, device, scale=2.0, shift=0.5)
    grad = _randn(shape, gen, x_dtype, device)
    _check_against_torch(ours, ref, x, grad, f"{kind} {x_dtype}/{p_dtype}")


@pytest.mark.parametrize("kind", ["ln", "rms"])
@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32, torch.float32),  # fp32 residual stream, bf16 activations
        (torch.float16, torch.float16, torch.float32),
    ],
    ids=lambda d: "-".join(str(t)[6:] for t in d),
)
def test_residual_forward_backward(
    device: str, kind: str, dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]
) -> None:
    x_dtype, r_dtype, p_dtype = dtypes
    gen = torch.Generator().manual_seed(3)
    n = 40
    ours, ref = _make_pair(kind, n, device=device, dtype=p_dtype)
    _randomize(ours, gen)
    ref.load_state_dict(ours.state_dict())
    ref64 = _double_copy(ref, torch.promote_types(x_dtype, r_dtype))
    x = _randn((6, 7, n), gen, x_dtype, device)
    r = _randn((6, 7, n), gen, r_dtype, device, scale=3.0)
    g_out = _randn((6, 7, n), gen, x_dtype, device)
    h_dtype = torch.promote_types(x_dtype, r_dtype)
    g_res = _randn((6, 7, n), gen, h_dtype, device)

    def run(module: Module, fused: bool, x0: Tensor, r0: Tensor, go: Tensor, gr: Tensor
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, dict[str, Tensor]]:
        module.zero_grad(set_to_none=True)
        xi = x0.detach().clone().requires_grad_(True)
        ri = r0.detach().clone().requires_grad_(True)
        if fused:
            result = module(xi, ri)
            assert isinstance(result, tuple) and len(result) == 2
            out, h = result
        else:
            h = xi + ri
            out = _call(module, h).to(xi.dtype)
        torch.autograd.backward([out, h], [go, gr])
        assert xi.grad is not None and ri.grad is not None
        return out.detach(), h.detach(), xi.grad, ri.grad, _grads(module)

    out, h, dx, dr, dp = run(ours, True, x, r, g_out, g_res)
    out_a, h_a, dx_a, dr_a, dp_a = run(ref, False, x, r, g_out, g_res)
    # fp64 reference: h in its own dtype first (as the rule says), then everything in float64.
    h_exact = (x + r).double()
    out_r, _, dh_r, _, dp_r = run(ref64, False, h_exact, torch.zeros_like(h_exact), g_out.double(), g_res.double())

    assert h.dtype == h_dtype and out.dtype == x_dtype
    assert torch.equal(h, x + r), "residual_out must be exactly input + residual"
    assert torch.equal(h, h_a)
    assert_no_worse_than_aten(out, out_a, out_r, "out")
    assert dx.dtype == x_dtype and dr.dtype == r_dtype
    assert_no_worse_than_aten(dx, dx_a, dh_r, "grad_input")
    assert_no_worse_than_aten(dr, dr_a, dh_r, "grad_residual")
    for name in dp_a:
        assert_no_worse_than_aten(dp[name], dp_a[name], dp_r[name], f"grad_{name}")


@pytest.mark.parametrize("kind", ["ln", "rms"])
def test_residual_without_grad_returns_pair(kind: str) -> None:
    ours, _ = _make_pair(kind, 16)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
    r = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        result = ours(x, r)
        plain = ours(x + r)
    assert isinstance(result, tuple) and len(result) == 2
    out, h = result
    assert torch.equal(h, x + r)
    assert torch.equal(out, plain)
    assert not isinstance(ours(x), tuple)


# ---- device / dtype constructor arguments ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ln", "rms"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_device_dtype_constructor(device: str, kind: str, dtype: torch.dtype) -> None:
    ours, ref = _make_pair(kind, (2, 8), device=device, dtype=dtype)
    for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        assert p.device.type == device and p.dtype == dtype, name
        assert p.device == q.device and torch.equal(p, q), name
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(6)).to(device, dtype)
    out = ours(x)
    assert out.dtype == dtype and out.device == x.device and out.shape == x.shape
    out_a = ref(x)
    out_r = _double_copy(ref, dtype)(x.double())
    assert_no_worse_than_aten(out, out_a, out_r, f"{kind} {dtype}")


@pytest.mark.parametrize("kind", ["ln", "rms"])
def test_meta_device_module(kind: str) -> None:
    ours, _ = _make_pair(kind, 8, device="meta")
    assert ours.weight is not None and ours.weight.device.type == "meta"
    out = ours(torch.empty(3, 8, device="meta"))
    assert out.device.type == "meta" and out.shape == (3, 8)
    out2, h = ours(torch.empty(3, 8, device="meta", dtype=torch.bfloat16),
                   torch.empty(3, 8, device="meta", dtype=torch.float32))
    assert out2.dtype == torch.bfloat16 and h.dtype == torch.float32


def test_to_casts_like_torch() -> None:
    ours, ref = _make_pair("ln", 8, memory_efficient=True)
    ours, ref = ours.to(torch.float64), ref.to(torch.float64)
    assert isinstance(ours, FusedLayerNorm) and ours.memory_efficient is True
    assert ours.weight.dtype == torch.float64 and ours.bias.dtype == torch.float64
    x = torch.randn(2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(ours(x), ref(x))


# ---- memory_efficient ------------------------------------------------------------------------------------


def _grads_of(module: Module, x: Tensor, grad: Tensor, residual: Tensor | None = None
              ) -> list[Tensor]:
    module.zero_grad(set_to_none=True)
    xi = x.detach().clone().requires_grad_(True)
    ri = None if residual is None else residual.detach().clone().requires_grad_(True)
    if ri is None:
        out = module(xi)
        out.backward(grad)
    else:
        out, h = module(xi, ri)
        torch.autograd.backward([out, h], [grad, grad.to(h.dtype)])
    result = [out.detach(), xi.grad]
    if ri is not None:
        result.append(ri.grad)
    result += [p.grad for _, p in module.named_parameters()]
    assert all(t is not None for t in result)
    return result  # type: ignore[return-value]


@pytest.mark.parametrize("pair", [DTYPE_PAIRS[0], DTYPE_PAIRS[2], DTYPE_PAIRS[4]], ids=_pair_id)
@pytest.mark.parametrize("kind", ["ln", "ln_nobias", "ln_noaffine", "rms", "rms_noaffine"])
def test_memory_efficient_same_gradients(device: str, pair: tuple[torch.dtype, torch.dtype], kind: str) -> None:
    """Saving the output instead of the input: the gradients pass the accuracy rule like the default mode's.

    Weights in [0.5, 1.5]: recovering xhat = (out - bias) / weight is well conditioned there (a weight near 0
    amplifies the output's rounding by 1/|weight|; exact zeros are handled by saving the input instead)."""
    x_dtype, p_dtype = pair
    gen = torch.Generator().manual_seed(8)
    base = kind.split("_")[0]
    affine, bias = "noaffine" not in kind, "nobias" not in kind
    eff, ref = _make_pair(base, 64, elementwise_affine=affine, bias=bias, device=device, dtype=p_dtype,
                          memory_efficient=True)
    plain, _ = _make_pair(base, 64, elementwise_affine=affine, bias=bias, device=device, dtype=p_dtype)
    assert eff.memory_efficient is True and plain.memory_efficient is False
    _randomize(eff, gen)
    if eff.weight is not None:
        with torch.no_grad():
            eff.weight.copy_(torch.rand(64, generator=gen, dtype=torch.float64) + 0.5)
    plain.load_state_dict(eff.state_dict())
    ref.load_state_dict(eff.state_dict())
    x = _randn((33, 64), gen, x_dtype, device, scale=2.0, shift=-0.3)
    grad = _randn((33, 64), gen, x_dtype, device)
    _check_against_torch(eff, ref, x, grad, f"memory_efficient {kind}")
    got_eff = _grads_of(eff, x, grad)
    got_plain = _grads_of(plain, x, grad)
    assert torch.equal(got_eff[0], got_plain[0]), "the forward must not depend on memory_efficient"
    for a, b in zip(got_eff[1:], got_plain[1:]):
        assert a.dtype == b.dtype and a.shape == b.shape
        # Close to the default mode's: a few ulps of the *input* dtype (xhat comes from the rounded output).
        scale = max(1.0, float(b.abs().max()))
        torch.testing.assert_close(a, b, rtol=0, atol=4 * torch.finfo(x_dtype).eps * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["ln", "ln_nobias", "rms"])
@pytest.mark.parametrize("zeros", ["some", "all", "negative_zero"])
def test_memory_efficient_weight_with_zeros(device: str, dtype: torch.dtype, kind: str, zeros: str) -> None:
    """A weight entry of exactly 0 makes the output useless for the backward; the input must be saved then,
    so the gradients are bitwise those of memory_efficient=False (and finite)."""
    gen = torch.Generator().manual_seed(9)
    base = kind.split("_")[0]
    eff, _ = _make_pair(base, 40, bias="nobias" not in kind, device=device, dtype=dtype, memory_efficient=True)
    plain, _ = _make_pair(base, 40, bias="nobias" not in kind, device=device, dtype=dtype)
    _randomize(eff, gen)
    with torch.no_grad():
        if zeros == "some":
            eff.weight[::7] = 0.0
        elif zeros == "all":
            eff.weight.zero_()
        else:
            eff.weight[3] = -0.0
    plain.load_state_dict(eff.state_dict())
    x = _randn((21, 40), gen, dtype, device)
    grad = _randn((21, 40), gen, dtype, device)
    got_eff = _grads_of(eff, x, grad)
    got_plain = _grads_of(plain, x, grad)
    for i, (a, b) in enumerate(zip(got_eff, got_plain)):
        assert torch.isfinite(a).all(), f"result {i} not finite"
        assert torch.equal(a, b), f"result {i} differs from memory_efficient=False"


@pytest.mark.parametrize("kind", ["ln", "rms"])
def test_memory_efficient_with_residual(device: str, kind: str) -> None:
    """With a residual, h is saved either way: gradients bitwise equal to the default mode's."""
    gen = torch.Generator().manual_seed(10)
    eff, _ = _make_pair(kind, 48, device=device, memory_efficient=True)
    plain, _ = _make_pair(kind, 48, device=device)
    _randomize(eff, gen)
    plain.load_state_dict(eff.state_dict())
    x = _randn((17, 48), gen, torch.float32, device)
    r = _randn((17, 48), gen, torch.float32, device)
    grad = _randn((17, 48), gen, torch.float32, device)
    for a, b in zip(_grads_of(eff, x, grad, r), _grads_of(plain, x, grad, r)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("module", [FusedLayerNorm, FusedRMSNorm], ids=lambda m: m.__name__)
@pytest.mark.parametrize("weight_offset", [1.0, -0.5, float("inf"), float("nan")])
def test_weight_offset_needs_a_weight_at_construction(module: type, weight_offset: float) -> None:
    """A nonzero weight_offset without a weight (elementwise_affine=False), or a non-finite one, is refused when
    the module is built (every forward would raise), with the functions' words."""
    words = "needs a weight" if math.isfinite(weight_offset) else "expected a finite weight_offset"
    with pytest.raises(ValueError, match=rf"{module.__name__}: .*{words}"):
        module(7, elementwise_affine=False, weight_offset=weight_offset)
    if words == "needs a weight":  # with a weight it is the offset of that weight; without an offset, no weight
        x = torch.randn(3, 7)
        with_weight = module(7, weight_offset=weight_offset)
        assert with_weight(x).shape == x.shape
        assert module(7, elementwise_affine=False, weight_offset=0.0)(x).shape == x.shape
