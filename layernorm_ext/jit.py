"""Build the native library just in time with torch.utils.cpp_extension.load, from the same sources as setup.py.

Used when ``LAYERNORM_EXT_JIT=1`` is set at import, or automatically when the package was installed without
a prebuilt library (``LAYERNORM_EXT_BUILD=0 pip install .``). Only one native library may be loaded per
process (both register ``torch.ops.layernorm_ext``), so call :func:`load` before importing the package, or
let the import do it.
"""

from __future__ import annotations

import os
from types import ModuleType

from ._sources import CXX_FLAGS, source_paths

JIT_MODULE_NAME = "layernorm_ext_jit"


def load(verbose: bool | None = None) -> ModuleType:
    """Compile (or reuse the cached build of) the native library and load it into this process.

    The build lands in torch's extension cache (``TORCH_EXTENSIONS_DIR`` to move it). ``verbose`` defaults to
    ``LAYERNORM_EXT_VERBOSE=1``.
    """
    from torch.utils.cpp_extension import load as cpp_load

    if verbose is None:
        verbose = os.environ.get("LAYERNORM_EXT_VERBOSE", "0") == "1"
    return cpp_load(
        name=JIT_MODULE_NAME,
        sources=source_paths(),
        extra_cflags=list(CXX_FLAGS),
        verbose=verbose,
    )
