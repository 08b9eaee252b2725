"""DTensor sharding strategies for every op of torch.ops.layernorm_ext (tensor / sequence parallelism).

A norm works row by row, so it runs on each shard's local rows with no communication as long as no normalized
dim is sharded: the output, the residual output and the statistics keep the input's placement, and the weight
and bias stay replicated. In the backward, grad_input keeps that placement and the weight / bias gradients
(sums over rows) come out Partial("sum"), reduced when something needs them whole. These are the strategies
ATen gives its own layer_norm and rms_norm (torch/distributed/tensor/_ops/_math_ops.py), so a DTensor input
is placed, redistributed (an input sharded on a normalized dim: the propagator picks the cheapest of the
placements below, as for ATen) and reduced exactly as with torch.nn.functional.layer_norm / rms_norm.

Importing torch.distributed.tensor costs a third of a second, more than all of this package, so the
strategies are registered when it is first imported (an import hook), or at once if it already was.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
import threading
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

_ops = torch.ops.layernorm_ext
_DTENSOR_MODULE = "torch.distributed.tensor"

# Index of normalized_shape, the first argument after which every non-tensor argument enters DTensor's cache key.
_STATIC_ARGNUM = {
    "layer_norm_fwd": 1, "rms_norm_fwd": 1, "layer_norm_bwd": 4, "rms_norm_bwd": 3,
    "layer_norm": 1, "rms_norm": 1, "add_layer_norm": 2, "add_rms_norm": 2, "layer_norm_quant": 1,
    "rms_norm_quant": 1,
}  # fmt: skip


def _placements(input: Any, normalized_shape: Sequence[int]) -> list[Any]:
    """Where a row-wise op may run without communication: replicated, or sharded on a dim not normalized."""
    from torch.distributed.tensor import Replicate, Shard

    axis = input.ndim - len(normalized_shape)
    return [Replicate()] + [Shard(d) for d in range(max(axis, 0))]


def _given(arg: Any, placement: Any) -> Any:
    """An optional tensor argument's placement: None where the argument is None."""
    return None if arg is None else placement


def _reduced_over_rows(arg: Any, place: Any) -> Any:
    """Placement of a parameter's gradient (a sum over rows): partial where the rows are sharded. Without the
    parameter the op returns an empty placeholder, the same on every rank."""
    from torch.distributed.tensor import Partial, Replicate

    if arg is None or isinstance(place, Replicate):
        return Replicate()
    return Partial("sum")


Strategies = list[tuple[list[Any], list[Any]]]


# Each function below has its op's signature (DTensorSpecs for tensors) and returns, per acceptable placement
# on one mesh dim, (output placements, input placements), None for arguments that are not tensors.
def _layer_norm_fwd(
    input: Any, normalized_shape: Sequence[int], weight: Any, bias: Any, eps: float, residual: Any = None,
    residual_in_fp32: bool = False, memory_efficient: bool = False, weight_offset: float = 0.0,
    cast_before_weight: bool = False,
) -> Strategies:
    from torch.distributed.tensor import Replicate

    return [
        # out, residual_out (an empty placeholder without a residual), mean, rstd
        ([place, place if residual is not None else Replicate(), place, place],
         [place, None, _given(weight, Replicate()), _given(bias, Replicate()), None, _given(residual, place)])
        for place in _placements(input, normalized_shape)
    ]  # fmt: skip


def _rms_norm_fwd(
    input: Any, normalized_shape: Sequence[int], weight: Any, eps: float | None, residual: Any = None,
    residual_in_fp32: bool = False, memory_efficient: bool = False, weight_offset: float = 0.0,
    cast_before_weight: bool = False,
) -> Strategies:
    from torch.distributed.tensor import Replicate

    return [
        # out, residual_out, rstd
        ([place, place if residual is not None else Replicate(), place],
         [place, None, _given(weight, Replicate()), None, _given(residual, place)])
        for place in _placements(input, normalized_shape)
    ]  # fmt: skip


def _layer_norm_bwd(
    grad_out: Any, saved: Any, mean: Any, rstd: Any, normalized_shape: Sequence[int], weight: Any, bias: Any,
    saved_is_output: bool = False, grad_residual_out: Any = None, weight_offset: float = 0.0,
) -> Strategies:
    from torch.distributed.tensor import Replicate

    return [
        # grad_input, grad_weight, grad_bias
        ([place, _reduced_over_rows(weight, place), _reduced_over_rows(bias, place)],
         [place, place, place, place, None, _given(weight, Replicate()), _given(bias, Replicate()), None,
          _given(grad_residual_out, place)])
        for place in _placements(saved, normalized_shape)
    ]  # fmt: skip


def _rms_norm_bwd(
    grad_out: Any, saved: Any, rstd: Any, normalized_shape: Sequence[int], weight: Any,
    saved_is_output: bool = False, grad_residual_out: Any = None, weight_offset: float = 0.0,
) -> Strategies:
    from torch.distributed.tensor import Replicate

    return [
        # grad_input, grad_weight
        ([place, _reduced_over_rows(weight, place)],
         [place, place, place, None, _given(weight, Replicate()), None, _given(grad_residual_out, place)])
        for place in _placements(saved, normalized_shape)
    ]  # fmt: skip


# The functional API's ops (layer_norm, ...: the forward ops less the statistics). With autograd on they
# decompose into the forward ops before DTensor sees them; under inference_mode they reach DTensor whole (a
# torch before 2.8 does not decompose them there), so they get the forward ops' strategies, less the statistics.
def _layer_norm(
    input: Any, normalized_shape: Sequence[int], weight: Any = None, bias: Any = None, eps: float = 1e-5,
    memory_efficient: bool = False, weight_offset: float = 0.0, cast_before_weight: bool = False,
) -> Strategies:
    from torch.distributed.tensor import Replicate

    return [([place], [place, None, _given(weight, Replicate()), _given(bias, Replicate())])
            for place in _placements(input, normalized_shape)]  # fmt: skip


def _rms_norm(
    input: Any, normalized_shape: Sequence[int], weight: Any = None, eps: float | None = None,
    memory_efficient: bool = False, weight_offset: float = 0.0, cast_before_weight: bool = False,
) -> Strategies:
    from torch.distributed.tensor import Replicate

    return [([place], [place, None, _given(weight, Replicate())]) for place in _placements(input, normalized_shape)]


def _add_layer_norm(
    input: Any, residual: Any, normalized_shape: Sequence[int], weight: Any = None, bias: Any = None,
    eps: float = 1e-5, residual_in_fp32: bool = False, memory_efficient: bool = False, weight_offset: float = 0.0,
    cast_before_weight: bool = False,
) -> Strategies:
    from torch.distributed.tensor import Replicate

    return [([place, place], [place, place, None, _given(weight, Replicate()), _given(bias, Replicate())])
            for place in _placements(input, normalized_shape)]  # fmt: skip


def _add_rms_norm(
    input: Any, residual: Any, normalized_shape: Sequence[int], weight: Any = None, eps: float | None = None,
    residual_in_fp32: bool = False, memory_efficient: bool = False, weight_offset: float = 0.0,
    cast_before_weight: bool = False,
) -> Strategies:
    from torch.distributed.tensor import Replicate

    return [([place, place], [place, place, None, _given(weight, Replicate())])
            for place in _placements(input, normalized_shape)]  # fmt: skip


# The quantized-output ops (inference only: no autograd, so they always reach DTensor whole). The codes, the
# dynamic per-row scales (shaped as the rows, with a 1 for each normalized dim) and residual_out keep the rows'
# placement; a static scale and scale_ub stay replicated, and so does a [0] placeholder output.
def _quant_placements(input: Any, normalized_shape: Sequence[int], scales_swizzled: bool) -> list[Any]:
    """The rows' placements; swizzled scales (tiles of 128 rows, shaped [padded rows, padded blocks]) only whole."""
    from torch.distributed.tensor import Replicate

    return [Replicate()] if scales_swizzled else _placements(input, normalized_shape)


def _layer_norm_quant(
    input: Any, normalized_shape: Sequence[int], weight: Any, bias: Any, eps: float, quant_dtype: Any,
    scale: Any = None, scale_ub: Any = None, residual: Any = None, residual_in_fp32: bool = False,
    weight_offset: float = 0.0, cast_before_weight: bool = False, group_size: int = 0,
    scales_column_major: bool = False, scales_dtype: Any = None, scales_swizzled: bool = False,
) -> Strategies:
    from torch.distributed.tensor import Replicate

    return [
        ([place, place if scale is None else Replicate(), place if residual is not None else Replicate()],
         [place, None, _given(weight, Replicate()), _given(bias, Replicate()), None, None, _given(scale, Replicate()),
          _given(scale_ub, Replicate()), _given(residual, place)])
        for place in _quant_placements(input, normalized_shape, scales_swizzled)
    ]  # fmt: skip


def _rms_norm_quant(
    input: Any, normalized_shape: Sequence[int], weight: Any, eps: float | None, quant_dtype: Any,
    scale: Any = None, scale_ub: Any = None, residual: Any = None, residual_in_fp32: bool = False,
    weight_offset: float = 0.0, cast_before_weight: bool = False, group_size: int = 0,
    scales_column_major: bool = False, scales_dtype: Any = None, scales_swizzled: bool = False,
) -> Strategies:
    from torch.distributed.tensor import Replicate

    return [
        ([place, place if scale is None else Replicate(), place if residual is not None else Replicate()],
         [place, None, _given(weight, Replicate()), None, None, _given(scale, Replicate()),
          _given(scale_ub, Replicate()), _given(residual, place)])
        for place in _quant_placements(input, normalized_shape, scales_swizzled)
    ]  # fmt: skip


def register() -> None:
    """Register the strategies of every op with DTensor (torch.distributed.tensor must be importable)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor.experimental import register_sharding

    strategy_fns = {
        "layer_norm_fwd": _layer_norm_fwd,
        "rms_norm_fwd": _rms_norm_fwd,
        "layer_norm_bwd": _layer_norm_bwd,
        "rms_norm_bwd": _rms_norm_bwd,
        "layer_norm": _layer_norm,
        "rms_norm": _rms_norm,
        "add_layer_norm": _add_layer_norm,
        "add_rms_norm": _add_rms_norm,
        "layer_norm_quant": _layer_norm_quant,
        "rms_norm_quant": _rms_norm_quant,
    }
    # DTensor caches the chosen strategy per input specs and the arguments from static_argnum on: these must
    # include normalized_shape (SymInt[]), which decides the dims that may stay sharded. register_sharding
    # derives static_argnum from int arguments only (there are none), unless it takes schema_info (newer torch).
    takes_schema_info = "schema_info" in inspect.signature(register_sharding).parameters
    propagator = DTensor._op_dispatcher.sharding_propagator
    for name, fn in strategy_fns.items():
        overload = getattr(_ops, name).default
        schema_info = RuntimeSchemaInfo(_STATIC_ARGNUM[name], needs_pytree=True)
        if takes_schema_info:
            register_sharding(overload, schema_info=schema_info)(fn)
        else:
            register_sharding(overload)(fn)
            propagator.register_op_strategy(overload, propagator.op_strategy_funcs[overload], schema_info)


_EVERY_INPUT_STYLE = "SequenceParallelEveryInput"


@functools.cache
def _every_input_style() -> type:
    """SequenceParallelEveryInput, made once, on first use: its base class lives in
    torch.distributed.tensor.parallel, which this module must not import before it is needed. It is a module
    attribute all the same (this module's __getattr__), so that pickle finds the class by name, as it finds
    torch's SequenceParallel."""
    from torch.distributed.tensor.parallel import SequenceParallel

    class SequenceParallelEveryInput(SequenceParallel):
        """SequenceParallel for every tensor argument and each output of a tuple (sequence_parallel())."""

        __qualname__ = _EVERY_INPUT_STYLE  # a module attribute, not a local of this function

        @staticmethod
        def _prepare_input_fn(sequence_sharding: Any, mod: Any, inputs: Any, device_mesh: Any) -> Any:
            return tuple(
                SequenceParallel._prepare_input_fn(sequence_sharding, mod, (t,), device_mesh)
                if isinstance(t, torch.Tensor) else t
                for t in inputs
            )  # fmt: skip

        @staticmethod
        def _prepare_output_fn(use_local_output: bool, mod: Any, outputs: Any, device_mesh: Any) -> Any:
            each = SequenceParallel._prepare_output_fn
            if isinstance(outputs, tuple):
                return tuple(each(use_local_output, mod, o, device_mesh) for o in outputs)
            return each(use_local_output, mod, outputs, device_mesh)

    return SequenceParallelEveryInput


def __getattr__(name: str) -> Any:
    if name == _EVERY_INPUT_STYLE:
        return _every_input_style()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def sequence_parallel(sequence_dim: int = 1, use_local_output: bool = False) -> Any:
    """A ``torch.distributed.tensor.parallel.SequenceParallel`` plan entry for our modules, which also take a
    residual: every tensor argument is sharded on ``sequence_dim`` (torch's style passes on only the first, so
    ``norm(x, residual)`` would silently lose its residual), and a tuple output ``(out, residual_out)`` is
    returned whole (local tensors with ``use_local_output``). For one-argument calls it is torch's style. Its
    class is one (SequenceParallelEveryInput), and its instances pickle as torch's do.
    """
    return _every_input_style()(sequence_dim=sequence_dim, use_local_output=use_local_output)


def _register_or_warn() -> None:
    """register(), but a failure (an older torch's DTensor internals, say) only warns: it must never break the
    import of torch.distributed.tensor, on which FSDP2 and tensor parallelism rest."""
    try:
        register()
    except Exception as err:  # noqa: BLE001  (any failure of private DTensor APIs)
        message = (f"layernorm_ext: could not register DTensor sharding strategies ({type(err).__name__}: {err}); "
                   "layernorm_ext ops will not accept DTensor inputs")
        try:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        except Exception:  # noqa: BLE001  (warnings made errors, -W error: the import still must not fail)
            sys.stderr.write(f"RuntimeWarning: {message}\n")


class _RegisteringLoader:
    """The loader of torch.distributed.tensor's spec while the hook is armed: the module's own loader in every
    respect (is_package, get_code, get_resource_reader, ... pass through to it), but exec_module also registers
    the strategies once the module has run."""

    def __init__(self, loader: Any, hook: _RegisterAfterImport) -> None:
        self._loader = loader
        self._hook = hook

    def __getattr__(self, name: str) -> Any:
        if name in ("_loader", "_hook"):  # not yet set (copy, pickle): no endless look-up through self._loader
            raise AttributeError(name)
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module keeps its own loader; this one only runs register() once the module has loaded.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        with contextlib.suppress(ValueError):  # fire once
            sys.meta_path.remove(self._hook)
        _register_or_warn()


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds torch.distributed.tensor as the other finders do, with a loader that registers the strategies once
    the module is loaded.

    It leaves sys.meta_path when the module has been executed, not when it is looked up, so a look-up alone
    (importlib.util.find_spec) does not disarm it."""

    def __init__(self) -> None:
        # Set while this thread asks the other finders (which may ask sys.meta_path again): this finder must not
        # answer itself then; other threads' look-ups are answered as usual.
        self._searching = threading.local()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DTENSOR_MODULE or getattr(self._searching, "active", False):
            return None
        self._searching.active = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is not self and hasattr(finder, "find_spec"):
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        break
        finally:
            self._searching.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RegisteringLoader(spec.loader, self)
        return spec


def register_when_imported() -> None:
    """Register now if torch.distributed.tensor is loaded, else as soon as something imports it."""
    if not torch.distributed.is_available():
        return
    if _DTENSOR_MODULE in sys.modules:
        _register_or_warn()
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
