#!/usr/bin/env python
"""Memory-bandwidth benchmark of layernorm_ext against ATen eager, torch.compile, ONNX Runtime and a plain copy.

    python benchmarks/bench.py --device cpu --threads 1,2 --out benchmarks/RESULTS.md --plot benchmarks/cpu_fwd.png
    python benchmarks/bench.py --device cuda
    python benchmarks/bench.py --quick                       # smoke run, about a minute
    python benchmarks/bench.py --gpu-check --out gpu.md       # the GPU check's sweep (benchmarks/gpu_check.sh)

Every case is one (op, dtype, N, size, mode, threads): op in layer_norm, rms_norm, add_layer_norm, add_rms_norm;
rows of N elements, M rows chosen so that x is about --small-mb (cache-resident) or --big-mb (far beyond L3);
mode fwd, or fwd+bwd (gradients for the input, residual, weight and bias, timed together with the forward).
Norms are over the last dim, with a weight (and a bias for LayerNorm) of the input's dtype.

Results are GB/s (bytes moved, see BYTES_NOTE, over the median time), the ratio of ours to each peer, and the
fraction of the bandwidth of a copy of x (torch.empty_like(x).copy_(x)) of the same shape and dtype.
See benchmarks/README.md for the method.
"""

# This file: the sweep (run_all, run_decode) and the command line. The cases and constants are in bench_cases.py,
# the implementations in bench_impls.py, the timers in bench_timing.py, the results and the report in
# bench_report.py.

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from bench_cases import (
    CPU_IMPLS,
    CUDA_IMPLS,
    DECODE_MS,
    DECODE_NS,
    DECODE_OPS,
    DTYPES,
    GPU_CHECK_NS,
    IMPLS,
    LABELS,
    MODES,
    NS,
    OPS,
    REFS,
    SIZES,
    Args,
    Case,
    Data,
    case_args,
    case_rows,
    make_data,
)
from bench_impls import Unsupported, build_call, first_output, norm_call, peer_fn
from bench_report import DecodeRow, Log, Row, fmt, plot, report
from bench_timing import (
    Budget,
    Call,
    CpuTimer,
    CudaTimer,
    Timer,
    copy_peak_gbps,
    decode_eager_us,
    decode_graph_us,
    reps_for,
    warm_up,
)

# ---------------------------------------------------------------------------------------------- measuring

TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def check(impl: str, result: object, reference: Tensor, case: Case, log: Log) -> None:
    dtype = DTYPES[case.dtype]
    got = first_output(impl, result, dtype).float()
    ref = reference.float()
    tol = TOLERANCE[dtype]
    bad = (got - ref).abs() > tol * (1 + ref.abs())
    if bool(bad.any()):
        worst = float((got - ref).abs().max())
        log.mismatches.append(f"{impl} {case.label()}: max |diff| vs ATen {worst:.3g} > {tol:g}*(1+|ref|)")
        print(f"  MISMATCH {log.mismatches[-1]}", file=sys.stderr)


def prepare(
    impls: Iterable[str], case: Case, args: Args, opts: argparse.Namespace, timer: Timer, log: Log
) -> dict[str, Call]:
    """Build each implementation and run it once, untimed: compile, ORT session setup, Triton JIT, first touch;
    the output is checked against ATen in small forward cases. At the big size ours, ATen and the copies skip
    that call when the small size ran the same code first (each call takes long and has nothing to set up).
    Implementations that cannot run this case are left out (and logged)."""
    calls: dict[str, Call] = {}
    reference: Tensor | None = None
    for impl in sorted(impls, key=lambda i: i != "aten"):  # ATen first: its output is the reference
        start = time.perf_counter()
        try:
            fn = build_call(impl, case, args, opts)
            if case.size == "big" and "small" in opts.sizes and impl not in ("compile", "ort", "liger", "quack"):
                calls[impl] = fn
                continue
            result = fn()
            timer.sync()
        except Unsupported as e:
            log.skip(impl, str(e))
            continue
        except Exception as e:  # noqa: BLE001  (a peer that fails on a case is reported, not fatal)
            log.failed(impl, case, e)
            continue
        log.setup_s[impl] = log.setup_s.get(impl, 0.0) + time.perf_counter() - start
        if impl == "aten" and case.mode == "fwd":
            reference = result[0]  # type: ignore[index]
        elif impl not in REFS and reference is not None and case.mode == "fwd" and case.size == "small":
            check(impl, result, reference, case, log)
        del result
        calls[impl] = fn
    return calls


def measure(calls: dict[str, Call], case: Case, timer: Timer, budget: Budget, log: Log) -> dict[str, float]:
    """Median seconds per call of each implementation: warm-up, then reps scaled to the time budget, taken in
    turns (rounds) by the implementations."""
    warm: dict[str, list[float]] = {}
    for impl, fn in list(calls.items()):
        try:
            warm[impl] = warm_up(timer, fn, budget.target_s / 10)
        except Exception as e:  # noqa: BLE001  (only reachable where prepare did not run the call)
            log.failed(impl, case, e)
            del calls[impl]
    estimate = {impl: statistics.median(times) for impl, times in warm.items()}
    # A warm-up of a single call (slower than the warm-up time) is in steady state: it counts as a sample.
    samples = {impl: times if len(times) == 1 else [] for impl, times in warm.items()}
    todo = {impl: max(0, reps_for(estimate[impl], budget) - len(samples[impl])) for impl in calls}
    for turn in range(budget.rounds):
        for impl, fn in calls.items():
            share = todo[impl] * (turn + 1) // budget.rounds - todo[impl] * turn // budget.rounds
            samples[impl] += timer(fn, share)
    return {impl: statistics.median(times) for impl, times in samples.items()}


def run_case(
    case: Case,
    data: Data,
    impls: Sequence[str],
    refs: dict[tuple[int, str, str, int], dict[str, float | None]],
    opts: argparse.Namespace,
    timer: Timer,
    log: Log,
) -> Row:
    """Times the implementations, and the references on the first case of each (threads, dtype, size, N)."""
    args = case_args(data, case)
    key = (case.threads, case.dtype, case.size, case.n)
    todo = list(impls) if key in refs else [*impls, *REFS]
    medians = measure(prepare(todo, case, args, opts, timer, log), case, timer, opts.budget, log)
    if key not in refs:
        refs[key] = {ref: medians.get(ref) for ref in REFS}
    return Row(case, {impl: medians.get(impl) for impl in impls} | refs[key])


def progress(row: Row, index: int, total: int, started: float) -> None:
    cells = [f"{LABELS[i]} {g:.1f}" for i in (*IMPLS, *REFS) if (g := row.gbps(i)) is not None]
    elapsed = time.perf_counter() - started
    print(f"[{index}/{total} {elapsed:5.0f}s] {row.case.label()}: " + ", ".join(cells) + " GB/s", file=sys.stderr)


def run_all(opts: argparse.Namespace, device: torch.device, timer: Timer, log: Log) -> list[Row]:
    """Loops over cases: data per (dtype, N, size); torch.compile caches reset per (dtype, N, threads, op)."""
    impls = [i for i in IMPLS if i in opts.impls]
    total = len(opts.dtypes) * len(opts.ns) * len(opts.threads) * len(opts.ops) * len(opts.sizes) * len(opts.modes)
    rows: list[Row] = []
    refs: dict[tuple[int, str, str, int], dict[str, float | None]] = {}
    started = time.perf_counter()
    for dtype in opts.dtypes:
        for n in opts.ns:
            ms = {size: case_rows(n, dtype, size, opts) for size in opts.sizes}
            datas = {size: make_data(m, n, DTYPES[dtype], device, opts.seed) for size, m in ms.items()}
            for threads in opts.threads:
                torch.set_num_threads(threads)
                for op in opts.ops:
                    torch._dynamo.reset()
                    for size in opts.sizes:
                        for mode in opts.modes:
                            case = Case(op, dtype, n, ms[size], size, mode, threads)
                            rows.append(run_case(case, datas[size], impls, refs, opts, timer, log))
                            progress(rows[-1], len(rows), total, started)
            del datas
            gc.collect()
    torch._dynamo.reset()
    return rows


def run_decode(opts: argparse.Namespace, device: torch.device, log: Log) -> list[DecodeRow]:
    """Decode-sized calls (M = 1..16 rows, bf16, forward only): latency per call, eager and from a CUDA graph."""
    impls = [i for i in ("ours", "aten", "liger", "quack") if i in opts.impls]
    rows = []
    for n in DECODE_NS:
        for m in DECODE_MS:
            data = make_data(m, n, torch.bfloat16, device, opts.seed)
            for op in DECODE_OPS:
                case = Case(op, "bf16", n, m, "decode", "fwd", 1)
                args = case_args(data, case)
                eager: dict[str, float | None] = {}
                graph: dict[str, float | None] = {}
                for impl in impls:
                    try:
                        fn = norm_call(peer_fn(impl, op), args, "fwd")
                        eager[impl] = decode_eager_us(fn)
                    except Unsupported as e:
                        log.skip(impl, str(e))
                        continue
                    except Exception as e:  # noqa: BLE001
                        log.failed(impl, case, e)
                        continue
                    try:
                        graph[impl] = decode_graph_us(fn)
                    except Exception as e:  # noqa: BLE001  (a peer that cannot be captured is reported)
                        log.failed(impl, replace(case, size="decode graph"), e)
                        graph[impl] = None
                rows.append(DecodeRow(op, m, n, eager, graph))
                cells = ", ".join(f"{LABELS[i]} {v:.1f}/{fmt(graph.get(i), '.1f')}" for i, v in eager.items())
                print(f"  decode {op} M={m} N={n}: {cells} us (eager/graph)", file=sys.stderr)
    return rows


# ---------------------------------------------------------------------------------------------- command line


def csv(kind: Callable[[str], object], choices: Sequence[object] | None = None) -> Callable[[str], list]:
    def parse(text: str) -> list:
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
        bad = [v for v in values if choices is not None and v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(map(str, choices or []))}")
        return values

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ops", type=csv(str, OPS), default=list(OPS))
    p.add_argument("--dtypes", type=csv(str, list(DTYPES)), default=list(DTYPES))
    p.add_argument("--ns", type=csv(int), default=None, help=f"row lengths N (default {','.join(map(str, NS))})")
    p.add_argument("--threads", type=csv(int), default=None, help="CPU thread counts (default 1,<all usable>)")
    p.add_argument("--modes", type=csv(str, MODES), default=list(MODES))
    p.add_argument("--sizes", type=csv(str, SIZES), default=list(SIZES))
    p.add_argument("--small-mb", type=float, default=1.0, help="MiB of x for the cache-resident size (default 1)")
    p.add_argument("--big-mb", type=float, default=None, help="MiB of x for the big size (default 64; cuda 256)")
    p.add_argument("--impls", type=csv(str, IMPLS), default=None,
                   help="ours,aten,compile,ort,liger,quack (copy: always; default: cpu without Liger and Quack, "
                   "cuda without ORT)")
    p.add_argument("--min-rows", type=int, default=0, help="big size: at least this many rows")
    p.add_argument("--max-mb", type=float, default=0.0, help="big size: but x at most this many MiB (0: no cap)")
    p.add_argument("--decode", action="store_true", help="cuda: add the decode latency table (M 1..16)")
    p.add_argument("--gpu-check", action="store_true",
                   help="the GPU check's sweep (cuda): N 256..262144, bf16 and fp32, layer_norm, rms_norm and "
                   "add_rms_norm, M >= 8192 rows with x <= 1 GiB, ours/ATen/Liger/Quack, few calls, copy "
                   "bandwidth C, decode table; about two minutes on an H200")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--compile-static", action="store_true", help="compile M static too (one compile per shape)")
    p.add_argument("--target-s", type=float, default=None, help="timed seconds per implementation and case")
    p.add_argument("--min-reps", type=int, default=None)
    p.add_argument("--max-reps", type=int, default=None)
    p.add_argument("--cap-s", type=float, default=None, help="fewer reps (>= 1) when min-reps would exceed this")
    p.add_argument("--rounds", type=int, default=None, help="turns the implementations of a case take")
    p.add_argument("--quick", action="store_true", help="smoke run: N 512,4096, 1 thread, 8 MiB, few reps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    p.add_argument("--plot", type=Path, default=None, help="write the PNG plot here")
    p.add_argument("--plot-size", choices=SIZES, default="big", help="the size the plot shows (default big)")
    opts = p.parse_args(argv)
    return resolve(opts)


def resolve(opts: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on --quick and --device."""
    if opts.gpu_check:
        opts.device = "cuda"
        opts.ns = opts.ns or list(GPU_CHECK_NS)
        opts.dtypes = ["bf16", "fp32"] if opts.dtypes == list(DTYPES) else opts.dtypes
        opts.ops = ["layer_norm", "rms_norm", "add_rms_norm"] if opts.ops == list(OPS) else opts.ops
        opts.sizes = ["big"] if opts.sizes == list(SIZES) else opts.sizes
        opts.impls = opts.impls or ["ours", "aten", "liger", "quack"]
        opts.min_rows = opts.min_rows or 8192
        opts.max_mb = opts.max_mb or 1024.0
        opts.target_s = opts.target_s or 0.01
        opts.min_reps = opts.min_reps or 10
        opts.max_reps = opts.max_reps or 100
        opts.decode = True
    cuda = opts.device == "cuda"
    q = opts.quick
    opts.impls = opts.impls or list(CUDA_IMPLS if cuda else CPU_IMPLS)
    opts.peak_gbps = None  # measured by main on CUDA
    opts.ns = opts.ns or ([512, 4096] if q else list(NS))
    opts.threads = sorted(set(opts.threads or ([1] if q or cuda else [1, len(os.sched_getaffinity(0))])))
    opts.big_mb = opts.big_mb or (8.0 if q else 256.0 if cuda else 64.0)
    if opts.no_compile:
        opts.impls = [i for i in opts.impls if i != "compile"]
    opts.budget = Budget(
        target_s=opts.target_s or (0.01 if q else 0.05),
        min_reps=opts.min_reps or (100 if cuda else 3),
        max_reps=opts.max_reps or (10_000 if cuda else 30 if q else 2_000),
        cap_s=opts.cap_s or (1e9 if cuda else 0.3),
        rounds=opts.rounds or (1 if q else 2),
    )
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device(opts.device)
    timer: Timer = CudaTimer(device) if device.type == "cuda" else CpuTimer()
    log = Log()
    started = time.perf_counter()
    if device.type == "cuda":
        opts.peak_gbps = copy_peak_gbps(device)
        print(f"copy bandwidth C = {opts.peak_gbps:.0f} GB/s", file=sys.stderr)
    rows = run_all(opts, device, timer, log)
    decode = run_decode(opts, device, log) if opts.decode and device.type == "cuda" else None
    text = report(rows, opts, device, log, time.perf_counter() - started, decode)
    print(text)
    if opts.out:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(text)
        print(f"wrote {opts.out}", file=sys.stderr)
    if opts.plot and rows:
        plot(rows, opts.plot, opts, device)
        print(f"wrote {opts.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
