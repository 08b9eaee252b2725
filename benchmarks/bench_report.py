"""What bench.py reports and how: the results (Row, DecodeRow) and the run's log (Log), the markdown report
(summary, per-section and decode tables, machine info, method notes) and the plot."""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shlex
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import layernorm_ext
from bench_cases import BYTES_NOTE, DTYPES, IMPLS, LABELS, LN_EPS, MODES, OPS, PEERS, REFS, RMS_EPS, SIZES, Case

# ---------------------------------------------------------------------------------------------- results


@dataclass
class Row:
    case: Case
    seconds: dict[str, float | None]  # implementation or reference -> median seconds (None: n/a)

    def gbps(self, impl: str) -> float | None:
        s = self.seconds.get(impl)
        size = self.case.copy_bytes if impl in REFS else self.case.bytes
        return None if s is None else size / s / 1e9


@dataclass
class Log:
    """What the run tells besides the numbers: n/a reasons, mismatches, time spent compiling."""

    reasons: dict[str, set[str]] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    setup_s: dict[str, float] = field(default_factory=dict)

    def skip(self, impl: str, why: str) -> None:
        if why not in self.reasons.setdefault(impl, set()):
            print(f"  [{impl}] n/a: {why}", file=sys.stderr)
            self.reasons[impl].add(why)

    def failed(self, impl: str, case: Case, error: Exception) -> None:
        message = (str(error).strip().splitlines() or [""])[0][:200]
        self.skip(impl, f"{case.label()}: {type(error).__name__}: {message}")


@dataclass
class DecodeRow:
    op: str
    m: int
    n: int
    eager_us: dict[str, float | None]  # implementation -> microseconds per call, host included
    graph_us: dict[str, float | None]  # implementation -> microseconds per call replayed from a CUDA graph


# ---------------------------------------------------------------------------------------------- reporting


def fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def percent(fraction: float | None) -> str:
    return "—" if fraction is None else f"{100 * fraction:.0f}%"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def geomean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None and v > 0]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None


def sections(rows: list[Row]) -> dict[tuple[int, str, str], list[Row]]:
    """Rows grouped by (threads, mode, size), fewest threads first."""
    order = {m: i for i, m in enumerate(MODES)} | {s: i for i, s in enumerate(SIZES)}
    groups: dict[tuple[int, str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.case.threads, row.case.mode, row.case.size), []).append(row)
    keys = sorted(groups, key=lambda k: (k[0], order[k[1]], order[k[2]]))
    return {k: groups[k] for k in keys}


def section_title(key: tuple[int, str, str], opts: argparse.Namespace) -> str:
    threads, mode, size = key
    mb = opts.small_mb if size == "small" else opts.big_mb
    mode_name = "forward" if mode == "fwd" else "forward + backward"
    if opts.device == "cuda":
        return f"cuda · {mode_name} · {size}: x ≈ {mb:g} MiB"
    what = "cache-resident" if size == "small" else "beyond L3"
    unit = "thread" if threads == 1 else "threads"
    return f"{threads} {unit} · {mode_name} · {size}: x ≈ {mb:g} MiB ({what})"


def present_peers(rows: list[Row]) -> list[str]:
    return [p for p in PEERS if any(r.seconds.get(p) is not None for r in rows)]


def detail_table(rows: list[Row], peak: float | None = None) -> list[str]:
    """Per case: GB/s of each, speed ratios, ours/copy; with `peak` (the copy bandwidth C), every
    implementation's GB/s as a fraction of C."""
    peers = present_peers(rows)
    head = ["op", "dtype", "N", "M", "ours", *(LABELS[p] for p in peers), *REFS]
    head += [f"ours/{LABELS[p]}" for p in peers] + ["ours/copy"]
    if peak:
        head += [f"{LABELS[i]}/C" for i in ("ours", *peers)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = {op: i for i, op in enumerate(OPS)} | {d: i for i, d in enumerate(DTYPES)}
    for row in sorted(rows, key=lambda r: (order[r.case.op], order[r.case.dtype], r.case.n)):
        c, ours = row.case, row.gbps("ours")
        cells = [c.op, c.dtype, str(c.n), str(c.m), fmt(ours, ".1f")]
        cells += [fmt(row.gbps(p), ".1f") for p in (*peers, *REFS)]
        cells += [fmt(ratio(ours, row.gbps(p)), ".2f") for p in peers]
        cells.append(percent(ratio(ours, row.gbps("copy"))))
        if peak:
            cells += [percent(ratio(row.gbps(i), peak)) for i in ("ours", *peers)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def decode_table(rows: list[DecodeRow]) -> list[str]:
    impls = [i for i in ("ours", "aten", "liger", "quack") if any(r.eager_us.get(i) is not None for r in rows)]
    head = ["op", "N", "M"] + [f"{LABELS[i]} eager" for i in impls] + [f"{LABELS[i]} graph" for i in impls]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.op, str(r.n), str(r.m)]
        cells += [fmt(r.eager_us.get(i), ".1f") for i in impls] + [fmt(r.graph_us.get(i), ".2f") for i in impls]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def summary_table(groups: dict[tuple[int, str, str], list[Row]], peak: float | None = None) -> list[str]:
    """Per section, op and dtype: geometric mean over N of ours/peer (speed ratio) and of ours/copy (and of
    ours/C with the copy bandwidth `peak`)."""
    peers = [p for p in PEERS if any(p in present_peers(rows) for rows in groups.values())]
    head = ["threads", "mode", "size", "op", "dtype", *(f"ours/{LABELS[p]}" for p in peers), "ours/copy"]
    head += ["ours/C"] if peak else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (threads, mode, size), rows in groups.items():
        for op in OPS:
            for dtype in DTYPES:
                sub = [r for r in rows if r.case.op == op and r.case.dtype == dtype]
                if not sub:
                    continue
                cells = [str(threads), mode, size, op, dtype]
                cells += [fmt(geomean(ratio(r.gbps("ours"), r.gbps(p)) for r in sub), ".2f") for p in peers]
                cells.append(percent(geomean(ratio(r.gbps("ours"), r.gbps("copy")) for r in sub)))
                if peak:
                    cells.append(percent(geomean(ratio(r.gbps("ours"), peak) for r in sub)))
                lines.append("| " + " | ".join(cells) + " |")
    return lines


def cache_sizes() -> str:
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    found = []
    for index in sorted(base.glob("index*")):
        try:
            level, kind, size = ((index / f).read_text().strip() for f in ("level", "type", "size"))
        except OSError:
            continue
        if kind != "Instruction":
            found.append(f"L{level} {size}")
    return ", ".join(found) or "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(device: torch.device) -> list[str]:
    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "CPU": cpu_model(),
        "cores": f"{os.cpu_count()} logical, {len(os.sched_getaffinity(0))} usable; caches (cpu0): {cache_sizes()}",
        "OS": platform.platform(),
        "load average (1, 5, 15 min) when the run ended": ", ".join(f"{v:.2f}" for v in os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "layernorm_ext": f"{layernorm_ext.__version__}, build_info {layernorm_ext.build_info()}",
    }
    try:
        import onnxruntime

        info["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        info["onnxruntime"] = "not installed"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["GPU"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, L2 {props.L2_cache_size / 2**20:.0f} MiB"
        info["CUDA"] = str(torch.version.cuda)
    return [f"- {k}: {v}" for k, v in info.items()]


def method_notes(opts: argparse.Namespace, device: torch.device, log: Log, wall_s: float) -> list[str]:
    if device.type == "cuda":
        timing = (
            f"CUDA events around each call; before each call a write of 2x the L2 size evicts the data from L2 "
            f"(so 'small' is L2-cold too); median of {opts.budget.min_reps}..{opts.budget.max_reps} calls"
        )
    else:
        b = opts.budget
        timing = (
            f"time.perf_counter around each call; median of {b.min_reps}..{b.max_reps} calls per implementation "
            f"and case, as many as fit in {b.target_s:g} s (fewer, down to 1, when {b.min_reps} calls would take "
            f"over {b.cap_s:g} s)"
        )
    compile_how = "M and N static (one compile per shape)" if opts.compile_static else (
        "N static, M dynamic (mark_dynamic): one compile per (op, dtype, N, threads, fwd/fwd+bwd), "
        "shared by both sizes"
    )
    setup = ", ".join(f"{LABELS[k]} {v:.0f} s" for k, v in sorted(log.setup_s.items()))
    lines = [
        f"- Timing: {timing}, after a warm-up; the implementations of a case take turns "
        f"({opts.budget.rounds} rounds). GB/s = bytes / median time; ratios are speed ratios (>1: ours faster); "
        "ours/copy is our GB/s over the copy's.",
        "- Allocation policy: every timed call allocates its outputs — ours, ATen and torch.compile through the "
        "PyTorch allocator, ORT through its own allocator with the CPU memory arena disabled, and the copy as "
        "`torch.empty_like(x).copy_(x)` — so no implementation reuses a warm output buffer. On CPU, outputs "
        "above glibc's mmap threshold (32 MiB at most) are mmap'ed and page-faulted in every call, alike for all; "
        "copy_out (`out.copy_(x)` into a preallocated out) shows what the same copy does without that.",
        "- Peers: ATen eager = `F.layer_norm` / `F.rms_norm` (residual variants: `h = x + r`, then the norm); "
        f"torch.compile = the same functions, mode default, compiled outside the timing ({compile_how}); "
        "ORT (CPU, forward only) = LayerNormalization (opset 17) / SimplifiedLayerNormalization (its RMSNorm), "
        "residual variants as Add + norm (faster there than ORT's fused com.microsoft SkipLayerNormalization / "
        "SkipSimplifiedLayerNormalization, which stand in for bf16, where ORT's CPU Add has no kernel), "
        "intra_op_num_threads = threads; copy = `Tensor.copy_` of x (read x, write y).",
        f"- eps: {LN_EPS:g} for LayerNorm, finfo(float32).eps = {RMS_EPS:.3g} for RMSNorm (every implementation). "
        "Weight (and bias) in the input's dtype.",
        f"- Setup time outside the timing (compiles, ORT sessions, first calls): {setup}.",
        f"- Run time: {wall_s / 60:.1f} min.",
    ]
    if device.type == "cuda":
        lines.append(
            "- CUDA peers: Liger = liger_kernel's LigerLayerNormFunction / LigerRMSNormFunction (casting_mode "
            "'llama', not in place), residual variants as `x + r` then the norm; Quack = `quack.rmsnorm` (RMSNorm "
            "only; the residual variant fused with prenorm=True). Each is skipped when not importable."
        )
    if opts.peak_gbps:
        lines.append(
            f"- C = {opts.peak_gbps:.0f} GB/s: device-to-device copy bandwidth (a 1 GiB `copy_` into a preallocated "
            "buffer, bytes read + written, median of 20). 'X/C' columns: X's GB/s as a fraction of C."
        )
    if opts.decode:
        lines.append(
            "- Decode table: bf16, forward only, M rows of N. 'eager' = wall-clock microseconds per call over 200 "
            "back-to-back calls, host dispatch included; 'graph' = GPU microseconds per call, 20 calls captured in "
            "a CUDA graph and replayed between CUDA events (inputs and weights stay in L2)."
        )
    if opts.min_rows or opts.max_mb:
        lines.append(
            f"- Big size: x of about {opts.big_mb:g} MiB, at least {opts.min_rows} rows, but x at most "
            f"{opts.max_mb:g} MiB (fewer rows for the longest rows)."
        )
    if log.mismatches:
        lines.append(f"- **Output mismatches vs ATen ({len(log.mismatches)}):** " + "; ".join(log.mismatches[:20]))
    for impl, reasons in sorted(log.reasons.items()):
        lines.append(f"- {LABELS[impl]} n/a: " + "; ".join(sorted(reasons)[:5]))
    return lines


def command_line() -> str:
    return "python benchmarks/bench.py " + shlex.join(sys.argv[1:])


def report(
    rows: list[Row],
    opts: argparse.Namespace,
    device: torch.device,
    log: Log,
    wall_s: float,
    decode: list[DecodeRow] | None = None,
) -> str:
    groups = sections(rows)
    lines = [
        f"# layernorm_ext benchmark ({device.type})",
        "",
        f"Regenerate: `{command_line()}`",
        "",
        "## Machine",
        "",
        *machine_info(device),
        "",
        "## Method",
        "",
        *method_notes(opts, device, log, wall_s),
        "",
        "```text",
        BYTES_NOTE,
        "```",
        "",
        "## Summary (geometric mean over N)",
        "",
        *summary_table(groups, opts.peak_gbps),
    ]
    for key, sub in groups.items():
        lines += ["", f"## {section_title(key, opts)}", "", "GB/s, higher is better.", ""]
        lines += detail_table(sub, opts.peak_gbps)
    if decode:
        lines += ["", "## decode: microseconds per call (lower is better)", "", *decode_table(decode)]
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path, opts: argparse.Namespace, device: torch.device) -> None:
    """GB/s against N, one line per implementation, one subplot per (op, dtype): the fewest threads, the size
    --plot-size and the forward pass when measured (else what was)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = min(r.case.threads for r in rows)
    size = opts.plot_size if any(r.case.size == opts.plot_size for r in rows) else rows[0].case.size
    mode = "fwd" if any(r.case.mode == "fwd" for r in rows) else "fwdbwd"
    sel = [r for r in rows if (r.case.threads, r.case.size, r.case.mode) == (threads, size, mode)]
    ops = [op for op in OPS if any(r.case.op == op for r in sel)]
    dtypes = [d for d in DTYPES if any(r.case.dtype == d for r in sel)]
    fig, axes = plt.subplots(len(ops), len(dtypes), figsize=(4.6 * len(dtypes), 3.3 * len(ops)), squeeze=False)
    styles = {"ours": "o-", "aten": "s--", "compile": "^--", "ort": "d--", "copy": "kx:", "copy_out": "+:"}
    for i, op in enumerate(ops):
        for j, dtype in enumerate(dtypes):
            ax = axes[i][j]
            sub = sorted((r for r in sel if r.case.op == op and r.case.dtype == dtype), key=lambda r: r.case.n)
            for impl in (*IMPLS, *REFS):
                pts = [(r.case.n, g) for r in sub if (g := r.gbps(impl)) is not None]
                if pts:
                    extra = {"color": "0.6"} if impl == "copy_out" else {}
                    ax.plot(*zip(*pts), styles[impl], label=LABELS[impl], markersize=4, linewidth=1.4, **extra)
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{op} · {dtype}", fontsize=10)
            ax.grid(True, alpha=0.3)
            if i == len(ops) - 1:
                ax.set_xlabel("N (row length)")
            if j == 0:
                ax.set_ylabel("GB/s")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False, bbox_to_anchor=(0.5, 0.995))
    mb = opts.big_mb if size == "big" else opts.small_mb
    fig.suptitle(
        f"{device.type}: {'forward' if mode == 'fwd' else 'forward+backward'}, {threads} thread(s), x ≈ {mb:g} MiB "
        f"— {cpu_model() if device.type == 'cpu' else torch.cuda.get_device_name(device)}",
        y=0.965,
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
