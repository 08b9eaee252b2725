"""Build layernorm_ext: the native library (C++ CPU kernels; CUDA kernels when available) and the package.

Environment:
  LAYERNORM_EXT_BUILD=0   install the pure-Python package with the C++ sources; the library is JIT-built on
                          first import.
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


def _extensions():
    if os.environ.get("LAYERNORM_EXT_BUILD", "1") == "0":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        sys.exit(
            "layernorm_ext: building the native library needs torch installed first. Install torch, then run "
            "`pip install --no-build-isolation .` (or set LAYERNORM_EXT_BUILD=0 to JIT-build on first import)."
        )
    sources_module = _load_sources_module()
    sources = [f"csrc/{name}" for name in sources_module.CPU_SOURCES]
    extension = CppExtension(
        name="layernorm_ext._C",
        sources=sources,
        extra_compile_args={"cxx": list(sources_module.CXX_FLAGS)},
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
