"""layernorm_ext: fused LayerNorm and RMSNorm for PyTorch (C++/CUDA kernels behind torch.ops.layernorm_ext)."""

from __future__ import annotations

__version__ = "0.1.0"

from ._loader import load_method, native
from . import ops
from .functional import (
    add_layer_norm, add_layer_norm_, add_rms_norm, add_rms_norm_, layer_norm, layer_norm_2d, rms_norm, rms_norm_2d,
)
from .modules import FusedLayerNorm, FusedLayerNorm2d, FusedRMSNorm, FusedRMSNorm2d
from .quantized import add_layer_norm_quant, add_rms_norm_quant, layer_norm_quant, rms_norm_quant
from .replace import ReplaceReport, replace_norms


def build_info() -> dict[str, object]:
    """How the native library was built and loaded (torch version, CUDA, CPU instruction set, load method)."""
    info = dict(native.build_info())
    info["load_method"] = load_method
    return info


__all__ = [
    "FusedLayerNorm",
    "FusedLayerNorm2d",
    "FusedRMSNorm",
    "FusedRMSNorm2d",
    "ReplaceReport",
    "add_layer_norm",
    "add_layer_norm_",
    "add_layer_norm_quant",
    "add_rms_norm",
    "add_rms_norm_",
    "add_rms_norm_quant",
    "build_info",
    "layer_norm",
    "layer_norm_2d",
    "layer_norm_quant",
    "ops",
    "replace_norms",
    "rms_norm",
    "rms_norm_2d",
    "rms_norm_quant",
]
