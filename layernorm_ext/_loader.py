"""Load the native library once: the prebuilt ``layernorm_ext._C``, or a JIT build of the same sources."""

from __future__ import annotations

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


def _load_prebuilt() -> ModuleType | None:
    """The library setup.py built, or None when the package was installed without one."""
    try:
        from . import _build_info
    except ImportError:
        return None
    if _build_info.TORCH_VERSION != torch.__version__:
        raise ImportError(
            f"layernorm_ext was built against torch {_build_info.TORCH_VERSION}, but torch {torch.__version__} "
            f"is running. {_REBUILD_HINT}"
        )
    try:
        from . import _C
    except ImportError as err:
        raise ImportError(f"layernorm_ext: loading the prebuilt library failed ({err}). {_REBUILD_HINT}") from err
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
