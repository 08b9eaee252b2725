"""How close a two-pass norm can come to a copy on this CPU: the row kernels' own loads, conversions and stores
(csrc/cpu/rows_simd.h) in loops without the norm's arithmetic, timed beside ours, ATen and ``copy_``.

    python benchmarks/cpu_floor.py [--shapes 64x4096,4096x4096] [--repeats 7]

1 thread, preallocated outputs (out=) for all but ATen, medians of interleaved repeats. Columns:
- ``copy_``: ``out.copy_(x)`` (torch's, memcpy); the unit of every "of copy" figure.
- ``convert``: one pass, each vector loaded and converted to float, converted back and stored (our conversions).
- ``two pass``: a sum per row (one add a vector), then the row scaled and stored: the least a norm's two passes
  can do with these conversions. A norm can be no faster than this on the same instruction set.
- ``LN`` / ``RMS``: ours with out=, on the instruction set named; ``ATen LN``: ``F.layer_norm`` (fresh output).
The loops are built once (torch cpp_extension, -O3) into build/cpu_floor-py<ver>-torch<ver>.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import cpp_extension

import layernorm_ext
from layernorm_ext import native
from layernorm_ext.jit import build_lock

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent / "cpu_floor"


def build():
    version = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    directory = ROOT / "build" / f"cpu_floor-{version}"
    directory.mkdir(parents=True, exist_ok=True)
    with build_lock(str(directory)):
        return cpp_extension.load(
            name="layernorm_ext_cpu_floor",
            sources=[str(HERE / "floor.cpp")],
            extra_cflags=["-O3", "-g0"],
            build_directory=str(directory),
            verbose=False,
        )


def timed(fn, iters: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="64x4096,4096x4096")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    module = build()
    isas = [isa for isa in ("avx512_bf16", "avx512", "avx2") if isa in native.supported_cpu_isas()]
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"CPU: {cpu}; instruction sets: {', '.join(native.supported_cpu_isas())}; torch {torch.__version__}; "
          f"layernorm_ext {layernorm_ext.__version__}; 1 thread; medians of {args.repeats} interleaved repeats, us\n")
    print("| shape | dtype | ISA | copy_ | convert (of copy) | two pass (of copy) | LN (of copy, of two pass) "
          "| RMS (of copy, of two pass) | ATen LN |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    previous = native.set_cpu_isa(native.supported_cpu_isas()[0])
    try:
        for shape in args.shapes.split(","):
            rows, cols = (int(v) for v in shape.split("x"))
            iters = max(3, int(1e8 // (rows * cols)))  # about 30 ms a timing
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, cols).to(dtype)
                w, b = torch.randn(cols).to(dtype), torch.randn(cols).to(dtype)
                out = torch.empty_like(x)
                for isa in isas:
                    cases = {
                        "copy": lambda: out.copy_(x),
                        "convert": lambda: module.floor("convert", isa, x, out),
                        "two_pass": lambda: module.floor("two_pass", isa, x, out),
                        "ln": lambda: layernorm_ext.layer_norm(x, (cols,), w, b, out=out),
                        "rms": lambda: layernorm_ext.rms_norm(x, (cols,), w, out=out),
                        "aten": lambda: F.layer_norm(x, (cols,), w, b),
                    }
                    native.set_cpu_isa(isa)
                    times: dict[str, list[float]] = {name: [] for name in cases}
                    with torch.inference_mode():
                        for _ in range(args.repeats):
                            for name, fn in cases.items():
                                times[name].append(timed(fn, iters))
                    t = {name: statistics.median(v) for name, v in times.items()}
                    of = lambda name: t["copy"] / t[name]  # noqa: E731
                    print(f"| {shape} | {str(dtype).removeprefix('torch.')} | {isa} | {t['copy']:.1f} "
                          f"| {t['convert']:.1f} ({of('convert'):.2f}) | {t['two_pass']:.1f} ({of('two_pass'):.2f}) "
                          f"| {t['ln']:.1f} ({of('ln'):.2f}, {t['two_pass'] / t['ln']:.2f}) "
                          f"| {t['rms']:.1f} ({of('rms'):.2f}, {t['two_pass'] / t['rms']:.2f}) | {t['aten']:.1f} |")
    finally:
        native.set_cpu_isa(previous)


if __name__ == "__main__":
    main()
