"""Functional API: drop-ins for torch.nn.functional.layer_norm / rms_norm, and their fused residual variants.

Every function is one call of the ``torch.ops.layernorm_ext`` op of its name (no Python loops, no fallback to
ATen): the forward op (layer_norm_fwd, rms_norm_fwd) less the statistics it also returns, so it works under
torch.compile(fullgraph=True), torch.export and autograd. Eager calls enter the op through the library's own
CPython entry points (csrc/python_functions.cpp: torch's argument parser, then the same dispatcher call as
the OpOverload's); while dynamo traces, the OpOverload itself is called, which is what dynamo knows. As in
torch.nn.functional, tensors with ``__torch_function__`` overrides (and active torch function modes) are handed
to ``handle_torch_function`` first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function_variadic

from . import ops  # noqa: F401  (registers fake kernels and sharding strategies)
from ._loader import native

_ops = torch.ops.layernorm_ext
_is_compiling = torch.compiler.is_compiling

ShapeLike = int | Sequence[int] | torch.Size

_NUMERICS_DOC = """
    Numerics of other norm modules (defaults: ATen's): ``weight_offset`` makes the scale ``weight +
    weight_offset`` (1.0 reproduces Gemma's ``1 + weight`` and zero-centred gamma; the gradient reaches weight
    unchanged). ``cast_before_weight=True`` rounds the normalized rows to the input dtype before the affine
    (Llama's ``weight * xhat.to(input_dtype)``), where otherwise ``xhat * weight + bias`` is rounded once; it
    changes nothing for float32 / float64 input, and backward passes the gradient straight through the rounding.
"""


_SHAPE_TYPES = (tuple, torch.Size, list)


def _as_shape(normalized_shape: ShapeLike) -> Sequence[int]:
    """A single size (int, SymInt while tracing, numpy integer) as a one-dim shape. (The exact type test first:
    isinstance against the Sequence ABC costs about 0.2 us per call.)"""
    if type(normalized_shape) in _SHAPE_TYPES or isinstance(normalized_shape, Sequence):
        return normalized_shape
    return (normalized_shape,)


def layer_norm(
    input: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    memory_efficient: bool = False,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
    out: Tensor | None = None,
) -> Tensor:
    """LayerNorm over the trailing ``normalized_shape`` dims, as ``torch.nn.functional.layer_norm``.

    ``memory_efficient=True`` saves the output instead of the input for backward (same gradients).
    """
    if out is not None:
        if has_torch_function_variadic(input, weight, bias, out):
            return handle_torch_function(
                layer_norm, (input, weight, bias, out), input, normalized_shape, weight, bias, eps,
                memory_efficient=memory_efficient, weight_offset=weight_offset, cast_before_weight=cast_before_weight,
                out=out,
            )  # fmt: skip
        entry = _ops.layer_norm_into.default if _is_compiling() else native.layer_norm_into
        entry(input, _as_shape(normalized_shape), weight, bias, eps, out, None, None, False, weight_offset,
              cast_before_weight)  # fmt: skip
        return out
    return _layer_norm(input, normalized_shape, weight, bias, eps, memory_efficient, weight_offset,
                       cast_before_weight)  # fmt: skip


# The bodies, with every argument positional: the modules call these (a keyword argument costs a dict per call).
def _layer_norm(
    input: Tensor, normalized_shape: ShapeLike, weight: Tensor | None, bias: Tensor | None, eps: float,
    memory_efficient: bool, weight_offset: float = 0.0, cast_before_weight: bool = False,
) -> Tensor:
    if has_torch_function_variadic(input, weight, bias):
        return handle_torch_function(
            layer_norm, (input, weight, bias), input, normalized_shape, weight, bias, eps,
            memory_efficient=memory_efficient, weight_offset=weight_offset, cast_before_weight=cast_before_weight,
        )  # fmt: skip
    entry = _ops.layer_norm.default if _is_compiling() else native.layer_norm
    return entry(input, _as_shape(normalized_shape), weight, bias, eps, memory_efficient, weight_offset,
                 cast_before_weight)  # fmt: skip


def rms_norm(
    input: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    memory_efficient: bool = False,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
    out: Tensor | None = None,
) -> Tensor:
    """RMSNorm as ``torch.nn.functional.rms_norm``.

    ``eps=None`` means, as in ATen, the machine epsilon of the compute dtype: ``finfo(float32).eps`` for
    float32/float16/bfloat16 input, ``finfo(float64).eps`` for float64.
    """
    if out is not None:
        if has_torch_function_variadic(input, weight, out):
            return handle_torch_function(
                rms_norm, (input, weight, out), input, normalized_shape, weight, eps,
                memory_efficient=memory_efficient, weight_offset=weight_offset, cast_before_weight=cast_before_weight,
                out=out,
            )  # fmt: skip
        entry = _ops.rms_norm_into.default if _is_compiling() else native.rms_norm_into
        entry(input, _as_shape(normalized_shape), weight, eps, out, None, None, False, weight_offset,
              cast_before_weight)  # fmt: skip
        return out
    return _rms_norm(input, normalized_shape, weight, eps, memory_efficient, weight_offset, cast_before_weight)


def _rms_norm(
    input: Tensor, normalized_shape: ShapeLike, weight: Tensor | None, eps: float | None, memory_efficient: bool,
    weight_offset: float = 0.0, cast_before_weight: bool = False,
) -> Tensor:
    if has_torch_function_variadic(input, weight):
        return handle_torch_function(
            rms_norm, (input, weight), input, normalized_shape, weight, eps, memory_efficient=memory_efficient,
            weight_offset=weight_offset, cast_before_weight=cast_before_weight,
        )  # fmt: skip
    entry = _ops.rms_norm.default if _is_compiling() else native.rms_norm
    return entry(input, _as_shape(normalized_shape), weight, eps, memory_efficient, weight_offset, cast_before_weight)


def add_layer_norm(
    input: Tensor,
    residual: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    residual_in_fp32: bool = False,
    *,
    memory_efficient: bool = False,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Pre-norm block: ``h = input + residual; out = layer_norm(h)``, fused. Returns ``(out, h)``.

    ``h`` (residual_out) has the promoted dtype of input and residual, at least float32 when
    ``residual_in_fp32``; ``out`` has the input's dtype.
    """
    if out is not None or residual_out is not None:
        out, residual_out = _both_buffers("add_layer_norm", out, residual_out)
        if has_torch_function_variadic(input, residual, weight, bias, out, residual_out):
            return handle_torch_function(
                add_layer_norm, (input, residual, weight, bias, out, residual_out), input, residual, normalized_shape,
                weight, bias, eps, residual_in_fp32, memory_efficient=memory_efficient, weight_offset=weight_offset,
                cast_before_weight=cast_before_weight, out=out, residual_out=residual_out,
            )  # fmt: skip
        entry = _ops.layer_norm_into.default if _is_compiling() else native.layer_norm_into
        entry(input, _as_shape(normalized_shape), weight, bias, eps, out, residual, residual_out, residual_in_fp32,
              weight_offset, cast_before_weight)  # fmt: skip
        return out, residual_out
    if has_torch_function_variadic(input, residual, weight, bias):
        return handle_torch_function(
            add_layer_norm, (input, residual, weight, bias), input, residual, normalized_shape, weight, bias, eps,
            residual_in_fp32, memory_efficient=memory_efficient, weight_offset=weight_offset,
            cast_before_weight=cast_before_weight,
        )  # fmt: skip
    entry = _ops.add_layer_norm.default if _is_compiling() else native.add_layer_norm
    return entry(input, residual, _as_shape(normalized_shape), weight, bias, eps, residual_in_fp32, memory_efficient,
                 weight_offset, cast_before_weight)  # fmt: skip


def add_rms_norm(
    input: Tensor,
    residual: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    eps: float | None = None,
    residual_in_fp32: bool = False,
    *,
    memory_efficient: bool = False,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Pre-norm block: ``h = input + residual; out = rms_norm(h)``, fused. Returns ``(out, h)``.

    ``eps=None`` means the machine epsilon of h's compute dtype (float32, or float64 for float64 h).
    """
    if out is not None or residual_out is not None:
        out, residual_out = _both_buffers("add_rms_norm", out, residual_out)
        if has_torch_function_variadic(input, residual, weight, out, residual_out):
            return handle_torch_function(
                add_rms_norm, (input, residual, weight, out, residual_out), input, residual, normalized_shape, weight,
                eps, residual_in_fp32, memory_efficient=memory_efficient, weight_offset=weight_offset,
                cast_before_weight=cast_before_weight, out=out, residual_out=residual_out,
            )  # fmt: skip
        entry = _ops.rms_norm_into.default if _is_compiling() else native.rms_norm_into
        entry(input, _as_shape(normalized_shape), weight, eps, out, residual, residual_out, residual_in_fp32,
              weight_offset, cast_before_weight)  # fmt: skip
        return out, residual_out
    if has_torch_function_variadic(input, residual, weight):
        return handle_torch_function(
            add_rms_norm, (input, residual, weight), input, residual, normalized_shape, weight, eps,
            residual_in_fp32, memory_efficient=memory_efficient, weight_offset=weight_offset,
            cast_before_weight=cast_before_weight,
        )  # fmt: skip
    entry = _ops.add_rms_norm.default if _is_compiling() else native.add_rms_norm
    return entry(input, residual, _as_shape(normalized_shape), weight, eps, residual_in_fp32, memory_efficient,
                 weight_offset, cast_before_weight)  # fmt: skip


def _both_buffers(op: str, out: Tensor | None, residual_out: Tensor | None) -> tuple[Tensor, Tensor]:
    if out is None or residual_out is None:
        raise RuntimeError(f"{op}: out= and residual_out= go together (the op writes both)")
    return out, residual_out


def add_layer_norm_(
    input: Tensor,
    residual: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
) -> tuple[Tensor, Tensor]:
    """The inference engines' fused add + norm, in place: ``residual = input + residual`` (rounded to residual's
    dtype, which must be h's: the promoted dtype of the two), then ``input = layer_norm(residual)``. Stores no
    statistics; refuses arguments that require grad, and (as ATen refuses writes through overlapping tensors)
    input and residual that share memory with each other or with weight / bias. Returns ``(input, residual)``."""
    if has_torch_function_variadic(input, residual, weight, bias):
        return handle_torch_function(
            add_layer_norm_, (input, residual, weight, bias), input, residual, normalized_shape, weight, bias, eps,
            weight_offset=weight_offset, cast_before_weight=cast_before_weight,
        )  # fmt: skip
    entry = _ops.add_layer_norm_.default if _is_compiling() else native.add_layer_norm_
    entry(input, residual, _as_shape(normalized_shape), weight, bias, eps, weight_offset, cast_before_weight)
    return input, residual


def add_rms_norm_(
    input: Tensor,
    residual: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
) -> tuple[Tensor, Tensor]:
    """vLLM's ``fused_add_rms_norm``, for every dtype and device: ``residual = input + residual``, then ``input =
    rms_norm(residual)``, in place (see :func:`add_layer_norm_`). Returns ``(input, residual)``."""
    if has_torch_function_variadic(input, residual, weight):
        return handle_torch_function(
            add_rms_norm_, (input, residual, weight), input, residual, normalized_shape, weight, eps,
            weight_offset=weight_offset, cast_before_weight=cast_before_weight,
        )  # fmt: skip
    entry = _ops.add_rms_norm_.default if _is_compiling() else native.add_rms_norm_
    entry(input, residual, _as_shape(normalized_shape), weight, eps, weight_offset, cast_before_weight)
    return input, residual


def _channels_last(input: Tensor, op: str) -> tuple[Tensor, list[int]]:
    """input (N, C, *spatial) as (N, *spatial, C), and the permutation back."""
    if input.dim() < 2:
        raise RuntimeError(f"{op}: expected input of shape (N, C, *spatial), but got input of size {list(input.shape)}")
    ndim = input.dim()
    return input.permute(0, *range(2, ndim), 1), [0, ndim - 1, *range(1, ndim - 1)]


def layer_norm_2d(
    input: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-6, **kwargs: Any
) -> Tensor:
    """LayerNorm over the channel dim of (N, C, *spatial) input (timm's ``LayerNorm2d``: ConvNeXt, SAM's image
    encoder): each pixel's C channels are a row. No copy for the two usual layouts: a channels_last input's rows
    are packed (the row kernels); on the CPU, a contiguous (N, C, *spatial) input's channels are H * W apart and
    its pixels adjacent, which the channels-first kernels read in place (forward and backward). The result has the
    input's memory format there: channels_last for channels_last input, contiguous for contiguous input (timm's
    ``permute``, ``layer_norm``, ``permute`` gives channels_last for both; the values are the same). Any other
    layout (a slice of the channels, a strided plane, a CUDA tensor in NCHW) is copied once into channels_last
    rows first, and the result is channels_last. Keyword arguments as :func:`layer_norm`'s."""
    rows, back = _channels_last(input, "layer_norm_2d")
    return layer_norm(rows, input.shape[1], weight, bias, eps, **kwargs).permute(back)


def rms_norm_2d(input: Tensor, weight: Tensor | None = None, eps: float | None = None, **kwargs: Any) -> Tensor:
    """RMSNorm over the channel dim of (N, C, *spatial) input, as :func:`layer_norm_2d` (timm's ``RmsNorm2d``)."""
    rows, back = _channels_last(input, "rms_norm_2d")
    return rms_norm(rows, input.shape[1], weight, eps, **kwargs).permute(back)


_OUT_DOC = """
    ``out=`` (and, with a residual, ``residual_out=``, h's dtype): write into these buffers (each row's elements
    consecutive, the rows anywhere but never twice: no stride-0 dim), which must not share memory with the
    arguments; no statistics are computed into memory. Like ATen's out= ops,
    this refuses arguments that require grad.
"""

for _fn in (layer_norm, rms_norm, add_layer_norm, add_rms_norm):
    _fn.__doc__ = (_fn.__doc__ or "") + _OUT_DOC
for _fn in (layer_norm, rms_norm, add_layer_norm, add_rms_norm, add_layer_norm_, add_rms_norm_):
    _fn.__doc__ = (_fn.__doc__ or "") + _NUMERICS_DOC
del _fn
