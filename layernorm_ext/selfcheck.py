"""The accuracy rule and a quick self-check of every op against ATen (used by ``python -m layernorm_ext``
and by the test suite).

Rule: our max abs error against an fp64 reference must not exceed ATen's own max abs error (same inputs,
same dtypes) by more than one ulp of the result dtype at the reference's largest magnitude. For float64
results the reference is no more precise than the results themselves (ATen's error against it is often 0),
so the atol there is a few (8) ulps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import functional as ours


@dataclass
class Comparison:
    what: str
    err_ours: float
    err_aten: float
    atol: float

    @property
    def ok(self) -> bool:
        return self.err_ours == self.err_ours and self.err_ours <= self.err_aten + self.atol


FP64_ULPS = 8


def ulp_atol(dtype: torch.dtype, reference: Tensor) -> float:
    """One ulp of ``dtype`` (FP64_ULPS for float64) at the reference's largest magnitude (at least at 1.0)."""
    scale = max(1.0, float(reference.abs().max())) if reference.numel() else 1.0
    ulps = FP64_ULPS if dtype == torch.float64 else 1
    return ulps * torch.finfo(dtype).eps * scale


def compare(ours: Tensor, aten: Tensor, reference: Tensor, what: str = "", slack: float = 1.0) -> Comparison:
    if ours.numel() == 0:
        return Comparison(what, 0.0, 0.0, 0.0)
    ref = reference.detach().double().cpu()
    err_ours = float((ours.detach().double().cpu() - ref).abs().max())
    err_aten = float((aten.detach().double().cpu() - ref).abs().max())
    return Comparison(what, err_ours, err_aten, slack * ulp_atol(ours.dtype, ref))


# ---- self-check -------------------------------------------------------------------------------------------

Impl = Callable[[Tensor, Tensor | None, Tensor | None, Tensor | None], tuple[Tensor, ...]]


def _variants() -> dict[str, tuple[Impl, Impl]]:
    """name -> (ours, ATen reference); each maps (x, residual, weight, bias) to the outputs."""
    return {
        "layer_norm": (
            lambda x, r, w, b: (ours.layer_norm(x, x.shape[-1:], w, b),),
            lambda x, r, w, b: (F.layer_norm(x, x.shape[-1:], w, b),),
        ),
        "rms_norm": (
            lambda x, r, w, b: (ours.rms_norm(x, x.shape[-1:], w),),
            lambda x, r, w, b: (F.rms_norm(x, x.shape[-1:], w),),
        ),
        "add_layer_norm": (
            lambda x, r, w, b: ours.add_layer_norm(x, r, x.shape[-1:], w, b),
            lambda x, r, w, b: (F.layer_norm(x + r, x.shape[-1:], w, b), x + r),
        ),
        "add_rms_norm": (
            lambda x, r, w, b: ours.add_rms_norm(x, r, x.shape[-1:], w),
            lambda x, r, w, b: (F.rms_norm(x + r, x.shape[-1:], w), x + r),
        ),
    }


def _run(impl: Impl, inputs: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    x, r, w, b = leaves
    outs = impl(x, r, w, b)
    loss = sum((o.double() * g.double()).sum() for o, g in zip(outs, grads))
    used = [t for t in leaves]
    grad_list = torch.autograd.grad(loss, used, allow_unused=True)
    return [o.detach() for o in outs] + [g if g is not None else torch.zeros_like(t) for g, t in zip(grad_list, used)]


def check_all(device: str = "cpu", rows: int = 64, cols: int = 769) -> list[Comparison]:
    """Forward and every gradient of every op, in every dtype, against ATen under the accuracy rule."""
    results: list[Comparison] = []
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        base = [
            torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 3 + 1,
            torch.randn(rows, cols, generator=gen, dtype=torch.float64),
            torch.randn(cols, generator=gen, dtype=torch.float64),
            torch.randn(cols, generator=gen, dtype=torch.float64),
        ]
        inputs = [t.to(device=device, dtype=dtype) for t in base]
        out_grads = [torch.randn(rows, cols, generator=gen, dtype=torch.float64).to(device) for _ in range(2)]
        for name, (impl_ours, impl_aten) in _variants().items():
            got = _run(impl_ours, inputs, out_grads)
            want = _run(impl_aten, inputs, out_grads)
            ref = _run(impl_aten, [t.double() for t in inputs], out_grads)
            labels = ["out", "residual_out"][: len(got) - 4] + ["grad_input", "grad_residual", "grad_weight", "grad_bias"]
            for label, g, a, rf in zip(labels, got, want, ref):
                results.append(compare(g, a.to(g.dtype), rf, f"{name} {str(dtype)[6:]} {device} {label}"))
    return results
