"""Fake (meta) implementations of the ops defined in csrc/bindings.cpp, and their DTensor strategies.

The ops run their C++ kernels on CPU and CUDA, and their autograd is C++ too (csrc/norm_autograd.cpp: one
dispatcher call per Python call); this module only tells torch.compile / FakeTensor what they return, so that
compiled graphs have no breaks, and registers their sharding strategies (layernorm_ext/sharding.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from . import _checks, sharding
from ._loader import native  # noqa: F401  (loading the library defines the ops)

_ops = torch.ops.layernorm_ext


def residual_out_dtype(input: Tensor, residual: Tensor, residual_in_fp32: bool) -> torch.dtype:
    """dtype of h = input + residual (mirrors residual_out_dtype in csrc/norm_checks.cpp)."""
    dtype = torch.promote_types(input.dtype, residual.dtype)
    return torch.promote_types(dtype, torch.float32) if residual_in_fp32 else dtype


def _is_rms(op: str) -> bool:
    """Whether the op (named as in its errors) is an rms_norm, whose weight may have any floating dtype."""
    return op.startswith(("rms_norm", "add_rms_norm"))


def _stat_dtype(h_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if h_dtype == torch.float64 else torch.float32


# The fake kernels check their arguments as the C++ ops do (layernorm_ext/_checks.py mirrors
# csrc/norm_checks.cpp), so that torch.compile / torch.export reject what eager rejects, with the same error.


def _column_plane(t: Tensor, normalized_ndim: int) -> int:
    """Mirrors column_plane in csrc/norm_ops.cpp: the pixels per image when t's rows are channels-first rows that
    the kernels read in place (t (N, *spatial, C) over a dense (N, C, *spatial) block: layer_norm_2d's view of a
    contiguous NCHW tensor), else 0. Such an op's output (forward: out; backward: grad_input) has t's strides."""
    if normalized_ndim != 1 or t.dim() < 2:
        return 0
    sizes, strides = t.shape, t.stride()
    cols = sizes[-1]
    expected, plane = 1, 0
    for d in range(t.dim() - 2, -1, -1):
        if sizes[d] == 1:
            continue
        if strides[d] != expected:
            if plane != 0 or expected == 1:
                return 0
            plane = expected
            expected *= cols
            if strides[d] != expected:
                return 0
        expected *= sizes[d]
    if plane == 0:
        plane = expected
    return plane if cols > 1 and plane > 1 and strides[-1] == plane else 0


def _like_rows(t: Tensor, normalized_ndim: int) -> Tensor:
    """A new tensor of t's shape as the ops allocate it: t's strides for channels-first rows, else contiguous."""
    if _column_plane(t, normalized_ndim) > 0:
        return t.new_empty_strided(t.shape, t.stride())
    return t.new_empty(t.shape)


def _fake_forward(
    op: str,
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    residual_in_fp32: bool,
    weight_offset: float,
) -> tuple[Tensor, Tensor, Tensor]:
    stat_shape = _checks.check_forward(op, input, normalized_shape, weight, bias, residual, rms=_is_rms(op))
    _checks.check_weight_offset(op, weight, weight_offset)
    h_dtype = input.dtype if residual is None else residual_out_dtype(input, residual, residual_in_fp32)
    out = input.new_empty(input.shape) if residual is not None else _like_rows(input, len(normalized_shape))
    residual_out = input.new_empty(input.shape if residual is not None else (0,), dtype=h_dtype)
    stat = input.new_empty(stat_shape, dtype=_stat_dtype(h_dtype))
    return out, residual_out, stat


@torch.library.register_fake("layernorm_ext::layer_norm_fwd")
def _layer_norm_fwd_fake(
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    residual: Tensor | None = None,
    residual_in_fp32: bool = False,
    memory_efficient: bool = False,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out, residual_out, stat = _fake_forward(
        "layer_norm", input, normalized_shape, weight, bias, residual, residual_in_fp32, weight_offset
    )
    return out, residual_out, stat, torch.empty_like(stat)


@torch.library.register_fake("layernorm_ext::rms_norm_fwd")
def _rms_norm_fwd_fake(
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    eps: float | None,
    residual: Tensor | None = None,
    residual_in_fp32: bool = False,
    memory_efficient: bool = False,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    return _fake_forward("rms_norm", input, normalized_shape, weight, None, residual, residual_in_fp32, weight_offset)


def _param_grad_placeholder(saved: Tensor, param: Tensor | None, other: Tensor | None) -> Tensor:
    if param is not None:
        return torch.empty_like(param, memory_format=torch.contiguous_format)
    dtype = other.dtype if other is not None else saved.dtype
    return saved.new_empty((0,), dtype=dtype)


def _grad_input_like(
    grad_out: Tensor, saved: Tensor, normalized_shape: Sequence[int], grad_residual_out: Tensor | None
) -> Tensor:
    # Channels-first rows only with grad_out in saved's dtype (norm_ops.cpp, norm_backward).
    if grad_residual_out is not None or grad_out.dtype != saved.dtype:
        return saved.new_empty(saved.shape)
    return _like_rows(saved, len(normalized_shape))


@torch.library.register_fake("layernorm_ext::layer_norm_bwd")
def _layer_norm_bwd_fake(
    grad_out: Tensor,
    saved: Tensor,
    mean: Tensor,
    rstd: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    saved_is_output: bool = False,
    grad_residual_out: Tensor | None = None,
    weight_offset: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    _checks.check_backward(
        "layer_norm_backward", grad_out, saved, mean, rstd, normalized_shape, weight, bias, grad_residual_out,
        saved_is_output, rms=False,
    )
    _checks.check_weight_offset("layer_norm_backward", weight, weight_offset)
    return (
        _grad_input_like(grad_out, saved, normalized_shape, grad_residual_out),
        _param_grad_placeholder(saved, weight, bias),
        _param_grad_placeholder(saved, bias, weight),
    )


@torch.library.register_fake("layernorm_ext::rms_norm_bwd")
def _rms_norm_bwd_fake(
    grad_out: Tensor,
    saved: Tensor,
    rstd: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    saved_is_output: bool = False,
    grad_residual_out: Tensor | None = None,
    weight_offset: float = 0.0,
) -> tuple[Tensor, Tensor]:
    _checks.check_backward(
        "rms_norm_backward", grad_out, saved, None, rstd, normalized_shape, weight, None, grad_residual_out,
        saved_is_output, rms=True,
    )
    _checks.check_weight_offset("rms_norm_backward", weight, weight_offset)
    return (
        _grad_input_like(grad_out, saved, normalized_shape, grad_residual_out),
        _param_grad_placeholder(saved, weight, None),
    )


# The inference ops (out=, in place): they return nothing, so their fake kernels only check (as the C++ op
# bodies do, csrc/norm_ops.cpp: the forward's checks, then the destinations').


def _fake_into(
    op: str, input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, bias: Tensor | None,
    out: Tensor, residual: Tensor | None, residual_out: Tensor | None, residual_in_fp32: bool, weight_offset: float,
    in_place: bool,
) -> None:
    _checks.check_forward(op, input, normalized_shape, weight, bias, residual, rms=_is_rms(op))
    _checks.check_weight_offset(op, weight, weight_offset)
    h_dtype = input.dtype if residual is None else residual_out_dtype(input, residual, residual_in_fp32)
    _checks.check_destinations(op, input, len(normalized_shape), out, residual, residual_out, h_dtype, in_place)


@torch.library.register_fake("layernorm_ext::layer_norm_into")
def _layer_norm_into_fake(
    input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, bias: Tensor | None, eps: float,
    out: Tensor, residual: Tensor | None = None, residual_out: Tensor | None = None, residual_in_fp32: bool = False,
    weight_offset: float = 0.0, cast_before_weight: bool = False,
) -> None:
    _fake_into("layer_norm_into", input, normalized_shape, weight, bias, out, residual, residual_out,
               residual_in_fp32, weight_offset, in_place=False)  # fmt: skip


@torch.library.register_fake("layernorm_ext::rms_norm_into")
def _rms_norm_into_fake(
    input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, eps: float | None, out: Tensor,
    residual: Tensor | None = None, residual_out: Tensor | None = None, residual_in_fp32: bool = False,
    weight_offset: float = 0.0, cast_before_weight: bool = False,
) -> None:
    _fake_into("rms_norm_into", input, normalized_shape, weight, None, out, residual, residual_out, residual_in_fp32,
               weight_offset, in_place=False)  # fmt: skip


@torch.library.register_fake("layernorm_ext::add_layer_norm_")
def _add_layer_norm_inplace_fake(
    input: Tensor, residual: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None,
    bias: Tensor | None = None, eps: float = 1e-5, weight_offset: float = 0.0, cast_before_weight: bool = False,
) -> None:
    _fake_into("add_layer_norm_", input, normalized_shape, weight, bias, input, residual, residual, False,
               weight_offset, in_place=True)  # fmt: skip


@torch.library.register_fake("layernorm_ext::add_rms_norm_")
def _add_rms_norm_inplace_fake(
    input: Tensor, residual: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None,
    eps: float | None = None, weight_offset: float = 0.0, cast_before_weight: bool = False,
) -> None:
    _fake_into("add_rms_norm_", input, normalized_shape, weight, None, input, residual, residual, False,
               weight_offset, in_place=True)  # fmt: skip


# Quantized output: codes of quant_dtype, the dynamic scales (one per row, shaped as the rows with a 1 for each
# normalized dim; per group: the rows, then the groups, column-major on request; [0] for a static scale) and,
# with a residual, h.


def _fake_quant(
    op: str, input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, bias: Tensor | None,
    quant_dtype: torch.dtype, scale: Tensor | None, scale_ub: Tensor | None, residual: Tensor | None,
    residual_in_fp32: bool, weight_offset: float, group_size: int, scales_column_major: bool,
    scales_dtype: torch.dtype | None, scales_swizzled: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    stat_shape = _checks.check_forward(op, input, normalized_shape, weight, bias, residual, rms=_is_rms(op))
    _checks.check_weight_offset(op, weight, weight_offset)
    _checks.check_quant(op, input, quant_dtype, scale, scale_ub)
    nvfp4 = quant_dtype == _checks.NVFP4
    if scales_dtype is None:
        scales_dtype = torch.float8_e4m3fn if nvfp4 else torch.float32
    _checks.check_group_size(op, normalized_shape, group_size, scale is not None, scales_column_major,
                             scales_swizzled, scales_dtype, quant_dtype)
    if nvfp4:
        group_size = _checks.NVFP4_BLOCK
    h_dtype = input.dtype if residual is None else residual_out_dtype(input, residual, residual_in_fp32)
    codes = input.new_empty(_checks.codes_shape(input.shape, quant_dtype), dtype=quant_dtype)
    if group_size > 0:
        groups = normalized_shape[0] // group_size
        if scales_swizzled:
            scales = input.new_empty(_checks.swizzled_scales_shape(math.prod(stat_shape), groups), dtype=scales_dtype)
        elif scales_column_major:
            scales = input.new_empty((groups, *stat_shape), dtype=scales_dtype).movedim(0, -1)
        else:
            scales = input.new_empty((*stat_shape, groups), dtype=scales_dtype)
    else:
        scale_shape = (*stat_shape, *([1] * len(normalized_shape))) if scale is None else (0,)
        scales = input.new_empty(scale_shape, dtype=torch.float32 if scale is not None else scales_dtype)
    residual_out = input.new_empty(input.shape if residual is not None else (0,), dtype=h_dtype)
    return codes, scales, residual_out


@torch.library.register_fake("layernorm_ext::layer_norm_quant")
def _layer_norm_quant_fake(
    input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, bias: Tensor | None, eps: float,
    quant_dtype: torch.dtype, scale: Tensor | None = None, scale_ub: Tensor | None = None,
    residual: Tensor | None = None, residual_in_fp32: bool = False, weight_offset: float = 0.0,
    cast_before_weight: bool = False, group_size: int = 0, scales_column_major: bool = False,
    scales_dtype: torch.dtype | None = None, scales_swizzled: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    return _fake_quant("layer_norm_quant", input, normalized_shape, weight, bias, quant_dtype, scale, scale_ub,
                       residual, residual_in_fp32, weight_offset, group_size, scales_column_major,
                       scales_dtype, scales_swizzled)  # fmt: skip


@torch.library.register_fake("layernorm_ext::rms_norm_quant")
def _rms_norm_quant_fake(
    input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, eps: float | None,
    quant_dtype: torch.dtype, scale: Tensor | None = None, scale_ub: Tensor | None = None,
    residual: Tensor | None = None, residual_in_fp32: bool = False, weight_offset: float = 0.0,
    cast_before_weight: bool = False, group_size: int = 0, scales_column_major: bool = False,
    scales_dtype: torch.dtype | None = None, scales_swizzled: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    return _fake_quant("rms_norm_quant", input, normalized_shape, weight, None, quant_dtype, scale, scale_ub,
                       residual, residual_in_fp32, weight_offset, group_size, scales_column_major,
                       scales_dtype, scales_swizzled)  # fmt: skip


# The quantized ops into the caller's buffers (out: the codes; scales: the dynamic scales; residual_out: h, which
# may be residual itself): they return nothing, so their fake kernels only check, in norm_forward's order.


def _fake_quant_into(
    op: str, input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, bias: Tensor | None,
    out: Tensor, scale: Tensor | None, scales: Tensor | None, scale_ub: Tensor | None, residual: Tensor | None,
    residual_out: Tensor | None, residual_in_fp32: bool, weight_offset: float, group_size: int, scales_swizzled: bool,
) -> None:
    stat_shape = _checks.check_forward(op, input, normalized_shape, weight, bias, residual, rms=_is_rms(op))
    _checks.check_weight_offset(op, weight, weight_offset)
    _checks.check_quant(op, input, out.dtype, scale, scale_ub, dtype_of_out=True)
    nvfp4 = out.dtype == _checks.NVFP4
    if nvfp4 and group_size == 0:
        group_size = _checks.NVFP4_BLOCK
    mx = not nvfp4 and group_size > 0 and scales is not None and scales.dtype == torch.float8_e8m0fnu
    scales_dtype = torch.float8_e4m3fn if nvfp4 else (torch.float8_e8m0fnu if mx else torch.float32)
    _checks.check_group_size(op, normalized_shape, group_size, scale is not None, False, scales_swizzled,
                             scales_dtype, out.dtype)
    _checks.check_destination(op, "out", input, out, len(normalized_shape), out.dtype,
                              _checks.codes_shape(input.shape, out.dtype))
    if scales_swizzled:
        groups = normalized_shape[0] // group_size
        _checks.check_swizzled_scales_buffer(op, input, scales, math.prod(stat_shape), groups, scales_dtype)
    elif group_size > 0:
        _checks.check_group_scales_buffer(op, input, scales, (*stat_shape, normalized_shape[0] // group_size),
                                          scales_dtype)
    else:
        _checks.check_scales_buffer(op, input, scale is not None, scales,
                                    (*stat_shape, *([1] * len(normalized_shape))))
    h_dtype = input.dtype if residual is None else residual_out_dtype(input, residual, residual_in_fp32)
    if (residual is None) != (residual_out is None):
        _checks._fail(op, "a residual needs a residual_out buffer (h = input + residual)" if residual is not None
                      else "residual_out is given without a residual")  # fmt: skip
    if residual_out is not None:
        _checks.check_destination(op, "residual_out", input, residual_out, len(normalized_shape), h_dtype)


@torch.library.register_fake("layernorm_ext::layer_norm_quant_into")
def _layer_norm_quant_into_fake(
    input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, bias: Tensor | None, eps: float,
    out: Tensor, scale: Tensor | None = None, scales: Tensor | None = None, scale_ub: Tensor | None = None,
    residual: Tensor | None = None, residual_out: Tensor | None = None, residual_in_fp32: bool = False,
    weight_offset: float = 0.0, cast_before_weight: bool = False, group_size: int = 0, scales_swizzled: bool = False,
) -> None:
    _fake_quant_into("layer_norm_quant_into", input, normalized_shape, weight, bias, out, scale, scales, scale_ub,
                     residual, residual_out, residual_in_fp32, weight_offset, group_size, scales_swizzled)  # fmt: skip


@torch.library.register_fake("layernorm_ext::rms_norm_quant_into")
def _rms_norm_quant_into_fake(
    input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, eps: float | None, out: Tensor,
    scale: Tensor | None = None, scales: Tensor | None = None, scale_ub: Tensor | None = None,
    residual: Tensor | None = None, residual_out: Tensor | None = None, residual_in_fp32: bool = False,
    weight_offset: float = 0.0, cast_before_weight: bool = False, group_size: int = 0, scales_swizzled: bool = False,
) -> None:
    _fake_quant_into("rms_norm_quant_into", input, normalized_shape, weight, None, out, scale, scales, scale_ub,
                     residual, residual_out, residual_in_fp32, weight_offset, group_size, scales_swizzled)  # fmt: skip


# DTensor sharding strategies (layernorm_ext/sharding.py), registered once torch.distributed.tensor is loaded.
sharding.register_when_imported()
