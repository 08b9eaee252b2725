"""Build layernorm_ext: the native library (C++ CPU kernels; CUDA kernels when available) and the package.

Environment:
  LAYERNORM_EXT_BUILD=0   install the pure-Python package with the C++ sources; the library is JIT-built on
                          first import.
  FORCE_CUDA=1            build the CUDA kernels even when no GPU is visible (needs a CUDA build of torch and
                          the CUDA toolkit); without it they are built when torch has CUDA and nvcc is found.
  LAYERNORM_EXT_CUDA=0    never build the CUDA kernels.
  CUDA_HOME               the CUDA toolkit (found from nvcc / /usr/local/cuda* when unset).
  TORCH_CUDA_ARCH_LIST    GPU architectures; default: the visible GPUs', or "8.0;9.0;10.0;12.0+PTX" when none is visible.
  LAYERNORM_EXT_VERBOSE=1 pass -Xptxas -v to nvcc (registers and spills of every kernel).
  MAX_JOBS                parallel compile jobs (ninja).
Requires torch at build time: install it first and build with ``pip install --no-build-isolation .``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _load_sources_module():
    spec = importlib.util.spec_from_file_location("_layernorm_ext_sources", ROOT / "layernorm_ext" / "_sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _want_cuda(torch, sources_module, cuda_home: str | None) -> bool:
    if os.environ.get("LAYERNORM_EXT_CUDA", "1") == "0":
        return False
    if sources_module.force_cuda():
        if torch.version.cuda is None:
            sys.exit(f"layernorm_ext: FORCE_CUDA=1, but torch {torch.__version__} is a CPU-only build.")
        if cuda_home is None:
            sys.exit("layernorm_ext: FORCE_CUDA=1, but no CUDA toolkit was found: set CUDA_HOME.")
        return True
    return torch.version.cuda is not None and cuda_home is not None


def _extensions():
    if os.environ.get("LAYERNORM_EXT_BUILD", "1") == "0":
        return [], {}
    sources_module = _load_sources_module()
    # Before torch.utils.cpp_extension is imported: it reads CUDA_HOME once, at import.
    cuda_home = sources_module.configure_cuda_home()
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        sys.exit(
            "layernorm_ext: building the native library needs torch installed first. Install torch, then run "
            "`pip install --no-build-isolation .` (or set LAYERNORM_EXT_BUILD=0 to JIT-build on first import)."
        )
    cxx_flags = list(sources_module.CXX_FLAGS)
    if not _want_cuda(torch, sources_module, cuda_home):
        sources = [f"csrc/{name}" for name in sources_module.CPU_SOURCES]
        extension = CppExtension(name="layernorm_ext._C", sources=sources, extra_compile_args={"cxx": cxx_flags})
        return [extension], {"build_ext": BuildExtension}

    arch_list = sources_module.configure_arch_list(gpu_visible=torch.cuda.is_available())
    nvcc_flags = list(sources_module.NVCC_FLAGS)
    if os.environ.get("LAYERNORM_EXT_VERBOSE", "0") == "1":
        nvcc_flags += list(sources_module.NVCC_VERBOSE_FLAGS)
    print(
        f"layernorm_ext: building the CUDA kernels with {cuda_home} for TORCH_CUDA_ARCH_LIST={arch_list}",
        file=sys.stderr,
    )
    sources = [f"csrc/{name}" for name in sources_module.CPU_SOURCES + sources_module.CUDA_SOURCES]
    extension = CUDAExtension(
        name="layernorm_ext._C",
        sources=sources,
        define_macros=[(sources_module.WITH_CUDA_DEFINE, None)],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )
    return [extension], {"build_ext": BuildExtension}


ext_modules, cmdclass = _extensions()

setup(
    packages=["layernorm_ext", "layernorm_ext.csrc"],
    package_dir={"layernorm_ext.csrc": "csrc"},
    package_data={"layernorm_ext.csrc": ["*.h", "*.cpp", "*.cu", "*.cuh", "cpu/*", "cuda/*"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
