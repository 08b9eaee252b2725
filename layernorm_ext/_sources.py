"""The one list of native sources and compiler flags, shared by setup.py and the JIT loader.

This module imports nothing but the standard library so that setup.py can load it before torch's build
helpers and without importing the package.
"""

from __future__ import annotations

from pathlib import Path

# Paths relative to the csrc folder.
CPU_SOURCES: tuple[str, ...] = (
    "bindings.cpp",
    "norm_checks.cpp",
    "norm_ops.cpp",
    "cpu/norm_cpu.cpp",
    "cpu/norm_kernel.cpp",
    # Row kernels, one copy per instruction set (each file sets its own target; see csrc/cpu/rows_impl.h).
    "cpu/rows_portable.cpp",
    "cpu/rows_avx2.cpp",
    "cpu/rows_avx512.cpp",
)

# -fopenmp at compile time only: at::parallel_for is inline and expands to OpenMP pragmas; its runtime
# symbols resolve to the OpenMP library torch itself loaded, so torch.set_num_threads governs our threads.
# Linking a second OpenMP runtime would give the library a thread pool of its own.
CXX_FLAGS: tuple[str, ...] = ("-O3", "-fopenmp")


def csrc_dir() -> Path:
    """The folder holding the C++ sources: inside the installed package, or the repository's csrc/."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "csrc", here.parent / "csrc"):
        if (candidate / CPU_SOURCES[0]).is_file():
            return candidate
    raise FileNotFoundError(
        f"layernorm_ext: C++ sources not found next to {here} (looked for csrc/{CPU_SOURCES[0]})"
    )


def source_paths(root: Path | None = None) -> list[str]:
    root = csrc_dir() if root is None else root
    return [str(root / name) for name in CPU_SOURCES]
