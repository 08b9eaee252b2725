"""Strided rows (issue 24): QK-norm on views of a fused qkv projection and LayerNorm2d on channels_last input,
ours in place against the copy paths (ATen on the view, ours after .contiguous(), timm's permute + layer_norm);
then LayerNorm2d on contiguous NCHW input, forward (no grad) and forward + backward: ours in place (the CPU's
channels-first kernels) against ours on a channels_last copy (what the op did before them) and timm's path.
CPU, one thread, the median of --repeats timings of one call (CUDA: CUDA events, L2 flushed between calls,
bench_timing.CudaTimer), and the MB that one call's copies move beyond the norm's own
reads and writes (copied_mb: every aten::copy_ the profiler records, those inside ATen's kernels included, each
reading and writing its elements; a composite's intermediates are not counted).

    python benchmarks/strided.py [--repeats 30] [--device cuda]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import layernorm_ext as L


def median_us(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def copied_mb(fn: Callable[[], object], element_size: int) -> float:
    """MB read and written by the copies of one call of fn (see the module's docstring), elements of element_size
    bytes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    elements = sum(math.prod(e.input_shapes[1]) for e in prof.events() if e.name == "aten::copy_")
    return 2 * elements * element_size / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_timing import CudaTimer  # noqa: PLC0415

        timer = CudaTimer(device)

        def time_us(fn: Callable[[], object]) -> float:
            timer(fn, 3)
            return statistics.median(timer(fn, args.repeats)) * 1e6
    else:
        torch.set_num_threads(1)

        def time_us(fn: Callable[[], object]) -> float:
            return median_us(fn, args.repeats)

    print("| case | dtype | pass | ours, strided (us) | ours on .contiguous() (us) | ATen (us) | MB copied: ours, "
          "strided / on .contiguous() / ATen |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    tokens, heads, head_dim = 2048, 32, 128
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(tokens, 3 * heads * head_dim, dtype=dtype, device=device)
        q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
        w = torch.randn(head_dim, dtype=dtype, device=device)
        norms: list[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = [
            lambda t, w: L.rms_norm(t, head_dim, w, 1e-6),
            lambda t, w: L.rms_norm(t.contiguous(), head_dim, w, 1e-6),
            lambda t, w: F.rms_norm(t, (head_dim,), w, 1e-6),
        ]
        grad = torch.randn(q.shape, dtype=dtype, device=device)
        leaves = [t.detach().requires_grad_() for t in (q, w)]
        for name in ("forward", "forward + backward"):
            if name == "forward":
                calls = [lambda norm=norm: norm(q, w) for norm in norms]
                with torch.no_grad():
                    row = [time_us(call) for call in calls]
                    moved = " / ".join(f"{copied_mb(call, q.element_size()):.1f}" for call in calls)
            else:
                calls = [lambda norm=norm: torch.autograd.grad(norm(*leaves), leaves, grad) for norm in norms]
                row = [time_us(call) for call in calls]
                moved = " / ".join(f"{copied_mb(call, q.element_size()):.1f}" for call in calls)
            print(f"| QK-norm q view [{tokens}, {heads}, {head_dim}] | {dtype} | {name} | "
                  + " | ".join(f"{t:.0f}" for t in row) + f" | {moved} |")  # fmt: skip
    n, c, h, wd = 8, 256, 56, 56
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, c, h, wd, dtype=dtype, device=device).contiguous(memory_format=torch.channels_last)
        weight = torch.randn(c, dtype=dtype, device=device)
        bias = torch.randn(c, dtype=dtype, device=device)

        def timm() -> torch.Tensor:
            return F.layer_norm(x.permute(0, 2, 3, 1), (c,), weight, bias, 1e-6).permute(0, 3, 1, 2)

        calls = [
            lambda: L.layer_norm_2d(x, weight, bias),
            lambda: L.layer_norm_2d(x.contiguous(), weight, bias),
            timm,
        ]
        with torch.no_grad():
            row = [time_us(call) for call in calls]
            moved = " / ".join(f"{copied_mb(call, x.element_size()):.1f}" for call in calls)
        print(f"| LayerNorm2d channels_last [{n}, {c}, {h}, {wd}] | {dtype} | forward | "
              + " | ".join(f"{t:.0f}" for t in row) + f" | {moved} |")  # fmt: skip

    nchw(device, time_us)


def nchw(device: torch.device, time_us: Callable[[Callable[[], object]], float]) -> None:
    print()
    print("| LayerNorm2d, NCHW input | dtype | pass | ours, in place (us) | ours on a channels_last copy (us) "
          "| timm: permute + ATen (us) | copy / in place | timm / in place "
          "| MB copied: in place / copy / timm |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in ((8, 96, 56, 56), (1, 256, 64, 64)):
        c = shape[1]
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(shape, dtype=dtype, device=device)
            weight = torch.randn(c, dtype=dtype, device=device)
            bias = torch.randn(c, dtype=dtype, device=device)
            grad = torch.randn(shape, dtype=dtype, device=device)
            norms: list[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = [
                lambda t, w, b: L.layer_norm_2d(t, w, b),
                lambda t, w, b: L.layer_norm_2d(t.contiguous(memory_format=torch.channels_last), w, b),
                lambda t, w, b: F.layer_norm(t.permute(0, 2, 3, 1), (c,), w, b, 1e-6).permute(0, 3, 1, 2),
            ]
            leaves = [t.detach().requires_grad_() for t in (x, weight, bias)]
            for name in ("forward", "forward + backward"):
                if name == "forward":
                    calls = [lambda norm=norm: norm(x, weight, bias) for norm in norms]
                    with torch.no_grad():
                        times = [time_us(call) for call in calls]
                        moved = [copied_mb(call, x.element_size()) for call in calls]
                else:
                    calls = [lambda norm=norm: torch.autograd.grad(norm(*leaves), leaves, grad) for norm in norms]
                    times = [time_us(call) for call in calls]
                    moved = [copied_mb(call, x.element_size()) for call in calls]
                cells = [f"{t:.0f}" for t in times] + [f"{times[1] / times[0]:.2f}", f"{times[2] / times[0]:.2f}"]
                cells.append(" / ".join(f"{mb:.1f}" for mb in moved))
                print(f"| {list(shape)} | {dtype} | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
