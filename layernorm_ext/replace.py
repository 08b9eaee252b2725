"""replace_norms: swap every norm of a model for ours, in place, keeping the very Parameter objects.

What is replaced:
- ``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm`` (the classes themselves; a subclass may have changed
  ``forward``, so it goes through the check below like any other module);
- other norm modules recognised by duck typing, with no dependency on any model library: a ``weight``
  Parameter and an ``eps`` or ``variance_epsilon`` attribute (Hugging Face's LlamaRMSNorm, MistralRMSNorm,
  T5LayerNorm, Apex's FusedRMSNorm / FusedLayerNorm, ...), with a ``bias`` Parameter for LayerNorm. Their
  forward is unknown, so the candidate is checked: the module and its replacement run on the same probe rows
  (in the module's own dtype and device, without grad) and must agree in dtype, shape and values; otherwise the
  module is left alone and reported (Gemma's RMSNorm, which multiplies by ``1 + weight``, is one such).

What is kept: the module's Parameter objects (an optimizer built before still updates them, state_dict keys
and values are unchanged), its training flag. Modules with hooks, or already ours, are left alone.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from .modules import FusedLayerNorm, FusedRMSNorm

# A pattern (fnmatch, on the module's qualified name, e.g. "layers.*.input_layernorm") or a module class.
Selector = str | type[nn.Module]

_PROBE_ROWS = 4
# torch's norms over other dims than the trailing ones: never candidates, never reported.
_OTHER_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LocalResponseNorm)


@dataclass
class ReplaceReport:
    """What replace_norms did: (qualified name, original class name, replacement class name) per replaced
    module, (qualified name, class name, reason) per norm-like module left alone."""

    model: nn.Module
    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} norm module(s), left {len(self.skipped)} alone"]
        lines += [f"  {name or '<root>'}: {old} -> {new}" for name, old, new in self.replaced]
        lines += [f"  {name or '<root>'}: {cls} left alone: {why}" for name, cls, why in self.skipped]
        return "\n".join(lines)


def _selected(name: str, module: nn.Module, selectors: Iterable[Selector]) -> bool:
    for s in selectors:
        if isinstance(s, str) and fnmatch.fnmatchcase(name, s):
            return True
        if isinstance(s, type) and isinstance(module, s):
            return True
    return False


def _eps(module: nn.Module) -> tuple[bool, float | None]:
    """(found, value) of the module's epsilon attribute."""
    for attr in ("eps", "variance_epsilon"):
        if hasattr(module, attr):
            value = getattr(module, attr)
            if value is None or isinstance(value, (int, float)):
                return True, None if value is None else float(value)
    return False, None


def _candidate(module: nn.Module) -> tuple[nn.Module | None, str]:
    """Our module reproducing ``module`` (sharing its parameters), or None and why not."""
    if isinstance(module, (FusedLayerNorm, FusedRMSNorm)):
        return None, "already a layernorm_ext module"
    if isinstance(module, _OTHER_NORMS):
        return None, "not a norm (one over other dims: batch, group, instance, local response)"
    if type(module) is nn.LayerNorm:
        new: nn.Module = FusedLayerNorm(module.normalized_shape, module.eps, module.elementwise_affine,
                                        bias=module.bias is not None, device="meta")  # fmt: skip
        return _adopt(new, module), ""
    if type(module) is nn.RMSNorm:
        new = FusedRMSNorm(module.normalized_shape, module.eps, module.elementwise_affine, device="meta")
        return _adopt(new, module), ""
    weight = getattr(module, "weight", None)
    has_eps, eps = _eps(module)
    if not isinstance(weight, nn.Parameter) or not has_eps:
        return None, "not a norm (no weight Parameter with an eps or variance_epsilon)"
    bias = getattr(module, "bias", None)
    if bias is not None and not isinstance(bias, nn.Parameter):
        return None, "its bias is not a Parameter"
    if bias is not None and bias.shape != weight.shape:
        return None, f"bias of shape {tuple(bias.shape)} with a weight of shape {tuple(weight.shape)}"
    if len(list(module.parameters(recurse=True))) != (1 if bias is None else 2) or len(list(module.buffers())):
        return None, "it holds parameters or buffers besides weight and bias"
    if bias is None:
        new = FusedRMSNorm(tuple(weight.shape), eps, device="meta")
    else:
        new = FusedLayerNorm(tuple(weight.shape), 1e-5 if eps is None else eps, bias=True, device="meta")
    return _adopt(new, module), ""


def _adopt(new: nn.Module, old: nn.Module) -> nn.Module:
    """``new`` (built on the meta device) holding ``old``'s very Parameter objects."""
    for name in ("weight", "bias"):
        if name in new._parameters:
            new._parameters[name] = getattr(old, name, None)
    new.train(old.training)
    return new


def _agrees(old: nn.Module, new: nn.Module) -> str:
    """Why the two differ on probe rows ("" if they agree): dtype, shape or values beyond rounding."""
    weight = old.weight
    shape = (_PROBE_ROWS, *weight.shape)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen, dtype=torch.float32) * 2 + 0.5).to(weight.device, weight.dtype)
    try:
        with torch.no_grad():
            want, got = old(x), new(x)
    except Exception as err:  # noqa: BLE001  (whatever a foreign forward raises)
        return f"its forward failed on probe rows ({type(err).__name__}: {err})"
    if not isinstance(want, torch.Tensor):
        return f"its forward returns {type(want).__name__}, not a tensor"
    if want.dtype != got.dtype or want.shape != got.shape:
        return f"its output is {want.dtype} {tuple(want.shape)}, ours would be {got.dtype} {tuple(got.shape)}"
    # Different orders of rounding (e.g. Llama's cast before the weight multiply) stay within a few ulps of the
    # output's dtype; a different formula (Gemma's 1 + weight, no centering) is off by O(1).
    tol = 8 * torch.finfo(want.dtype).eps if want.dtype != torch.float64 else 1e-9
    scale = want.abs().max().clamp(min=1).item()
    if not torch.allclose(got.double(), want.double(), rtol=tol, atol=tol * scale):
        diff = (got.double() - want.double()).abs().max().item()
        return f"computes something else (max difference {diff:.3g} on probe rows)"
    return ""


def replace_norms(
    model: nn.Module, *, include: Iterable[Selector] | None = None, exclude: Iterable[Selector] | None = None
) -> ReplaceReport:
    """Replace, in place, every norm module of ``model`` that ours reproduce (see the module docstring).

    ``include``: only modules matching one of these (fnmatch patterns on qualified names, or classes);
    ``exclude``: never these. Returns a ReplaceReport; its ``model`` is ``model`` itself, or the replacement
    when ``model`` itself is a norm.
    """
    include = list(include) if include is not None else None
    exclude = list(exclude or ())
    report = ReplaceReport(model)
    for name, module in list(model.named_modules()):
        if include is not None and not _selected(name, module, include):
            continue
        if _selected(name, module, exclude):
            continue
        new, why = _candidate(module)
        if new is None:
            if why.startswith("not a norm"):
                continue
            report.skipped.append((name, type(module).__name__, why))
            continue
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
            report.skipped.append((name, type(module).__name__, "it has hooks, which a new module would lose"))
            continue
        if type(module) not in (nn.LayerNorm, nn.RMSNorm):
            why = _agrees(module, new)
            if why:
                report.skipped.append((name, type(module).__name__, why))
                continue
        if name:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, new)
        else:
            report.model = new
        report.replaced.append((name, type(module).__name__, type(new).__name__))
    return report
