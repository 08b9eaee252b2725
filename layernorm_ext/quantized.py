"""Quantized output: LayerNorm / RMSNorm (and their fused residual variants) written as float8_e4m3fn, float8_e5m2,
int8 or NVFP4 (float4_e2m1fn_x2 with float8_e4m3fn block scales).

The engines' ``rms_norm_static_fp8_quant`` / ``fused_add_rms_norm_static_fp8_quant`` (a static scale) and
``rms_norm_dynamic_per_token_quant`` (a scale per row, from the row's absmax, computed in the same pass), for
LayerNorm and RMSNorm, every input dtype, CPU and CUDA. Each function is one call of
``torch.ops.layernorm_ext.layer_norm_quant`` / ``rms_norm_quant`` (csrc/quant_math.h has the arithmetic), which
is vLLM's, bit for bit, given the norm's output:

- ``y`` is what the unquantized function returns (rounded to the input dtype), taken as float32;
- dynamic: ``absmax = max |y|`` over the row (NaN if the row holds a NaN), capped at ``scale_ub`` when given,
  ``scale = max(absmax / qmax, min_scale)``; qmax is 448 (float8_e4m3fn), 57344 (float8_e5m2) or 127 (int8),
  min_scale 1 / (qmax * 512) for the float8 codes or float32's epsilon, so that a row of zeros gets codes 0 and a
  positive scale;
- the scaled value is ``y * (1 / scale)`` (the reciprocal rounded once) for static float8_e4m3fn and dynamic
  int8, ``y / scale`` for dynamic float8_e4m3fn and static int8: as vLLM's kernels do (its dynamic fp8 path
  divides "for exact match with FBGemm", its static int8 quantization divides too); the two differ by one
  code step at rounding ties (41 to 168 of the 262144 dynamic fp8 codes of a 64 x 4096 bf16 activation);
- float8_e4m3fn: clamp to [-448, 448] (saturating: an infinity gives +-448), round to nearest even, NaN stays
  NaN; int8: clamp to [-128, 127], round half to even, NaN gives 0.

Where engines (and vLLM's own kernels) disagree, and what this module does:

- the norm's output: vLLM rounds ``x * rstd`` to the input dtype before the weight (``cast_before_weight=True``
  here; the default follows ATen's ``rms_norm``, weight applied in float32), and sums its float32 squares in
  its own order with ``rsqrtf``, so rstd itself may differ by an ulp;
- with a residual: vLLM's static kernel (``fused_add_rms_norm_static_fp8_quant``) normalizes ``h = input +
  residual`` rounded to the input dtype (the default here); its dynamic kernel normalizes the unrounded
  float32 sum but stores the rounded one (``residual_in_fp32=True`` here normalizes the float32 sum, and
  returns it as float32);
- NaN: vLLM's absmax (fmaxf) skips NaN and its float8 clamp (fmin / fmax) turns a NaN into 448; here a NaN
  makes the row's scale NaN and its float8 code NaN (int8: 0 in both), so that it is not hidden;
- vLLM's standalone ``dynamic_scaled_int8_quant`` (no norm) multiplies by ``127 / absmax`` and has no
  min_scale; ``scale_ub`` there is float8 only, here either dtype.

Per group (``group_size``, vLLM's ``rms_norm_per_block_quant``): each group of ``group_size`` consecutive
elements of a row gets the dynamic scale of its own absmax (as above, capped by ``scale_ub``), and every code is
``y * (1 / scale)`` with the group's reciprocal rounded once, whatever the codes' dtype;
``(codes.float().unflatten(-1, (-1, group_size)) * scales[..., None]).flatten(-2)`` dequantizes (``scales.float()``
for MX scales).

MX block scales (``scales_dtype=torch.float8_e8m0fnu``; OCP Microscaling Formats v1.0, 6.3; MXFP8 with
``group_size=32``): each group's scale is the power of two ``2^e``, ``e = floor(log2(absmax)) - emax`` (8 for
float8_e4m3fn codes, 15 for float8_e5m2), clamped to [-127, 127] (a zero group: ``2^-127``; a NaN: the NaN scale),
and the codes are ``y / 2^e`` saturated to the codes' range (the group's largest values may saturate: the OCP
rule rounds the exponent down). The scales are in the plain rows x groups layout (row-major or column-major), or
swizzled (below).

NVFP4 (``quant_dtype=torch.float4_e2m1fn_x2``, ``scale=`` the float32 global scale, required; vLLM's
``ref_nvfp4_quant`` bit for bit, the two levels of TransformerEngine / FlashInfer / vLLM's ``scaled_fp4_quant``):
blocks of 16 consecutive elements (``group_size`` 16 or left 0), each with the float8_e4m3fn scale
``s = e4m3(global_scale * (absmax / 6))`` (float32 operations, ``absmax * (1/6)``; saturating at 448), and the
codes ``e2m1(y * (1 / (float(s) * (1 / global_scale))))`` (a zero reciprocal where its argument is 0), float4_e2m1
rounded to nearest even and saturated at 6, two per byte (the even element in the low nibble), so the codes are
shaped ``[..., N / 2]`` and the scales ``[..., N / 16]`` (row-major, column-major or swizzled on request). A NaN
block gets the NaN scale and codes +6 (e2m1 has no NaN). ``e2m1 value * s / global_scale`` dequantizes; N must be
a multiple of 16.

Swizzled block scales (``scales_swizzled=True``; MXFP8, ``group_size=32`` with float8_e8m0fnu scales, and NVFP4):
the layout the Blackwell scaled matmuls read (``torch._scaled_mm``; cuBLAS's 1D block scaling factors layout,
torch's ``SwizzleType.SWIZZLE_32_4_4``, torch's ``to_blocked``): the rows x blocks scales padded with zeros to rows a
multiple of 128 and blocks a multiple of 4, cut into 128 x 4 tiles stored band of 128 rows by band, left to right,
each tile as 32 x 16 (row ``r``, block ``c`` of a tile at ``(r % 32) * 16 + (r // 32) * 4 + c``), shaped
``[padded rows, padded blocks]`` (the rows of every leading dim together). The kernel writes each scale at its
place (csrc/quant_math.h swizzled_scale_index), padding included; a ``scales=`` buffer may have any shape of as many
elements, contiguous. The codes are unchanged.

``codes.float() * scale`` dequantizes (the dynamic scales are shaped as the rows with a 1 for each normalized
dim, so they broadcast). They store no statistics and, like the other inference ops, refuse arguments that
require grad while grad mode is on.

With ``out=`` (vLLM's convention: the codes' buffer, whose dtype is the quantized one), ``scales=`` (the dynamic
scales' buffer) and, for the residual variants, ``residual_out=`` (h's buffer, which may be ``residual`` itself:
vLLM's ``fused_add_rms_norm_static_fp8_quant`` updates the residual in place), nothing is allocated
(``torch.ops.layernorm_ext.layer_norm_quant_into`` / ``rms_norm_quant_into``). ``quant_dtype`` may then be
left out; given, it must be out's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import ops  # noqa: F401  (registers the fake kernels)
from ._checks import _fail
from .functional import ShapeLike, _as_shape

_ops = torch.ops.layernorm_ext

_ARGS_DOC = """
    ``quant_dtype``: torch.float8_e4m3fn, torch.float8_e5m2, torch.int8 or torch.float4_e2m1fn_x2; by default
    out's dtype with ``out=``, else torch.float8_e4m3fn. ``scale``: a float32 tensor of one element on the input's
    device, the static scale; without it each row gets its own scale, capped by ``scale_ub`` (a
    float32 tensor of one element) when given. ``weight_offset`` / ``cast_before_weight`` as in
    :func:`layernorm_ext.layer_norm`. ``group_size`` (> 0, dividing the row's elements; a 1-D normalized_shape,
    dynamic scales only): a scale per group of ``group_size`` consecutive elements of a row instead of one per row
    (vLLM's ``rms_norm_per_block_quant``), shaped as the rows, then the groups; ``scales_column_major`` allocates
    them transposed (each group's scales of all rows contiguous: vLLM's ``is_scale_transposed``); with
    ``scales=`` the buffer may be either layout. ``scales_dtype=torch.float8_e8m0fnu`` (with ``scales=``: a buffer
    of that dtype) makes them MX block scales, powers of two (OCP MX; MXFP8 is ``group_size=32`` with float8_e4m3fn
    codes). ``quant_dtype=torch.float4_e2m1fn_x2`` (NVFP4, CPU only so far): ``scale`` is then the float32 global
    scale (required), and the returned scales the float8_e4m3fn scales of the blocks of 16 elements (see the
    module's doc). ``scales_swizzled`` (MXFP8: ``group_size=32`` with float8_e8m0fnu scales, or NVFP4) writes the
    block scales in the 128 x 4 tiles the scaled matmuls read (torch's ``SwizzleType.SWIZZLE_32_4_4``), shaped
    ``[rows rounded up to 128, blocks rounded up to 4]`` with zero padding; with ``scales=``, a contiguous buffer of
    that many elements (any shape, e.g. flat). The scales are not checked for being positive and finite (on CUDA that
    would cost a host sync). ``out=`` / ``scales=`` / ``residual_out=``: write into these buffers instead (see the
    module's doc).
"""


def _into_only(op: str, out: Tensor | None, **buffers: Tensor | None) -> None:
    if out is None:
        for name, buffer in buffers.items():
            if buffer is not None:
                _fail(op, f"{name}= goes with out= (the codes' buffer)")


def _new_scales_only(op: str, out: Tensor | None, scales_column_major: bool, scales_dtype: torch.dtype | None
                     ) -> None:
    if out is not None and scales_column_major:
        _fail(op, "scales_column_major lays out new scales; with out= the scales= buffer's own layout is written")
    if out is not None and scales_dtype is not None:
        _fail(op, "scales_dtype is new scales' dtype; with out= the scales= buffer's own dtype is written")


def _returned_scales(scale: Tensor | None, scales: Tensor, quant_dtype: torch.dtype) -> Tensor:
    """The static scale given, else the computed scales (NVFP4: the block scales; its scale is the global one)."""
    return scale if scale is not None and quant_dtype != torch.float4_e2m1fn_x2 else scales


def _quant_dtype(op: str, quant_dtype: torch.dtype | None, out: Tensor | None) -> torch.dtype:
    """The codes' dtype: out's (a quant_dtype that contradicts it is refused, not ignored), else quant_dtype or
    float8_e4m3fn."""
    if out is None:
        return torch.float8_e4m3fn if quant_dtype is None else quant_dtype
    if quant_dtype is not None and quant_dtype != out.dtype:
        _fail(op, f"quant_dtype={quant_dtype} contradicts out's dtype {out.dtype} (the codes' buffer); give one "
                  "of them, or the same")
    return out.dtype


def _layer_norm_quant(
    op_name: str, input: Tensor, normalized_shape: ShapeLike, weight: Tensor | None, bias: Tensor | None,
    eps: float, residual: Tensor | None, residual_in_fp32: bool, quant_dtype: torch.dtype | None, scale: Tensor | None,
    scale_ub: Tensor | None, weight_offset: float, cast_before_weight: bool, out: Tensor | None,
    scales: Tensor | None, residual_out: Tensor | None, group_size: int, scales_column_major: bool,
    scales_dtype: torch.dtype | None, scales_swizzled: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The one call of every LayerNorm function: into the buffers (out=) or allocating; (codes, scale, h)."""
    _into_only(op_name, out, scales=scales, residual_out=residual_out)
    _new_scales_only(op_name, out, scales_column_major, scales_dtype)
    quant_dtype = _quant_dtype(op_name, quant_dtype, out)
    shape = _as_shape(normalized_shape)
    if out is not None:
        _ops.layer_norm_quant_into.default(
            input, shape, weight, bias, eps, out, scale, scales, scale_ub, residual, residual_out, residual_in_fp32,
            weight_offset, cast_before_weight, group_size, scales_swizzled,
        )  # fmt: skip
        codes = out
    else:
        codes, scales, residual_out = _ops.layer_norm_quant.default(
            input, shape, weight, bias, eps, quant_dtype, scale, scale_ub, residual, residual_in_fp32, weight_offset,
            cast_before_weight, group_size, scales_column_major, scales_dtype, scales_swizzled,
        )  # fmt: skip
    return codes, _returned_scales(scale, scales, quant_dtype), residual_out  # type: ignore[return-value]


def _rms_norm_quant(
    op_name: str, input: Tensor, normalized_shape: ShapeLike, weight: Tensor | None, eps: float | None,
    residual: Tensor | None, residual_in_fp32: bool, quant_dtype: torch.dtype | None, scale: Tensor | None,
    scale_ub: Tensor | None, weight_offset: float, cast_before_weight: bool, out: Tensor | None,
    scales: Tensor | None, residual_out: Tensor | None, group_size: int, scales_column_major: bool,
    scales_dtype: torch.dtype | None, scales_swizzled: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The one call of every RMSNorm function (see _layer_norm_quant)."""
    _into_only(op_name, out, scales=scales, residual_out=residual_out)
    _new_scales_only(op_name, out, scales_column_major, scales_dtype)
    quant_dtype = _quant_dtype(op_name, quant_dtype, out)
    shape = _as_shape(normalized_shape)
    if out is not None:
        _ops.rms_norm_quant_into.default(
            input, shape, weight, eps, out, scale, scales, scale_ub, residual, residual_out, residual_in_fp32,
            weight_offset, cast_before_weight, group_size, scales_swizzled,
        )  # fmt: skip
        codes = out
    else:
        codes, scales, residual_out = _ops.rms_norm_quant.default(
            input, shape, weight, eps, quant_dtype, scale, scale_ub, residual, residual_in_fp32, weight_offset,
            cast_before_weight, group_size, scales_column_major, scales_dtype, scales_swizzled,
        )  # fmt: skip
    return codes, _returned_scales(scale, scales, quant_dtype), residual_out  # type: ignore[return-value]


def layer_norm_quant(
    input: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    quant_dtype: torch.dtype | None = None,
    scale: Tensor | None = None,
    scale_ub: Tensor | None = None,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
    group_size: int = 0,
    scales_column_major: bool = False,
    scales_dtype: torch.dtype | None = None,
    scales_swizzled: bool = False,
    out: Tensor | None = None,
    scales: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``layer_norm(input, ...)`` quantized: returns ``(codes, scale)``, ``scale`` the one given (static) or the
    rows' scales (dynamic)."""
    codes, scale_out, _ = _layer_norm_quant(
        "layer_norm_quant", input, normalized_shape, weight, bias, eps, None, False, quant_dtype, scale, scale_ub,
        weight_offset, cast_before_weight, out, scales, None, group_size, scales_column_major,
        scales_dtype, scales_swizzled,
    )  # fmt: skip
    return codes, scale_out


def rms_norm_quant(
    input: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    quant_dtype: torch.dtype | None = None,
    scale: Tensor | None = None,
    scale_ub: Tensor | None = None,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
    group_size: int = 0,
    scales_column_major: bool = False,
    scales_dtype: torch.dtype | None = None,
    scales_swizzled: bool = False,
    out: Tensor | None = None,
    scales: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``rms_norm(input, ...)`` quantized (vLLM's ``rms_norm_static_fp8_quant`` with ``scale``,
    ``rms_norm_dynamic_per_token_quant`` without): returns ``(codes, scale)``."""
    codes, scale_out, _ = _rms_norm_quant(
        "rms_norm_quant", input, normalized_shape, weight, eps, None, False, quant_dtype, scale, scale_ub,
        weight_offset, cast_before_weight, out, scales, None, group_size, scales_column_major,
        scales_dtype, scales_swizzled,
    )  # fmt: skip
    return codes, scale_out


def add_layer_norm_quant(
    input: Tensor,
    residual: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    quant_dtype: torch.dtype | None = None,
    scale: Tensor | None = None,
    scale_ub: Tensor | None = None,
    residual_in_fp32: bool = False,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
    group_size: int = 0,
    scales_column_major: bool = False,
    scales_dtype: torch.dtype | None = None,
    scales_swizzled: bool = False,
    out: Tensor | None = None,
    scales: Tensor | None = None,
    residual_out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``h = input + residual``, then ``layer_norm(h)`` quantized: returns ``(codes, scale, h)`` (h as in
    :func:`layernorm_ext.add_layer_norm`)."""
    return _layer_norm_quant(
        "layer_norm_quant", input, normalized_shape, weight, bias, eps, residual, residual_in_fp32, quant_dtype,
        scale, scale_ub, weight_offset, cast_before_weight, out, scales, residual_out, group_size,
        scales_column_major, scales_dtype, scales_swizzled,
    )  # fmt: skip


def add_rms_norm_quant(
    input: Tensor,
    residual: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    quant_dtype: torch.dtype | None = None,
    scale: Tensor | None = None,
    scale_ub: Tensor | None = None,
    residual_in_fp32: bool = False,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
    group_size: int = 0,
    scales_column_major: bool = False,
    scales_dtype: torch.dtype | None = None,
    scales_swizzled: bool = False,
    out: Tensor | None = None,
    scales: Tensor | None = None,
    residual_out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``h = input + residual``, then ``rms_norm(h)`` quantized (vLLM's ``fused_add_rms_norm_static_fp8_quant``
    with ``scale``, and ``residual_out=residual`` for its in-place residual; without ``scale``, the dynamic
    per-row variant): returns ``(codes, scale, h)``."""
    return _rms_norm_quant(
        "rms_norm_quant", input, normalized_shape, weight, eps, residual, residual_in_fp32, quant_dtype, scale,
        scale_ub, weight_offset, cast_before_weight, out, scales, residual_out, group_size,
        scales_column_major, scales_dtype, scales_swizzled,
    )  # fmt: skip


for _fn in (layer_norm_quant, rms_norm_quant, add_layer_norm_quant, add_rms_norm_quant):
    _fn.__doc__ = (_fn.__doc__ or "") + _ARGS_DOC
del _fn
