"""The block scales of MXFP8 and NVFP4 in the layout the Blackwell scaled matmuls read (``scales_swizzled``).

cuBLAS's "1D block scaling factors layout" (torch's ``SwizzleType.SWIZZLE_32_4_4``, what torch._scaled_mm takes for
``BlockWise1x32`` / ``BlockWise1x16``): the rows x blocks scales padded to 128 x 4 tiles, each tile stored as
32 x 16. Held to a composite written here in torch ops (pad, view, permute, reshape: the arrangement of torch's
to_blocked) applied to our own row-major scales, bit for bit, padding zeros included; the codes are the row-major
call's. Plus buffers (2-D or flat, written whole over garbage), bad arguments (eager and fake alike), fake shapes,
opcheck, compile, and on a Blackwell GPU torch._scaled_mm against the dequantized matmul.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

import layernorm_ext as L
from conftest import compiled_and_eager
from test_inference_ops import _args
from test_quantized import _quantized
from test_quantized_groups import refused_alike

pytestmark = pytest.mark.usefixtures("cpu_isa")

BF16, F32 = torch.bfloat16, torch.float32
FP8, FP4, E8M0 = torch.float8_e4m3fn, torch.float4_e2m1fn_x2, torch.float8_e8m0fnu
U8 = torch.uint8
_ops = torch.ops.layernorm_ext


def to_blocked(scales: Tensor) -> Tensor:
    """rows x blocks scales -> the swizzled layout, 2-D [rows rounded up to 128, blocks rounded up to 4]: padded with
    zeros, cut into 128 x 4 tiles (a band of 128 rows after another, tiles left to right), each tile's rows
    r = 32 * i + j stored as [j][i][block] (32 x 16)."""
    rows, blocks = scales.shape
    padded_rows, padded_blocks = -(-rows // 128) * 128, -(-blocks // 4) * 4
    bits = F.pad(scales.view(U8), (0, padded_blocks - blocks, 0, padded_rows - rows))
    tiles = bits.view(padded_rows // 128, 128, padded_blocks // 4, 4).permute(0, 2, 1, 3)  # band, tile, row, block
    swizzled = tiles.reshape(-1, 4, 32, 4).transpose(1, 2)  # tile, j, i, block
    return swizzled.reshape(padded_rows, padded_blocks).view(scales.dtype)


# (format, quant_dtype, the call's block arguments)
FORMATS = {
    "mxfp8": {"quant_dtype": FP8, "group_size": 32, "scales_dtype": E8M0},
    "nvfp4": {"quant_dtype": FP4},
}


def _format_args(fmt: str, y: Tensor | None = None) -> dict[str, object]:
    kw = dict(FORMATS[fmt])
    if fmt == "nvfp4":  # the global scale: vLLM's 448 * 6 / amax (any positive one would do)
        kw["scale"] = (448.0 * 6.0 / y.float().abs().amax()).reshape(1) if y is not None else torch.tensor([50.0])
    return kw


def _bits(t: Tensor) -> Tensor:
    return t.view(U8)


@pytest.mark.parametrize("cols", [32, 64, 160, 4096 + 32])
@pytest.mark.parametrize("rows", [1, 7, 129, 300])
@pytest.mark.parametrize(("fn", "fmt"), [("rms_norm", "mxfp8"), ("add_layer_norm", "mxfp8"), ("rms_norm", "nvfp4"),
                                         ("add_rms_norm", "nvfp4")])  # fmt: skip
def test_swizzled_scales_are_the_composite_of_the_row_major_ones(fn: str, fmt: str, rows: int, cols: int) -> None:
    a = _args(fn, BF16, BF16, cols, rows=rows)
    kw = _format_args(fmt, a["x"])
    codes, scales, h = _quantized(fn, a, **kw)
    got_codes, got_scales, got_h = _quantized(fn, a, scales_swizzled=True, **kw)
    want = to_blocked(scales)
    assert (got_scales.shape, got_scales.dtype) == (want.shape, want.dtype) and got_scales.is_contiguous()
    assert torch.equal(_bits(got_scales), _bits(want)), "swizzled scales: not to_blocked of the row-major ones"
    assert torch.equal(_bits(got_codes), _bits(codes)), "codes changed with the scales' layout"
    if h is not None:
        assert torch.equal(got_h, h)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_of_leading_dims_and_buffers(fmt: str) -> None:
    """A [3, 43, N] input is 129 rows; into a 2-D or a flat buffer full of garbage, every element is written (the
    padding with zeros), nothing allocated; the scales of zero rows and the fake tensors' shapes too."""
    x, w = torch.randn(3, 43, 96).bfloat16(), torch.randn(96).bfloat16()
    kw = _format_args(fmt, x)
    codes, scales = L.rms_norm_quant(x, 96, w, **kw)
    want = to_blocked(scales.flatten(0, 1))
    assert want.shape == ((256, 4) if fmt == "mxfp8" else (256, 8))
    _, swizzled = L.rms_norm_quant(x, 96, w, scales_swizzled=True, **kw)
    assert torch.equal(_bits(swizzled), _bits(want))
    with FakeTensorMode(allow_non_fake_inputs=True):
        _, fake = L.rms_norm_quant(x, 96, w, scales_swizzled=True, **kw)
    assert (fake.shape, fake.stride(), fake.dtype) == (swizzled.shape, swizzled.stride(), swizzled.dtype)
    into_kw = {k: v for k, v in kw.items() if k != "scales_dtype"}  # with out=, the buffer's dtype
    for buffer in (torch.full(want.shape, 0x7F, dtype=U8).view(want.dtype),
                   torch.full((want.numel(),), 0x7F, dtype=U8).view(want.dtype)):  # fmt: skip
        out = torch.empty_like(codes)

        def into() -> None:
            L.rms_norm_quant(x, 96, w, out=out, scales=buffer, scales_swizzled=True, **into_kw)  # noqa: B023

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            into()
        allocated = [e.name for e in prof.events() if e.name in ("aten::empty", "aten::empty_strided")]
        assert not allocated, allocated
        assert torch.equal(_bits(buffer).view(want.shape), _bits(want)), f"buffer of shape {tuple(buffer.shape)}"
        assert torch.equal(_bits(out), _bits(codes))
    _, none = L.rms_norm_quant(x[:, :0], 96, w, scales_swizzled=True, **kw)
    assert none.shape == (0, want.shape[1])


def _bad_calls() -> list:
    x, w = torch.randn(3, 64), torch.randn(64)
    fp8, fp4, gs = torch.empty(3, 64, dtype=FP8), torch.empty(3, 32, dtype=FP4), torch.tensor([10.0])
    tiles = "the 3 rows x 2 blocks padded to whole 128 x 4 tiles"
    return [
        pytest.param(lambda: L.rms_norm_quant(x, 64, w, group_size=32, scales_swizzled=True),
                     r"rms_norm_quant: scales_swizzled lays out the block scales of MXFP8 \(float8_e8m0fnu scales, "
                     r"group_size 32\) and NVFP4 in the scaled matmuls' 128 x 4 tiles, but got group_size=32 and "
                     "scales of dtype Float", id="float32-scales"),
        pytest.param(lambda: L.rms_norm_quant(x, 64, w, group_size=64, scales_dtype=E8M0, scales_swizzled=True),
                     "but got group_size=64 and scales of dtype Float8_e8m0fnu", id="mx-group-64"),
        pytest.param(lambda: L.rms_norm_quant(x, 64, w, scales_swizzled=True),
                     "but got group_size=0 and scales of dtype Float", id="per-row"),
        pytest.param(lambda: L.layer_norm_quant(x, 64, w, quant_dtype=FP4, scale=gs, scales_swizzled=True,
                                                scales_column_major=True),
                     "layer_norm_quant: scales_swizzled and scales_column_major are two layouts of the scales; give "
                     "one of them", id="two-layouts"),
        pytest.param(lambda: L.rms_norm_quant(x, 64, w, quant_dtype=FP4, scale=gs, scales_swizzled=True), "",
                     id="fine"),
        pytest.param(lambda: L.rms_norm_quant(x, 64, w, group_size=32, out=fp8, scales_swizzled=True,
                                              scales=torch.empty(128, 4, dtype=E8M0)), "", id="fine-into"),
        pytest.param(lambda: L.rms_norm_quant(x, 64, w, group_size=32, out=fp8, scales_swizzled=True,
                                              scales=torch.empty(3, 2, dtype=E8M0)),
                     rf"rms_norm_quant_into: expected swizzled scales \({tiles}\) to be a contiguous Float8_e8m0fnu "
                     r"tensor of 512 elements \(shape \[128, 4\], or any of as many\), but got scales of shape \[3, 2\], "
                     r"strides \[2, 1\] and dtype Float8_e8m0fnu", id="row-major-buffer"),
        pytest.param(lambda: L.rms_norm_quant(x, 64, w, scale=gs, out=fp4, scales_swizzled=True,
                                              scales=torch.empty(512, dtype=F32)),
                     r"a contiguous Float8_e4m3fn tensor of 512 elements \(shape \[128, 4\], or any of as many\), "
                     r"but got scales of shape \[512\], strides \[1\] and dtype Float", id="nvfp4-buffer-dtype"),
        pytest.param(lambda: L.rms_norm_quant(x, 64, w, scale=gs, out=fp4, scales_swizzled=True,
                                              scales=torch.empty(4, 128, dtype=FP8).t()),
                     r"but got scales of shape \[128, 4\], strides \[1, 128\] and dtype Float8_e4m3fn",
                     id="not-contiguous"),
        pytest.param(lambda: L.rms_norm_quant(x, 64, w, scale=gs, out=fp4, scales_swizzled=True),
                     r"NVFP4 codes need a scales= buffer for their blocks' float8_e4m3fn scales of shape \[128, 4\]",
                     id="no-buffer"),
    ]


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize(("call", "match"), _bad_calls())
def test_bad_swizzle_arguments_are_refused(call, match: str, fake: bool) -> None:
    refused_alike(call, match, fake)


def test_opcheck() -> None:
    gen = torch.Generator().manual_seed(41)
    x, r = torch.randn(7, 64, generator=gen).bfloat16(), torch.randn(7, 64, generator=gen).bfloat16()
    w, b = torch.randn(64, generator=gen).bfloat16(), torch.randn(64, generator=gen).bfloat16()
    torch.library.opcheck(_ops.layer_norm_quant.default,
                          (x, [64], w, b, 1e-5, FP8, None, None, r, False, 0.0, False, 32, False, E8M0, True),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(_ops.rms_norm_quant_into.default,
                          (x, [64], w, 1e-6, torch.empty(7, 32, dtype=FP4), torch.tensor([40.0]),
                           torch.empty(512, dtype=FP8), None, None, None, False, 0.0, False, 0, True),
                          test_utils=("test_autograd_registration", "test_faketensor"))  # fmt: skip


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_swizzled_quant_compiles_fullgraph(backend: str) -> None:
    """Fused add + RMSNorm + MXFP8 with swizzled scales, compiled fullgraph: eager's bits."""
    torch.manual_seed(42)
    w = torch.randn(256).bfloat16()

    def step(x: Tensor, residual: Tensor) -> tuple[Tensor, ...]:
        q, s, h = L.add_rms_norm_quant(x, residual, 256, w, 1e-6, group_size=32, scales_dtype=E8M0,
                                       scales_swizzled=True)
        return q.view(U8), s.view(U8), h

    x, r = torch.randn(130, 256).bfloat16(), torch.randn(130, 256).bfloat16()
    got, eager = compiled_and_eager(step, (x, r), backend)
    for g, e, name in zip(got, eager, ("codes", "scales", "h"), strict=True):
        assert torch.equal(g, e) and g.shape == e.shape, name


def test_dtensor_keeps_swizzled_scales_whole() -> None:
    """The DTensor strategies: rows sharded on a leading dim for the plain scales, replicated only for the swizzled
    ones (a shard's band of 128 rows would not be the whole tensor's)."""
    dtensor = pytest.importorskip("torch.distributed.tensor")
    from layernorm_ext import sharding

    x, mx = torch.empty(4, 3, 64), {"group_size": 32, "scales_dtype": E8M0}
    plain = sharding._rms_norm_quant(x, [64], None, None, FP8, **mx)
    swizzled = sharding._layer_norm_quant(x, [64], None, None, 1e-5, FP8, **mx, scales_swizzled=True)
    assert [outputs[0] for outputs, _ in plain] == [dtensor.Replicate(), dtensor.Shard(0), dtensor.Shard(1)]
    assert [outputs[1] for outputs, _ in swizzled] == [dtensor.Replicate()]


# ---- torch._scaled_mm (its CPU kernels take neither format in torch 2.13: a Blackwell GPU only) ----------------
def _blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0)


def _dequantized(codes: Tensor, scales: Tensor, fmt: str) -> Tensor:
    """rows x K values of the codes times their blocks' scales (row-major scales), float32."""
    if fmt == "mxfp8":
        values, block = codes.float(), 32
    else:
        from test_quantized_nvfp4 import unpacked_values

        values, block = unpacked_values(codes), 16
    return (values.unflatten(-1, (-1, block)) * scales.float()[..., None]).flatten(-2)


@pytest.mark.skipif(not _blackwell(), reason="torch._scaled_mm's MX / NVFP4 path needs a Blackwell GPU (sm_100+)")
@pytest.mark.parametrize("fmt", FORMATS)
def test_scaled_mm_reads_our_swizzled_scales(fmt: str) -> None:
    """Our codes and swizzled scales (computed on the CPU, moved to the GPU) through torch._scaled_mm equal the
    matmul of the dequantized codes (NVFP4: without the global scales, which _scaled_mm does not take)."""
    gen = torch.Generator().manual_seed(43)
    a_in, b_in = torch.randn(129, 512, generator=gen).bfloat16(), torch.randn(192, 512, generator=gen).bfloat16()
    kw = _format_args(fmt, a_in)
    a_codes, a_scales = L.rms_norm_quant(a_in, 512, **kw)
    b_codes, b_scales = L.rms_norm_quant(b_in, 512, **kw)
    _, a_swizzled = L.rms_norm_quant(a_in, 512, scales_swizzled=True, **kw)
    _, b_swizzled = L.rms_norm_quant(b_in, 512, scales_swizzled=True, **kw)
    want = _dequantized(a_codes, a_scales, fmt) @ _dequantized(b_codes, b_scales, fmt).T
    got = torch._scaled_mm(a_codes.cuda(), b_codes.cuda().t(), a_swizzled.cuda(), b_swizzled.cuda(), out_dtype=BF16)
    # bf16's rounding, and float32 sums in another order (an absolute error of the products' size)
    torch.testing.assert_close(got.float().cpu(), want.to(BF16).float(), rtol=2**-7,
                               atol=2**-16 * want.abs().max().item())
