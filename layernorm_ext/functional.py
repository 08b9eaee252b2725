"""Functional API: drop-ins for torch.nn.functional.layer_norm / rms_norm, and their fused residual variants.

Every function is one call of a ``torch.ops.layernorm_ext`` op (no Python loops, no fallback to ATen), so it
works under torch.compile(fullgraph=True), torch.export and autograd.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import ops  # noqa: F401  (registers fake kernels and autograd formulas)

_ops = torch.ops.layernorm_ext

ShapeLike = int | Sequence[int] | torch.Size


def _as_shape(normalized_shape: ShapeLike) -> list[int]:
    if isinstance(normalized_shape, int):
        return [normalized_shape]
    return list(normalized_shape)


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
    out, _, _, _ = _ops.layer_norm_fwd(
        input, _as_shape(normalized_shape), weight, bias, eps, None, False, memory_efficient
    )
    return out


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
    out, _, _ = _ops.rms_norm_fwd(input, _as_shape(normalized_shape), weight, eps, None, False, memory_efficient)
    return out


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
    out, residual_out, _, _ = _ops.layer_norm_fwd(
        input, _as_shape(normalized_shape), weight, bias, eps, residual, residual_in_fp32, memory_efficient
    )
    return out, residual_out


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
    out, residual_out, _ = _ops.rms_norm_fwd(
        input, _as_shape(normalized_shape), weight, eps, residual, residual_in_fp32, memory_efficient
    )
    return out, residual_out
