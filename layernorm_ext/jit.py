"""Build the native library just in time with torch.utils.cpp_extension.load, from the same sources as setup.py.

Used when ``LAYERNORM_EXT_JIT=1`` is set at import, or automatically when the package was installed without
a prebuilt library (``LAYERNORM_EXT_BUILD=0 pip install .``). Only one native library may be loaded per
process (both register ``torch.ops.layernorm_ext``), so call :func:`load` before importing the package, or
let the import do it.

The CUDA kernels are part of the build when torch has CUDA, a toolkit is found, and a GPU is visible (or
``FORCE_CUDA=1``); ``LAYERNORM_EXT_CUDA=0`` leaves them out. A CUDA build lands under its own name in the cache.
"""

from __future__ import annotations

import os
from types import ModuleType

from ._sources import (
    CXX_FLAGS,
    NVCC_FLAGS,
    NVCC_VERBOSE_FLAGS,
    WITH_CUDA_DEFINE,
    configure_arch_list,
    configure_cuda_home,
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
    """Compile (or reuse the cached build of) the native library and load it into this process.

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
    cflags = list(CXX_FLAGS)
    cuda_cflags: list[str] = []
    if with_cuda:
        cflags.append(f"-D{WITH_CUDA_DEFINE}")
        cuda_cflags = [*NVCC_FLAGS, f"-D{WITH_CUDA_DEFINE}", *(NVCC_VERBOSE_FLAGS if verbose else ())]
    return cpp_extension.load(
        name=JIT_MODULE_NAME + ("_cuda" if with_cuda else ""),
        sources=source_paths(with_cuda=with_cuda),
        extra_cflags=cflags,
        extra_cuda_cflags=cuda_cflags,
        with_cuda=with_cuda,
        verbose=verbose,
    )
