"""Build the native library just in time with torch.utils.cpp_extension.load, from the same sources as setup.py.

Used when ``LAYERNORM_EXT_JIT=1`` is set at import, or automatically when the package was installed without
a prebuilt library (``LAYERNORM_EXT_BUILD=0 pip install .``). Only one native library may be loaded per
process (each registers ``torch.ops.layernorm_ext``), and importing this module imports the package, which
loads one: so the import does the JIT build (with ``LAYERNORM_EXT_JIT=1``), and :func:`load` returns the
library the import loaded when that is a JIT build, or raises RuntimeError when it is the prebuilt one.

The CUDA kernels are part of the build when torch has CUDA, a toolkit is found, and a GPU is visible (or
``FORCE_CUDA=1``); ``LAYERNORM_EXT_CUDA=0`` leaves them out. A CUDA build lands under its own name in the cache.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from types import ModuleType

from ._sources import (
    NVCC_FLAGS,
    NVCC_VERBOSE_FLAGS,
    WITH_CUDA_DEFINE,
    configure_arch_list,
    configure_cuda_home,
    cxx_flags,
    force_cuda,
    source_paths,
)

JIT_MODULE_NAME = "layernorm_ext_jit"


def want_cuda() -> bool:
    """Whether a JIT build here would include the CUDA kernels."""
    if os.environ.get("LAYERNORM_EXT_CUDA", "1") == "0":
        return False
    import torch

    if torch.version.cuda is None or configure_cuda_home() is None:
        return False
    return force_cuda() or torch.cuda.is_available()


def load(verbose: bool | None = None) -> ModuleType:
    """The JIT-built native library of this process (``verbose``: unused once it is loaded).

    The package's import has already loaded a library (importing this module imports the package): a JIT build
    (``LAYERNORM_EXT_JIT=1``, or an install without a prebuilt library) is returned as it is; with the prebuilt
    library loaded this raises RuntimeError, since a second library cannot register ``torch.ops.layernorm_ext``.
    """
    from . import _loader

    if _loader.load_method == "jit":
        return _loader.native
    raise RuntimeError(
        "layernorm_ext.jit.load(): the prebuilt library (layernorm_ext._C) is already loaded in this process, and "
        "a second library cannot register torch.ops.layernorm_ext again. Set LAYERNORM_EXT_JIT=1 before the first "
        "`import layernorm_ext` to use a JIT build instead (layernorm_ext.build_info()['load_method'] says which "
        "is loaded)."
    )


def build_arguments(with_cuda: bool, verbose: bool = False) -> dict[str, object]:
    """torch.utils.cpp_extension.load's arguments for the JIT build (the flags setup.py uses)."""
    cflags = cxx_flags()
    cuda_cflags: list[str] = []
    if with_cuda:
        cflags.append(f"-D{WITH_CUDA_DEFINE}")
        cuda_cflags = [*NVCC_FLAGS, f"-D{WITH_CUDA_DEFINE}", *(NVCC_VERBOSE_FLAGS if verbose else ())]
    return {
        "name": JIT_MODULE_NAME + ("_cuda" if with_cuda else ""),
        "sources": source_paths(with_cuda=with_cuda),
        "extra_cflags": cflags,
        "extra_cuda_cflags": cuda_cflags,
        "with_cuda": with_cuda,
        "verbose": verbose,
    }


@contextlib.contextmanager
def build_lock(build_directory: str) -> Iterator[None]:
    """Serialize the builds in ``build_directory`` with an flock and clear a stale torch baton under it.

    cpp_extension.load marks a build in progress with a ``lock`` file that only the building process removes: a
    build killed (SIGKILL, OOM) leaves it behind and every later load waits on it forever (a CI run hung 90
    minutes on one). An flock is released with its holder, so once it is held no build of ours is in progress
    and a ``lock`` file left there is stale."""
    try:
        import fcntl
    except ImportError:  # Windows: torch's baton alone
        yield
        return
    os.makedirs(build_directory, exist_ok=True)
    with open(os.path.join(build_directory, "layernorm_ext.flock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        baton = os.path.join(build_directory, "lock")
        if os.path.exists(baton):
            warnings.warn(f"layernorm_ext: removing {baton}, left behind by a build that did not finish", stacklevel=3)
            os.remove(baton)
        yield


def build_and_load(verbose: bool | None = None) -> ModuleType:
    """Compile (or reuse the cached build of) the native library and load it into this process: for the
    package's loader (layernorm_ext/_loader.py), which makes sure no other copy is loaded.

    The build lands in torch's extension cache (``TORCH_EXTENSIONS_DIR`` to move it). ``verbose`` defaults to
    ``LAYERNORM_EXT_VERBOSE=1``.
    """
    with_cuda = want_cuda()  # sets CUDA_HOME before cpp_extension's first import, which reads it once
    import torch.utils.cpp_extension as cpp_extension

    if with_cuda:
        import torch

        # If cpp_extension was imported earlier, it may hold a wrong guess (e.g. nvcc on PATH is a wrapper).
        cpp_extension.CUDA_HOME = configure_cuda_home()
        configure_arch_list(gpu_visible=torch.cuda.is_available())

    if verbose is None:
        verbose = os.environ.get("LAYERNORM_EXT_VERBOSE", "0") == "1"
    arguments = build_arguments(with_cuda, verbose)
    with build_lock(cpp_extension._get_build_directory(str(arguments["name"]), verbose=False)):
        return cpp_extension.load(**arguments)
