"""Every (input, weight, bias) dtype triple: ours accept exactly what the running torch's F.layer_norm /
F.rms_norm accept on the CPU (conftest.ATEN_DTYPE_TRIPLES enumerates it), with ATen's result dtype, and refuse
the rest with an ATen-like error; the fake kernels agree; and where the kernels get the parameters converted,
the gradients come back in each tensor's own dtype and meet the suite's accuracy rule
(conftest.assert_no_worse_than_aten; test_functional sweeps the pairings the kernels take as they are).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor

import layernorm_ext as L
from conftest import ATEN_DTYPE_TRIPLES, DEVICES, DtypeTriple, assert_no_worse_than_aten, ulp_atol

_ops = torch.ops.layernorm_ext
_SHORT = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", None: "-"}

pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")


def _id(t: DtypeTriple) -> str:
    name = "rms" if t.rms else "ln"
    return f"{name}-x{_SHORT[t.input]}-w{_SHORT[t.weight]}" + ("" if t.rms else f"-b{_SHORT[t.bias]}")


_TRIPLES = [pytest.param(t, id=_id(t)) for t in ATEN_DTYPE_TRIPLES]

def _kernels_take(t: DtypeTriple) -> bool:
    """Whether the kernels take the parameters as they are (the input's dtype, or float32 for half input): those
    pairings are test_functional's sweep (conftest.DTYPE_PAIRS); the others are converted (csrc/norm_ops.cpp)."""
    half = t.input in (torch.float16, torch.bfloat16)
    return all(p is None or p == t.input or (half and p == torch.float32) for p in (t.weight, t.bias))


_CONVERTED = [pytest.param(t, id=_id(t)) for t in ATEN_DTYPE_TRIPLES if t.result is not None and not _kernels_take(t)]


def test_table_is_atens() -> None:
    """The enumeration holds what this test file is about: rms_norm takes a weight of another dtype than its
    input's beyond the half/float32 pairing (a float64 input with a float32 weight, a float32 input with a
    bfloat16 one), and layer_norm refuses some triple."""
    accepted = {(t.rms, t.input, t.weight, t.bias) for t in ATEN_DTYPE_TRIPLES if t.result is not None}
    assert (True, torch.float64, torch.float32, None) in accepted
    assert (True, torch.float32, torch.bfloat16, None) in accepted
    assert any(t.result is None for t in ATEN_DTYPE_TRIPLES if not t.rms)


def _tensors(t: DtypeTriple, rows: int, cols: int, device: str) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Rows of a controlled spread (each standardized, then scaled and shifted, as test_functional's), so that
    no case is decided by cancellation noise; weights near 1, biases near 0."""
    gen = torch.Generator().manual_seed(cols * 31 + rows)
    z = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    z = z.sign() if cols == 1 else (z - z.mean(1, keepdim=True)) / z.std(1, correction=0, keepdim=True)
    row_std = torch.exp(0.5 * torch.randn(rows, 1, generator=gen, dtype=torch.float64).clamp(-2, 2))
    x = (0.3 + row_std * z).to(device=device, dtype=t.input)
    w = (1 + 0.5 * torch.randn(cols, generator=gen, dtype=torch.float64)).to(device=device, dtype=t.weight) \
        if t.weight is not None else None  # fmt: skip
    b = (0.5 * torch.randn(cols, generator=gen, dtype=torch.float64)).to(device=device, dtype=t.bias) \
        if t.bias is not None else None  # fmt: skip
    return x, w, b


def _ours(t: DtypeTriple, x: Tensor, w: Tensor | None, b: Tensor | None, residual: bool) -> Tensor:
    shape = (x.shape[-1],)
    if residual:  # a same-dtype residual: h = x + x / 2 in x's dtype
        r = x / 2
        return (L.add_rms_norm(x, r, shape, w, 1e-5) if t.rms else L.add_layer_norm(x, r, shape, w, b))[0]
    return L.rms_norm(x, shape, w, 1e-5) if t.rms else L.layer_norm(x, shape, w, b)


def _aten(t: DtypeTriple, x: Tensor, w: Tensor | None, b: Tensor | None) -> Tensor:
    shape = (x.shape[-1],)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nn.functional.rms_norm(x, shape, w, 1e-5) if t.rms else torch.nn.functional.layer_norm(
            x, shape, w, b)


@pytest.mark.parametrize("triple", _TRIPLES)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "add"])
@pytest.mark.parametrize("device", DEVICES)
def test_accepts_exactly_atens_triples(triple: DtypeTriple, residual: bool, device: str) -> None:
    x, w, b = _tensors(triple, 3, 7, device)
    if triple.result is None:
        op = "rms_norm" if triple.rms else "layer_norm"
        with pytest.raises(RuntimeError, match=rf"{op}: expected (weight|bias) to have the input's dtype|{op}: "
                                               r"expected weight and bias to have the same dtype"):
            _ours(triple, x, w, b, residual)
        return
    out = _ours(triple, x, w, b, residual)
    assert out.dtype == triple.result


def _fake_forward(triple: DtypeTriple, x: Tensor, w: Tensor | None, b: Tensor | None) -> Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    x, w, b = (None if v is None else mode.from_tensor(v) for v in (x, w, b))
    with mode:
        if triple.rms:
            return _ops.rms_norm_fwd(x, [x.shape[-1]], w, None, None, False, False)[0]
        return _ops.layer_norm_fwd(x, [x.shape[-1]], w, b, 1e-5, None, False, False)[0]


@pytest.mark.parametrize("triple", _TRIPLES)
def test_fake_kernels_agree(triple: DtypeTriple) -> None:
    """The fake kernels (torch.compile, torch.export) accept and refuse the same triples, word for word."""
    x, w, b = _tensors(triple, 3, 7, "cpu")
    real: object
    try:
        real = (_ops.rms_norm_fwd(x, [7], w, None, None, False, False) if triple.rms
                else _ops.layer_norm_fwd(x, [7], w, b, 1e-5, None, False, False))[0].dtype  # fmt: skip
    except RuntimeError as e:
        real = str(e).splitlines()[0]
    fake: object
    try:
        fake = _fake_forward(triple, x, w, b).dtype
    except RuntimeError as e:
        fake = str(e).splitlines()[0]
    assert real == fake
    assert real == triple.result if triple.result is not None else isinstance(real, str)


@pytest.mark.parametrize("triple", _CONVERTED)
@pytest.mark.parametrize("cols", [1, 7, 769, 5125])
@pytest.mark.parametrize("device", DEVICES)
def test_accuracy_and_gradient_dtypes(
    triple: DtypeTriple, cols: int, device: str, request: pytest.FixtureRequest
) -> None:
    """The pairings whose parameters are converted for the kernels: outputs and gradients no worse than ATen's
    against the fp64 reference, each gradient in its tensor's dtype."""
    if device == "cuda" and cols == 1 and triple.rms and triple.input == torch.float32:
        # H200, torch 2.11 (2026-12-04): dx 2.26e-7 against ATen's 0.80e-7 + 1.19e-7. For N = 1, dx = g w rstd
        # (1 - x^2 rstd^2) cancels completely: both errors are the saved float32 rstd's rounding (up to 2^-23 of
        # |g w rstd|), which lands nearer for one or the other by chance; exact needs eps in the backward.
        request.applymarker(pytest.mark.xfail(strict=False, reason="N = 1 RMSNorm float32 grad_input: the "
                                              "cancellation in 1 - xhat^2 (as test_numerics_options on the CPU)"))
    rows = 5
    x, w, b = _tensors(triple, rows, cols, device)
    leaves = [v.detach().requires_grad_(True) if v is not None else None for v in (x, w, b)]
    aten_leaves = [v.detach().requires_grad_(True) if v is not None else None for v in (x, w, b)]
    ref_leaves = [v.detach().double().requires_grad_(True) if v is not None else None for v in (x, w, b)]
    # grad_out in the output's dtype; the reference is fed exactly those values.
    grad = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols), dtype=torch.float64)
    grad = grad.to(triple.result).double().to(device)
    results = []
    for fn, (xi, wi, bi) in ((_ours, leaves), (_aten, aten_leaves), (_aten, ref_leaves)):
        out = fn(triple, xi, wi, bi, False) if fn is _ours else fn(triple, xi, wi, bi)
        out.backward(grad.to(out.dtype))
        results.append((out, *(v.grad if v is not None else None for v in (xi, wi, bi))))
    ours, aten, ref = results
    assert ours[0].dtype == triple.result
    for name, o, a, r, leaf in zip(("out", "dx", "dw", "db"), ours, aten, ref, (None, *leaves)):
        if o is None:
            continue
        if leaf is not None:
            assert o.dtype == leaf.dtype, (name, o.dtype, leaf.dtype)
        # A float64 parameter's gradient from narrower rows is a sum of products with xhat, which ATen and ours
        # both form from float32 statistics: float32's ulp, not float64's, is what the two can be held to there.
        slack = 1.0
        if o.dtype == torch.float64 and triple.input != torch.float64:
            slack = ulp_atol(torch.float32, r) / ulp_atol(torch.float64, r)
        assert_no_worse_than_aten(o, a, r, f"{_id(triple)} {name} cols={cols}", slack)


@pytest.mark.parametrize("triple", _CONVERTED)
def test_opcheck_converted_pairings(triple: DtypeTriple) -> None:
    """torch.library.opcheck (schema, fake kernel, autograd registration, AOT dispatch) on the forward op with
    parameters the kernels get converted."""
    x, w, _ = _tensors(triple, 3, 7, "cpu")
    args = (x.requires_grad_(True), [7], w.requires_grad_(True), None, None, False, False)
    results = torch.library.opcheck(_ops.rms_norm_fwd.default, args)
    assert all(v == "SUCCESS" for v in results.values()), results
