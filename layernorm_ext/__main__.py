"""``python -m layernorm_ext``: versions, how the library was built and loaded, a self-check of every op
against ATen, and a small speed table (ours vs ATen, GB/s). Exits non-zero if a check fails."""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import layernorm_ext
from layernorm_ext import functional as ours
from layernorm_ext.selfcheck import check_all


def _median_seconds(fn: Callable[[], object], device: str, reps: int) -> float:
    fn()  # warm-up (and page in the allocator's blocks)
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def speed_table(device: str, reps: int) -> list[str]:
    """Forward LayerNorm / RMSNorm, ours vs ATen; both allocate their outputs. Bytes = read x + write y."""
    lines = [
        f"| op | dtype | rows x cols | ours GB/s | ATen GB/s | ours / ATen |",
        "|---|---|---|---:|---:|---:|",
    ]
    target_bytes = (64 if device == "cuda" else 8) * 2**20
    for dtype in (torch.float32, torch.bfloat16):
        for cols in (768, 4096, 8192):
            rows = max(1, target_bytes // (cols * torch.finfo(dtype).bits // 8))
            x = torch.randn(rows, cols, device=device).to(dtype)
            w = torch.randn(cols, device=device).to(dtype)
            b = torch.randn(cols, device=device).to(dtype)
            moved = 2 * x.numel() * x.element_size()
            cases = {
                "layer_norm": (lambda: ours.layer_norm(x, (cols,), w, b), lambda: F.layer_norm(x, (cols,), w, b)),
                "rms_norm": (lambda: ours.rms_norm(x, (cols,), w), lambda: F.rms_norm(x, (cols,), w)),
            }
            with torch.no_grad():
                for name, (mine, aten) in cases.items():
                    t_ours = _median_seconds(mine, device, reps)
                    t_aten = _median_seconds(aten, device, reps)
                    lines.append(
                        f"| {name} | {str(dtype)[6:]} | {rows} x {cols} | {moved / t_ours / 1e9:.1f} | "
                        f"{moved / t_aten / 1e9:.1f} | {t_aten / t_ours:.2f} |"
                    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m layernorm_ext", description=__doc__)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the CPU speed table")
    parser.add_argument("--no-bench", action="store_true", help="skip the speed table")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per case (median)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    info = layernorm_ext.build_info()
    print(f"layernorm_ext {layernorm_ext.__version__}  (torch {torch.__version__}, python {platform.python_version()})")
    print(f"  library: {info['load_method']}, built against torch {info['torch_version']} with {info['compiler']}")
    print(f"  CUDA kernels: {'yes' if info['with_cuda'] else 'no'}; CUDA device: "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
    print(f"  CPU: {platform.processor() or platform.machine()}, instruction set used: {info['cpu_isa']}, "
          f"threads: {torch.get_num_threads()}")

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and info["with_cuda"] else [])
    failures = 0
    for device in devices:
        results = check_all(device)
        bad = [r for r in results if not r.ok]
        failures += len(bad)
        print(f"\nself-check on {device}: {len(results) - len(bad)}/{len(results)} comparisons within ATen's error")
        for r in bad:
            print(f"  FAIL {r.what}: error {r.err_ours:.3e} vs ATen {r.err_aten:.3e} (+{r.atol:.1e})")

    if not args.no_bench:
        for device in devices:
            print(f"\nspeed on {device} ({torch.get_num_threads()} threads; median of {args.reps}; "
                  "both sides allocate outputs):")
            print("\n".join(speed_table(device, args.reps)))
    if failures:
        print(f"\n{failures} check(s) FAILED", file=sys.stderr)
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
