"""Modules: drop-ins for torch.nn.LayerNorm and torch.nn.RMSNorm, and for timm's channels-first LayerNorm2d and
RmsNorm2d (FusedLayerNorm2d, FusedRMSNorm2d: the same parameters, over dim 1 of (N, C, *spatial) input).

They subclass the torch modules, so constructor arguments, attributes, parameter names, initialization,
``extra_repr``, state_dict and ``isinstance`` checks are exactly torch's; only ``forward`` runs our kernels
and additionally accepts a residual to fuse (pre-norm block). Beyond torch's arguments, the numerics of other
norm modules (functional.py): ``weight_offset`` (the scale is ``weight + weight_offset``; the weight then starts
at ``1 - weight_offset``, zeros for Gemma's 1, so that a new module is still the identity scale) and
``cast_before_weight`` (Llama's order of rounding). A ``weight_offset`` needs the weight it offsets: with
``elementwise_affine=False`` a nonzero one is refused at construction (ValueError), as the functions refuse it
without a weight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import functional as F

_ShapeArg = int | Sequence[int] | torch.Size


class _Numerics:
    """The numerics options shared by both modules (a mixin before torch's module class: its reset_parameters and
    extra_repr extend torch's)."""

    weight: torch.nn.Parameter | None
    weight_offset: float = 0.0
    cast_before_weight: bool = False

    def _set_numerics(self, memory_efficient: bool, weight_offset: float, cast_before_weight: bool) -> None:
        # The functions' rule (csrc/norm_checks.cpp), at construction rather than at every forward.
        if not math.isfinite(weight_offset):
            raise ValueError(f"{type(self).__name__}: expected a finite weight_offset, but got {weight_offset}")
        if weight_offset != 0.0 and self.weight is None:
            raise ValueError(f"{type(self).__name__}: weight_offset={weight_offset} needs a weight (the scale is "
                             "weight + weight_offset), but got elementwise_affine=False")
        self.memory_efficient = memory_efficient
        self.weight_offset = float(weight_offset)
        self.cast_before_weight = bool(cast_before_weight)
        if self.weight_offset != 0.0:
            self._init_weight_for_offset()

    def reset_parameters(self) -> None:
        super().reset_parameters()  # type: ignore[misc]  (torch's module, next in the MRO)
        self._init_weight_for_offset()

    def extra_repr(self) -> str:
        return super().extra_repr() + self._numerics_repr()  # type: ignore[misc]

    def _init_weight_for_offset(self) -> None:
        if self.weight is not None and self.weight_offset != 0.0:
            with torch.no_grad():
                self.weight.fill_(1.0 - self.weight_offset)

    def _numerics_repr(self) -> str:
        extra = ""
        if self.weight_offset != 0.0:
            extra += f", weight_offset={self.weight_offset}"
        if self.cast_before_weight:
            extra += ", cast_before_weight=True"
        return extra


class FusedLayerNorm(_Numerics, torch.nn.LayerNorm):
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
        weight_offset: float = 0.0,
        cast_before_weight: bool = False,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device=device, dtype=dtype)
        self._set_numerics(memory_efficient, weight_offset, cast_before_weight)

    def forward(self, input: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            return F._layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps, self.memory_efficient,
                                 self.weight_offset, self.cast_before_weight)  # fmt: skip
        return F.add_layer_norm(
            input,
            residual,
            self.normalized_shape,
            self.weight,
            self.bias,
            self.eps,
            memory_efficient=self.memory_efficient,
            weight_offset=self.weight_offset,
            cast_before_weight=self.cast_before_weight,
        )


class FusedRMSNorm(_Numerics, torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with fused kernels; ``forward(x, residual)`` as in :class:`FusedLayerNorm`."""

    def __init__(
        self,
        normalized_shape: _ShapeArg,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        memory_efficient: bool = False,
        weight_offset: float = 0.0,
        cast_before_weight: bool = False,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
        self._set_numerics(memory_efficient, weight_offset, cast_before_weight)

    def forward(self, input: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            return F._rms_norm(input, self.normalized_shape, self.weight, self.eps, self.memory_efficient,
                               self.weight_offset, self.cast_before_weight)  # fmt: skip
        return F.add_rms_norm(
            input,
            residual,
            self.normalized_shape,
            self.weight,
            self.eps,
            memory_efficient=self.memory_efficient,
            weight_offset=self.weight_offset,
            cast_before_weight=self.cast_before_weight,
        )


class FusedLayerNorm2d(FusedLayerNorm):
    """timm's ``LayerNorm2d`` (ConvNeXt, SAM): LayerNorm over the channels of (N, C, *spatial) input, with its
    arguments and state_dict (``weight``, ``bias`` of shape (C,)). See :func:`layer_norm_2d` for the layouts."""

    def __init__(self, num_channels: int, eps: float = 1e-6, affine: bool = True, **kwargs: Any) -> None:
        super().__init__(num_channels, eps=eps, elementwise_affine=affine, **kwargs)

    def forward(self, input: Tensor) -> Tensor:  # type: ignore[override]  (no residual)
        return F.layer_norm_2d(input, self.weight, self.bias, self.eps, memory_efficient=self.memory_efficient,
                               weight_offset=self.weight_offset, cast_before_weight=self.cast_before_weight)  # fmt: skip


class FusedRMSNorm2d(FusedRMSNorm):
    """timm's ``RmsNorm2d``: RMSNorm over the channels of (N, C, *spatial) input (``weight`` of shape (C,))."""

    def __init__(self, num_channels: int, eps: float = 1e-6, affine: bool = True, **kwargs: Any) -> None:
        super().__init__(num_channels, eps=eps, elementwise_affine=affine, **kwargs)

    def forward(self, input: Tensor) -> Tensor:  # type: ignore[override]  (no residual)
        return F.rms_norm_2d(input, self.weight, self.eps, memory_efficient=self.memory_efficient,
                             weight_offset=self.weight_offset, cast_before_weight=self.cast_before_weight)  # fmt: skip
