"""The argument checks of csrc/norm_checks.cpp, for the fake kernels (layernorm_ext/ops.py).

torch.compile and torch.export trace with fake tensors, which never reach the C++ checks; these raise the same
RuntimeErrors, worded the same, in the same order, so that a traced program fails where and as eager would.
Keep the two in step: tests/test_errors.py runs every bad-argument case through both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

_SUPPORTED = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_HALF = (torch.float16, torch.bfloat16)

# c10's names of the dtypes, as the C++ messages print them.
_C10_NAMES = {
    torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
    torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
    torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
    torch.complex32: "ComplexHalf", torch.float8_e4m3fn: "Float8_e4m3fn", torch.float8_e5m2: "Float8_e5m2",
    torch.float8_e4m3fnuz: "Float8_e4m3fnuz", torch.float8_e5m2fnuz: "Float8_e5m2fnuz",
    torch.float8_e8m0fnu: "Float8_e8m0fnu", torch.float4_e2m1fn_x2: "Float4_e2m1fn_x2",
}  # fmt: skip


# NVFP4 codes (two float4_e2m1 per byte) and their blocks of columns (csrc/quant_math.h kNvfp4Block).
NVFP4 = torch.float4_e2m1fn_x2
NVFP4_BLOCK = 16


def codes_shape(input_shape: Sequence[object], quant_dtype: torch.dtype) -> list[object]:
    """The codes' shape: input's, the last dim halved for NVFP4 (two codes per byte)."""
    shape = list(input_shape)
    if quant_dtype == NVFP4:
        shape[-1] = shape[-1] // 2
    return shape


def _name(dtype: torch.dtype) -> str:
    return _C10_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _sizes(shape: Sequence[object]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _fail(op: str, message: str) -> None:
    raise RuntimeError(f"{op}: {message}")


def _check_float(op: str, name: str, t: Tensor) -> None:
    if t.dtype not in _SUPPORTED:
        _fail(op, f"expected {name} to be a floating point tensor (float32, float64, float16 or bfloat16), but got "
                  f"{name} of dtype {_name(t.dtype)}")


def _check_same_device(op: str, name: str, first: Tensor, t: Tensor) -> None:
    if t.device != first.device:
        _fail(op, f"expected all tensors to be on the same device, but found at least two devices, {first.device} "
                  f"and {t.device}! (when checking argument {name})")


def _check_param(op: str, name: str, input: Tensor, t: Tensor, normalized_shape: Sequence[int], rms: bool) -> None:
    """check_param: rms_norm takes a weight of any floating dtype; layer_norm the input's or (half input)
    float32."""
    _check_same_device(op, name, input, t)
    if list(t.shape) != list(normalized_shape):
        _fail(op, f"expected {name} to be of same shape as normalized_shape, but got {name} of shape "
                  f"{_sizes(t.shape)} and normalized_shape = {_sizes(normalized_shape)}")
    _check_float(op, name, t)
    if rms:
        return
    half_input = input.dtype in _HALF
    if not (t.dtype == input.dtype or (half_input and t.dtype == torch.float32)):
        _fail(op, f"expected {name} to have the input's dtype ({_name(input.dtype)})"
                  f"{' or float32' if half_input else ''}, but got {name} of dtype {_name(t.dtype)}")


def stat_shape(op: str, input: Tensor, normalized_shape: Sequence[int]) -> list[object]:
    """The input's leading (not normalized) dims, after checking that normalized_shape fits the input."""
    if len(normalized_shape) < 1:
        _fail(op, "expected normalized_shape to be at least 1-dimensional, i.e., containing at least one element, "
                  f"but got normalized_shape = {_sizes(normalized_shape)}")
    axis = input.dim() - len(normalized_shape)
    if axis < 0 or list(input.shape[axis:]) != list(normalized_shape):
        expected = "".join(f", {d}" for d in normalized_shape)
        _fail(op, f"given normalized_shape={_sizes(normalized_shape)}, expected input with shape [*{expected}], "
                  f"but got input of size{_sizes(input.shape)}")
    return list(input.shape[:axis])


def check_forward(
    op: str,
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    rms: bool,
) -> list[object]:
    """check_forward_args; returns the statistics' shape."""
    _check_float(op, "input", input)
    stats = stat_shape(op, input, normalized_shape)
    if weight is not None:
        _check_param(op, "weight", input, weight, normalized_shape, rms)
    if bias is not None:
        _check_param(op, "bias", input, bias, normalized_shape, rms)
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        _fail(op, f"expected weight and bias to have the same dtype, but got weight of dtype {_name(weight.dtype)} "
                  f"and bias of dtype {_name(bias.dtype)}")
    if residual is not None:
        _check_same_device(op, "residual", input, residual)
        _check_float(op, "residual", residual)
        if residual.shape != input.shape:
            _fail(op, f"expected residual to have the same shape as input, but got residual of shape "
                      f"{_sizes(residual.shape)} and input of shape {_sizes(input.shape)}")
    return stats


def check_weight_offset(op: str, weight: Tensor | None, weight_offset: float) -> None:
    """check_weight_offset: finite, and nonzero only with a weight."""
    if not math.isfinite(weight_offset):
        _fail(op, f"expected a finite weight_offset, but got {weight_offset:g}")
    if weight_offset != 0.0 and weight is None:
        _fail(op, f"weight_offset={weight_offset:g} needs a weight (the scale is weight + weight_offset), but got "
                  "weight=None")


def check_quant(
    op: str, input: Tensor, quant_dtype: torch.dtype, scale: Tensor | None, scale_ub: Tensor | None,
    dtype_of_out: bool = False,
) -> None:
    """check_quant_args."""
    if quant_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, NVFP4):
        if dtype_of_out:
            _fail(op, "expected out to be a torch.float8_e4m3fn, torch.float8_e5m2, torch.int8 or "
                      f"torch.float4_e2m1fn_x2 tensor (the codes), but got out of dtype {_name(quant_dtype)}")
        _fail(op, "expected quant_dtype to be torch.float8_e4m3fn, torch.float8_e5m2, torch.int8 or "
                  f"torch.float4_e2m1fn_x2, but got {_name(quant_dtype)}")
    if quant_dtype == NVFP4 and scale is None:
        _fail(op, "NVFP4 codes (float4_e2m1fn_x2) need scale=, their float32 global scale (the blocks' "
                  "float8_e4m3fn scales are computed)")
    if scale is not None and scale_ub is not None:
        _fail(op, "scale_ub caps the dynamic per-row scale, so it cannot be given with a static scale")
    for name, t in (("scale", scale), ("scale_ub", scale_ub)):
        if t is None:
            continue
        _check_same_device(op, name, input, t)
        if t.dtype != torch.float32 or t.numel() != 1:
            _fail(op, f"expected {name} to be a float32 tensor of one element, but got {name} of dtype "
                      f"{_name(t.dtype)} and shape {_sizes(t.shape)}")


def check_group_size(
    op: str, normalized_shape: Sequence[int], group_size: int, static_scale: bool, scales_column_major: bool,
    scales_swizzled: bool, scales_dtype: torch.dtype, quant_dtype: torch.dtype,
) -> None:
    """check_group_size."""
    if scales_swizzled and scales_column_major:
        _fail(op, "scales_swizzled and scales_column_major are two layouts of the scales; give one of them")
    if quant_dtype == NVFP4:
        if group_size not in (0, NVFP4_BLOCK):
            _fail(op, f"NVFP4 codes (float4_e2m1fn_x2) have blocks of 16 elements (group_size 16, or 0), but got "
                      f"group_size={group_size}")
        if scales_dtype != torch.float8_e4m3fn:
            _fail(op, f"NVFP4 block scales are float8_e4m3fn, but got scales_dtype {_name(scales_dtype)}")
        if len(normalized_shape) != 1:
            _fail(op, "NVFP4 codes need a 1-D normalized_shape (blocks along its dim), but got normalized_shape "
                      f"{_sizes(normalized_shape)}")
        if normalized_shape[0] % NVFP4_BLOCK != 0:
            _fail(op, f"NVFP4 codes need rows of a multiple of 16 elements (their blocks), but got rows of "
                      f"{normalized_shape[0]}")
        return
    if group_size < 0:
        _fail(op, f"expected group_size to be positive (or 0: a scale per row), but got {group_size}")
    if scales_dtype not in (torch.float32, torch.float8_e8m0fnu):
        _fail(op, "expected scales_dtype to be torch.float32 or torch.float8_e8m0fnu (MX block scales), but got "
                  f"{_name(scales_dtype)}")
    if scales_dtype == torch.float8_e8m0fnu:
        if group_size == 0:
            _fail(op, "float8_e8m0fnu scales are MX block scales, so they need a group_size")
        if quant_dtype == torch.int8:
            _fail(op, f"MX block scales (float8_e8m0fnu) go with float8 codes, but got codes of dtype "
                      f"{_name(quant_dtype)}")
    if scales_swizzled and not (scales_dtype == torch.float8_e8m0fnu and group_size == 32):
        _fail(op, "scales_swizzled lays out the block scales of MXFP8 (float8_e8m0fnu scales, group_size 32) and NVFP4 "
                  f"in the scaled matmuls' 128 x 4 tiles, but got group_size={group_size} and scales of dtype "
                  f"{_name(scales_dtype)}")
    if group_size == 0:
        if scales_column_major:
            _fail(op, "scales_column_major lays out per-group scales, so it needs a group_size")
        return
    if static_scale:
        _fail(op, "group_size gives each group of columns a dynamic scale, so it cannot be given with a static scale")
    if len(normalized_shape) != 1:
        _fail(op, "group_size needs a 1-D normalized_shape (groups along its dim), but got normalized_shape "
                  f"{_sizes(normalized_shape)}")
    if normalized_shape[0] % group_size != 0:
        _fail(op, f"expected group_size to divide the {normalized_shape[0]} normalized elements of a row, but got "
                  f"group_size={group_size}")


def _require_group_scales_buffer(
    op: str, scales: Tensor | None, shape: Sequence[object], scales_dtype: torch.dtype
) -> Tensor:
    if scales is None:
        if scales_dtype == torch.float8_e4m3fn:
            _fail(op, "NVFP4 codes need a scales= buffer for their blocks' float8_e4m3fn scales of shape "
                      f"{_sizes(shape)}")
        _fail(op, "a dynamic scale (no scale=) needs a scales= buffer for the per-group scales of shape "
                  f"{_sizes(shape)}")
    return scales  # type: ignore[return-value]


def _round_up(n: object, multiple: int) -> object:
    return (n + multiple - 1) // multiple * multiple  # type: ignore[operator]


def swizzled_scales_shape(rows: object, groups: object) -> list[object]:
    """swizzled_scales_shape: [rows padded to 128, groups padded to 4] (the scaled matmuls' 128 x 4 tiles)."""
    return [_round_up(rows, 128), _round_up(groups, 4)]


def check_swizzled_scales_buffer(
    op: str, input: Tensor, scales: Tensor | None, rows: object, groups: object, scales_dtype: torch.dtype
) -> None:
    """check_swizzled_scales_buffer: of scales_dtype, contiguous, as many elements as the padded tiles (any shape)."""
    shape = swizzled_scales_shape(rows, groups)
    scales = _require_group_scales_buffer(op, scales, shape, scales_dtype)
    _check_same_device(op, "scales", input, scales)
    numel = shape[0] * shape[1]  # type: ignore[operator]
    if scales.dtype != scales_dtype or scales.numel() != numel or not scales.is_contiguous():
        _fail(op, f"expected swizzled scales (the {rows} rows x {groups} blocks padded to whole 128 x 4 tiles) to be "
                  f"a contiguous {_name(scales_dtype)} tensor of {numel} elements (shape {_sizes(shape)}, or any of "
                  f"as many), but got scales of shape {_sizes(scales.shape)}, strides {_sizes(scales.stride())} "
                  f"and dtype {_name(scales.dtype)}")


def check_group_scales_buffer(
    op: str, input: Tensor, scales: Tensor | None, scale_shape: Sequence[int], scales_dtype: torch.dtype
) -> None:
    """check_group_scales_buffer: row-major or column-major (each group's scales of all rows contiguous)."""
    scales = _require_group_scales_buffer(op, scales, scale_shape, scales_dtype)
    _check_destination_shape(op, "scales", input, scales, scales_dtype, scale_shape)
    groups, rows = scale_shape[-1], math.prod(scale_shape[:-1])
    if scales.is_contiguous() or groups == 0 or rows == 0:
        return
    group_stride = scales.stride(-1) if groups > 1 else rows
    if not (scales.select(-1, 0).is_contiguous() and group_stride >= rows):
        _fail(op, "expected scales to be row-major (contiguous) or column-major (each group's scales of all rows "
                  "contiguous, the groups at least as many elements apart), but got scales of shape "
                  f"{_sizes(scales.shape)} and strides {_sizes(scales.stride())}")


def _check_destination_shape(
    op: str, name: str, input: Tensor, dest: Tensor, dtype: torch.dtype, shape: Sequence[object]
) -> None:
    _check_same_device(op, name, input, dest)
    want = list(shape)
    if dest.dtype != dtype or list(dest.shape) != want:
        _fail(op, f"expected {name} of shape {_sizes(want)} and dtype {_name(dtype)}, but got {name} of shape "
                  f"{_sizes(dest.shape)} and dtype {_name(dest.dtype)}")


def check_destination(
    op: str, name: str, input: Tensor, dest: Tensor, normalized_ndim: int, dtype: torch.dtype,
    shape: Sequence[object] | None = None,
) -> None:
    """check_destination of a buffer of rows: input's shape (or shape: NVFP4's codes), the normalized dims packed,
    no leading dim of stride 0. (check_no_overlap is not mirrored: fake tensors have no memory to compare; a traced
    program whose buffers overlap fails when it runs.)"""
    _check_destination_shape(op, name, input, dest, dtype, input.shape if shape is None else shape)
    sizes, strides = dest.shape, dest.stride()
    axis = dest.dim() - normalized_ndim
    packed = 1
    for d in range(dest.dim() - 1, axis - 1, -1):
        if sizes[d] != 1 and strides[d] != packed:
            _fail(op, f"expected {name} to be contiguous in its normalized dims (the kernels write each row in "
                      f"place), but got {name} of strides {_sizes(strides)}")
        packed *= sizes[d]
    for d in range(axis):
        if sizes[d] > 1 and strides[d] == 0:
            _fail(op, f"unsupported operation: more than one element of {name} refers to a single memory location "
                      "(an expanded dim of stride 0). Please clone() it first.")


def check_shaped_destination(
    op: str, name: str, input: Tensor, dest: Tensor, dtype: torch.dtype, shape: Sequence[object]
) -> None:
    """check_destination of a buffer of another shape (the per-row scales): contiguous."""
    _check_destination_shape(op, name, input, dest, dtype, shape)
    if not dest.is_contiguous():
        _fail(op, f"expected {name} to be contiguous (the kernels write it row by row)")


def check_scales_buffer(
    op: str, input: Tensor, static_scale: bool, scales: Tensor | None, scale_shape: Sequence[object]
) -> None:
    """check_scales_buffer."""
    if static_scale:
        if scales is not None:
            _fail(op, "scales= receives the dynamic per-row scales; with a static scale there are none to write")
        return
    if scales is None:
        _fail(op, "a dynamic scale (no scale=) needs a scales= buffer for the per-row scales of shape "
                  f"{_sizes(scale_shape)}")
    check_shaped_destination(op, "scales", input, scales, torch.float32, scale_shape)


def check_destinations(
    op: str, input: Tensor, normalized_ndim: int, out: Tensor, residual: Tensor | None, residual_out: Tensor | None,
    h_dtype: torch.dtype, in_place: bool,
) -> None:
    """The destination checks of norm_forward (csrc/norm_ops.cpp) for the inference ops."""
    check_destination(op, "input" if in_place else "out", input, out, normalized_ndim, input.dtype)
    if (residual is None) != (residual_out is None):
        _fail(op, "a residual needs a residual_out buffer (h = input + residual)" if residual is not None
                  else "residual_out is given without a residual")  # fmt: skip
    if residual_out is not None:
        check_destination(op, "residual" if in_place else "residual_out", input, residual_out, normalized_ndim,
                          h_dtype)


def check_backward(
    op: str,
    grad_out: Tensor,
    saved: Tensor,
    mean: Tensor | None,
    rstd: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    grad_residual_out: Tensor | None,
    saved_is_output: bool,
    rms: bool,
) -> None:
    """check_backward_args."""
    _check_float(op, "saved", saved)
    _check_float(op, "grad_out", grad_out)
    stats = stat_shape(op, saved, normalized_shape)
    if grad_out.shape != saved.shape:
        _fail(op, f"expected grad_out of shape {_sizes(saved.shape)}, but got grad_out of shape "
                  f"{_sizes(grad_out.shape)}")
    _check_same_device(op, "grad_out", saved, grad_out)
    if torch.promote_types(grad_out.dtype, saved.dtype) != saved.dtype:
        _fail(op, f"expected grad_out to have saved's dtype ({_name(saved.dtype)}) or a narrower one, but got "
                  f"grad_out of dtype {_name(grad_out.dtype)}")
    if weight is not None:
        _check_param(op, "weight", grad_out, weight, normalized_shape, rms)
    if bias is not None:
        _check_param(op, "bias", grad_out, bias, normalized_shape, rms)
    rows = 1
    for d in stats:
        rows *= d
    acc = torch.float64 if (grad_out if saved_is_output else saved).dtype == torch.float64 else torch.float32
    for name, t in (("mean", mean), ("rstd", rstd)):
        if t is None:
            continue
        _check_same_device(op, name, saved, t)
        if t.numel() != rows:
            _fail(op, f"expected {name} to hold one value per row ({rows}), but got {name} of shape {_sizes(t.shape)}")
        if t.dtype != acc:
            _fail(op, f"expected {name} of dtype {_name(acc)}, but got {_name(t.dtype)}")
    if saved_is_output and saved.dtype != grad_out.dtype:
        _fail(op, f"with saved_is_output, expected saved (the forward's output) to have grad_out's dtype "
                  f"{_name(grad_out.dtype)}, but got {_name(saved.dtype)}")
    if grad_residual_out is not None:
        _check_same_device(op, "grad_residual_out", saved, grad_residual_out)
        if grad_residual_out.shape != saved.shape:
            _fail(op, f"expected grad_residual_out of shape {_sizes(saved.shape)}, but got "
                      f"{_sizes(grad_residual_out.shape)}")
        _check_float(op, "grad_residual_out", grad_residual_out)
