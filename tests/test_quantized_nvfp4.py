"""NVFP4 output of the quantized norms (quant_dtype=torch.float4_e2m1fn_x2, scale= the float32 global scale).

The e2m1 encoder is held to a reference written from the format's table (torch has no float4 cast) on every
bfloat16 value and the midpoints between codes; the codes and float8_e4m3fn block scales, bit for bit, to a
composite of vLLM's ref_nvfp4_quant arithmetic in torch ops applied to our own unquantized output; plus the round
trip, special blocks, layouts, bad arguments (eager and fake alike), opcheck, compile and no allocation into buffers.
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
from test_quantized import _quantized, _same_bits
from test_quantized_groups import refused_alike

pytestmark = pytest.mark.usefixtures("cpu_isa")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
FP4, FP8 = torch.float4_e2m1fn_x2, torch.float8_e4m3fn
_ops = torch.ops.layernorm_ext
FNS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; code | 8 is the negative


# ---- references ------------------------------------------------------------------------------------------------
def e2m1_codes(v: Tensor) -> Tensor:
    """float32 values -> e2m1 codes (uint8, 0..15) from the table: saturate at 6, the nearest value, a tie to the
    even code; the sign bit as the float's (so -0.0 and small negatives give 8); NaN gives 7 (+6)."""
    grid = torch.tensor(E2M1_VALUES)
    magnitude = v.abs().clamp(max=6.0)
    distance = (magnitude[..., None] - grid).abs()
    nearest = distance == distance.amin(dim=-1, keepdim=True)
    even = torch.arange(8) % 2 == 0
    code = (nearest.to(torch.int32) * (1 + even.to(torch.int32))).argmax(dim=-1)  # of two, the even one
    sign = torch.signbit(v).to(torch.int64) * 8
    return torch.where(v.isnan(), 7, code + sign).to(torch.uint8)


def packed(codes: Tensor) -> Tensor:
    """Codes [..., N] as float4_e2m1fn_x2 [..., N / 2]: the even element in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(FP4)


def unpacked_values(fp4: Tensor) -> Tensor:
    """float4_e2m1fn_x2 [..., N / 2] -> the codes' float32 values [..., N]."""
    b = fp4.view(torch.uint8)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2).long()
    table = torch.tensor(E2M1_VALUES + tuple(-x for x in E2M1_VALUES))
    return table[codes]


def _reciprocal_or_zero(x: Tensor) -> Tensor:
    return torch.where(x == 0, torch.zeros_like(x), 1.0 / x)


def reference_nvfp4(y: Tensor, global_scale: Tensor) -> tuple[Tensor, Tensor]:
    """vLLM's ref_nvfp4_quant in torch ops (float32 throughout): per block of 16, s = e4m3(gs * (absmax * (1/6)))
    clamped to +-448, codes e2m1(y * rcp(float(s) * rcp(gs))); returns the packed codes and the scales."""
    blocks = y.float().unflatten(-1, (-1, 16))
    absmax = blocks.abs().amax(dim=-1, keepdim=True)
    scales = (global_scale * (absmax * (1.0 / 6.0))).clamp(-448.0, 448.0).to(FP8)
    factor = _reciprocal_or_zero(scales.float() * _reciprocal_or_zero(global_scale))
    codes = e2m1_codes((blocks * factor).flatten(-2))
    return packed(codes), scales.squeeze(-1)


def _global_scale(y: Tensor) -> Tensor:
    """vLLM's choice: 448 * 6 / amax of the tensor (the largest block then gets the largest scale)."""
    return (448.0 * 6.0 / y.float().abs().amax()).reshape(1)


# ---- (1) the encoder, exhaustively -----------------------------------------------------------------------------
def _codes_of_values(values: Tensor) -> Tensor:
    """The op's e2m1 codes of exactly these float32 values (no NaN): RMSNorm of a row of ones with eps=0 is 1, so
    y is the weight; each block starts with 6, so that with the global scale 448 its e4m3 scale saturates at 448
    and its codes' factor is exactly rcp(448 * rcp(448)) = 1."""
    per_block = values.numel() // 15 + 1
    padded = torch.cat([values, torch.zeros(per_block * 15 - values.numel())]).view(per_block, 15)
    w = torch.cat([torch.full((per_block, 1), 6.0), padded], dim=1).flatten()
    codes, scales = L.rms_norm_quant(torch.ones(1, w.numel()), w.numel(), w, 0.0, quant_dtype=FP4,
                                     scale=torch.tensor([448.0]))
    assert bool((scales.view(torch.uint8) == 0x7E).all())  # 448
    b = codes.view(torch.uint8)[0]
    nibbles = torch.stack([b & 0xF, b >> 4], dim=-1).flatten().view(per_block, 16)[:, 1:]
    return nibbles.flatten()[: values.numel()]


def test_e2m1_encoder_on_every_bfloat16_and_the_midpoints() -> None:
    every_bf16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(BF16).float()
    grid = torch.tensor(E2M1_VALUES)
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, mids.nextafter(torch.tensor(math.inf)), mids.nextafter(torch.tensor(-math.inf))])
    edges = torch.tensor([6.0, 6.0001, 7.0, 1e30, math.inf, 1e-45, 0.0])
    positive = torch.cat([near, edges])
    values = torch.cat([every_bf16, positive, -positive])
    values = values[~values.isnan()]
    got, want = _codes_of_values(values), e2m1_codes(values)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(values[i].item(), got[i].item(), want[i].item()) for i in bad[:8]]
    # the table itself: ties to even, saturation, the sign of zero
    probe = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 100.0, -0.0, -0.2, -5.1])
    assert e2m1_codes(probe).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 8, 15]


# ---- (2) the codes and scales: the composite of our own output ----------------------------------------------
def _cases() -> list:
    return [
        pytest.param(fn, dtype, cols, rows, id=f"{fn}-{str(dtype)[6:]}-n{cols}r{rows}")
        for fn in FNS for dtype in (BF16, F16, F32) for cols, rows in ((16, 1), (32, 7), (784, 5), (5120, 3))
    ]  # fmt: skip


@pytest.mark.parametrize(("fn", "dtype", "cols", "rows"), _cases())
def test_nvfp4_is_the_composite_of_our_output(fn: str, dtype: torch.dtype, cols: int, rows: int) -> None:
    a = _args(fn, dtype, dtype, cols, rows=rows)
    y, h = _unquantized(fn, a)
    gs = _global_scale(y)
    codes, scales, got_h = _quantized(fn, a, quant_dtype=FP4, scale=gs)
    want_codes, want_scales = reference_nvfp4(y, gs)
    assert codes.shape == (rows, cols // 2) and scales.shape == (rows, cols // 16)
    _same_bits(codes.view(torch.uint8), want_codes.view(torch.uint8), "codes")
    _same_bits(scales, want_scales, "scales")
    if h is not None:
        _same_bits(got_h, h, "residual_out")


# ---- (3) round trip --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", ["rms_norm", "add_layer_norm"])
def test_round_trip_within_half_a_step(fn: str) -> None:
    """codes * s / gs against y: within half an e2m1 step of y in units of the block's scale (the step of the code
    nearest |v|: 0.5 below 2, 1 to 4, 2 above), or saturated at 6 where the e4m3 scale rounded down (by at most
    half its own step, 1/16)."""
    a = _args(fn, BF16, BF16, 1024, rows=9)
    y, _ = _unquantized(fn, a)
    gs = _global_scale(y)
    codes, scales, _ = _quantized(fn, a, quant_dtype=FP4, scale=gs)
    block_unit = (scales.float() / gs).repeat_interleave(16, dim=-1)  # one code step of 1 is worth this much of y
    v = y.float() / block_unit
    step = torch.where(v.abs() < 2, 0.5, torch.where(v.abs() < 4, 1.0, 2.0))
    error = (unpacked_values(codes) - v).abs()
    saturated = v.abs() > 6
    assert bool((error[~saturated] <= step[~saturated] / 2 * (1 + 2.0**-20)).all()), float((error / step).max())
    assert bool((v.abs()[saturated] <= 6 * (1 + 1 / 16)).all()) and bool((error[saturated] <= 6 / 16).all())
    # the blocks' scales differ: one scale per row would lose the small blocks' precision
    assert scales.float().amax() > scales.float().amin()


# ---- (4) special blocks ----------------------------------------------------------------------------------------
def test_special_blocks() -> None:
    """Rows of ones with eps=0 normalize to exactly 1, so y is the weight: a zero block gets scale 0 and codes 0; a
    NaN spoils its own block only (scale NaN, codes +6); an infinity saturates its block's scale at 448 and itself
    at 6; a global scale too large for a block saturates its scale and its largest codes."""
    w = torch.linspace(0.5, 2.0, 64)
    w[0:16] = 0.0
    w[20] = float("nan")
    w[40] = float("inf")
    x = torch.ones(3, 64)
    gs = torch.tensor([300.0])
    codes, scales = L.rms_norm_quant(x, 64, w, 0.0, quant_dtype=FP4, scale=gs)
    y = L.rms_norm(x, 64, w, 0.0)
    want_codes, want_scales = reference_nvfp4(y, gs)
    _same_bits(codes.view(torch.uint8), want_codes.view(torch.uint8), "codes")
    _same_bits(scales, want_scales, "scales")
    bits, values = scales.view(torch.uint8), unpacked_values(codes)
    assert bool((bits[:, 0] == 0).all()) and bool((values[:, :16] == 0).all())
    assert bool(((bits[:, 1] & 0x7F) == 0x7F).all()) and bool((values[:, 16:32] == 6.0).all())
    assert bool((bits[:, 2] == 0x7E).all()) and bool((values[:, 40] == 6.0).all())
    # block 3 (absmax 2): 300 * 2 / 6 = 100 lies halfway between e4m3's 96 and 104, rounded to the even 96; the
    # codes' factor 300 / 96 puts its values (1.6 to 2) above 5, so they are all coded 6
    assert bool((scales[:, 3].float() == 96.0).all()) and bool((values[:, 48:] == 6.0).all())
    big, _ = L.rms_norm_quant(x, 64, w, 0.0, quant_dtype=FP4, scale=torch.tensor([1e6]))
    assert bool((unpacked_values(big)[:, 48:] == 6.0).all())  # scale saturated at 448: every code saturates


# ---- buffers and layouts ---------------------------------------------------------------------------------------
def test_into_buffers_and_column_major() -> None:
    """out= / scales= (row-major, column-major, padded column-major) and residual_out=: the allocating op's bits;
    a codes buffer of rows any stride apart too, and column-major new scales."""
    a = _args("add_rms_norm", BF16, BF16, 256, rows=5)
    y, _ = _unquantized("add_rms_norm", a)
    gs = _global_scale(y)
    want_codes, want_scales, want_h = _quantized("add_rms_norm", a, quant_dtype=FP4, scale=gs)
    padded = torch.zeros(16, 8, dtype=FP8)
    for name, scales in {"row_major": torch.empty(5, 16, dtype=FP8),
                         "column_major": torch.empty(16, 5, dtype=FP8).t(),
                         "padded": padded[:, :5].t()}.items():  # fmt: skip
        out, h = torch.empty(5, 128, dtype=FP4), torch.empty(5, 256, dtype=BF16)
        got = _quantized("add_rms_norm", a, scale=gs, out=out, scales=scales, residual_out=h)
        assert got[0] is out and got[1] is scales and got[2] is h
        _same_bits(out.view(torch.uint8), want_codes.view(torch.uint8), f"codes ({name})")
        _same_bits(scales, want_scales, f"scales ({name})")
        _same_bits(h, want_h, f"h ({name})")
    assert bool((padded.view(torch.uint8)[:, 5:] == 0).all()), "the padding was written"
    wide = torch.zeros(5, 3, 128, dtype=torch.uint8)
    out = wide[:, 1].view(FP4)  # rows 384 bytes apart
    _quantized("add_rms_norm", a, scale=gs, out=out, scales=torch.empty(5, 16, dtype=FP8),
               residual_out=torch.empty(5, 256, dtype=BF16))
    _same_bits(out.view(torch.uint8), want_codes.view(torch.uint8), "codes (strided rows)")
    assert not bool(wide[:, 0].any()) and not bool(wide[:, 2].any())
    _, column_major, _ = _quantized("add_rms_norm", a, quant_dtype=FP4, scale=gs, scales_column_major=True)
    assert column_major.stride() == (1, 5)
    _same_bits(column_major, want_scales, "new column-major scales")


def test_into_allocates_nothing() -> None:
    a = _args("rms_norm", BF16, BF16, 512, rows=16)
    out, scales, gs = torch.empty(16, 256, dtype=FP4), torch.empty(16, 32, dtype=FP8), torch.tensor([100.0])

    def allocations(call) -> int:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call()
        return sum(1 for e in prof.events() if e.name in ("aten::empty", "aten::empty_strided", "aten::empty_like"))

    x, w = a["x"], a["w"]
    # codes, scales and the residual_out placeholder ([0])
    assert allocations(lambda: L.rms_norm_quant(x, 512, w, quant_dtype=FP4, scale=gs)) == 3
    assert allocations(lambda: L.rms_norm_quant(x, 512, w, scale=gs, out=out, scales=scales)) == 0


# ---- (5) bad arguments -----------------------------------------------------------------------------------------
def _bad_calls() -> list:
    x, w, gs = torch.randn(3, 32), torch.randn(32), torch.tensor([10.0])
    codes, scales = torch.empty(3, 16, dtype=FP4), torch.empty(3, 2, dtype=FP8)
    return [
        pytest.param(lambda: L.rms_norm_quant(x[:, :24], 24, w[:24], quant_dtype=FP4, scale=gs),
                     r"rms_norm_quant: NVFP4 codes need rows of a multiple of 16 elements \(their blocks\), but got "
                     "rows of 24", id="n-not-16"),
        pytest.param(lambda: L.rms_norm_quant(x, 32, w, quant_dtype=FP4),
                     r"NVFP4 codes \(float4_e2m1fn_x2\) need scale=, their float32 global scale", id="no-scale"),
        pytest.param(lambda: L.rms_norm_quant(x, 32, w, quant_dtype=FP4, scale=gs.half()),
                     "expected scale to be a float32 tensor of one element, but got scale of dtype Half",
                     id="scale-dtype"),
        pytest.param(lambda: L.rms_norm_quant(x, 32, w, quant_dtype=FP4, scale=torch.ones(2)),
                     r"expected scale to be a float32 tensor of one element, but got scale of dtype Float and shape "
                     r"\[2\]", id="scale-shape"),
        pytest.param(lambda: L.layer_norm_quant(x, 32, w, quant_dtype=FP4, scale=gs, group_size=32),
                     r"layer_norm_quant: NVFP4 codes \(float4_e2m1fn_x2\) have blocks of 16 elements \(group_size 16, "
                     r"or 0\), but got group_size=32", id="group-size"),
        pytest.param(lambda: L.rms_norm_quant(x, 32, w, quant_dtype=FP4, scale=gs, scales_dtype=torch.float32),
                     "NVFP4 block scales are float8_e4m3fn, but got scales_dtype Float", id="scales-dtype"),
        pytest.param(lambda: L.rms_norm_quant(x.view(3, 2, 16), (2, 16), w.view(2, 16), quant_dtype=FP4, scale=gs),
                     r"NVFP4 codes need a 1-D normalized_shape \(blocks along its dim\), but got normalized_shape "
                     r"\[2, 16\]", id="2d-shape"),
        pytest.param(lambda: L.rms_norm_quant(x, 32, w, quant_dtype=FP4, scale=gs, group_size=16),
                     "", id="fine"),
        pytest.param(lambda: L.rms_norm_quant(x, 32, w, scale=gs, out=torch.empty(3, 32, dtype=FP4), scales=scales),
                     r"expected out of shape \[3, 16\] and dtype Float4_e2m1fn_x2, but got out of shape \[3, 32\]",
                     id="out-shape"),
        pytest.param(lambda: L.rms_norm_quant(x, 32, w, scale=gs, out=codes,
                                              scales=torch.empty(3, 2, dtype=torch.float32)),
                     r"expected scales of shape \[3, 2\] and dtype Float8_e4m3fn, but got scales of shape \[3, 2\] "
                     "and dtype Float", id="scales-buffer-dtype"),
        pytest.param(lambda: L.rms_norm_quant(x, 32, w, scale=gs, out=codes,
                                              scales=torch.empty(3, 2, dtype=torch.float8_e8m0fnu)),
                     r"expected scales of shape \[3, 2\] and dtype Float8_e4m3fn, but got scales of shape \[3, 2\] "
                     "and dtype Float8_e8m0fnu", id="scales-buffer-e8m0"),
        pytest.param(lambda: L.rms_norm_quant(x, 32, w, scale=gs, out=codes),
                     r"NVFP4 codes need a scales= buffer for their blocks' float8_e4m3fn scales of shape \[3, 2\]",
                     id="no-scales-buffer"),
        pytest.param(lambda: L.rms_norm_quant(x, 32, w, scale=gs, out=codes, scales=scales), "", id="fine-into"),
    ]


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize(("call", "match"), _bad_calls())
def test_bad_nvfp4_arguments_are_refused(call, match: str, fake: bool) -> None:
    refused_alike(call, match, fake)


def test_fake_outputs_are_the_real_ones() -> None:
    x, w, gs = torch.randn(6, 64), torch.randn(64), torch.tensor([5.0])
    for column_major in (False, True):
        real = _ops.rms_norm_quant.default(x, [64], w, None, FP4, gs, None, None, False, 0.0, False, 0, column_major)
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = _ops.rms_norm_quant.default(x, [64], w, None, FP4, gs, None, None, False, 0.0, False, 0,
                                               column_major)
        for r, f in zip(real[:2], fake[:2], strict=True):
            assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)


def test_opcheck() -> None:
    gen = torch.Generator().manual_seed(31)
    x, r = torch.randn(3, 64, generator=gen).bfloat16(), torch.randn(3, 64, generator=gen).bfloat16()
    w, b = torch.randn(64, generator=gen).bfloat16(), torch.randn(64, generator=gen).bfloat16()
    gs = torch.tensor([40.0])
    torch.library.opcheck(_ops.layer_norm_quant.default,
                          (x, [64], w, b, 1e-5, FP4, gs, None, r, False, 0.0, False, 16, False),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))  # fmt: skip
    torch.library.opcheck(_ops.rms_norm_quant_into.default,
                          (x, [64], w, 1e-6, torch.empty(3, 32, dtype=FP4), gs, torch.empty(3, 4, dtype=FP8), None,
                           None, None, False, 0.0, False, 0),
                          test_utils=("test_autograd_registration", "test_faketensor"))  # fmt: skip


def test_nvfp4_compiles_fullgraph() -> None:
    """Fused add + RMSNorm + NVFP4, compiled fullgraph (aot_eager): eager's bits."""
    torch.manual_seed(32)
    w = torch.randn(256).bfloat16()
    gs = torch.tensor([200.0])

    def step(x: Tensor, residual: Tensor) -> tuple[Tensor, ...]:
        q, s, h = L.add_rms_norm_quant(x, residual, 256, w, 1e-6, quant_dtype=FP4, scale=gs)
        return q.view(torch.uint8), s.view(torch.uint8), h

    x, r = torch.randn(5, 256).bfloat16(), torch.randn(5, 256).bfloat16()
    eager = step(x, r)
    torch._dynamo.reset()
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(x, r)
    torch._dynamo.reset()
    for g, e, name in zip(got, eager, ("codes", "scales", "h"), strict=True):
        assert torch.equal(g, e), name
