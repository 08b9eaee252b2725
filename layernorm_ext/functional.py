"""Functional API: drop-ins for torch.nn.functional.layer_norm / rms_norm, and their fused residual variants.

Every function is one call of a ``torch.ops.layernorm_ext`` op of its name (no Python loops, no fallback to
ATen): the forward op (layer_norm_fwd, rms_norm_fwd) less the statistics it also returns, so it works under
torch.compile(fullgraph=True), torch.export and autograd. Eager calls enter the op through its C++ entry point
(the callable behind the OpOverload: the same dispatcher call without the OpOverload's Python frame); while
dynamo traces, the OpOverload itself is called, which is what dynamo knows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import ops  # noqa: F401  (registers fake kernels and sharding strategies)

_ops = torch.ops.layernorm_ext
_LAYER_NORM = _ops.layer_norm.default
_RMS_NORM = _ops.rms_norm.default
_ADD_LAYER_NORM = _ops.add_layer_norm.default
_ADD_RMS_NORM = _ops.add_rms_norm.default
_LAYER_NORM_EAGER = _LAYER_NORM._op
_RMS_NORM_EAGER = _RMS_NORM._op
_ADD_LAYER_NORM_EAGER = _ADD_LAYER_NORM._op
_ADD_RMS_NORM_EAGER = _ADD_RMS_NORM._op
_is_compiling = torch.compiler.is_compiling

ShapeLike = int | Sequence[int] | torch.Size


def _as_shape(normalized_shape: ShapeLike) -> Sequence[int]:
    return (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape


def layer_norm(
    input: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    memory_efficient: bool = False,
) -> Tensor:
    """LayerNorm over the trailing ``normalized_shape`` dims, as ``torch.nn.functional.layer_norm``.

    ``memory_efficient=True`` saves the output instead of the input for backward (same gradients).
    """
    op = _LAYER_NORM if _is_compiling() else _LAYER_NORM_EAGER
    return op(input, _as_shape(normalized_shape), weight, bias, eps, memory_efficient)


def rms_norm(
    input: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    memory_efficient: bool = False,
) -> Tensor:
    """RMSNorm as ``torch.nn.functional.rms_norm``.

    ``eps=None`` means, as in ATen, the machine epsilon of the compute dtype: ``finfo(float32).eps`` for
    float32/float16/bfloat16 input, ``finfo(float64).eps`` for float64.
    """
    op = _RMS_NORM if _is_compiling() else _RMS_NORM_EAGER
    return op(input, _as_shape(normalized_shape), weight, eps, memory_efficient)


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
) -> tuple[Tensor, Tensor]:
    """Pre-norm block: ``h = input + residual; out = layer_norm(h)``, fused. Returns ``(out, h)``.

    ``h`` (residual_out) has the promoted dtype of input and residual, at least float32 when
    ``residual_in_fp32``; ``out`` has the input's dtype.
    """
    op = _ADD_LAYER_NORM if _is_compiling() else _ADD_LAYER_NORM_EAGER
    return op(input, residual, _as_shape(normalized_shape), weight, bias, eps, residual_in_fp32, memory_efficient)


def add_rms_norm(
    input: Tensor,
    residual: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    eps: float | None = None,
    residual_in_fp32: bool = False,
    *,
    memory_efficient: bool = False,
) -> tuple[Tensor, Tensor]:
    """Pre-norm block: ``h = input + residual; out = rms_norm(h)``, fused. Returns ``(out, h)``.

    ``eps=None`` means the machine epsilon of h's compute dtype (float32, or float64 for float64 h).
    """
    op = _ADD_RMS_NORM if _is_compiling() else _ADD_RMS_NORM_EAGER
    return op(input, residual, _as_shape(normalized_shape), weight, eps, residual_in_fp32, memory_efficient)
