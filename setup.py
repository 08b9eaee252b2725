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
  LAYERNORM_EXT_DEBUG=1   keep the debug info (the default is a release build: -g0).
  MAX_JOBS                parallel compile jobs (ninja).
Requires torch at build time: install it first and build with ``pip install --no-build-isolation .``.

A build with the library gets a version with a local tag naming the torch it was built against
(``0.1.0+torch2.13.0cpu``, ``0.1.0+torch2.14.1cu130``) and requires exactly that torch release; a build from
an sdist keeps the sdist's version (pip checks that they agree) but still requires that torch.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import sysconfig
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


def _base_version() -> str:
    """The package's version, from layernorm_ext/__init__.py (the one place it is written)."""
    text = (ROOT / "layernorm_ext" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE).group(1)


def _oldest_torch() -> str:
    """An sdist's (or a pure-Python build's) torch requirement: the oldest release supported, or newer."""
    return f"torch>={_load_sources_module().OLDEST_TORCH}"


def _release(torch_version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0': what the loader compares (layernorm_ext/_loader.py)."""
    return torch_version.split("+")[0]


def _version_and_requirements(torch, with_cuda: bool) -> tuple[str, list[str]]:
    """A library build is tied to one torch release (the loader refuses another): its version's local tag names
    that torch and the CUDA of the kernels in it, and it requires that release. The requirement leaves out torch's
    own local tag, so the CPU wheel installs beside either build of that torch (its CPU library runs on both).
    An sdist, and a wheel built from one (PKG-INFO in the tree), keep the plain version: pip refuses a wheel
    whose version differs from its sdist's."""
    base, release = _base_version(), _release(torch.__version__)
    building_sdist = "sdist" in sys.argv or (ROOT / "PKG-INFO").is_file()
    if building_sdist:
        return base, [_oldest_torch()] if "sdist" in sys.argv else [f"torch=={release}"]
    accelerator = "cu" + torch.version.cuda.replace(".", "") if with_cuda else "cpu"
    return f"{base}+torch{release}{accelerator}", [f"torch=={release}"]


def _build_ext_class(build_extension: type) -> type:
    class BuildExtensionKeepingObjects(build_extension):
        """An editable install compiles in a temporary folder; here it keeps its objects in build/, where the
        wheel build (README's `pip wheel ...`, CI right after the quick start's editable install) finds them up
        to date and only links, instead of compiling everything again (about 9 minutes on 2 cores)."""

        def finalize_options(self) -> None:
            super().finalize_options()
            if getattr(self, "editable_mode", False):
                platform_tag = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
                self.build_temp = str(ROOT / "build" / f"temp.{platform_tag}")

    return BuildExtensionKeepingObjects


def _extensions():
    """(ext_modules, cmdclass, version, install_requires)."""
    if os.environ.get("LAYERNORM_EXT_BUILD", "1") == "0":
        return [], {}, _base_version(), [_oldest_torch()]
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
    cxx_flags = sources_module.cxx_flags()
    cmdclass = {"build_ext": _build_ext_class(BuildExtension)}
    if not _want_cuda(torch, sources_module, cuda_home):
        sources = [f"csrc/{name}" for name in sources_module.CPU_SOURCES]
        extension = CppExtension(name="layernorm_ext._C", sources=sources, extra_compile_args={"cxx": cxx_flags})
        return [extension], cmdclass, *_version_and_requirements(torch, with_cuda=False)

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
    return [extension], cmdclass, *_version_and_requirements(torch, with_cuda=True)


ext_modules, cmdclass, version, install_requires = _extensions()

setup(
    version=version,
    install_requires=install_requires,
    packages=["layernorm_ext", "layernorm_ext.csrc"],
    package_dir={"layernorm_ext.csrc": "csrc"},
    package_data={"layernorm_ext.csrc": ["*.h", "*.cpp", "*.cu", "*.cuh", "cpu/*", "cuda/*"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
