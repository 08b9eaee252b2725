"""Modules: drop-ins for torch.nn.LayerNorm and torch.nn.RMSNorm.

They subclass the torch modules, so constructor arguments, attributes, parameter names, initialization,
``extra_repr``, state_dict and ``isinstance`` checks are exactly torch's; only ``forward`` runs our kernels
and additionally accepts a residual to fuse (pre-norm block).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import functional as F

_ShapeArg = int | Sequence[int] | torch.Size


class FusedLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` with fused kernels.

    ``forward(x)`` returns ``layer_norm(x)``; ``forward(x, residual)`` returns ``(layer_norm(x + residual),
    x + residual)`` in one pass. ``memory_efficient=True`` saves the output instead of the input for backward.
    """

    def __init__(
        self,
        normalized_shape: _ShapeArg,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        memory_efficient: bool = False,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device=device, dtype=dtype)
        self.memory_efficient = memory_efficient

    def forward(self, input: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            return F._layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps, self.memory_efficient)
        return F.add_layer_norm(
            input,
            residual,
            self.normalized_shape,
            self.weight,
            self.bias,
            self.eps,
            memory_efficient=self.memory_efficient,
        )


class FusedRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with fused kernels; ``forward(x, residual)`` as in :class:`FusedLayerNorm`."""

    def __init__(
        self,
        normalized_shape: _ShapeArg,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        memory_efficient: bool = False,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
        self.memory_efficient = memory_efficient

    def forward(self, input: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            return F._rms_norm(input, self.normalized_shape, self.weight, self.eps, self.memory_efficient)
        return F.add_rms_norm(
            input, residual, self.normalized_shape, self.weight, self.eps, memory_efficient=self.memory_efficient
        )
