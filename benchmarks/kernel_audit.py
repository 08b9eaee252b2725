"""Kernel audit: properties of the compiled CUDA kernels that decide their speed, read without a GPU from the
built library's SASS (cuobjdump) and the dispatcher's launch plan (layernorm_ext._C.cuda_launch_plan).

For every dispatched kernel (LayerNorm and RMSNorm, bf16 and fp32, forward, backward and the forward with
quantized output (forward_quant: one variant, QUANT_VARIANT), N in SIZES, sm_80 and sm_90): registers, spills,
CTAs and threads per SM, bytes of loads a thread issues before their first use, KB of loads in flight per SM,
barriers, FP64 instructions and instructions per element on a row's hot path, and DRAM bytes per element. The
method, and what is approximate in it, is in benchmarks/README.md ("Kernel audit").

    python benchmarks/kernel_audit.py --out benchmarks/RESULTS-kernel-audit.md   # tables and every target
    python benchmarks/kernel_audit.py --check     # CI: exit 1 on a missed target not in KNOWN_MISSES_FILE,
                                                  # or on a known miss that got worse
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass  # noqa: E402

SIZES = (256, 512, 1024, 2048, 4096, 5120, 8192, 16384, 32768, 65536, 131072, 262144)
OPS = ("layer_norm", "rms_norm")
DTYPES = ("bfloat16", "float32")
# forward_quant: the forward with quantized output (codes and a scale per row instead of out; QUANT_VARIANT).
DIRECTIONS = ("forward", "backward", "forward_quant")
ROWS_BYTES = 256 << 20  # rows per case: the input holds 256 MiB, as the CUDA benchmark's big size
DEBUG = bool(os.environ.get("KERNEL_AUDIT_DEBUG"))
# Text after this line in the --out file is written by hand (the comparison with earlier analyses): kept.
NOTES_MARKER = "<!-- notes below: kept when kernel_audit.py rewrites this file -->"
KNOWN_MISSES_FILE = Path(__file__).resolve().parent / "kernel_audit_known_misses.tsv"
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True)
class Arch:
    name: str
    sms: int
    param_base: int  # offset of the first kernel parameter in constant bank 0
    shared_per_sm: int  # bytes, the largest carveout
    shared_per_block: int  # opt-in maximum per block
    shared_reserved: int = 1024  # per block, by the system
    registers: int = 65536
    max_threads: int = 2048
    max_blocks: int = 32

    @property
    def compute_capability(self) -> int:  # 90 for sm_90: the plan's clusters
        return int(self.name.removeprefix("sm_"))


ARCHS = {
    "sm_80": Arch("sm_80", sms=108, param_base=0x160, shared_per_sm=167936, shared_per_block=166912),
    "sm_90": Arch("sm_90", sms=132, param_base=0x210, shared_per_sm=233472, shared_per_block=232448),
}
TARGET_ARCH = "sm_90"

# Pointer fields of the kernels' argument structs (forward_kernels.cuh ForwardArgs, backward_kernels.cuh
# BackwardArgs), in order from the first parameter: a memory access is attributed to a stream by the pointer its
# address derives from. Keep in step with the structs (the audit fails when the input stream is not found).
FORWARD_POINTERS = ("input", "residual", "weight", "bias", "out", "residual_out", "mean", "rstd")
BACKWARD_POINTERS = ("grad_out", "grad_residual_out", "saved", "mean", "rstd", "weight", "bias", "grad_input",
                     "partial_dweight", "partial_dbias")
# The long backward's second parameter, after BackwardArgs<float> (128 bytes): the rows' terms [rows, 4] (mean,
# delta, mean_g, k) that backward_long_sums_kernel writes and backward_long_kernel reads (per row, not per element).
BACKWARD_ARGS_BYTES = 128
# Run-time flags of the plain kernels that the audited call fixes, decided as QUANT_VARIANT's fields are (below):
# BackwardArgs.saved_is_output (byte 116; false: the default mode saves the input), with which every backward
# kernel picks one of two copies of its row code (the other, the memory-efficient mode's, derives the input from
# the output); forward_long_kernel's `staged` and `whole_chunks` parameters (bytes 0 and 1 after ForwardArgs), the
# plan's.
SAVED_IS_OUTPUT_OFFSET = 116
# A pointer value for the parameters the audited call gives (weight, bias): any non-null address, both words non-zero.
NON_NULL_POINTER = 0x00007F0012340000
# QuantArgs (forward_kernels.cuh), the quantized kernels' second parameter: its pointer fields by byte offset, and
# where it starts: after ForwardArgs<float> (120 bytes; float is the compute type of bf16 and fp32 rows), and in
# forward_long_kernel after its `staged` and `whole_chunks` flags too (8-byte aligned).
QUANT_POINTERS = {"codes": 0, "scale": 8, "scale_ub": 16, "row_scales": 24, "block_scales": 48}
FORWARD_ARGS_BYTES = 120
QUANT_ARGS_OFFSET = {"rows": FORWARD_ARGS_BYTES, "long": FORWARD_ARGS_BYTES + 8}
# The audited quantized variant, vLLM's rms_norm_dynamic_per_token_quant to float8_e4m3fn (its LayerNorm
# counterpart for layer_norm): a dynamic scale per row from the row's absmax, no scale_ub, no groups. The QuantArgs
# fields it fixes, as (offset, bytes, value): the kernel's run-time branches on them are decided
# (sass.decided_successors), the other variants' code is off the path.
QUANT_VARIANT = {"scale": (8, 8, 0), "scale_ub": (16, 8, 0), "code": (32, 1, 0),  # quant::Code::kE4m3fn
                 "group_units": (36, 4, 0), "block_scales": (48, 8, 0), "swizzled": (72, 1, 0)}
# The integer fields of ForwardArgs<float> / BackwardArgs<float> that the launcher sets from the plan (offset, bytes),
# and the launch's block size in constant bank 0 (blockDim.x): with them (and the thread THREAD) the audit follows a
# thread's index arithmetic to its branches (which of its packs hold values of the row).
FORWARD_ARG_FIELDS = {"rows": (64, 8), "cols": (72, 8), "units": (80, 8), "weight_offset": (104, 4),
                      "cast_before_weight": (108, 1), "lanes": (112, 4), "rows_per_block": (116, 4)}
BACKWARD_ARG_FIELDS = {"rows": (80, 8), "cols": (88, 8), "units": (96, 8), "lanes": (120, 4),
                       "rows_per_block": (124, 4)}
BLOCK_DIM_X_OFFSET = 0x0
# The audited thread: thread 0 of block 0 (and of its cluster): lane 0 of its row.
THREAD = {"SR_TID.X": 0, "SR_CTAID.X": 0, "SR_CgaCtaId": 0}
# A thread-block cluster's barrier (cluster.sync(): arrive, then wait): counted once, as a barrier.
CLUSTER_BARRIERS = ("UCGABAR_ARV", "UCGABAR_WAIT")
CLUSTER_BARRIER_WAIT = "UCGABAR_WAIT"
# Streams with one access per element (DRAM traffic); weight / bias are per column (L2), mean / rstd per row.
ELEMENT_STREAMS = {"input", "residual", "out", "residual_out", "grad_out", "grad_residual_out", "saved",
                   "grad_input", "partial_dweight", "partial_dbias", "codes"}


def call_streams(op: str, direction: str) -> tuple[set[str], set[str]]:
    """(used, unused) streams of the audited call: the plain op with weight (and bias for LayerNorm), no
    residual, no quantized output; the backward of the default (non memory-efficient) mode; the quantized forward
    of QUANT_VARIANT (codes and the rows' scales; no out, no statistics)."""
    rms = op == "rms_norm"
    if direction == "forward_quant":
        used = {"input", "weight", "codes", "row_scales"} | (set() if rms else {"bias"})
        return used, (set(FORWARD_POINTERS) | set(QUANT_POINTERS)) - used
    if direction == "forward":
        used = {"input", "weight", "out", "rstd"} | (set() if rms else {"bias", "mean"})
        return used, set(FORWARD_POINTERS) - used
    used = {"grad_out", "saved", "rstd", "weight", "grad_input", "partial_dweight", "row_terms"}
    used |= set() if rms else {"mean", "partial_dbias"}
    return used, (set(BACKWARD_POINTERS) | {"row_terms"}) - used


class AttributionError(RuntimeError):
    """The audit cannot vouch for a path's figures: a global access the kernel can run is attributed to no pointer
    (or to several), or the path misses a stream the kernel must read or write. Its figures would leave that
    traffic out (as the long forward's normalize pass was, unseen, until 2026-12-02)."""


def expected_streams(op: str, direction: str, role: str = "rows") -> tuple[set[str], set[str], set[str]]:
    """(loads, stores) a row's path must hold, and stores the kernel must hold somewhere (outside the row
    region: the rows and cluster backward's partials, written once per block after its rows), by kernel role:
    "rows" (every kernel but the long backward's), "sums" (backward_long_sums_kernel: dy and saved in, the rows'
    terms out), "columns" (backward_long_kernel: dx and the partials of its group of rows)."""
    partials = {"partial_dweight"} | (set() if op == "rms_norm" else {"partial_dbias"})
    if direction == "forward":
        return {"input"}, {"out"}, set()
    if direction == "forward_quant":
        return {"input"}, {"codes", "row_scales"}, set()
    if role == "sums":
        return {"grad_out", "saved"}, {"row_terms"}, set()
    if role == "columns":
        return {"grad_out", "saved", "row_terms"}, {"grad_input"} | partials, set()
    return {"grad_out", "saved"}, {"grad_input"}, partials


# ---- occupancy -------------------------------------------------------------------------------------------------


def blocks_per_sm(arch: Arch, registers: int, shared: int, threads: int) -> int:
    """Resident blocks per SM, as the CUDA occupancy calculator: registers allocated per warp in units of 256
    (8 per thread), in four sub-partitions of 16K; shared memory plus 1 KB reserved per block."""
    warps = math.ceil(threads / 32)
    per_warp = math.ceil(max(registers, 1) / 8) * 8 * 32
    by_registers = 4 * ((arch.registers // 4) // per_warp) // warps
    by_shared = arch.shared_per_sm // (shared + arch.shared_reserved)
    by_threads = arch.max_threads // (warps * 32)
    return max(0, min(by_registers, by_shared, by_threads, arch.max_blocks))


# ---- the hot path of a row -----------------------------------------------------------------------------------


@dataclass
class PathFigures:
    instructions: float = 0.0  # per thread per row
    fp64: float = 0.0
    barriers: float = 0.0
    shuffles: float = 0.0  # SHFL, per thread per row: the reductions' steps
    element_bytes: float = 0.0  # per thread per row, streams of ELEMENT_STREAMS
    loads_before_use: int = 0  # peak bytes per thread of global loads issued and not yet consumed
    row_loads_before_use: int = 0  # the same, loads of ELEMENT_STREAMS only (DRAM; weight / bias hit L2)
    streams_found: set[str] = field(default_factory=set)
    path: list[int] = field(default_factory=list)  # the blocks of the path (sass.basic_blocks indices)


def parameter_bytes(offset: int, value: int, size: int) -> dict[int, int]:
    """A kernel parameter's bytes as the known-bytes map of sass.decided_successors wants them (little-endian)."""
    return {offset + k: (value >> (8 * k)) & 0xFF for k in range(size)}


def streams_of(blocks: list[sass.Block], stream: dict[int, str | None], block_ids: Iterable[int]) -> set[str]:
    """The streams the blocks' global accesses are attributed to."""
    return {stream[i.address] for b in block_ids for i in blocks[b].instructions if stream.get(i.address)}


def analyze_row_path(function: sass.Function, arch: Arch, plan: dict, op: str, direction: str) -> PathFigures:
    """Per thread and row: the hot path through the kernel for the audited call, and its figures.

    The row region is the body of the loop over rows (or the whole kernel). The path through it is chosen
    without running anything: blocks touching a stream the call does not use (residual, quantized output) are
    excluded; among the rest the path with most accesses to the call's streams (and, when a row spans warps,
    the all-reduce's shared-memory writes; the stage's accesses when staged; entries of loops that run) wins,
    ties to the fewest instructions. Loops count trip / unroll times:
    column loops ceil(units / threads), shuffle loops log2(lanes in a warp), shared-memory merge loops
    ceil(warps of the row / 32); of a loop and its remainder loops only the most unrolled counts.
    Accesses are attributed to a pointer along the control-flow graph (sass.attributed_accesses), its branches
    decided by the parameters the call fixes (saved_is_output, staged; QUANT_VARIANT's fields) and, given
    plan["args"] (launch_arguments), by thread 0's index arithmetic on its first row: only their taken side is
    kept. AttributionError where an access the call can run has no pointer, or the path lacks a stream of
    expected_streams. forward_quant: the loops folding the warps' absmax (shared or distributed shared memory)
    count (warps of the row) / (states per iteration) times."""
    forward = direction != "backward"
    pointers_list = FORWARD_POINTERS if forward else BACKWARD_POINTERS
    pointers = {arch.param_base + 8 * i: name for i, name in enumerate(pointers_list)}
    if not forward:  # the long backward's row_terms (no other backward kernel has a second parameter)
        pointers[arch.param_base + BACKWARD_ARGS_BYTES] = "row_terms"
    known: dict[int, int] = {}  # parameter bytes the audited variant fixes
    if direction == "forward_quant":
        quant_base = arch.param_base + QUANT_ARGS_OFFSET["rows" if plan["packs"] else "long"]
        pointers.update({quant_base + offset: name for name, offset in QUANT_POINTERS.items()})
        for offset, size, value in QUANT_VARIANT.values():
            known.update(parameter_bytes(quant_base + offset, value, size))
    if not forward:  # the default mode saves the input (the memory-efficient mode's copy of the code is off the path)
        known[arch.param_base + SAVED_IS_OUTPUT_OFFSET] = 0
    elif not plan["packs"]:  # forward_long_kernel's `staged` and `whole_chunks`: the plan's
        known[arch.param_base + FORWARD_ARGS_BYTES] = int(plan["staged"])
        known[arch.param_base + FORWARD_ARGS_BYTES + 1] = int(plan.get("whole_chunks", False))
    used, unused = call_streams(op, direction)
    # The call's weight (and LayerNorm's bias) pointers are not null: the branches on them take that side. Left
    # undecided, a branch holding only arithmetic (no access to tell the sides apart) went by the fewest
    # instructions, i.e. without the weight's multiply and the bias' add (FMUL 35 for the 32 values of a bf16
    # LayerNorm forward thread at N = 2048, where the weight alone needs 32 more). So are the backward's partial
    # dweight (and dbias) buffers: left undecided, the path went around the row's dweight and dbias terms, held in
    # registers (3 instructions per element of the bf16 LayerNorm backward, uncounted until 2026-12-05).
    for name in ("weight", "bias", "partial_dweight", "partial_dbias"):
        if name in used and name in pointers_list:
            offset = arch.param_base + 8 * pointers_list.index(name)
            known.update(parameter_bytes(offset, NON_NULL_POINTER, 8))
    lanes, threads = plan["lanes"], plan["threads"]
    cluster = plan.get("cluster", 1)  # blocks per row (a thread-block cluster): the row's threads are lanes
    row_spans_warps = lanes > 32
    units = -(-plan["cols"] // plan["vec"])

    first_stream = "input" if forward else "grad_out"

    def attribute(specials: dict[str, int] | None = None, first_pass: frozenset = frozenset()):
        """Every global access attributed to the pointer its address derives from, along the control-flow graph's
        edges that `known` (and the thread `specials` names, on the first pass of `first_pass`'s loop) leaves taken
        (sass.reaching_parameters), once per kernel and call; the loop over rows."""
        blocks, successors, parameters = sass.attributed_accesses(function, known, specials, first_pass)
        pointer_names = {address: [pointers[p] for p in sorted(params) if p in pointers]
                         for address, params in parameters.items()}
        stream = {address: names[0] if len(names) == 1 else None for address, names in pointer_names.items()}
        all_loops = [loop for loop in sass.loops(blocks) if loop.header in successors[loop.latch]]  # back edge taken
        row_loops = [loop for loop in all_loops if first_stream in streams_of(blocks, stream, loop.blocks)
                     and any(i.op in ("SHFL", "BAR") for b in loop.blocks for i in blocks[b].instructions)]
        row_loop = max(row_loops, key=lambda loop: len(loop.blocks)) if row_loops else None
        return blocks, successors, pointer_names, stream, all_loops, row_loop

    blocks, successors, pointer_names, stream, all_loops, row_loop = attribute()
    # The branches of one thread: lane 0 of block 0 (at every audited N, every pack of its row present) on its
    # first row, the kernel's arguments as the launcher sets them (plan["args"]). Until 2026-12-04 only parameter
    # bytes decided branches, and the path went around each pack's `if (valid[p])` where it held arithmetic only:
    # the bf16 RMSNorm forward at N = 2048 counted FMUL 32 and no FFMA for the 64 of its sum of squares.
    if "args" in plan:
        args = plan["args"]
        fields = FORWARD_ARG_FIELDS if forward else BACKWARD_ARG_FIELDS
        for name, (offset, size) in fields.items():
            known.update(parameter_bytes(arch.param_base + offset, args[name], size))
        known.update(parameter_bytes(BLOCK_DIM_X_OFFSET, args["threads"], 4))
        # The first pass of the loop over rows that the call runs. With the arguments known, a kernel of two bodies
        # (forward_rows_kernel's full-row one and its general one) keeps one loop only, maybe not the larger one that
        # the parameters alone left: taken again until the loop stays the same (with the other body's back edge
        # dropped, the row index of the one run arrived unknown, its tests stayed open, and the path went around
        # the LayerNorm statistics' sums of d and d^2: bf16 N = 2048 counted 19.3 instructions per element).
        first_pass: frozenset | None = None  # at least one pass with the arguments, a row loop found or not
        for _ in range(4):
            wanted = frozenset({(row_loop.latch, row_loop.header)}) if row_loop else frozenset()
            if wanted == first_pass:
                break
            first_pass = wanted
            blocks, successors, pointer_names, stream, all_loops, row_loop = attribute(THREAD, first_pass)
    # Guard: every access the audited call can run (its blocks reachable along the taken edges) has one pointer; an
    # access of none would be left out of the figures, and could steer the path away from the code it lies in.
    reachable = sass.reachable(successors)
    unattributed = [f"{i.address:#x} {i.opcode} -> {pointer_names[i.address] or 'no pointer'}"
                    for b in sorted(reachable) for i in blocks[b].instructions
                    if i.address in pointer_names and len(pointer_names[i.address]) != 1]
    if unattributed:
        raise AttributionError(
            f"{function.name} ({direction}): global accesses attributed to no pointer or to several: "
            f"{', '.join(unattributed[:6])}; are FORWARD_POINTERS / BACKWARD_POINTERS / QUANT_POINTERS in step with "
            "the kernels' argument structs?")

    def has(block: sass.Block, ops: Iterable[str]) -> bool:
        return any(i.op in ops for i in block.instructions)

    def streams_in(block_ids: Iterable[int]) -> set[str]:
        return streams_of(blocks, stream, block_ids)

    out_stream = "codes" if direction == "forward_quant" else ("out" if forward else "grad_input")
    region = sorted(row_loop.blocks) if row_loop else [b.index for b in blocks]
    region_set = set(region)
    inner = [loop for loop in all_loops if loop is not row_loop and loop.blocks <= region_set]

    # Loop multiplicities.
    def folds_absmax(loop: sass.Loop) -> bool:  # quant::nan_max: FSETP.NAN, FSETP.GT.OR, FSEL per state
        return any(i.opcode.startswith("FSETP.NAN") for b in loop.blocks for i in blocks[b].instructions)

    # The instructions of the row region in address order: what a shuffle loop reduces is told by what precedes it.
    region_instructions = [i for b in region for i in blocks[b].instructions]
    region_position = {i.address: k for k, i in enumerate(region_instructions)}

    def over_warps(loop: sass.Loop) -> bool:
        """A shuffle loop that adds the warps' states (merge_shifted_moments, merge_warp_sums,
        row_allreduce_one_barrier after its round): the nearest shared-memory access or shuffle before it is a read
        of shared memory (LDS; LD, the distributed shared memory of a cluster). Its width is pow2(warps of the row)
        lanes, not 32: log2 of that many steps (a row of 2 warps takes 1, where 5 were counted until 2026-12-05)."""
        if not row_spans_warps:
            return False
        for i in reversed(region_instructions[:region_position[blocks[loop.header].start]]):
            if i.op in ("LDS", "LD"):
                return True
            if i.op in ("SHFL", "STS", "BAR") or i.op in CLUSTER_BARRIERS:
                return False
        return False

    def kind(loop: sass.Loop) -> str:
        if any(has(blocks[b], ("SHFL",)) for b in loop.blocks):
            return "warp-states" if over_warps(loop) else "shuffle"
        if streams_in(loop.blocks) or any(has(blocks[b], ("STS",)) for b in loop.blocks):
            return "column"
        if direction == "forward_quant" and folds_absmax(loop):
            # The row's absmax from its warps' (every thread reads them all): from shared memory, or on a cluster
            # from the blocks' distributed shared memory (generic loads, LD); two copies of the loop, one per case.
            if any(has(blocks[b], ("LD",)) for b in loop.blocks):
                return "absmax-cluster"
            if any(has(blocks[b], ("LDS",)) for b in loop.blocks):
                return "absmax"
        return "merge" if any(has(blocks[b], ("LDS",)) for b in loop.blocks) else "other"

    def marker_count(loop: sass.Loop, k: str) -> int:
        if k.startswith("absmax"):  # warps' states per iteration
            return sum(1 for b in loop.blocks for i in blocks[b].instructions if i.opcode.startswith("FSETP.NAN"))
        ops = {"column": sass.GLOBAL_LOADS + sass.GLOBAL_STORES + ("LDS", "STS"), "shuffle": ("SHFL",),
               "warp-states": ("SHFL",),
               "merge": ("LDS",), "other": ()}[k]
        return sum(1 for b in loop.blocks for i in blocks[b].instructions if i.op in ops) or 1

    trips = {
        "column": -(-units // (threads * cluster)),
        "shuffle": int(math.log2(min(lanes, 32))) if lanes > 1 else 0,
        "warp-states": (min(32, 1 << (max(1, lanes // 32) - 1).bit_length())).bit_length() - 1,  # pow2_at_least
        "merge": -(-(lanes // 32) // 32),  # a lane takes every 32nd warp's state (merge_shifted_moments)
        "other": 1,
        "absmax": lanes // 32,
        "absmax-cluster": lanes // 32,
    }
    multiplicity = {b: 1.0 for b in region}
    top = [loop for loop in inner if not any(other.contains(loop) for other in inner)]
    top.sort(key=lambda loop: loop.header)
    groups: list[list[sass.Loop]] = []
    for loop in top:  # a loop and its remainder loops: same kind, nothing but plain code between them
        k = kind(loop)
        if groups and kind(groups[-1][-1]) == k:
            between = range(max(groups[-1][-1].blocks) + 1, loop.header)
            # (a read of shared memory between: two rounds of a merge of the warps' states, not a remainder loop)
            if not any(has(blocks[b], ("BAR", "SHFL", "LDS", "LD")) or streams_in([b]) for b in between):
                groups[-1].append(loop)
                continue
        groups.append([loop])
    counted_loops: list[sass.Loop] = []
    for group in groups:
        k = kind(group[0])
        main = max(group, key=lambda loop: marker_count(loop, k))
        smallest = min(marker_count(loop, k) for loop in group)
        unroll = marker_count(main, k) / smallest if len(group) > 1 else (
            marker_count(main, k) if k == "column" else 1)
        if k.startswith("absmax"):
            unroll = marker_count(main, k)
        if k == "column":
            # One pack of the row per source iteration: loads of the row's first stream, else (the staged
            # pass 2) stores of its output.
            body = [i for b in main.blocks for i in blocks[b].instructions]
            row_loads = sum(1 for i in body if i.op in sass.GLOBAL_LOADS and stream.get(i.address) == first_stream)
            row_stores = sum(1 for i in body if i.op in sass.GLOBAL_STORES and stream.get(i.address) == out_stream)
            unroll = plan.get("rows_per_iteration") or row_loads or row_stores or 1
        times = trips[k] / unroll
        for loop in group:
            for b in loop.blocks:
                multiplicity[b] *= times if loop is main else 0.0
            if loop is main and times > 0:
                counted_loops.append(loop)
    for loop in inner:  # nested loops (rare): their own trip count on top
        if loop not in top:
            k = kind(loop)
            for b in loop.blocks:
                multiplicity[b] *= trips[k]
    # Code outside the loops runs once per row, or (the long backward's column pass: once_per_row < 1) once per
    # group of rows.
    in_loops = {b for loop in inner for b in loop.blocks}
    for b in region:
        if b not in in_loops:
            multiplicity[b] *= plan.get("once_per_row", 1.0)

    # Path: dynamic programming over the region in address order (back edges dropped).
    # The first barrier this plan runs: the cluster's where a row spans a cluster, else the block's (the other
    # one's branch is not taken, and may come first in the code).
    # The row's reduction is the first such barrier after the first load of the row (pass 1).
    barrier_ops = CLUSTER_BARRIERS if cluster > 1 else ("BAR",)
    first_row_load = min((i.address for b in region for i in blocks[b].instructions
                          if i.op in sass.GLOBAL_LOADS and stream.get(i.address) == first_stream), default=-1)
    first_barrier = min((i.address for b in region for i in blocks[b].instructions
                         if i.op in barrier_ops and i.address > first_row_load), default=None)

    def skipped(i: sass.Instruction) -> bool:
        """An access to a stream the call does not use, under a predicate: the predicate is its null test."""
        return bool(i.predicate) and stream.get(i.address) in unused

    # The absmax loop of the other case: a row of one block reads no distributed shared memory, a row on a cluster
    # reads its warps' absmax through it.
    other_absmax = {b for loop in inner if kind(loop) == ("absmax" if cluster > 1 else "absmax-cluster")
                    for b in loop.blocks}

    def excluded(block: sass.Block) -> bool:
        if block.index in other_absmax:
            return True
        if has(block, ("PMTRIG",)):
            return True  # kernel_common.cuh's cold_path(): rows whose float statistics overflowed, not the hot path
        for i in block.instructions:
            s = stream.get(i.address)
            if s in unused and not i.predicate:
                return True
            if plan.get("staged") and s == first_stream and first_barrier is not None and i.address > first_barrier \
                    and i.op in sass.GLOBAL_LOADS:
                return True  # the staged pass 2 reads shared memory, not the row again
        # A row on a cluster takes the cluster's barrier, a row of one block the block's (the other is not run).
        if has(block, ("BAR",) if cluster > 1 else CLUSTER_BARRIERS):
            return True
        return not row_spans_warps and has(block, ("BAR",))

    loop_entries = {loop.header for loop in counted_loops}
    column_blocks = {b for loop in inner if kind(loop) == "column" for b in loop.blocks}
    looped = {b for loop in inner for b in loop.blocks}

    def score(block: sass.Block) -> int:
        points = sum(1 for i in block.instructions if stream.get(i.address) in used)
        in_column_loop = block.index in column_blocks
        if row_spans_warps and not in_column_loop:  # the all-reduce's step across warps: its shared write
            points += sum(1 for i in block.instructions if i.op == "STS")
        if plan.get("staged"):  # the stage's writes and reads, and the barrier before it is overwritten
            points += sum(1 for i in block.instructions if i.op in ("LDS", "STS") and in_column_loop)
            points += sum(1 for i in block.instructions
                          if i.op in ("BAR", CLUSTER_BARRIER_WAIT) and block.index not in looped)
        return points + (1 if block.index in loop_entries else 0)

    def cost(block: sass.Block) -> float:
        return len(block.instructions) * multiplicity[block.index]

    best: dict[int, tuple[int, float, int | None]] = {}
    entry = region[0]
    if not excluded(blocks[entry]):
        best[entry] = (score(blocks[entry]), -cost(blocks[entry]), None)
    ends = []
    for b in region:
        if b not in best:
            continue
        forward_edges = [s for s in successors[b] if s > b and s in region_set]
        if len(forward_edges) < len(successors[b]) or not successors[b]:
            ends.append(b)
        for s in forward_edges:
            if excluded(blocks[s]):
                continue
            candidate = (best[b][0] + score(blocks[s]), best[b][1] - cost(blocks[s]), b)
            if s not in best or candidate[:2] > best[s][:2]:
                best[s] = candidate
    if not ends:
        raise RuntimeError(f"{function.name}: no path through the row region")
    end = max(ends, key=lambda b: best[b][:2])
    path = []
    node: int | None = end
    while node is not None:
        path.append(node)
        node = best[node][2]
    path.reverse()
    if DEBUG:
        for b in path:
            for i in blocks[b].instructions:
                if i.address in stream:
                    print(f"  B{b} {i.address:#x} {i.predicate} {i.opcode} {stream[i.address]}")
        print(function.name[:60], "path:", " ".join(f"B{b}x{multiplicity[b]:g}({len(blocks[b].instructions)})" for b in path))

    figures = PathFigures(path=path)
    outstanding: dict[int, tuple[set[int], int]] = {}  # load address -> (destination registers, bytes)
    async_bytes = 0
    for b in path:
        weight = multiplicity[b]
        for i in blocks[b].instructions:
            figures.instructions += weight
            figures.fp64 += weight if i.is_fp64 else 0.0
            figures.barriers += weight if i.op in ("BAR", CLUSTER_BARRIER_WAIT) else 0.0
            figures.shuffles += weight if i.op == "SHFL" else 0.0
            if skipped(i):
                continue
            s = stream.get(i.address)
            if s:
                figures.streams_found.add(s)
                if s in ELEMENT_STREAMS:
                    figures.element_bytes += weight * i.access_bytes()
            reads, writes = i.sources(), i.destinations()
            for address in [a for a, (regs, _) in outstanding.items() if regs & (reads | writes)]:
                del outstanding[address]
            if i.op == "DEPBAR":  # waits for the async copies (all of them: an upper bound on the wait)
                async_bytes = 0
            if i.op in sass.GLOBAL_LOADS:
                outstanding[i.address] = (writes, i.access_bytes())
            elif i.op in sass.ASYNC_COPIES:
                async_bytes += i.access_bytes()
            in_flight = sum(size for _, size in outstanding.values()) + async_bytes
            row_in_flight = sum(size for a, (_, size) in outstanding.items() if stream.get(a) in ELEMENT_STREAMS)
            if in_flight > figures.loads_before_use and DEBUG:
                print(f"  peak {in_flight} B at {i.address:#x}:", [(hex(a), stream.get(a)) for a in outstanding])
            figures.loads_before_use = max(figures.loads_before_use, in_flight)
            figures.row_loads_before_use = max(figures.row_loads_before_use, row_in_flight + async_bytes)
    # Guard: the path reads and writes every stream the kernel must (a path without its output's stores reports
    # too few bytes and instructions), and the kernel writes the partials it must.
    want_loads, want_stores, want_kernel_stores = expected_streams(op, direction, plan.get("role", "rows"))
    path_accesses = [i for b in path for i in blocks[b].instructions if i.address in stream and not skipped(i)]
    loaded = {stream[i.address] for i in path_accesses if i.op in sass.GLOBAL_LOADS + sass.ASYNC_COPIES}
    stored = {stream[i.address] for i in path_accesses if i.op in sass.GLOBAL_STORES}
    kernel_stored = {stream[i.address] for b in reachable for i in blocks[b].instructions
                     if i.op in sass.GLOBAL_STORES and i.address in stream}
    missing = ([f"no load of {name} on the path" for name in sorted(want_loads - loaded)]
               + [f"no store of {name} on the path" for name in sorted(want_stores - stored)]
               + [f"no store of {name} in the kernel" for name in sorted(want_kernel_stores - kernel_stored)])
    if missing:
        raise AttributionError(
            f"{function.name} ({op} {direction}, {plan.get('role', 'rows')} kernel): {'; '.join(missing)} "
            f"(path: {' '.join(f'B{b}' for b in path)})")
    return figures


# ---- the audit -----------------------------------------------------------------------------------------------


@dataclass
class Row:
    arch: str
    op: str
    dtype: str
    direction: str
    n: int
    rows: int
    plan: dict
    registers: int
    spill_bytes: int  # STL per thread over the whole kernel (bytes)
    blocks: int
    threads_per_sm: int
    loads_before_use: int
    row_loads_before_use: int
    inflight_kb: float  # row-stream loads (DRAM): the target's figure
    barriers: float
    fp64: float
    per_element: float
    dram_per_element: float

    @property
    def path(self) -> str:
        cluster = self.plan.get("cluster", 1)
        if self.plan["packs"]:
            return "rows" + (f" x{cluster} CTAs" if cluster > 1 else "")
        return ("long-staged" if self.plan["staged"] else "long") + (f" x{cluster} CTAs" if cluster > 1 else "")

    def key(self, metric: str) -> str:
        return "\t".join((self.arch, self.op, self.dtype, self.direction, str(self.n), metric))


def launch_arguments(plan: dict, rows: int, cols: int) -> dict[str, int]:
    """The arguments the launcher sets from the plan (norm_kernels.cuh; the long backward's rows per block is its
    group of rows) and the block size: what analyze_row_path's thread takes its branches by; the audited call's
    weight_offset (0.0: its bits) and cast_before_weight (false), as nn.LayerNorm and nn.RMSNorm pass them."""
    return {"rows": rows, "cols": cols, "units": -(-cols // plan["vec"]), "lanes": plan["lanes"],
            "rows_per_block": plan["group_rows"] if plan.get("sums_kernel") else plan["rows_per_block"],
            "threads": plan["threads"], "weight_offset": 0, "cast_before_weight": 0}


def case_rows(dtype: str, n: int) -> int:
    return max(1, ROWS_BYTES // (n * ELEMENT_BYTES[dtype]))


def audit(library: str, archs: Iterable[str], plan_function) -> list[Row]:
    rows: list[Row] = []
    for arch_name in archs:
        arch = ARCHS[arch_name]
        usage = sass.resource_usage(library, arch_name)
        demangled = sass.demangle(sass.function_names(usage))
        by_kernel = {}
        for name, pretty in demangled.items():
            base = pretty.split("(", 1)[0].removeprefix("void ").removeprefix("layernorm_ext::cuda::")
            by_kernel[base] = name
        cases = [(op, dtype, direction, n) for op in OPS for dtype in DTYPES for direction in DIRECTIONS
                 for n in SIZES]
        plans = {}
        for op, dtype, direction, n in cases:
            m = case_rows(dtype, n)
            plan = plan_function(op=op, direction=direction.removesuffix("_quant"), input_dtype=dtype, rows=m, cols=n,
                                 sm_count=arch.sms, max_shared_per_block=arch.shared_per_block,
                                 compute_capability=arch.compute_capability, quantized=direction == "forward_quant")
            plans[(op, dtype, direction, n)] = plan
        names = {p["kernel"] for p in plans.values()} | {p["sums_kernel"] for p in plans.values() if p.get("sums_kernel")}
        wanted = {by_kernel[name] for name in names if name in by_kernel}
        missing = names - set(by_kernel)
        if missing:
            raise RuntimeError(f"{arch_name}: planned kernels not in the library: {sorted(missing)[:3]}")
        functions = sass.parse_sass(sass.disassemble(library, arch_name, sorted(wanted)), wanted)
        sass.parse_resource_usage(usage, functions)
        analyzed: dict[tuple, PathFigures] = {}
        for (op, dtype, direction, n), plan in plans.items():
            function = functions[by_kernel[plan["kernel"]]]
            dynamic = plan["dynamic_shared"]
            resident = blocks_per_sm(arch, function.registers, function.shared + dynamic, plan["threads"])
            m = case_rows(dtype, n)
            if plan["persistent"]:  # the grid the launcher takes from the occupancy API
                plan = plan_function(op=op, direction=direction.removesuffix("_quant"), input_dtype=dtype, rows=m,
                                     cols=n, sm_count=arch.sms, max_shared_per_block=arch.shared_per_block,
                                     blocks_per_sm=resident, compute_capability=arch.compute_capability,
                                     quantized=direction == "forward_quant")
            plan = dict(plan, cols=n, args=launch_arguments(plan, m, n))
            buffers = 1 if op == "rms_norm" else 2
            if plan.get("sums_kernel"):
                row = long_backward_row(arch, functions[by_kernel[plan["sums_kernel"]]], function, plan, op, dtype, m,
                                        resident, analyzed)
                row.dram_per_element += plan["row_groups"] * n * 4 * buffers / (m * n)  # the reduce kernel's read
                rows.append(row)
                continue
            key = (plan["kernel"], plan["lanes"], plan["threads"], plan["staged"], plan.get("cluster", 1),
                   -(-n // plan["vec"]))
            if key not in analyzed:
                analyzed[key] = analyze_row_path(function, arch, plan, op, direction)
            figures = analyzed[key]
            elements_per_thread = n / plan["lanes"]
            dram = figures.element_bytes / elements_per_thread
            if direction == "backward":  # partial buffers: the rows kernel's write of its block (or cluster)
                partial = plan["grid"] // plan.get("cluster", 1) * n * 4 * buffers  # partials, the reduce's read
                dram += 2 * partial / (m * n)
            stl = sum(i.access_bytes() for i in function.instructions if i.op == "STL")
            rows.append(Row(
                arch=arch_name, op=op, dtype=dtype, direction=direction, n=n, rows=m, plan=plan,
                registers=function.registers, spill_bytes=stl, blocks=resident,
                threads_per_sm=resident * plan["threads"], loads_before_use=figures.loads_before_use,
                row_loads_before_use=figures.row_loads_before_use,
                inflight_kb=figures.row_loads_before_use * resident * plan["threads"] / 1024,
                barriers=figures.barriers, fp64=figures.fp64, per_element=figures.instructions / elements_per_thread,
                dram_per_element=dram,
            ))
    return rows


def long_backward_row(arch: Arch, sums_function: sass.Function, function: sass.Function, plan: dict, op: str,
                      dtype: str, m: int, resident: int, analyzed: dict) -> Row:
    """The long backward's two passes as one row: the sums pass (a block of 256 threads per row, a column loop
    like the other long paths) and the column pass (a thread owns one pack of a row, its row loop counted once
    per row, its set-up and partials' store once per group of rows); instructions, FP64, barriers and bytes
    added, registers the larger, spills both, in-flight the smaller of the two."""
    n, vec = plan["cols"], plan["vec"]
    sums_plan = dict(plan, kernel=plan["sums_kernel"], lanes=256, threads=256, role="sums",  # kLongThreads per row
                     args=dict(plan["args"], threads=256))
    # Rows per iteration of the column pass (kLongPacks, backward_kernels.cuh).
    rows_per_iteration = min(4, max(1, 32 // (ELEMENT_BYTES[dtype] * vec)))
    column_plan = dict(plan, lanes=plan["threads"], cols=vec * plan["threads"], once_per_row=1 / plan["group_rows"],
                       rows_per_iteration=rows_per_iteration, role="columns")
    key = (plan["kernel"], n, plan["group_rows"])
    if key not in analyzed:
        analyzed[key] = (analyze_row_path(sums_function, arch, sums_plan, op, "backward"),
                         analyze_row_path(function, arch, column_plan, op, "backward"))
    sums, columns = analyzed[key]
    sums_per_thread = n / sums_plan["lanes"]  # elements per thread per row in each pass
    sums_resident = blocks_per_sm(arch, sums_function.registers, sums_function.shared, sums_plan["threads"])
    inflight = min(sums.row_loads_before_use * sums_resident * sums_plan["threads"],
                   columns.row_loads_before_use * resident * plan["threads"]) / 1024
    stl = sum(i.access_bytes() for f in (sums_function, function) for i in f.instructions if i.op == "STL")
    return Row(
        arch=arch.name, op=op, dtype=dtype, direction="backward", n=n, rows=m, plan=plan,
        registers=max(sums_function.registers, function.registers), spill_bytes=stl, blocks=resident,
        threads_per_sm=resident * plan["threads"],
        loads_before_use=max(sums.loads_before_use, columns.loads_before_use),
        row_loads_before_use=min(sums.row_loads_before_use, columns.row_loads_before_use), inflight_kb=inflight,
        barriers=sums.barriers + columns.barriers, fp64=sums.fp64 + columns.fp64,
        per_element=sums.instructions / sums_per_thread + columns.instructions / vec,
        dram_per_element=sums.element_bytes / sums_per_thread + columns.element_bytes / vec,
    )


# ---- targets ---------------------------------------------------------------------------------------------------

INSTRUCTION_TARGETS = {("layer_norm", "bfloat16", "forward"): 18.0, ("rms_norm", "bfloat16", "forward"): 12.0,
                       ("layer_norm", "bfloat16", "backward"): 28.0}
BACKWARD_SMALL_BYTES = 0.5  # per element, beyond 3 x element size: partial buffers, their reduce


@dataclass
class Check:
    row: Row
    metric: str
    value: float
    target: str
    met: bool
    worse_than: float | None = None  # how a known miss's value compares: larger is worse unless noted


def targets(row: Row) -> list[Check]:
    """The issue's targets (sm_90 only)."""
    if row.arch != TARGET_ARCH:
        return []
    s = ELEMENT_BYTES[row.dtype]
    barrier_target = 1 if row.plan["lanes"] > 32 else 0
    checks = [
        Check(row, "inflight_kb", round(row.inflight_kb, 1), ">= 32", row.inflight_kb >= 32),
        Check(row, "barriers_per_row", round(row.barriers, 1), f"<= {barrier_target}", row.barriers <= barrier_target),
        Check(row, "fp64_per_row", round(row.fp64, 1), "<= 20", row.fp64 <= 20),
        Check(row, "spill_bytes", row.spill_bytes, "== 0", row.spill_bytes == 0),
    ]
    limit = INSTRUCTION_TARGETS.get((row.op, row.dtype, row.direction))
    if limit is not None:
        checks.append(Check(row, "instructions_per_element", round(row.per_element, 1), f"<= {limit:g}",
                            row.per_element <= limit))
    # The quantized forward reads the input once and writes a byte of code per element (its scale per row: negligible).
    dram_limit = {"forward": 2 * s, "forward_quant": s + 1}.get(row.direction, 3 * s + BACKWARD_SMALL_BYTES)
    checks.append(Check(row, "dram_bytes_per_element", round(row.dram_per_element, 2), f"<= {dram_limit:g}",
                        row.dram_per_element <= dram_limit + 1e-9))
    return checks


def lower_is_better(metric: str) -> bool:
    return metric != "inflight_kb"


def read_known(path: Path) -> dict[str, float]:
    known = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                *key, kernel, value, target = line.split("\t")
                known["\t".join(key)] = float(value)
    return known


def write_known(path: Path, checks: list[Check]) -> None:
    lines = [
        "# Known misses of benchmarks/kernel_audit.py --check: arch, op, dtype, direction, N, metric, kernel, value "
        "today, target.",
        "# A miss not listed here, or a listed one whose value got worse, fails CI. Rewrite with --update-known "
        "after an improvement (the list only shrinks).",
    ]
    for c in checks:
        if not c.met:
            lines.append("\t".join((c.row.key(c.metric), c.row.plan["kernel"], f"{c.value:g}", c.target)))
    path.write_text("\n".join(lines) + "\n")


def evaluate(rows: list[Row], known: dict[str, float]) -> tuple[list[str], list[Check], int]:
    """Lines for every target, the checks, and the count of failures (new misses and regressions)."""
    lines, checks, failures = [], [], 0
    for row in rows:
        for c in targets(row):
            checks.append(c)
            label = f"{row.arch} {row.op} {row.dtype} {row.direction} N={row.n} {c.metric}={c.value:g} (target {c.target})"
            key = row.key(c.metric)
            if c.met:
                note = "  [listed as a known miss: remove it with --update-known]" if key in known else ""
                lines.append(f"target met: {label}{note}")
            elif key in known:
                recorded = known[key]
                worse = c.value > recorded if lower_is_better(c.metric) else c.value < recorded
                if worse:
                    failures += 1
                    lines.append(f"REGRESSION: {label}, known miss at {recorded:g}")
                else:
                    lines.append(f"target missed (known): {label}")
            else:
                failures += 1
                lines.append(f"NEW MISS: {label}  kernel {row.plan['kernel']}")
    return lines, checks, failures


# ---- report ----------------------------------------------------------------------------------------------------

HEADER = ("| N | path | thr/row x rows/blk | grid | dyn smem | regs | spill B | CTA/SM | thr/SM "
          "| B before use/thr (all / rows) | KB in flight/SM | BAR/row | FP64/row | instr/elem | DRAM B/elem |")


def table(rows: list[Row]) -> list[str]:
    out = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for r in rows:
        p = r.plan
        out.append(
            f"| {r.n} | {r.path} | {p['lanes']}x{p['rows_per_block']} | {p['grid']}{' persist' if p['persistent'] else ''} "
            f"| {p['dynamic_shared']} | {r.registers} | {r.spill_bytes} | {r.blocks} | {r.threads_per_sm} "
            f"| {r.loads_before_use} / {r.row_loads_before_use} | {r.inflight_kb:.0f} | {r.barriers:.0f} | {r.fp64:.0f} | {r.per_element:.1f} "
            f"| {r.dram_per_element:.2f} |"
        )
    return out


def misses_table(checks: list[Check]) -> list[str]:
    """The missed targets, one line per family and metric: the N that miss and their values."""
    grouped: dict[tuple, list[Check]] = {}
    for c in checks:
        if not c.met:
            grouped.setdefault((c.row.op, c.row.dtype, c.row.direction, c.metric, c.target), []).append(c)
    out = ["| op | dtype | direction | metric | target | missed at N (value) |", "|---|---|---|---|---|---|"]
    for (op, dtype, direction, metric, target), members in grouped.items():
        values = ", ".join(f"{c.row.n} ({c.value:g})" for c in members)
        out.append(f"| {op} | {dtype} | {direction} | {metric} | {target} | {values} |")
    return out


def report(rows: list[Row], checks: list[Check], command: str) -> str:
    met = sum(c.met for c in checks)
    out = [
        "# Kernel audit: the compiled CUDA kernels, read without a GPU",
        "",
        f"Written by `{command}` (method and caveats: benchmarks/README.md, \"Kernel audit\"). Rows per case: the "
        "input holds 256 MiB. Per thread and row on the audited call's hot path (weight, and bias for LayerNorm; "
        "no residual). `B before use/thr`: bytes of global loads a thread has issued and not yet consumed, at the "
        "peak: all loads / loads of the row's streams (x, dy, saved: DRAM; weight and bias mostly hit L2). "
        "`KB in flight/SM` = the row streams' figure x threads per SM, the figure the target is set for. "
        "`forward_quant`: the quantized output of one variant, vLLM's rms_norm_dynamic_per_token_quant to "
        "float8_e4m3fn (a dynamic scale per row, no scale_ub, no groups; the LayerNorm kernel likewise): codes, 1 "
        "byte per element, and a scale per row instead of out, no statistics.",
        "",
        f"## Targets (sm_90): {met} of {len(checks)} met",
        "",
    ] + misses_table(checks) + [""]
    families: dict[tuple, list[Row]] = {}
    for r in rows:
        families.setdefault((r.arch, r.dtype, r.direction, r.op), []).append(r)
    for (arch, dtype, direction, op), members in sorted(families.items(), key=lambda kv: (kv[0][0] != "sm_90", kv[0])):
        kernels = sorted({m.plan["kernel"] for m in members})
        out += [f"### {arch} {dtype} {direction} {op}", "", "Kernels: " + ", ".join(f"`{k}`" for k in kernels), ""]
        out += table(members) + [""]
    return "\n".join(out)


def plan_function_from_library():
    import layernorm_ext  # noqa: F401  (loads the native library)
    from layernorm_ext import _C

    if not hasattr(_C, "cuda_launch_plan"):
        raise SystemExit("layernorm_ext was built without its CUDA kernels (FORCE_CUDA=1 to build them)")
    return _C.cuda_launch_plan, _C.__file__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default="sm_80,sm_90")
    parser.add_argument("--out", help="write the Markdown report here")
    parser.add_argument("--check", action="store_true", help="exit 1 on a new miss or a regression")
    parser.add_argument("--known", default=str(KNOWN_MISSES_FILE), help="known misses (TSV)")
    parser.add_argument("--update-known", action="store_true", help="rewrite the known-misses file from this run")
    args = parser.parse_args(argv)
    plan_function, library = plan_function_from_library()
    archs = [a for a in args.archs.split(",") if a]
    rows = audit(library, archs, plan_function)
    known = read_known(Path(args.known))
    lines, checks, failures = evaluate(rows, known)
    for line in lines:
        print(line)
    met = sum(c.met for c in checks)
    print(f"{len(checks)} targets: {met} met, {len(checks) - met} missed ({failures} new misses or regressions)")
    if args.update_known:
        write_known(Path(args.known), checks)
        print(f"wrote {args.known}")
    if args.out:
        # The command that writes the same file again (--check / --update-known change nothing in it).
        kept = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--check", "--update-known")]
        command = "python benchmarks/kernel_audit.py " + " ".join(kept)
        out = Path(args.out)
        notes = out.read_text().split(NOTES_MARKER, 1)[1] if out.is_file() and NOTES_MARKER in out.read_text() else ""
        out.write_text(report(rows, checks, command.strip()) + (f"\n{NOTES_MARKER}{notes}" if notes else ""))
        print(f"wrote {args.out}")
    return 1 if args.check and failures else 0


if __name__ == "__main__":
    sys.exit(main())
