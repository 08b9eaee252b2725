"""Load the native library once: the prebuilt ``layernorm_ext._C``, or a JIT build of the same sources.

Only one copy of the library can live in a process: each registers ``torch.ops.layernorm_ext``. So the import
refuses (ImportError) when something else registered that namespace first, e.g. a user's own
``torch.utils.cpp_extension.load`` of these sources, and ``layernorm_ext.jit.load()`` hands back the library
already loaded or refuses (RuntimeError) instead of loading a second one. (A second copy loaded behind our back
fails its own import with an ImportError: csrc/bindings.cpp registers the schemas from its module init.)
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import warnings
from types import ModuleType

import torch

_REBUILD_HINT = (
    "Rebuild it against the running torch with `pip install --no-build-isolation --force-reinstall --no-deps .` "
    "in the layernorm_ext source tree, or set LAYERNORM_EXT_JIT=1 to build it just in time."
)

# How the native library got here: "prebuilt" or "jit".
load_method: str = ""

# The namespace the library registers, and one of its ops (whose presence means it is registered).
NAMESPACE = "layernorm_ext"
_PROBE_OP = "layer_norm_fwd"


def namespace_registered() -> bool:
    """Whether some library in this process already registered torch.ops.layernorm_ext's schemas."""
    return hasattr(getattr(torch.ops, NAMESPACE), _PROBE_OP)


def _refuse_if_registered() -> None:
    """Before loading a library: refuse if another one (not loaded by this package) owns the namespace."""
    if namespace_registered():
        raise ImportError(
            f"layernorm_ext: torch.ops.{NAMESPACE} is already registered in this process by a library this package "
            "did not load (e.g. a torch.utils.cpp_extension.load of layernorm_ext's sources); a second copy cannot "
            "register it again. Import layernorm_ext before anything else loads its sources, and set "
            "LAYERNORM_EXT_JIT=1 before that import for a JIT build."
        )


def _release(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0' (the part a built library depends on)."""
    return version.split("+")[0]


def _warn_if_older_than_supported(version: str) -> None:
    """A torch older than the oldest release the suite passes on still loads, with a warning saying why."""
    from ._sources import OLDEST_TORCH

    running = tuple(int(part) for part in re.findall(r"\d+", _release(version))[:2])
    oldest = tuple(int(part) for part in OLDEST_TORCH.split("."))
    if running < oldest:
        warnings.warn(
            f"layernorm_ext supports torch {OLDEST_TORCH} and newer; torch {version} is running, on which the "
            "library may not build (2.7 lacks float4_e2m1fn_x2) and whose own F.rms_norm may differ (2.6 and "
            "before: eps=None is the input dtype's eps, a wider weight promotes the result).",
            stacklevel=3,
        )


def _load_prebuilt() -> ModuleType | None:
    """The library setup.py built, or None when the package was installed without one."""
    name = f"{__package__}._C"
    if importlib.util.find_spec(name) is None:
        return None
    try:
        _C = importlib.import_module(name)
    except ImportError as err:  # typically an undefined symbol: built against another torch
        raise ImportError(f"layernorm_ext: loading the prebuilt library failed ({err}). {_REBUILD_HINT}") from err
    built_for = _C.build_info()["torch_version"]
    if _release(built_for) != _release(torch.__version__):
        raise ImportError(
            f"layernorm_ext was built against torch {built_for}, but torch {torch.__version__} is running. "
            f"{_REBUILD_HINT}"
        )
    return _C


def _load_jit() -> ModuleType:
    from . import jit

    return jit.build_and_load()


def load() -> ModuleType:
    global load_method
    _warn_if_older_than_supported(torch.__version__)
    _refuse_if_registered()
    if os.environ.get("LAYERNORM_EXT_JIT", "0") == "1":
        module, load_method = _load_jit(), "jit"
        return module
    module = _load_prebuilt()
    if module is not None:
        load_method = "prebuilt"
        return module
    print(
        "layernorm_ext: no prebuilt library in this install; building it just in time (once, cached)...",
        file=sys.stderr,
    )
    module, load_method = _load_jit(), "jit"
    return module


native: ModuleType = load()
