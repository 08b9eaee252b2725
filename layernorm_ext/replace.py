"""replace_norms: swap every norm of a model for ours, in place, keeping the very Parameter objects.

What is replaced:
- ``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm`` (the classes themselves; a subclass may have changed
  ``forward``, so it goes through the check below like any other module);
- other norm modules recognised by duck typing, with no dependency on any model library: a ``weight``
  Parameter and an ``eps`` or ``variance_epsilon`` attribute (Hugging Face's LlamaRMSNorm, MistralRMSNorm,
  T5LayerNorm, GemmaRMSNorm, Apex's FusedRMSNorm / FusedLayerNorm, ...), with a ``bias`` Parameter for
  LayerNorm; a class named ``*Norm2d`` (timm's LayerNorm2d / RmsNorm2d, ConvNeXt's, SAM's) is taken to
  normalize over dim 1 of (N, C, *spatial) input, candidates FusedLayerNorm2d / FusedRMSNorm2d, probed on such
  input. Their forward is unknown, so candidates with each numerics option are checked: the module and
  each candidate run on the same probe rows (in the module's own dtype and device, without grad); the candidate
  closest to the module's output is taken if it agrees in dtype, shape and values (ATen's order, Llama's cast
  before the weight multiply, Gemma's ``1 + weight``: ``weight_offset``, ``cast_before_weight``); otherwise the
  module is left alone and reported.

What is kept: the module's Parameter objects (an optimizer built before still updates them, state_dict keys
and values are unchanged), its training flag; a module tied under several names is replaced by one module.
Modules with hooks, whose forward takes more than the input, or already ours, are left alone. One difference
that remains: for float16 / bfloat16 input with float32 weights ours return the input's dtype (as
torch.nn.RMSNorm), where Hugging Face's LlamaRMSNorm returns float32.
"""

from __future__ import annotations

import copy
import math
import fnmatch
import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from .modules import FusedLayerNorm, FusedLayerNorm2d, FusedRMSNorm, FusedRMSNorm2d

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


# The numerics a duck-typed module is probed with, (weight_offset, cast_before_weight), in order of preference.
_NUMERICS = ((0.0, False), (0.0, True), (1.0, False), (1.0, True))


def _candidate(module: nn.Module, numerics: tuple[float, bool] = (0.0, False)) -> tuple[nn.Module | None, str]:
    """Our module reproducing ``module`` (sharing its parameters) with ``numerics`` (weight_offset,
    cast_before_weight: only for duck-typed modules), or None and why not."""
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
    offset, cast = numerics
    if _channels_first(module):
        if weight.dim() != 1:
            return None, f"a channels-first norm with a weight of shape {tuple(weight.shape)}"
        options = {"device": "meta", "weight_offset": offset, "cast_before_weight": cast}
        if bias is None:
            return _adopt(FusedRMSNorm2d(weight.shape[0], eps, **options), module), ""
        return _adopt(FusedLayerNorm2d(weight.shape[0], 1e-6 if eps is None else eps, **options), module), ""
    if bias is None:
        new = FusedRMSNorm(tuple(weight.shape), eps, device="meta", weight_offset=offset, cast_before_weight=cast)
    else:
        new = FusedLayerNorm(tuple(weight.shape), 1e-5 if eps is None else eps, bias=True, device="meta",
                             weight_offset=offset, cast_before_weight=cast)  # fmt: skip
    return _adopt(new, module), ""


def _channels_first(module: nn.Module) -> bool:
    """A norm over dim 1 of (N, C, *spatial) input, by its class's name (timm's LayerNorm2d, RmsNorm2d)."""
    return type(module).__name__.lower().endswith("norm2d")


def _adopt(new: nn.Module, old: nn.Module) -> nn.Module:
    """``new`` (built on the meta device) holding ``old``'s very Parameter objects."""
    for name in ("weight", "bias"):
        if name in new._parameters:
            new._parameters[name] = getattr(old, name, None)
    new.train(old.training)
    return new


def _probe_copies(old: nn.Module, numerics: tuple[float, bool]) -> tuple[nn.Module, nn.Module]:
    """A copy of ``old`` with fresh, well-conditioned parameters (weight in [0.5, 1.5], bias in [-0.2, 0.2]),
    and our candidate with ``numerics`` sharing them: trained values could hide a different formula (Gemma's
    1 + w is close to w for w of 8 or more), and the probe must not touch the model's own module."""
    old_copy = copy.deepcopy(old)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, low, width in (("weight", 0.5, 1.0), ("bias", -0.2, 0.4)):
            p = getattr(old_copy, name, None)
            if isinstance(p, torch.Tensor):
                p.copy_((torch.rand(p.shape, generator=gen) * width + low).to(p.dtype))
    candidate, _ = _candidate(old_copy, numerics)
    assert candidate is not None
    return old_copy, candidate


def _probe(old: nn.Module, numerics: tuple[float, bool]) -> tuple[float, str]:
    """How far our candidate with ``numerics`` is from ``old`` on probe rows in the weight's dtype: (the number
    of differing elements, "") when within rounding, else (inf, why not). (Half rows with a float32 weight are
    not probed: there ours return the input's dtype, as torch.nn.RMSNorm does, where Hugging Face's
    LlamaRMSNorm promotes to float32.)"""
    weight = old.weight
    old, new = _probe_copies(old, numerics)
    gen = torch.Generator().manual_seed(0)
    dtype = weight.dtype
    shape = (_PROBE_ROWS, weight.shape[0], 2, 3) if _channels_first(old) else (_PROBE_ROWS, *weight.shape)
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(weight.device, dtype)
    try:
        with torch.no_grad():
            want, got = old(x), new(x)
    except Exception as err:  # noqa: BLE001  (whatever a foreign forward raises)
        return math.inf, f"its forward failed on {dtype} probe rows ({type(err).__name__}: {err})"
    if not isinstance(want, torch.Tensor):
        return math.inf, f"its forward returns {type(want).__name__}, not a tensor"
    if want.dtype != got.dtype or want.shape != got.shape:
        return math.inf, (f"for {dtype} input its output is {want.dtype} {tuple(want.shape)}, ours would be "
                          f"{got.dtype} {tuple(got.shape)}")  # fmt: skip
    # Another order of rounding stays within a few ulps of the output dtype, element by element; another formula
    # (1 + weight, no centering) is off by tens of percent.
    tol = 8 * torch.finfo(want.dtype).eps if want.dtype != torch.float64 else 1e-9
    got64, want64 = got.double(), want.double()
    row_scale = want64.abs().amax(dim=-1, keepdim=True).clamp(min=1)
    if not bool(((got64 - want64).abs() <= tol * (want64.abs() + row_scale * 0.1)).all()):
        diff = (got64 - want64).abs().max().item()
        return math.inf, f"computes something else (max difference {diff:.3g} on {dtype} probe rows)"
    return float((got != want).sum().item()), ""


def _closest_numerics(old: nn.Module) -> tuple[tuple[float, bool] | None, str]:
    """The numerics whose candidate reproduces ``old`` best (fewest differing elements, the earlier of
    _NUMERICS on a tie), or None and why none does."""
    if old.weight.is_meta:
        return None, "its parameters are on the meta device, so its forward cannot be checked"
    best: tuple[float, bool] | None = None
    best_count, first_why = math.inf, ""
    for numerics in _NUMERICS:
        count, why = _probe(old, numerics)
        if count < best_count:
            best, best_count = numerics, count
        first_why = first_why or why
        if count == 0:
            break
    return (best, "") if best is not None else (None, first_why)


# Hooks a replacement would silently drop.
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")  # fmt: skip


def _has_hooks(module: nn.Module) -> bool:
    return any(getattr(module, name, None) for name in _HOOK_DICTS)


def _extra_forward_parameters(module: nn.Module) -> list[str]:
    """Parameters of forward beyond the input (a norm taking a residual or flags of its own, whose calls
    ours would not understand the same way)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return []
    return [p.name for p in params[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _as_selectors(selectors: Iterable[Selector] | Selector | None) -> list[Selector] | None:
    if selectors is None:
        return None
    if isinstance(selectors, (str, type)):
        return [selectors]  # one pattern or class, not a sequence of characters
    return list(selectors)


def replace_norms(
    model: nn.Module,
    *,
    include: Iterable[Selector] | Selector | None = None,
    exclude: Iterable[Selector] | Selector | None = None,
) -> ReplaceReport:
    """Replace, in place, every norm module of ``model`` that ours reproduce (see the module docstring).

    ``include``: only modules matching one of these (fnmatch patterns on qualified names, or classes; one
    pattern or class alone is fine too); ``exclude``: never these. A module reached under several names (tied)
    is replaced by one module everywhere. Returns a ReplaceReport; its ``model`` is ``model`` itself, or the
    replacement when ``model`` itself is a norm.
    """
    include_list = _as_selectors(include)
    exclude_list = _as_selectors(exclude) or []
    report = ReplaceReport(model)
    decided: dict[int, nn.Module | None] = {}  # id(module) -> its replacement (None: left alone)
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if id(module) in decided:  # a tied module met again: the same decision in this slot
            new = decided[id(module)]
        else:
            new = _decide(name, module, include_list, exclude_list, report)
            decided[id(module)] = new
        if new is None:
            continue
        if name:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, new)
        else:
            report.model = new
    return report


def _describe(new: nn.Module) -> str:
    """The replacement's class, with its numerics options when they are not ATen's."""
    options = [f"weight_offset={new.weight_offset:g}"] if getattr(new, "weight_offset", 0.0) else []
    options += ["cast_before_weight=True"] if getattr(new, "cast_before_weight", False) else []
    return type(new).__name__ + (f"({', '.join(options)})" if options else "")


def _decide(name: str, module: nn.Module, include: list[Selector] | None, exclude: list[Selector],
            report: ReplaceReport) -> nn.Module | None:  # fmt: skip
    """The replacement of one module (recorded in the report), or None."""
    if include is not None and not _selected(name, module, include):
        return None
    if _selected(name, module, exclude):
        return None
    new, why = _candidate(module)
    if new is None:
        if not why.startswith("not a norm"):
            report.skipped.append((name, type(module).__name__, why))
        return None
    if _has_hooks(module):
        report.skipped.append((name, type(module).__name__, "it has hooks, which a new module would lose"))
        return None
    if type(module) not in (nn.LayerNorm, nn.RMSNorm):
        extra = _extra_forward_parameters(module)
        if extra:
            report.skipped.append((name, type(module).__name__, f"its forward takes more than the input "
                                                                f"({', '.join(extra)})"))  # fmt: skip
            return None
        numerics, why = _closest_numerics(module)
        if numerics is None:
            report.skipped.append((name, type(module).__name__, why))
            return None
        new, _ = _candidate(module, numerics)
        assert new is not None
    report.replaced.append((name, type(module).__name__, _describe(new)))
    return new
