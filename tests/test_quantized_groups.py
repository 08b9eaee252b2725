"""Quantized output with a dynamic scale per group of columns (``group_size``: vLLM's rms_norm_per_block_quant).

Held, as test_quantized.py holds the per-row scales, to a composite PyTorch reference of the arithmetic
(csrc/quant_math.h: each group's absmax, capped by scale_ub, over qmax, at least min_scale; every code
``y * (1 / scale)``) applied to our own unquantized output: the same bits. Plus the round trip (dequantized codes
within half a code step of y), vLLM's two scale layouts (row-major and column-major, allocated or given, padded
rows included), special groups, bad arguments (eager and fake alike), fake strides, opcheck and compile.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

import layernorm_ext as L
from conftest import compiled_and_eager
from test_inference_ops import _args
from test_inference_ops import _functional as _unquantized
from test_quantized import (BF16, DTYPES, FNS, I8, MIN_SCALE, QMAX, QUANT_DTYPES, QUANT_IDS, _SHORT, _quantized,
                            _same_bits, encode)

pytestmark = pytest.mark.usefixtures("cpu_isa")

F32, FP8, E5M2 = torch.float32, torch.float8_e4m3fn, torch.float8_e5m2
_ops = torch.ops.layernorm_ext
# (cols, group_size): a group of the whole row, groups of one element, vLLM's 64 / 128, odd groups of odd rows.
GROUPS = ((1, 1), (7, 7), (7, 1), (768, 64), (768, 128), (5125, 125))


def reference_group_quant(y: Tensor, group_size: int, quant_dtype: torch.dtype, scale_ub: Tensor | None
                          ) -> tuple[Tensor, Tensor]:
    """codes and per-group scales (rows x groups) of y, rows x cols, in torch ops."""
    groups = y.float().unflatten(-1, (-1, group_size))
    absmax = groups.abs().amax(dim=-1)  # NaN stays NaN
    if scale_ub is not None:
        absmax = torch.where(absmax > scale_ub, scale_ub, absmax)
    s = absmax / QMAX[quant_dtype]
    floor = torch.tensor(MIN_SCALE[quant_dtype], dtype=F32)
    scales = torch.where(s < floor, floor, s)
    codes = encode((groups * torch.reciprocal(scales)[..., None]).flatten(-2), quant_dtype)
    return codes, scales


def _cases() -> list:
    return [
        pytest.param(fn, dtype, wdtype, cols, g, q,
                     id=f"{fn}-{_SHORT[dtype]}w{_SHORT[wdtype]}-n{cols}g{g}-{_SHORT[q]}")
        for fn in FNS for dtype, wdtype in DTYPES for cols, g in GROUPS for q in QUANT_DTYPES
    ]  # fmt: skip


# The cap and the scales' layout act independently (one caps the absmax, the other places the scale): paired.
@pytest.mark.parametrize(("capped", "layout"), [(False, "row_major"), (True, "column_major")],
                         ids=["dynamic-row_major", "dynamic_ub-column_major"])
@pytest.mark.parametrize(("fn", "dtype", "wdtype", "cols", "group_size", "quant_dtype"), _cases())
def test_group_codes_are_the_composite_of_our_output(
    fn: str, dtype: torch.dtype, wdtype: torch.dtype, cols: int, group_size: int, quant_dtype: torch.dtype,
    capped: bool, layout: str,
) -> None:
    a = _args(fn, dtype, wdtype, cols)
    y, h = _unquantized(fn, a)
    scale_ub = torch.tensor([y.float().abs().amax().item() * 0.7]) if capped else None
    column_major = layout == "column_major"
    codes, scales, got_h = _quantized(fn, a, quant_dtype=quant_dtype, scale_ub=scale_ub, group_size=group_size,
                                      scales_column_major=column_major)
    want_codes, want_scales = reference_group_quant(y, group_size, quant_dtype, scale_ub)
    _same_bits(codes, want_codes, "codes")
    _same_bits(scales, want_scales, "scales")
    rows, groups = y.shape[0], cols // group_size
    assert scales.stride() == ((1, rows) if column_major else (groups, 1))
    if h is not None:
        _same_bits(got_h, h, "residual_out")


_MANTISSA = {FP8: 3, E5M2: 2}
_MIN_EXPONENT = {FP8: -6, E5M2: -14}


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=QUANT_IDS)
@pytest.mark.parametrize("group_size", [32, 128])
def test_round_trip_within_half_a_step(group_size: int, quant_dtype: torch.dtype) -> None:
    """Dequantized codes against y: within half a code step of y / scale (in units of the group's scale)."""
    a = _args("rms_norm", BF16, BF16, 1024, rows=9)
    y, _ = _unquantized("rms_norm", a)
    codes, scales, _ = _quantized("rms_norm", a, quant_dtype=quant_dtype, group_size=group_size)
    per_element_scale = scales.repeat_interleave(group_size, dim=-1)
    v = y.float() / per_element_scale
    if quant_dtype == I8:
        step = torch.ones_like(v)
    else:
        exponent = torch.floor(torch.log2(v.abs().clamp_min(2.0 ** _MIN_EXPONENT[quant_dtype])))
        step = torch.exp2(exponent - _MANTISSA[quant_dtype])
    error = (codes.float() - v).abs()
    # codes are y * (1 / scale): the rounded reciprocal moves v by up to an ulp of float32 or two
    assert bool((error <= step / 2 + v.abs() * 2.0**-22).all()), float((error / step).max())
    # the groups' scales differ: a per-row scale would lose the small groups' precision
    assert scales.amax() > scales.amin()


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=QUANT_IDS)
def test_special_groups(quant_dtype: torch.dtype) -> None:
    """A zero group gets min_scale and zero codes; a NaN or an infinity spoils its own group's scale only. Rows of
    ones with eps=0 normalize to exactly 1, so y is the weight, special values included."""
    w = torch.linspace(0.5, 2.0, 16)
    w[0:4] = 0.0
    w[5] = float("nan")
    w[9] = float("inf")
    x = torch.ones(2, 16)
    codes, scales = L.rms_norm_quant(x, 16, w, 0.0, quant_dtype=quant_dtype, group_size=4)
    y = L.rms_norm(x, 16, w, 0.0)
    want_codes, want_scales = reference_group_quant(y, 4, quant_dtype, None)
    _same_bits(codes, want_codes, "codes")
    _same_bits(scales, want_scales, "scales")
    assert bool((scales[:, 0] == MIN_SCALE[quant_dtype]).all()) and not bool(codes[:, :4].float().any())
    assert bool(scales[:, 1].isnan().all()) and bool(scales[:, 2].isinf().all())
    assert bool(scales[:, 3].isfinite().all()) and bool((scales[:, 3] == 2.0 / QMAX[quant_dtype]).all())


def test_into_layouts_and_padded_column_major() -> None:
    """scales= may be row-major, column-major, or column-major with padded rows (vLLM's TMA-aligned scales): each
    gets the same scales where the layout puts them; the padding is left alone."""
    a = _args("add_rms_norm", BF16, BF16, 256, rows=5)
    want_codes, want_scales, want_h = _quantized("add_rms_norm", a, group_size=64)
    padded = torch.full((4, 8), -1.0)  # 4 groups x rows padded 5 -> 8
    buffers = {
        "row_major": torch.empty(5, 4),
        "column_major": torch.empty(4, 5).t(),
        "padded": padded[:, :5].t(),
    }
    for name, scales in buffers.items():
        out, h = torch.empty(5, 256, dtype=FP8), torch.empty(5, 256, dtype=BF16)
        codes, got_scales, got_h = _quantized("add_rms_norm", a, group_size=64, out=out, scales=scales,
                                              residual_out=h)
        assert codes is out and got_scales is scales and got_h is h
        _same_bits(out, want_codes, f"codes ({name})")
        _same_bits(scales, want_scales, f"scales ({name})")
        _same_bits(h, want_h, f"h ({name})")
    assert bool((padded[:, 5:] == -1.0).all()), "the padding was written"


def test_fake_scales_have_the_real_strides() -> None:
    x, w = torch.randn(6, 256), torch.randn(256)
    for column_major in (False, True):
        _, real, _ = _ops.rms_norm_quant.default(x, [256], w, None, FP8, None, None, None, False, 0.0, False, 64,
                                                  column_major)
        with FakeTensorMode(allow_non_fake_inputs=True):
            _, fake, _ = _ops.rms_norm_quant.default(x, [256], w, None, FP8, None, None, None, False, 0.0, False, 64,
                                                      column_major)
        assert fake.shape == real.shape == (6, 4) and fake.stride() == real.stride()


def _bad_calls() -> list:
    x, w = torch.randn(3, 8), torch.randn(8)
    codes = torch.empty(3, 8, dtype=FP8)
    return [
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, group_size=-4),
                     r"rms_norm_quant: expected group_size to be positive \(or 0: a scale per row\), but got -4",
                     id="negative"),
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, group_size=3),
                     "rms_norm_quant: expected group_size to divide the 8 normalized elements of a row, but got "
                     "group_size=3", id="not-dividing"),
        pytest.param(lambda: L.layer_norm_quant(x, 8, w, scale=torch.ones(1), group_size=4),
                     "layer_norm_quant: group_size gives each group of columns a dynamic scale, so it cannot be "
                     "given with a static scale", id="static"),
        pytest.param(lambda: L.rms_norm_quant(x.view(3, 2, 4), (2, 4), w.view(2, 4), group_size=4),
                     r"group_size needs a 1-D normalized_shape \(groups along its dim\), but got normalized_shape "
                     r"\[2, 4\]", id="2d-shape"),
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, scales_column_major=True),
                     "scales_column_major lays out per-group scales, so it needs a group_size", id="layout-alone"),
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, group_size=4),
                     "", id="fine"),
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, group_size=4, out=codes),
                     r"a dynamic scale \(no scale=\) needs a scales= buffer for the per-group scales of shape "
                     r"\[3, 2\]", id="no-scales"),
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, group_size=4, out=codes, scales=torch.empty(3, 1)),
                     r"expected scales of shape \[3, 2\] and dtype Float, but got scales of shape \[3, 1\]",
                     id="scales-shape"),
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, group_size=4, out=codes, scales=torch.empty(3, 4)[:, ::2]),
                     r"expected scales to be row-major \(contiguous\) or column-major", id="scales-strided"),
        pytest.param(lambda: L.rms_norm_quant(x, 8, w, group_size=4, out=codes, scales=torch.empty(3, 2),
                                              scales_column_major=True),
                     "scales_column_major lays out new scales; with out= the scales= buffer's own layout",
                     id="layout-with-out"),
    ]


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize(("call", "match"), _bad_calls())
def test_bad_group_arguments_are_refused(call, match: str, fake: bool) -> None:
    refused_alike(call, match, fake)


def refused_alike(call, match: str, fake: bool) -> None:
    """The same error, worded the same, eager and while tracing with fake tensors (and a good call passes both)."""
    context = FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.no_grad()
    with context:
        if not match:
            call()
            return
        with pytest.raises(RuntimeError, match=match):
            call()


@pytest.mark.parametrize("quant_dtype", [I8, FP8], ids=["i8", "fp8"])
@pytest.mark.parametrize("column_major", [False, True], ids=["row_major", "column_major"])
def test_opcheck(column_major: bool, quant_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(21)
    x, r = torch.randn(3, 64, generator=gen).bfloat16(), torch.randn(3, 64, generator=gen).bfloat16()
    w, b = torch.randn(64, generator=gen).bfloat16(), torch.randn(64, generator=gen).bfloat16()
    torch.library.opcheck(_ops.layer_norm_quant.default,
                          (x, [64], w, b, 1e-5, quant_dtype, None, torch.tensor([2.0]), r, False, 0.0, False, 16,
                           column_major))  # fmt: skip
    every = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    scales = torch.empty(4, 3).t() if column_major else torch.empty(3, 4)
    torch.library.opcheck(_ops.rms_norm_quant_into.default,
                          (x, [64], w, 1e-6, torch.empty(3, 64, dtype=quant_dtype), None, scales, None, None, None,
                           False, 0.0, False, 16),
                          test_utils=every if quant_dtype == I8 else every[1:])  # fmt: skip


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_group_quant_compiles_fullgraph(backend: str) -> None:
    """vLLM's fused add + RMSNorm + per-group fp8 with transposed scales, compiled fullgraph: eager's bits."""
    torch.manual_seed(22)
    w = torch.randn(256).bfloat16()

    def step(x: Tensor, residual: Tensor) -> tuple[Tensor, ...]:
        q, s, h = L.add_rms_norm_quant(x, residual, 256, w, 1e-6, group_size=128, scales_column_major=True)
        return q.view(torch.uint8), s, h

    x, r = torch.randn(4, 256).bfloat16(), torch.randn(4, 256).bfloat16()
    got, eager = compiled_and_eager(step, (x, r), backend)
    for g, e, name in zip(got, eager, ("codes", "scales", "h"), strict=True):
        assert torch.equal(g, e) and g.stride() == e.stride(), name


def test_into_allocates_nothing() -> None:
    a = _args("rms_norm", BF16, BF16, 512, rows=16)
    out, scales = torch.empty(16, 512, dtype=FP8), torch.empty(4, 16).t()

    def allocations(call) -> int:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call()
        return sum(1 for e in prof.events() if e.name in ("aten::empty", "aten::empty_strided", "aten::empty_like"))

    x, w = a["x"], a["w"]
    assert allocations(lambda: L.rms_norm_quant(x, 512, w, group_size=128, out=out, scales=scales)) == 0


# ---- MX block scales (scales_dtype=torch.float8_e8m0fnu: OCP Microscaling, MXFP8 with group_size 32) -----------
E8M0 = torch.float8_e8m0fnu
_EMAX = {FP8: 8, E5M2: 15}


def reference_mx(y: Tensor, group_size: int, quant_dtype: torch.dtype, scale_ub: Tensor | None = None
                 ) -> tuple[Tensor, Tensor]:
    """codes and float8_e8m0fnu scales of y by the OCP MX rule: e = floor(log2(absmax)) - emax, clamped to
    [-127, 127], codes y / 2^e saturated."""
    groups = y.float().unflatten(-1, (-1, group_size))
    absmax = groups.abs().amax(dim=-1)
    if scale_ub is not None:
        absmax = torch.where(absmax > scale_ub, scale_ub, absmax)
    floor_log2 = ((absmax.view(torch.int32) >> 23) & 0xFF) - 127
    e = (floor_log2 - _EMAX[quant_dtype]).clamp(-127, 127)
    nan = absmax.isnan()
    scales = torch.where(nan, 255, e + 127).to(torch.uint8).view(E8M0)
    # 2^-e from its bits (2^-127 is a subnormal float)
    factor = torch.where(e == 127, 0x00400000, (127 - e) << 23).to(torch.int32).view(F32)
    factor = torch.where(nan, float("nan"), factor)
    return encode((groups * factor[..., None]).flatten(-2), quant_dtype), scales


@pytest.mark.parametrize("quant_dtype", [FP8, E5M2], ids=["fp8", "e5m2"])
@pytest.mark.parametrize(("cols", "group_size"), [(32, 32), (96, 32), (7, 7), (5125, 125)])
@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("dtype", [BF16, F32, torch.float16], ids=["bf16", "f32", "f16"])
def test_mx_codes_and_scales_are_the_ocp_rule(
    dtype: torch.dtype, fn: str, cols: int, group_size: int, quant_dtype: torch.dtype
) -> None:
    a = _args(fn, dtype, dtype, cols)
    y, h = _unquantized(fn, a)
    codes, scales, got_h = _quantized(fn, a, quant_dtype=quant_dtype, group_size=group_size, scales_dtype=E8M0)
    want_codes, want_scales = reference_mx(y, group_size, quant_dtype)
    _same_bits(codes, want_codes, "codes")
    assert scales.dtype == E8M0 and torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8))
    # the scale is a power of two that puts the group's absmax in [2^emax, 2^(emax + 1))
    absmax = y.float().unflatten(-1, (-1, group_size)).abs().amax(-1)
    ratio = absmax / scales.float()
    finite = absmax > 2.0**-100
    assert bool(((ratio[finite] >= 2.0 ** _EMAX[quant_dtype]) & (ratio[finite] < 2.0 ** (_EMAX[quant_dtype] + 1))).all())
    if h is not None:
        _same_bits(got_h, h, "residual_out")


def test_mx_special_groups_and_buffers() -> None:
    """Zero group: 2^-127 and zero codes; NaN group: the NaN scale (0xff) and NaN codes; an infinity: its group's
    exponent clamps at 2^120 and the infinity saturates. Into a column-major float8_e8m0fnu buffer: the same."""
    w = torch.linspace(0.5, 2.0, 128)
    w[0:32] = 0.0
    w[40] = float("nan")
    w[70] = float("inf")
    x = torch.ones(3, 128)
    codes, scales = L.rms_norm_quant(x, 128, w, 0.0, group_size=32, scales_dtype=E8M0)
    bits = scales.view(torch.uint8)
    assert bool((bits[:, 0] == 0).all()) and not bool(codes[:, :32].float().any())
    assert bool((bits[:, 1] == 255).all()) and bool(codes[:, 32:64].float().isnan().all())
    assert bool((bits[:, 2] == 247).all()) and bool((codes[:, 70].float() == 448.0).all())
    want_codes, want_scales = reference_mx(L.rms_norm(x, 128, w, 0.0), 32, FP8)
    _same_bits(codes, want_codes, "codes")
    out, buffer = torch.empty(3, 128, dtype=FP8), torch.empty(4, 3, dtype=E8M0).t()
    L.rms_norm_quant(x, 128, w, 0.0, group_size=32, out=out, scales=buffer)
    _same_bits(out, want_codes, "codes into out")
    assert torch.equal(buffer.view(torch.uint8), want_scales.view(torch.uint8))


def _bad_mx_calls() -> list:
    x, w = torch.randn(3, 64), torch.randn(64)
    return [
        pytest.param(lambda: L.rms_norm_quant(x, 64, w, scales_dtype=E8M0),
                     "rms_norm_quant: float8_e8m0fnu scales are MX block scales, so they need a group_size",
                     id="no-group"),
        pytest.param(lambda: L.rms_norm_quant(x, 64, w, quant_dtype=I8, group_size=32, scales_dtype=E8M0),
                     r"MX block scales \(float8_e8m0fnu\) go with float8 codes, but got codes of dtype Char",
                     id="int8"),
        pytest.param(lambda: L.rms_norm_quant(x, 64, w, group_size=32, scales_dtype=torch.float16),
                     r"expected scales_dtype to be torch.float32 or torch.float8_e8m0fnu \(MX block scales\), but got "
                     "Half", id="dtype"),
        pytest.param(lambda: L.rms_norm_quant(x, 64, w, group_size=32, out=torch.empty(3, 64, dtype=FP8),
                                              scales=torch.empty(3, 2, dtype=torch.float16)),
                     r"expected scales of shape \[3, 2\] and dtype Float, but got scales of shape \[3, 2\] and dtype "
                     "Half", id="buffer-dtype"),
    ]


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize(("call", "match"), _bad_mx_calls())
def test_bad_mx_arguments_are_refused(call, match: str, fake: bool) -> None:
    context = FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.no_grad()
    with context, pytest.raises(RuntimeError, match=match):
        call()


def test_mx_opcheck() -> None:
    gen = torch.Generator().manual_seed(23)
    x, w = torch.randn(3, 64, generator=gen).bfloat16(), torch.randn(64, generator=gen).bfloat16()
    torch.library.opcheck(_ops.rms_norm_quant.default,
                          (x, [64], w, None, FP8, None, None, None, False, 0.0, False, 32, True, E8M0),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
