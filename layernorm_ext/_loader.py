"""Load the native library once: the prebuilt ``layernorm_ext._C``, or a JIT build of the same sources."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

import torch

_REBUILD_HINT = (
    "Rebuild it against the running torch with `pip install --no-build-isolation --force-reinstall --no-deps .` "
    "in the layernorm_ext source tree, or set LAYERNORM_EXT_JIT=1 to build it just in time."
)

# How the native library got here: "prebuilt" or "jit".
load_method: str = ""


def _release(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0' (the part a built library depends on)."""
    return version.split("+")[0]


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

    return jit.load()


def load() -> ModuleType:
    global load_method
    if os.environ.get("LAYERNORM_EXT_JIT", "0") == "1":
        load_method = "jit"
        return _load_jit()
    module = _load_prebuilt()
    if module is not None:
        load_method = "prebuilt"
        return module
    print(
        "layernorm_ext: no prebuilt library in this install; building it just in time (once, cached)...",
        file=sys.stderr,
    )
    load_method = "jit"
    return _load_jit()


native: ModuleType = load()
