"""How bench.py times a call: the CPU and CUDA timers, the time budget and the reps it gives, the device copy
bandwidth C, and the decode latencies (eager wall clock, CUDA graph replay)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

Call = Callable[[], object]  # one timed call; what it returns is released after the clock stops


class Timer:
    """Seconds of each of `reps` calls of fn."""

    def __call__(self, fn: Call, reps: int) -> list[float]:
        raise NotImplementedError

    def sync(self) -> None:
        pass


class CpuTimer(Timer):
    def __call__(self, fn: Call, reps: int) -> list[float]:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            result = fn()
            stop = time.perf_counter()
            del result
            times.append(stop - start)
        return times


class CudaTimer(Timer):
    """CUDA events around each call; between calls a write of 2x the L2 size evicts the inputs from L2."""

    def __init__(self, device: torch.device) -> None:
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        self.flush = torch.empty(max(2 * l2, 2**20), dtype=torch.uint8, device=device)

    def __call__(self, fn: Call, reps: int) -> list[float]:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, stop in events:
            self.flush.zero_()
            start.record()
            result = fn()
            stop.record()
            del result
        torch.cuda.synchronize()
        return [start.elapsed_time(stop) * 1e-3 for start, stop in events]

    def sync(self) -> None:
        torch.cuda.synchronize()


@dataclass(frozen=True)
class Budget:
    target_s: float  # timed seconds per implementation and case
    min_reps: int  # timed calls at least ...
    max_reps: int  # ... and at most
    cap_s: float  # but fewer than min_reps (at least 1) when min_reps calls would take longer than this
    rounds: int  # the implementations of a case take turns this many times (drift hits all alike)


def warm_up(timer: Timer, fn: Call, warm_s: float) -> list[float]:
    """Times of calls (after the untimed first one) until warm_s has passed."""
    times = timer(fn, 1)
    while sum(times) < warm_s and len(times) < 256:
        times += timer(fn, len(times))
    return times


def reps_for(seconds: float, budget: Budget) -> int:
    reps = min(max(math.ceil(budget.target_s / max(seconds, 1e-9)), budget.min_reps), budget.max_reps)
    return min(reps, max(1, math.floor(budget.cap_s / max(seconds, 1e-9))))


def copy_peak_gbps(device: torch.device, megabytes: int = 1024, reps: int = 20) -> float:
    """C: device-to-device copy bandwidth, GB/s counting bytes read plus written; median of `reps` copies of
    `megabytes` MiB into a preallocated buffer (far beyond L2, so the L2 flush is moot)."""
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    timer = CudaTimer(device)
    timer(lambda: dst.copy_(src), 3)  # warm-up
    times = timer(lambda: dst.copy_(src), reps)
    return 2 * src.numel() / statistics.median(times) / 1e9


# ---- decode latency (CUDA) ------------------------------------------------------------------------------------


def decode_eager_us(fn: Call, reps: int = 200) -> float:
    """Wall-clock microseconds per call of `reps` back-to-back calls (host dispatch included), then a sync."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


def decode_graph_us(fn: Call, calls: int = 20, replays: int = 20) -> float:
    """GPU microseconds per call: `calls` calls captured in one CUDA graph, replayed `replays` times between
    two CUDA events (no host dispatch, no launch gaps; inputs and weights stay in L2)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1e3 / (replays * calls)
