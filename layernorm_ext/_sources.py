"""The one list of native sources and compiler flags, shared by setup.py and the JIT loader.

This module imports nothing but the standard library so that setup.py can load it before torch's build
helpers and without importing the package.
"""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

# Paths relative to the csrc folder.
CPU_SOURCES: tuple[str, ...] = (
    "bindings.cpp",
    "norm_checks.cpp",
    "norm_ops.cpp",
    "norm_autograd.cpp",
    "python_functions.cpp",
    "cpu/norm_cpu.cpp",
    "cpu/norm_kernel.cpp",
    # Row kernels, one copy per instruction set (each file sets its own target; see csrc/cpu/rows_impl.h).
    "cpu/rows_portable.cpp",
    "cpu/rows_avx2.cpp",
    "cpu/rows_avx512.cpp",
)

# CUDA kernels (csrc/cuda): compiled when torch has CUDA and nvcc is found, or FORCE_CUDA=1.
CUDA_SOURCES: tuple[str, ...] = (
    "cuda/norm_cuda.cpp",
    # The kernel family of cuda/norm_kernels.cuh, instantiated once per input dtype (parallel builds).
    "cuda/launch_f32.cu",
    "cuda/launch_f64.cu",
    "cuda/launch_f16.cu",
    "cuda/launch_bf16.cu",
)

# -fopenmp at compile time only: at::parallel_for is inline and expands to OpenMP pragmas; its runtime
# symbols resolve to the OpenMP library torch itself loaded, so torch.set_num_threads governs our threads.
# Linking a second OpenMP runtime would give the library a thread pool of its own.
CXX_FLAGS: tuple[str, ...] = ("-O3", "-fopenmp")

# A release build carries no debug info: with it (Python's own CFLAGS add -g) the CPU library is about 62 MB,
# without it 5.4 MB. It keeps its symbol table (profilers name our functions with it): stripping that too
# (-s at link) would save only 0.4 MB. LAYERNORM_EXT_DEBUG=1 keeps the debug info.
DEBUG_ENV = "LAYERNORM_EXT_DEBUG"
RELEASE_CXX_FLAGS: tuple[str, ...] = ("-g0",)
DEBUG_CXX_FLAGS: tuple[str, ...] = ("-g",)

# nvcc: optimized, no fast-math (the results must match ATen's accuracy); -Xptxas -v only in verbose builds.
NVCC_FLAGS: tuple[str, ...] = ("-O3", "--expt-relaxed-constexpr")
NVCC_VERBOSE_FLAGS: tuple[str, ...] = ("-Xptxas", "-v")


def debug_build() -> bool:
    return os.environ.get(DEBUG_ENV, "0") == "1"


def cxx_flags() -> list[str]:
    """The host compiler's flags of a build (setup.py and the JIT): CXX_FLAGS, then no debug info unless
    LAYERNORM_EXT_DEBUG=1 (last, so that they override a -g of Python's CFLAGS)."""
    return [*CXX_FLAGS, *(DEBUG_CXX_FLAGS if debug_build() else RELEASE_CXX_FLAGS)]


# Macro telling the shared sources (bindings.cpp, norm.h) that the CUDA kernels are linked in.
WITH_CUDA_DEFINE = "LAYERNORM_EXT_WITH_CUDA"

# The oldest torch release supported: the oldest the suite passes on (CI's torch range leg, .ci/torch_range, runs
# it). 2.7 lacks float4_e2m1fn_x2 (NVFP4's codes); on 2.6 and before, torch's own F.rms_norm also means something
# else (eps=None is the input dtype's eps, a wider weight promotes the result).
OLDEST_TORCH = "2.8"

# Architectures built when TORCH_CUDA_ARCH_LIST is unset and no GPU is visible: Ampere, Hopper, datacenter
# Blackwell (sm_100) and consumer Blackwell (sm_120), with PTX for newer GPUs to JIT from. SASS of sm_90 does
# not run on sm_100/sm_120, and JIT from sm_90 PTX would cost a first-call compile of every kernel there.
DEFAULT_CUDA_ARCHS = "8.0;9.0;10.0;12.0+PTX"


def csrc_dir() -> Path:
    """The folder holding the C++ sources: inside the installed package, or the repository's csrc/."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "csrc", here.parent / "csrc"):
        if (candidate / CPU_SOURCES[0]).is_file():
            return candidate
    raise FileNotFoundError(
        f"layernorm_ext: C++ sources not found next to {here} (looked for csrc/{CPU_SOURCES[0]})"
    )


def source_paths(root: Path | None = None, with_cuda: bool = False) -> list[str]:
    root = csrc_dir() if root is None else root
    names = CPU_SOURCES + (CUDA_SOURCES if with_cuda else ())
    return [str(root / name) for name in names]


def _is_toolkit(folder: Path) -> bool:
    return (folder / "bin" / "nvcc").is_file() and (folder / "include" / "cuda_runtime.h").is_file()


def find_cuda_home() -> str | None:
    """The CUDA toolkit folder: $CUDA_HOME / $CUDA_PATH if set, else the toolkit of the nvcc on PATH, else
    /usr/local/cuda or the newest /usr/local/cuda-*.

    torch guesses the toolkit from `which nvcc`'s parent folder, which is wrong when nvcc on PATH is a wrapper
    script or a symlink farm (e.g. /usr/local/bin/nvcc); here a candidate must hold bin/nvcc and
    include/cuda_runtime.h.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    candidates: list[Path] = []
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        candidates.append(Path(nvcc).resolve().parent.parent)
        try:  # a wrapper script naming the real nvcc: exec /usr/local/cuda-13.0/bin/nvcc "$@"
            text = Path(nvcc).read_text(errors="ignore")[:4096]
        except OSError:
            text = ""
        for word in text.split():
            word = word.strip("'\"")
            if word.endswith("/bin/nvcc"):
                candidates.append(Path(word).parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    candidates += [Path(p) for p in sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    for folder in candidates:
        if _is_toolkit(folder):
            return str(folder)
    return None


def configure_cuda_home() -> str | None:
    """Set $CUDA_HOME for torch.utils.cpp_extension (which reads it when first imported) if it is unset and a
    toolkit is found; returns the toolkit folder or None."""
    home = find_cuda_home()
    if home is not None and not os.environ.get("CUDA_HOME"):
        os.environ["CUDA_HOME"] = home
    return home


def force_cuda() -> bool:
    return os.environ.get("FORCE_CUDA", "0") == "1"


def configure_arch_list(gpu_visible: bool) -> str:
    """TORCH_CUDA_ARCH_LIST for a CUDA build: as set, else (no GPU visible) DEFAULT_CUDA_ARCHS; with a GPU
    visible and nothing set, torch builds for that GPU. Returns what the build will use, for messages."""
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not gpu_visible:
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS
    return os.environ.get("TORCH_CUDA_ARCH_LIST", "(the visible GPUs)")
