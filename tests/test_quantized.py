"""Quantized output (layernorm_ext.quantized; ops layer_norm_quant / rms_norm_quant).

Held to a composite PyTorch reference of vLLM's arithmetic (scale, divide or multiply by the reciprocal as vLLM
does on each path, clamp, round / cast) in two ways:
- applied to our own unquantized output, the codes and the scales must be the same bits (the quantized ops run
  the same kernels, then the arithmetic of csrc/quant_math.h, which the reference spells out in torch ops); the
  values at the codes' rounding ties, where dividing and multiplying by the reciprocal part, are probed on
  every path, and a 64 x 4096 serving activation is held to vLLM's order of the norm too;
- applied to ATen's output, the codes may differ only where the two norms' outputs round differently: by at
  most one code step, at a small share of the elements.
The encoders are checked exhaustively against torch's own float -> float8_e4m3fn cast and round(): a row of
ones with eps=0 normalizes to exactly 1, so the weight's values are what gets encoded. Plus the special rows
(zeros, NaN, infinities, saturation, the scale_ub cap), empty shapes, bad arguments (eager and fake alike),
opcheck and torch.compile(fullgraph=True).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

import layernorm_ext as L
from test_inference_ops import _args
from test_inference_ops import _functional as _unquantized

pytestmark = pytest.mark.usefixtures("cpu_isa")

F32, F64, F16, BF16 = torch.float32, torch.float64, torch.float16, torch.bfloat16
FP8, E5M2, I8 = torch.float8_e4m3fn, torch.float8_e5m2, torch.int8
FLOAT8 = (FP8, E5M2)
QUANT_DTYPES = (FP8, E5M2, I8)
QUANT_IDS = ["fp8", "e5m2", "i8"]
_ops = torch.ops.layernorm_ext
_SHORT = {F32: "f32", F64: "f64", F16: "f16", BF16: "bf16", FP8: "fp8", E5M2: "e5m2", I8: "i8"}
FNS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
DTYPES = ((F32, F32), (F64, F64), (F16, F16), (BF16, BF16), (BF16, F32))
COLS = (1, 7, 769, 5125)
MODES = ("static", "dynamic", "dynamic_ub")
QMAX = {FP8: 448.0, E5M2: 57344.0, I8: 127.0}
MIN_SCALE = {FP8: 1.0 / (448.0 * 512.0), E5M2: 1.0 / (57344.0 * 512.0), I8: float(torch.finfo(torch.float32).eps)}


# ---- the composite reference -----------------------------------------------------------------------------------
def divides(quant_dtype: torch.dtype, static: bool) -> bool:
    """Whether vLLM divides y by the scale on this path (else it multiplies by 1 / scale): its dynamic fp8 kernel
    divides ("for exact match with FBGemm") and so does its static int8 quantization; its static fp8 and dynamic
    int8 kernels multiply by the reciprocal."""
    return static == (quant_dtype == I8)


def reference_quant(
    y: Tensor, norm_dims: int, quant_dtype: torch.dtype, scale: Tensor | None, scale_ub: Tensor | None
) -> tuple[Tensor, Tensor]:
    """codes and scale of y (the norm's output, any dtype) in torch ops: vLLM's arithmetic (quant_math.h), but for
    a NaN, which here makes the row's scale NaN and its float8 codes NaN (vLLM: skipped in the absmax, and 448)."""
    yf = y.float()
    static = scale is not None
    if scale is None:
        absmax = yf.abs().amax(dim=tuple(range(-norm_dims, 0)), keepdim=True)
        if scale_ub is not None:
            absmax = torch.where(absmax > scale_ub, scale_ub, absmax)  # NaN stays NaN
        s = absmax / QMAX[quant_dtype]
        floor = torch.tensor(MIN_SCALE[quant_dtype], dtype=F32, device=y.device)
        scale = torch.where(s < floor, floor, s)
    v = yf / scale if divides(quant_dtype, static) else yf * torch.reciprocal(scale)
    return encode(v, quant_dtype), scale


def encode(v: Tensor, quant_dtype: torch.dtype) -> Tensor:
    """float32 values as codes: float8 saturating (NaN stays NaN), int8 rounded half to even (NaN: 0)."""
    if quant_dtype in FLOAT8:
        return v.clamp(-QMAX[quant_dtype], QMAX[quant_dtype]).to(quant_dtype)
    return torch.where(v.isnan(), 0.0, v).clamp(-128.0, 127.0).round().to(I8)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _is_nan(t: Tensor) -> Tensor:
    if t.dtype == FP8:
        return (t.view(torch.uint8) & 0x7F) == 0x7F
    if t.dtype == E5M2:
        return (t.view(torch.uint8) & 0x7F) > 0x7C
    return t.isnan() if t.is_floating_point() else torch.zeros_like(t, dtype=torch.bool)


def _same_bits(got: Tensor, want: Tensor, what: str) -> None:
    """Bit for bit, except that a NaN equals any NaN (its sign and payload depend on operand order)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    got_nan, want_nan = _is_nan(got), _is_nan(want)
    assert torch.equal(got_nan, want_nan), f"{what}: NaN where the composite reference has none, or the reverse"
    ints = _INT_OF_SIZE[got.element_size()]
    same = torch.equal(got.view(ints)[~got_nan], want.view(ints)[~want_nan])
    assert same, f"{what}: not the composite reference's bits"


# ---- calls -----------------------------------------------------------------------------------------------------
def _quantized(fn: str, a: dict[str, Tensor | None], **kw: object) -> tuple[Tensor, Tensor, Tensor | None]:
    x, r, w, b, n = a["x"], a["r"], a["w"], a["b"], a["x"].shape[-1]
    if fn == "layer_norm":
        return (*L.layer_norm_quant(x, n, w, b, **kw), None)
    if fn == "rms_norm":
        return (*L.rms_norm_quant(x, n, w, **kw), None)
    if fn == "add_layer_norm":
        return L.add_layer_norm_quant(x, r, n, w, b, **kw)
    return L.add_rms_norm_quant(x, r, n, w, **kw)


def _scales(mode: str, quant_dtype: torch.dtype, y: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """(scale, scale_ub) for a mode: a static scale that saturates the largest values, or a cap below most
    rows' absmax (so that it acts)."""
    absmax = y.float().abs().amax().item() if y.numel() else 1.0
    if mode == "static":
        return torch.tensor([absmax / QMAX[quant_dtype] * 0.8]), None
    if mode == "dynamic_ub":
        return None, torch.tensor([absmax * 0.7])
    return None, None


def _cases() -> list:
    return [
        pytest.param(fn, dtype, wdtype, cols, q, id=f"{fn}-{_SHORT[dtype]}w{_SHORT[wdtype]}-n{cols}-{_SHORT[q]}")
        for fn in FNS for dtype, wdtype in DTYPES for cols in COLS for q in QUANT_DTYPES
    ]  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("fn", "dtype", "wdtype", "cols", "quant_dtype"), _cases())
def test_codes_are_the_composite_of_our_output(
    fn: str, dtype: torch.dtype, wdtype: torch.dtype, cols: int, quant_dtype: torch.dtype, mode: str
) -> None:
    a = _args(fn, dtype, wdtype, cols)
    y, h = _unquantized(fn, a)
    scale, scale_ub = _scales(mode, quant_dtype, y)
    codes, got_scale, got_h = _quantized(fn, a, quant_dtype=quant_dtype, scale=scale, scale_ub=scale_ub)
    want_codes, want_scale = reference_quant(y, 1, quant_dtype, scale, scale_ub)
    _same_bits(codes, want_codes, "codes")
    if scale is not None:
        assert got_scale is scale
    else:
        assert got_scale.shape == (a["x"].shape[0], 1)
        _same_bits(got_scale, want_scale, "scale")
    if h is not None:
        assert got_h is not None
        _same_bits(got_h, h, "residual_out")


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=QUANT_IDS)
@pytest.mark.parametrize(("fn", "kw"), [
    ("rms_norm", {"weight_offset": 1.0}),
    ("rms_norm", {"cast_before_weight": True}),
    ("add_layer_norm", {"weight_offset": 0.5, "cast_before_weight": True}),
    ("add_rms_norm", {"residual_in_fp32": True}),
], ids=["gemma", "llama", "ln-both", "residual-fp32"])  # fmt: skip
def test_numerics_options(fn: str, kw: dict[str, object], quant_dtype: torch.dtype) -> None:
    a = _args(fn, BF16, BF16, 769)
    y, h = _unquantized(fn, a, **kw)
    codes, scale, got_h = _quantized(fn, a, quant_dtype=quant_dtype, **kw)
    want_codes, want_scale = reference_quant(y, 1, quant_dtype, None, None)
    _same_bits(codes, want_codes, "codes")
    _same_bits(scale, want_scale, "scale")
    if h is not None:
        assert got_h is not None and got_h.dtype == h.dtype
        _same_bits(got_h, h, "residual_out")


# ---- against ATen ----------------------------------------------------------------------------------------------
def _code_steps(got: Tensor, want: Tensor) -> Tensor:
    """How many representable values apart two code tensors are (NaN codes equal only NaN codes)."""
    if got.dtype == I8:
        return (got.int() - want.int()).abs()
    # float8_e4m3fn bits are sign-magnitude, ordered by magnitude: map them onto a line.
    def line(t: Tensor) -> Tensor:
        b = t.view(torch.uint8).int()
        return torch.where(b >= 128, -(b - 128), b)

    return (line(got) - line(want)).abs()


# Not float8_e5m2: its subnormal codes near 0 are finer than the norms' rounding differences (an ulp of y's scale
# is several e5m2 steps there); its codes are checked bit for bit against our own output above.
@pytest.mark.parametrize("quant_dtype", [FP8, I8], ids=["fp8", "i8"])
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize(("rms", "shape", "norm_dims"), [
    (False, (64, 769), 1), (True, (64, 769), 1), (False, (3, 5, 64), 2), (True, (3, 5, 64), 2),
    (False, (2, 65536), 1), (True, (2, 65536), 1), (True, (33, 5125), 1),
], ids=["ln", "rms", "ln-2d", "rms-2d", "ln-long", "rms-long", "rms-5125"])  # fmt: skip
def test_codes_against_aten_composite(
    rms: bool, shape: tuple[int, ...], norm_dims: int, dtype: torch.dtype, quant_dtype: torch.dtype
) -> None:
    """ATen's norm, then the composite: codes within one step, at a few elements only; equal dynamic scales up to
    the norms' own rounding differences (an ulp of the input dtype; a few for float32)."""
    gen = torch.Generator().manual_seed(sum(shape) + norm_dims)
    x = (torch.randn(shape, generator=gen) * 3 + 1).to(dtype)
    ns = shape[-norm_dims:]
    w = (torch.randn(ns, generator=gen) * 0.5 + 1).to(dtype)
    b = None if rms else (torch.randn(ns, generator=gen) * 0.1).to(dtype)
    if rms:
        aten = torch.nn.functional.rms_norm(x, ns, w, 1e-6)
        codes, scale = L.rms_norm_quant(x, ns, w, 1e-6, quant_dtype=quant_dtype)
    else:
        aten = torch.nn.functional.layer_norm(x, ns, w, b, 1e-5)
        codes, scale = L.layer_norm_quant(x, ns, w, b, 1e-5, quant_dtype=quant_dtype)
    want_codes, want_scale = reference_quant(aten, norm_dims, quant_dtype, None, None)
    assert scale.shape == want_scale.shape == (*shape[:-norm_dims], *([1] * norm_dims))
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(scale, want_scale, rtol=(8 if dtype == F32 else 2) * ulp, atol=0)
    steps = _code_steps(codes, want_codes)
    assert steps.max().item() <= 1, "a code more than one step from the composite's"
    share = (steps > 0).float().mean().item()
    assert share <= (0.02 if dtype == F32 else 0.05), f"{share:.2%} of the codes differ from the composite's"


# ---- the encoders, exhaustively ------------------------------------------------------------------------------
def _through_the_op(values: Tensor, quant_dtype: torch.dtype, scale: Tensor | None) -> tuple[Tensor, Tensor]:
    """The op's codes and scale of y = exactly these float32 values: a row of ones, eps=0, RMSNorm without
    statistics error (x * rstd = 1 * 1), weight = values; scale static, or None (the row's dynamic scale)."""
    n = values.numel()
    codes, got_scale = L.rms_norm_quant(torch.ones(1, n), n, values, 0.0, quant_dtype=quant_dtype, scale=scale)
    return codes[0], got_scale.flatten()


def _encode_through_the_op(values: Tensor, quant_dtype: torch.dtype) -> Tensor:
    """The op's codes of exactly these float32 values with the static scale 1."""
    return _through_the_op(values, quant_dtype, torch.ones(1))[0]


def _float8_probe_values(quant_dtype: torch.dtype) -> Tensor:
    """Every code's value, the midpoints between them (ties: round to even) and their float32 neighbours, and the
    edges: the smallest normal and subnormal, their halves, qmax and beyond."""
    finite = torch.arange(256, dtype=torch.uint8).view(quant_dtype).float()
    finite = finite[finite.isfinite()]
    mags = finite[finite >= 0].unique().sort().values
    mids = (mags[1:] + mags[:-1]) / 2
    near = torch.cat([mids, mids.nextafter(torch.tensor(math.inf)), mids.nextafter(torch.tensor(-math.inf))])
    tiny = torch.finfo(quant_dtype).smallest_normal
    subnormal = float(mags[1])
    qmax = QMAX[quant_dtype]
    step = qmax - float(mags[-2])  # the top binade's step
    special = torch.tensor([0.0, tiny, subnormal, subnormal / 2, subnormal / 2 * 1.0001, subnormal / 4, 1e-30, 1e-45,
                            qmax * 0.9999, qmax, qmax * 1.0001, qmax + step / 2 - 0.1, qmax + step / 2,
                            qmax + step / 2 + 0.1, qmax + step, qmax * 1.2, 1e6, 3e38, math.inf])
    positive = torch.cat([mags, near, special])
    return torch.cat([positive, -positive, torch.tensor([math.nan, -math.nan])])


@pytest.mark.parametrize("quant_dtype", FLOAT8, ids=QUANT_IDS[:2])
def test_float8_encoder_is_torchs_cast_after_clamping(quant_dtype: torch.dtype) -> None:
    values = _float8_probe_values(quant_dtype)
    got = _encode_through_the_op(values, quant_dtype)
    want = values.clamp(-QMAX[quant_dtype], QMAX[quant_dtype]).to(quant_dtype)
    bad = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero().flatten()
    assert bad.numel() == 0, [(values[i].item(), got[i].view(torch.uint8).item(), want[i].view(torch.uint8).item())
                              for i in bad[:8]]


def test_int8_encoder_rounds_half_to_even_and_saturates() -> None:
    steps = torch.arange(-140, 141, dtype=F32)
    halves = steps + 0.5
    near = torch.cat([halves.nextafter(torch.tensor(math.inf)), halves.nextafter(torch.tensor(-math.inf))])
    values = torch.cat([steps, halves, near, torch.tensor([1e9, -1e9, math.inf, -math.inf, math.nan, -0.0, 1e-40])])
    got = _encode_through_the_op(values, I8)
    want = torch.where(values.isnan(), 0.0, values).clamp(-128.0, 127.0).round().to(I8)
    assert torch.equal(got, want)
    assert got[-3].item() == 0, "NaN encodes as 0"


# ---- vLLM's division or multiplication, at the codes' rounding ties -------------------------------------------
def _code_midpoints(quant_dtype: torch.dtype) -> Tensor:
    """The values halfway between adjacent codes below qmax, both signs (where the codes round to even)."""
    if quant_dtype in FLOAT8:
        mags = torch.arange(256, dtype=torch.uint8).view(quant_dtype).float()
        mags = mags[mags.isfinite() & (mags >= 0)].unique().sort().values
        mids = (mags[1:] + mags[:-1]) / 2
    else:
        mids = torch.arange(127, dtype=F32) + 0.5
    return torch.cat([mids, -mids])


@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=QUANT_IDS)
def test_ties_are_scaled_as_vllm_scales(quant_dtype: torch.dtype, static: bool) -> None:
    """y at the codes' rounding ties (each midpoint times the scale, rounded to float32, and its two float32
    neighbours), for a few scales: static, or dynamic (the row's absmax, qmax times the scale, set so): the
    codes are vLLM's, y / scale on the dynamic fp8 and static int8 paths and y * (1 / scale) on the others, bit
    for bit. The other way gives other codes at some of these values (checked: the test tells them apart)."""
    qmax = QMAX[quant_dtype]
    told_apart = 0
    for target in (0.0123, 0.3, 1.7e-3, 7.1, 1.0 / 3.0):
        if static:
            scale = torch.tensor([target])
            absmax = None
        else:
            absmax = torch.tensor([target * qmax])
            scale = absmax / qmax  # the op's dynamic scale (above min_scale here)
        mids = _code_midpoints(quant_dtype) * scale
        values = torch.cat([mids, mids.nextafter(torch.tensor(math.inf)), mids.nextafter(torch.tensor(-math.inf))])
        if absmax is not None:
            assert values.abs().max() < absmax
            values = torch.cat([values, absmax])
        codes, got_scale = _through_the_op(values, quant_dtype, scale if static else None)
        assert torch.equal(got_scale, scale)
        quotient, product = encode(values / scale, quant_dtype), encode(values * torch.reciprocal(scale), quant_dtype)
        want, other = (quotient, product) if divides(quant_dtype, static) else (product, quotient)
        _same_bits(codes, want, f"codes at the ties, scale {scale.item()}")
        told_apart += int((want.view(torch.uint8) != other.view(torch.uint8)).sum())
    assert told_apart > 0, "dividing and multiplying by the reciprocal gave the same codes: the test tells nothing"


@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=QUANT_IDS)
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_serving_activation_is_vllms(dtype: torch.dtype, quant_dtype: torch.dtype, static: bool) -> None:
    """A 64 x 4096 activation (262144 codes) through add_rms_norm_quant in vLLM's order of the norm (x * rstd
    rounded before the weight, cast_before_weight=True; h rounded to the input dtype, as its static kernel): the
    codes and scales are vLLM's arithmetic applied to our own output, bit for bit."""
    gen = torch.Generator().manual_seed(22)
    x = (torch.randn(64, 4096, generator=gen) * 2).to(dtype)
    r = torch.randn(64, 4096, generator=gen).to(dtype)
    w = (torch.randn(4096, generator=gen) * 0.3 + 1).to(dtype)
    kw = {"cast_before_weight": True}
    y, h = L.add_rms_norm(x, r, 4096, w, 1e-6, **kw)
    scale = torch.tensor([y.float().abs().amax().item() / QMAX[quant_dtype] * 0.5]) if static else None
    codes, got_scale, got_h = L.add_rms_norm_quant(x, r, 4096, w, 1e-6, quant_dtype=quant_dtype, scale=scale, **kw)
    want_codes, want_scale = reference_quant(y, 1, quant_dtype, scale, None)
    _same_bits(codes, want_codes, "codes")
    _same_bits(got_scale, want_scale, "scales")
    _same_bits(got_h, h, "residual_out")


# ---- special rows ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=QUANT_IDS)
def test_special_rows(quant_dtype: torch.dtype) -> None:
    """Rows of zeros (codes 0, the smallest scale), a NaN (NaN codes and scale, int8 codes 0), an infinity in the
    input (RMSNorm: NaN there, zeros elsewhere; the row's absmax is NaN), a huge weight (saturation), and the
    scale_ub cap."""
    n = 64
    x = torch.randn(5, n)
    x[0] = 0.0
    x[1, 3] = math.nan
    x[2, 5] = math.inf
    w = torch.ones(n)
    codes, scale = L.rms_norm_quant(x, n, w, quant_dtype=quant_dtype)
    y = L.rms_norm(x, n, w)
    want_codes, want_scale = reference_quant(y, 1, quant_dtype, None, None)
    _same_bits(codes, want_codes, "codes")
    _same_bits(scale, want_scale, "scale")
    assert scale[0].item() == pytest.approx(MIN_SCALE[quant_dtype], rel=1e-7)
    assert (codes[0].float() == 0).all()
    assert math.isnan(scale[1].item()) and math.isnan(scale[2].item())
    if quant_dtype in FLOAT8:
        assert codes[1].float().isnan().all()
    else:
        assert (codes[1] == 0).all()

    # Static scale far too small: every code saturates, with the value's sign.
    codes, _ = L.rms_norm_quant(x[3:], n, w, quant_dtype=quant_dtype, scale=torch.tensor([1e-9]))
    big = x[3:].abs() > 1e-3
    top = QMAX[quant_dtype]
    bottom = -128.0 if quant_dtype == I8 else -top
    assert (codes.float()[big & (x[3:] > 0)] == top).all() and (codes.float()[big & (x[3:] < 0)] == bottom).all()

    # scale_ub below the absmax: scale = ub / qmax, and the largest values saturate.
    ub = torch.tensor([0.5])
    codes, scale = L.rms_norm_quant(x[3:], n, w, quant_dtype=quant_dtype, scale_ub=ub)
    assert torch.equal(scale, torch.full((2, 1), 0.5 / QMAX[quant_dtype]))
    _same_bits(codes, reference_quant(y[3:], 1, quant_dtype, None, ub)[0], "capped codes")


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=QUANT_IDS)
@pytest.mark.parametrize("shape", [(0, 16), (4, 0), (2, 0, 3)], ids=["no-rows", "empty-rows", "empty-2d"])
def test_empty_shapes(shape: tuple[int, ...], quant_dtype: torch.dtype) -> None:
    x = torch.randn(shape)
    ns = shape[-1:] if len(shape) == 2 else shape[-2:]
    codes, scale = L.layer_norm_quant(x, ns, quant_dtype=quant_dtype)
    assert codes.shape == x.shape and codes.dtype == quant_dtype
    rows = shape[0] if len(shape) == 2 else shape[0]
    assert scale.shape == (rows, *([1] * len(ns)))
    assert (scale == MIN_SCALE[quant_dtype]).all(), "rows of no elements: absmax 0, the smallest scale"


# ---- bad arguments ---------------------------------------------------------------------------------------------
def _bad_calls() -> list:
    x, w = torch.randn(3, 8), torch.randn(8)
    return [
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, quant_dtype=torch.float16),
                     "expected quant_dtype to be torch.float8_e4m3fn, torch.float8_e5m2, torch.int8 or "
                     "torch.float4_e2m1fn_x2, but got Half",
                     id="dtype"),
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, quant_dtype=torch.float8_e4m3fnuz),
                     "but got Float8_e4m3fnuz", id="e4m3fnuz"),
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, scale=torch.ones(2)),
                     "expected scale to be a float32 tensor of one element, but got scale of dtype Float and shape "
                     r"\[2\]", id="scale-shape"),
        pytest.param(lambda: L.layer_norm_quant(x, 8, w, scale=torch.ones(1, dtype=F64)),
                     "expected scale to be a float32 tensor of one element, but got scale of dtype Double",
                     id="scale-dtype"),
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, scale=torch.ones(1), scale_ub=torch.ones(1)),
                     "scale_ub caps the dynamic per-row scale, so it cannot be given with a static scale",
                     id="scale-and-ub"),
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, scale_ub=torch.ones(1, 1, dtype=F16)),
                     "expected scale_ub to be a float32 tensor of one element", id="ub-dtype"),
        pytest.param(lambda: L.rms_norm_quant(x, 7, w), r"given normalized_shape=\[7\]", id="shape"),
        pytest.param(lambda: L.add_rms_norm_quant(x, torch.randn(3, 7), 8, w),
                     "expected residual to have the same shape as input", id="residual"),
    ]




def test_requires_grad_is_refused_and_no_grad_works() -> None:
    x, w = torch.randn(3, 8), torch.randn(8, requires_grad=True)
    with pytest.raises(RuntimeError, match="rms_norm_quant: the inference ops .* don't support automatic "
                                           "differentiation, but weight requires grad"):
        L.rms_norm_quant(x, 8, w)
    with torch.no_grad():
        codes, scale = L.rms_norm_quant(x, 8, w)
    with torch.inference_mode():
        codes_inf, scale_inf = L.rms_norm_quant(x, 8, w.detach())
    assert torch.equal(codes.view(torch.uint8), codes_inf.view(torch.uint8)) and torch.equal(scale, scale_inf)


# ---- opcheck and compile ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["ln-static", "ln-dynamic-residual", "rms-dynamic-ub", "rms-int8-residual"])
def test_opcheck(case: str) -> None:
    gen = torch.Generator().manual_seed(11)
    x, r = torch.randn(3, 40, generator=gen).bfloat16(), torch.randn(3, 40, generator=gen).bfloat16()
    w, b = torch.randn(40, generator=gen).bfloat16(), torch.randn(40, generator=gen).bfloat16()
    op, args = {
        "ln-static": (_ops.layer_norm_quant, (x, [40], w, b, 1e-5, FP8, torch.tensor([0.02]))),
        "ln-dynamic-residual": (_ops.layer_norm_quant, (x, [40], w, b, 1e-5, FP8, None, None, r, True, 0.5, True)),
        "rms-dynamic-ub": (_ops.rms_norm_quant, (x, [40], w, None, FP8, None, torch.tensor([2.0]))),
        "rms-e5m2-static": (_ops.rms_norm_quant, (x, [40], w, None, E5M2, torch.tensor([0.02]))),
        "rms-int8-residual": (_ops.rms_norm_quant, (x, [40], w, 1e-6, I8, None, None, r, False, 1.0, False)),
    }[case]
    torch.library.opcheck(op.default, args)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fp8_decode_step_compiles_fullgraph(backend: str) -> None:
    """An fp8 serving step: the fused add + RMSNorm quantized with a static scale for the next projection, and a
    dynamic per-token int8 LayerNorm; compiled with fullgraph, the same bits as eager."""
    torch.manual_seed(12)
    w1, w2 = torch.randn(64).bfloat16(), torch.randn(64).bfloat16()
    scale = torch.tensor([0.05])

    def step(x: Tensor, residual: Tensor) -> tuple[Tensor, ...]:
        q, _, h = L.add_rms_norm_quant(x, residual, 64, w1, 1e-6, scale=scale)
        deq = q.float() * scale
        q8, s8 = L.layer_norm_quant(deq.bfloat16(), 64, w2, None, quant_dtype=I8)
        return q.view(torch.uint8), h, q8, s8

    x, r = torch.randn(4, 64).bfloat16(), torch.randn(4, 64).bfloat16()
    eager = step(x, r)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    got = compiled(x, r)
    torch._dynamo.reset()
    for g, e, name in zip(got, eager, ("codes", "h", "int8 codes", "int8 scales"), strict=True):
        assert torch.equal(g, e), name


# ---- into the caller's buffers (out=, scales=, residual_out=) -------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=QUANT_IDS)
@pytest.mark.parametrize("cols", [7, 769])
@pytest.mark.parametrize("fn", FNS)
def test_into_buffers_equal_the_allocating_op(fn: str, cols: int, quant_dtype: torch.dtype, mode: str) -> None:
    a = _args(fn, BF16, F32, cols)
    y, _ = _unquantized(fn, a)
    scale, scale_ub = _scales(mode, quant_dtype, y)
    want = _quantized(fn, a, quant_dtype=quant_dtype, scale=scale, scale_ub=scale_ub)
    out = torch.full(a["x"].shape, 7, dtype=torch.uint8).view(quant_dtype)
    kw: dict[str, object] = {"out": out, "scale": scale, "scale_ub": scale_ub}
    if scale is None:
        kw["scales"] = torch.full((a["x"].shape[0], 1), math.nan)
    if fn.startswith("add_"):
        kw["residual_out"] = torch.full_like(a["x"], math.nan)
    got = _quantized(fn, a, **kw)
    assert got[0] is out
    _same_bits(out, want[0], "codes")
    if scale is None:
        assert got[1] is kw["scales"]
        _same_bits(got[1], want[1], "scales")
    else:
        assert got[1] is scale
    if fn.startswith("add_"):
        assert got[2] is kw["residual_out"]
        _same_bits(got[2], want[2], "residual_out")


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=QUANT_IDS)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_residual_updated_in_place(rms: bool, quant_dtype: torch.dtype) -> None:
    """vLLM's fused_add_rms_norm_static_fp8_quant: residual_out=residual writes h over the residual."""
    fn = "add_rms_norm" if rms else "add_layer_norm"
    a = _args(fn, BF16, BF16, 4096, rows=3)
    scale = torch.tensor([0.03])
    want = _quantized(fn, a, quant_dtype=quant_dtype, scale=scale)
    residual = a["r"].clone()
    out = torch.empty(a["x"].shape, dtype=quant_dtype)
    got = _quantized(fn, {**a, "r": residual}, quant_dtype=quant_dtype, scale=scale, out=out, residual_out=residual)
    assert got[2] is residual
    _same_bits(residual, want[2], "residual (h, in place)")
    _same_bits(out, want[0], "codes")


def test_into_allocates_nothing() -> None:
    a = _args("add_rms_norm", BF16, BF16, 512, rows=16)
    out, scales = torch.empty(16, 512, dtype=FP8), torch.empty(16, 1)

    def allocations(call) -> int:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call()
        return sum(1 for e in prof.events() if e.name in ("aten::empty", "aten::empty_strided", "aten::empty_like"))

    x, r, w = a["x"], a["r"], a["w"]
    assert allocations(lambda: L.add_rms_norm_quant(x, r, 512, w)) == 3  # codes, scales, h
    assert allocations(lambda: L.add_rms_norm_quant(x, r, 512, w, out=out, scales=scales, residual_out=r)) == 0
    scale = torch.tensor([0.1])
    assert allocations(lambda: L.rms_norm_quant(x, 512, w, out=out, scale=scale)) == 0


def _bad_into_calls() -> list:
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    codes = torch.empty(3, 8, dtype=FP8)
    return [
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, out=torch.empty(3, 8), scales=torch.empty(3, 1)),
                     "rms_norm_quant_into: expected out to be a torch.float8_e4m3fn, torch.float8_e5m2, torch.int8 or "
                     "torch.float4_e2m1fn_x2 tensor \\(the codes\\), but got out of dtype Float", id="out-dtype"),
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, out=torch.empty(3, 9, dtype=I8), scales=torch.empty(3, 1)),
                     r"expected out of shape \[3, 8\] and dtype Char, but got out of shape \[3, 9\]", id="out-shape"),
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, out=codes),
                     r"a dynamic scale \(no scale=\) needs a scales= buffer for the per-row scales of shape \[3, 1\]",
                     id="no-scales"),
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, out=codes, scale=torch.ones(1), scales=torch.empty(3, 1)),
                     "scales= receives the dynamic per-row scales; with a static scale there are none", id="stray-scales"),
        pytest.param(lambda: L.layer_norm_quant(x, 8, w, out=codes, scales=torch.empty(3)),
                     r"expected scales of shape \[3, 1\] and dtype Float, but got scales of shape \[3\]", id="scales-shape"),
        pytest.param(lambda: L.add_rms_norm_quant(x, r, 8, w, out=codes, scales=torch.empty(3, 1)),
                     "a residual needs a residual_out buffer", id="no-residual-out"),
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, scales=torch.empty(3, 1)),
                     "scales= goes with out=", id="scales-without-out"),
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, quant_dtype=I8, out=codes, scales=torch.empty(3, 1)),
                     "rms_norm_quant: quant_dtype=torch.int8 contradicts out's dtype torch.float8_e4m3fn",
                     id="quant-dtype-vs-out"),
        pytest.param(lambda: L.add_layer_norm_quant(x, r, 8, w, quant_dtype=FP8, scale=torch.ones(1),
                                                    out=torch.empty(3, 8, dtype=I8), residual_out=torch.empty(3, 8)),
                     "layer_norm_quant: quant_dtype=torch.float8_e4m3fn contradicts out's dtype torch.int8",
                     id="quant-dtype-vs-out-residual"),
    ]


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=QUANT_IDS)
def test_quant_dtype_with_out_is_outs(quant_dtype: torch.dtype) -> None:
    """With out=, quant_dtype may be left out (out's dtype decides) or given the same; a contradicting one is
    refused (_bad_into_calls)."""
    gen = torch.Generator().manual_seed(15)
    x, w, scale = torch.randn(3, 40, generator=gen), torch.randn(40, generator=gen), torch.tensor([0.01])
    want, _ = L.rms_norm_quant(x, 40, w, quant_dtype=quant_dtype, scale=scale)
    for kw in ({}, {"quant_dtype": quant_dtype}):
        out = torch.empty(3, 40, dtype=quant_dtype)
        codes, _ = L.rms_norm_quant(x, 40, w, scale=scale, out=out, **kw)
        assert codes is out
        _same_bits(out, want, f"codes, {kw}")


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize(("call", "match"), _bad_calls() + _bad_into_calls())
def test_bad_arguments_and_buffers_are_refused(call, match: str, fake: bool) -> None:
    """The same error, worded the same, eager and while tracing with fake tensors (torch.compile / export)."""
    if fake:
        with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(RuntimeError, match=match):
            call()
    else:
        with pytest.raises(RuntimeError, match=match):
            call()


def test_overlapping_buffers_are_refused() -> None:
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    codes = torch.empty(3, 8, dtype=FP8)
    with pytest.raises(RuntimeError, match="rms_norm_quant_into: residual_out shares memory with input"):
        L.add_rms_norm_quant(x, r, 8, w, scale=torch.ones(1), out=codes, residual_out=x)
    with pytest.raises(RuntimeError, match="rms_norm_quant_into: scales shares memory with input"):
        L.rms_norm_quant(x, 8, w, out=codes, scales=x.view(-1)[:3].view(3, 1))


@pytest.mark.parametrize("quant_dtype", [I8, FP8, E5M2], ids=["i8", "fp8", "e5m2"])
@pytest.mark.parametrize("case", ["rms-static-in-place", "ln-dynamic"])
def test_opcheck_into(case: str, quant_dtype: torch.dtype) -> None:
    """Every opcheck test with int8 codes; with float8 codes all but test_schema, whose comparison of the mutated
    arguments multiplies them (torch has no float8 mul on CPU)."""
    gen = torch.Generator().manual_seed(13)
    x, r = torch.randn(3, 40, generator=gen).bfloat16(), torch.randn(3, 40, generator=gen).bfloat16()
    w, b = torch.randn(40, generator=gen).bfloat16(), torch.randn(40, generator=gen).bfloat16()
    codes = torch.empty(3, 40, dtype=quant_dtype)
    every = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    utils = every if quant_dtype == I8 else every[1:]
    if case == "rms-static-in-place":
        res = r.clone()
        torch.library.opcheck(_ops.rms_norm_quant_into.default,
                              (x, [40], w, 1e-6, codes, torch.tensor([0.05]), None, None, res, res), test_utils=utils)
    else:
        torch.library.opcheck(_ops.layer_norm_quant_into.default,
                              (x, [40], w, b, 1e-5, codes, None, torch.empty(3, 1), torch.tensor([3.0]), r,
                               torch.empty_like(r), False, 0.5, True), test_utils=utils)  # fmt: skip


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fp8_decode_step_into_buffers_compiles_fullgraph(backend: str) -> None:
    """The engines' step with static buffers: residual updated in place, codes into a preallocated buffer."""
    torch.manual_seed(14)
    w = torch.randn(64).bfloat16()
    scale = torch.tensor([0.05])

    def step(x: Tensor, residual: Tensor, codes: Tensor) -> None:
        L.add_rms_norm_quant(x, residual, 64, w, 1e-6, scale=scale, out=codes, residual_out=residual)

    x, r = torch.randn(4, 64).bfloat16(), torch.randn(4, 64).bfloat16()
    re, ce = r.clone(), torch.empty(4, 64, dtype=FP8)
    step(x, re, ce)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    rc, cc = r.clone(), torch.empty(4, 64, dtype=FP8)
    compiled(x, rc, cc)
    torch._dynamo.reset()
    assert torch.equal(rc, re), "residual"
    assert torch.equal(cc.view(torch.uint8), ce.view(torch.uint8)), "codes"
