#!/usr/bin/env python
"""Per-call host overhead of layernorm_ext against ATen: microseconds per call, ours / ATen.

    python benchmarks/overhead.py                      # CPU (and CUDA when available), 1 thread; ~25 s on 2 cores
    python benchmarks/overhead.py --quick              # smoke run, ~10 s
    python benchmarks/overhead.py --clock thread --devices cpu --out overhead.md   # on a busy machine

What is measured: one case per (device, api, op, shape, mode).

- api ``functional``: ``layernorm_ext.layer_norm`` vs ``torch.nn.functional.layer_norm``, ``layernorm_ext.rms_norm``
  vs ``torch.nn.functional.rms_norm`` (weight, and bias for LayerNorm, in the input's dtype; the same tensors
  and arguments for both: ``normalized_shape`` as a tuple, eps 1e-5 for LayerNorm, None for RMSNorm).
  api ``module``: ``FusedLayerNorm(n)`` vs ``torch.nn.LayerNorm(n)``, ``FusedRMSNorm(n)`` vs ``torch.nn.RMSNorm(n)``,
  called as ``m(x)`` (``nn.Module.__call__`` included for both); the fused module gets the torch module's
  state_dict, so both hold the same parameters.
- shape: x of 1x8 float32, 16x4096 float32, 16x4096 bfloat16, normalized over the last dim.
- mode: ``inference_mode`` and ``no_grad`` (the whole timing loop inside the context; parameters require grad,
  as a model's do, x does not); ``grad`` (x and the parameters require grad, forward only: the autograd graph
  is built and dropped); ``fwd+bwd`` (forward, then ``torch.autograd.grad(y, (x, *params), g)`` with a fixed
  pre-made g: no ``.grad`` accumulation, so neither side pays for zeroing or accumulating).
- device: cpu, and cuda when available. On CUDA the loop is not synchronized per call: ``cuda`` rows give the
  host time per call (from a synchronized start until the K-th call returns, i.e. dispatch and launch only,
  as long as the GPU keeps up and the launch queue never fills), ``cuda+sync`` rows the wall time per call of
  the same loop ending with one ``torch.cuda.synchronize()``.

How: ``torch.set_num_threads(--threads)`` (default 1); per case a warm-up of both implementations, then K calls
per loop, K chosen so that the slower implementation's loop takes about ``--target-ms`` (``--calls`` fixes K);
then ``--rounds`` rounds, each timing one loop of ours and one of ATen with ``time.perf_counter_ns`` (which goes
first alternates per round), with Python's garbage collector off during the loops (as ``timeit`` does). Reported:
the median over rounds of each implementation's per-call time, and the ratio of the two medians (> 1: ours is
slower). Before timing, each case checks that ours and ATen agree on the output and, in the grad modes, on every
gradient; a case that fails is listed under the table and the run exits 1. Every call allocates its outputs, as
in real use. On a busy machine, ``--clock thread`` times with ``time.thread_time_ns`` instead: the calling
thread's CPU time, which at 1 thread on CPU holds every op and the backward (the autograd engine runs CPU work
on the calling thread) and leaves out the time the OS gives other processes. The last line gives the worst
ratio per mode.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

import layernorm_ext
from common import comma_list, finish_report, report_head

APIS = ("functional", "module")
OPS = ("layer_norm", "rms_norm")
SHAPES: dict[str, tuple[tuple[int, int], torch.dtype]] = {
    "1x8 fp32": ((1, 8), torch.float32),
    "16x4096 fp32": ((16, 4096), torch.float32),
    "16x4096 bf16": ((16, 4096), torch.bfloat16),
}
MODES = ("inference_mode", "no_grad", "grad", "fwd+bwd")
IMPLS = ("ours", "aten")
LN_EPS = 1e-5

Call = Callable[[], object]


@dataclass(frozen=True)
class Case:
    device: str
    api: str
    op: str
    shape: str
    mode: str


@dataclass(frozen=True)
class Row:
    case: Case
    timing: str  # "host" or "sync" (CUDA's two readings of one loop); "host" on CPU
    calls: int
    ours_us: float
    aten_us: float

    @property
    def ratio(self) -> float:
        return self.ours_us / self.aten_us

    @property
    def device_label(self) -> str:
        return self.case.device if self.timing == "host" else f"{self.case.device}+sync"


# ---- the calls ---------------------------------------------------------------------------------------------


def make_modules(op: str, n: int, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(ours, ATen's) module for op over n features, ours loaded with the torch module's state_dict."""
    if op == "layer_norm":
        ref: torch.nn.Module = torch.nn.LayerNorm(n, eps=LN_EPS, device=device, dtype=dtype)
        ours: torch.nn.Module = layernorm_ext.FusedLayerNorm(n, eps=LN_EPS, device=device, dtype=dtype)
    else:
        ref = torch.nn.RMSNorm(n, device=device, dtype=dtype)
        ours = layernorm_ext.FusedRMSNorm(n, device=device, dtype=dtype)
    with torch.no_grad():  # non-trivial parameters, the same for both
        for p in ref.parameters():
            p.uniform_(0.5, 1.5)
    ours.load_state_dict(ref.state_dict())
    return ours, ref


Forward = Callable[[Tensor], Tensor]


def make_forwards(case: Case, x: Tensor) -> tuple[Forward, Forward, list[Tensor], list[Tensor]]:
    """(ours, ATen's) forward of x, and the parameters each uses (the same tensors for the functional pair)."""
    n = x.shape[-1]
    shape = (n,)
    if case.api == "module":
        ours_m, ref_m = make_modules(case.op, n, x.dtype, case.device)
        return ours_m, ref_m, list(ours_m.parameters()), list(ref_m.parameters())
    w = torch.empty(n, device=case.device, dtype=x.dtype).uniform_(0.5, 1.5).requires_grad_()
    if case.op == "layer_norm":
        b = torch.empty(n, device=case.device, dtype=x.dtype).uniform_(-0.5, 0.5).requires_grad_()
        return (
            lambda t: layernorm_ext.layer_norm(t, shape, w, b, LN_EPS),
            lambda t: F.layer_norm(t, shape, w, b, LN_EPS),
            [w, b],
            [w, b],
        )
    return (
        lambda t: layernorm_ext.rms_norm(t, shape, w, None),
        lambda t: F.rms_norm(t, shape, w, None),
        [w],
        [w],
    )


def make_calls(case: Case) -> dict[str, Call]:
    """One zero-argument call per implementation: a single forward (or forward+backward) of the case."""
    (rows, n), dtype = SHAPES[case.shape]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n, generator=gen, dtype=torch.float32).to(device=case.device, dtype=dtype)
    ours_fwd, aten_fwd, ours_params, aten_params = make_forwards(case, x)
    if case.mode in ("inference_mode", "no_grad"):
        return {"ours": lambda: ours_fwd(x), "aten": lambda: aten_fwd(x)}
    x.requires_grad_()
    if case.mode == "grad":
        return {"ours": lambda: ours_fwd(x), "aten": lambda: aten_fwd(x)}
    g = torch.randn(rows, n, generator=gen, dtype=torch.float32).to(device=case.device, dtype=dtype)

    def fwd_bwd(fwd: Forward, inputs: tuple[Tensor, ...]) -> Call:
        return lambda: torch.autograd.grad(fwd(x), inputs, g)

    return {"ours": fwd_bwd(ours_fwd, (x, *ours_params)), "aten": fwd_bwd(aten_fwd, (x, *aten_params))}


def assert_same(ours: Tensor, aten: Tensor, what: str) -> None:
    """Loose agreement (a benchmark's sanity check, not a numerics test): bf16 to about 2 %, fp32 to 1e-4."""
    tol = 2e-2 if ours.dtype == torch.bfloat16 else 1e-4
    scale = max(1.0, aten.detach().abs().max().item())
    torch.testing.assert_close(ours, aten, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def check_case(case: Case) -> None:
    """Ours and ATen compute the same thing: outputs agree and, in the grad modes, so do all the gradients
    (so a missing or broken autograd formula fails the case instead of timing as fast)."""
    (rows, n), dtype = SHAPES[case.shape]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, n, generator=gen).to(device=case.device, dtype=dtype)
    g = torch.randn(rows, n, generator=gen).to(device=case.device, dtype=dtype)
    ours_fwd, aten_fwd, ours_params, aten_params = make_forwards(case, x)
    grad = case.mode in ("grad", "fwd+bwd")
    x.requires_grad_(grad)
    with mode_context(case.mode):
        ours, aten = ours_fwd(x), aten_fwd(x)
    assert_same(ours, aten, "output")
    if grad:
        ours_grads = torch.autograd.grad(ours, (x, *ours_params), g)
        aten_grads = torch.autograd.grad(aten, (x, *aten_params), g)
        for i, (a, b) in enumerate(zip(ours_grads, aten_grads, strict=True)):
            assert_same(a, b, "grad of input" if i == 0 else f"grad of parameter {i - 1}")


def mode_context(mode: str) -> AbstractContextManager[object]:
    if mode == "inference_mode":
        return torch.inference_mode()
    if mode == "no_grad":
        return torch.no_grad()
    return torch.enable_grad()


# ---- timing ------------------------------------------------------------------------------------------------


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


Clock = Callable[[], int]
CLOCKS: dict[str, Clock] = {"wall": time.perf_counter_ns, "thread": time.thread_time_ns}


def time_loop(call: Call, calls: int, device: str, clock: Clock) -> tuple[int, int]:
    """(host ns, synchronized ns) of `calls` back-to-back calls; on CPU both are the same."""
    sync(device)
    start = clock()
    for _ in range(calls):
        call()
    host = clock()
    sync(device)
    return host - start, clock() - start


def choose_calls(calls: dict[str, Call], device: str, clock: Clock, target_ms: float, max_calls: int) -> int:
    """K such that the slower implementation's loop takes about target_ms (after warming both up)."""
    probe = 8
    for _ in range(3):
        per_call_ns = max(time_loop(call, probe, device, clock)[1] / probe for call in calls.values())
        if per_call_ns * probe > 2e6:  # a 2 ms probe is long enough to estimate from
            break
        probe *= 8
    return max(1, min(max_calls, round(target_ms * 1e6 / per_call_ns)))


def measure(case: Case, opts: argparse.Namespace) -> list[Row]:
    check_case(case)
    calls = make_calls(case)
    clock = CLOCKS[opts.clock]
    with mode_context(case.mode):
        for call in calls.values():  # warm-up: caches, allocator, autograd graph code paths
            time_loop(call, opts.warmup, case.device, clock)
        k = opts.calls or choose_calls(calls, case.device, clock, opts.target_ms, opts.max_calls)
        host: dict[str, list[float]] = {impl: [] for impl in IMPLS}
        synced: dict[str, list[float]] = {impl: [] for impl in IMPLS}
        gc.collect()
        gc.disable()
        try:
            for r in range(opts.rounds):
                for impl in IMPLS if r % 2 == 0 else IMPLS[::-1]:
                    host_ns, sync_ns = time_loop(calls[impl], k, case.device, clock)
                    host[impl].append(host_ns / k / 1e3)
                    synced[impl].append(sync_ns / k / 1e3)
        finally:
            gc.enable()
    rows = [Row(case, "host", k, statistics.median(host["ours"]), statistics.median(host["aten"]))]
    if case.device == "cuda":
        rows.append(Row(case, "sync", k, statistics.median(synced["ours"]), statistics.median(synced["aten"])))
    return rows


def empty_call_us(clock: Clock, rounds: int = 5, calls: int = 200_000) -> float:
    """Cost of the harness itself (a loop over a do-nothing closure), per call."""

    def noop() -> None:
        return None

    return min(time_loop(noop, calls, "cpu", clock)[0] for _ in range(rounds)) / calls / 1e3


# ---- report ------------------------------------------------------------------------------------------------


def table(rows: Sequence[Row]) -> list[str]:
    lines = [
        "| device | api | op | shape | mode | ours us | ATen us | ours/ATen |",
        "|---|---|---|---|---|---:|---:|---:|",
    ]
    for row in rows:
        c = row.case
        lines.append(
            f"| {row.device_label} | {c.api} | {c.op} | {c.shape} | {c.mode} | {row.ours_us:.2f} | "
            f"{row.aten_us:.2f} | {row.ratio:.2f} |"
        )
    return lines


def worst_per_mode(rows: Sequence[Row]) -> str:
    parts = []
    for mode in MODES:
        of_mode = [row for row in rows if row.case.mode == mode]
        if of_mode:
            w = max(of_mode, key=lambda row: row.ratio)
            parts.append(f"{mode} {w.ratio:.2f} ({w.device_label} {w.case.api} {w.case.op} {w.case.shape})")
    return "Worst ours/ATen per mode: " + "; ".join(parts)


def clock_name(name: str) -> str:
    if name == "thread":
        return "time.thread_time_ns (CPU time of the calling thread, which runs every op and backward at 1 thread)"
    return "time.perf_counter_ns"


def header(opts: argparse.Namespace, devices: Sequence[str], harness_us: float, wall_s: float) -> list[str]:
    lines = report_head("layernorm_ext per-call overhead (ours vs ATen)", wall_s,
                        build=f"; loaded from {Path(layernorm_ext.__file__).parent}")  # fmt: skip
    if "cuda" in devices:
        lines.append(f"- cuda: {torch.cuda.get_device_name()} (torch CUDA {torch.version.cuda})")
    k = f"K = {opts.calls} calls per loop" if opts.calls else f"K calls per loop, about {opts.target_ms:g} ms"
    lines += [
        f"- method: {opts.rounds} rounds x ({k}) per implementation, alternating which goes first; "
        f"median per-call time over rounds; ours/ATen = ratio of the medians (> 1: ours slower); "
        f"{clock_name(opts.clock)}, gc off in the loops; harness cost of an empty call {harness_us * 1e3:.0f} ns "
        "(included in both columns)",
        "- modes: inference_mode / no_grad = forward in that context; grad = x and parameters require grad, "
        "forward only; fwd+bwd = forward + torch.autograd.grad(y, (x, *params), g)",
    ]
    if "cuda" in devices:
        lines.append(
            "- cuda rows: host time per call (dispatch + launch, no sync); cuda+sync rows: the same loop's wall "
            "time per call including one torch.cuda.synchronize() at its end"
        )
    return lines + [""]


# ---- main --------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per case (default 7)")
    p.add_argument("--target-ms", type=float, default=30.0, help="length of one timed loop (default 30 ms)")
    p.add_argument("--calls", type=int, default=0, help="fixed K calls per loop (default: from --target-ms)")
    p.add_argument("--max-calls", type=int, default=20_000, help="upper bound on the chosen K")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls per implementation and case")
    p.add_argument("--devices", type=comma_list(("cpu", "cuda")), default=None,
                   help="comma list (default: cpu, and cuda when available)")  # fmt: skip
    p.add_argument("--apis", type=comma_list(APIS), default=list(APIS))
    p.add_argument("--ops", type=comma_list(OPS), default=list(OPS))
    p.add_argument("--shapes", type=comma_list(tuple(SHAPES)), default=list(SHAPES),
                   help="comma list of: " + ", ".join(SHAPES))  # fmt: skip
    p.add_argument("--modes", type=comma_list(MODES), default=list(MODES))
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                   help="wall: time.perf_counter_ns (default); thread: time.thread_time_ns, this thread's\n"
                        "CPU time only (leaves out the time the OS gives other processes: for busy\n"
                        "machines; CPU and 1 thread only)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="smoke run: 3 rounds of ~2 ms loops, 5 warm-up calls")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.rounds, opts.target_ms, opts.warmup = 3, 2.0, 5
    if opts.devices is None:
        opts.devices = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    if "cuda" in opts.devices and not torch.cuda.is_available():
        p.error("--devices cuda: CUDA is not available")
    if opts.clock == "thread" and (opts.threads != 1 or "cuda" in opts.devices):
        p.error("--clock thread counts only the calling thread's CPU time: use it with --threads 1 --devices cpu")
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    torch.set_num_threads(opts.threads)
    started = time.perf_counter()
    harness_us = empty_call_us(CLOCKS[opts.clock])
    cases = [
        Case(device, api, op, shape, mode)
        for device in opts.devices
        for api in opts.apis
        for op in opts.ops
        for shape in opts.shapes
        for mode in opts.modes
    ]
    rows: list[Row] = []
    failures: list[str] = []
    for i, case in enumerate(cases, 1):
        try:
            new = measure(case, opts)
        except Exception as e:  # noqa: BLE001  (one broken case must not lose the rest of the table)
            message = str(e).strip().splitlines()[0] if str(e).strip() else ""
            name = f"{case.device} {case.api} {case.op} {case.shape} {case.mode}"
            failures.append(f"{name}: {type(e).__name__}: {message}")
            print(f"[{i}/{len(cases)}] FAILED {failures[-1]}", file=sys.stderr, flush=True)
            continue
        rows += new
        for row in new:
            print(f"[{i}/{len(cases)}] {row.device_label} {case.api} {case.op} {case.shape} {case.mode}: "
                  f"K={row.calls} ours {row.ours_us:.2f} us, ATen {row.aten_us:.2f} us, {row.ratio:.2f}",
                  file=sys.stderr, flush=True)  # fmt: skip
    report = [*header(opts, opts.devices, harness_us, time.perf_counter() - started), *table(rows), ""]
    return finish_report(report, failures, worst_per_mode(rows), opts.out)


if __name__ == "__main__":
    sys.exit(main())
