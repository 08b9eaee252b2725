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

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

import layernorm_ext

OPS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NS = (256, 512, 768, 1024, 2048, 4096, 5120, 8192, 16384, 65536)
MODES = ("fwd", "fwdbwd")
SIZES = ("small", "big")
PEERS = ("aten", "compile", "ort", "liger", "quack")
CPU_IMPLS = ("ours", "aten", "compile", "ort")  # default implementations per device (Liger, Quack: CUDA only)
CUDA_IMPLS = ("ours", "aten", "compile", "liger", "quack")
IMPLS = ("ours", *PEERS)
REFS = ("copy", "copy_out")  # bandwidth references, measured once per (threads, dtype, size, N)
LABELS = {"ours": "ours", "aten": "ATen", "compile": "compile", "ort": "ORT", "liger": "Liger", "quack": "Quack",
          "copy": "copy", "copy_out": "copy_out"}  # fmt: skip
# --gpu-check: row lengths, at M >= 8192 rows (fewer where x would exceed --max-mb)
GPU_CHECK_NS = (256, 512, 768, 1024, 2048, 4096, 5120, 8192, 16384, 32768, 65536, 131072, 262144)
DECODE_MS = (1, 2, 4, 8, 16)
DECODE_NS = (4096, 8192)
DECODE_OPS = ("rms_norm", "add_rms_norm", "layer_norm")
LN_EPS = 1e-5
RMS_EPS = torch.finfo(torch.float32).eps  # what eps=None means for float32/float16/bfloat16 in ATen and ours

# Tensor passes of M*N elements (weight, bias, mean and rstd are O(N) or O(M): ignored).
PASSES = {(False, "fwd"): 2, (True, "fwd"): 4, (False, "fwdbwd"): 5, (True, "fwdbwd"): 8}
BYTES_NOTE = """\
Bytes counted per call (s = element size; weight/bias, their gradients and mean/rstd are O(N) or O(M), ignored):
- layer_norm, rms_norm, fwd: read x + write y = 2*M*N*s
- add_layer_norm, add_rms_norm, fwd: read x, r + write y, h = 4*M*N*s
- layer_norm, rms_norm, fwd+bwd: fwd + read x, dy + write dx = 5*M*N*s
- add_*, fwd+bwd: fwd + read h, dy, dh + write dx = 8*M*N*s. Both outputs get a gradient (dy for y, dh for
  h = x + r, as in a pre-norm block where h feeds the next residual); d(residual) is the same tensor as dx
  (both are dL/dh), so it is written once.
- copy, copy_out: read x + write y = 2*M*N*s"""


# ---------------------------------------------------------------------------------------------- cases and data


@dataclass(frozen=True)
class Case:
    op: str
    dtype: str
    n: int
    m: int
    size: str
    mode: str
    threads: int

    @property
    def residual(self) -> bool:
        return self.op.startswith("add_")

    @property
    def rms(self) -> bool:
        return "rms" in self.op

    @property
    def x_bytes(self) -> int:
        return self.m * self.n * DTYPES[self.dtype].itemsize

    @property
    def bytes(self) -> int:
        return PASSES[(self.residual, self.mode)] * self.x_bytes

    @property
    def copy_bytes(self) -> int:
        return 2 * self.x_bytes

    def label(self) -> str:
        return f"{self.op} {self.dtype} N={self.n} M={self.m} {self.size} {self.mode} {self.threads}t"


def rows_for(n: int, dtype: str, megabytes: float) -> int:
    """M such that x (M x N) holds about `megabytes` MiB."""
    return max(1, round(megabytes * 2**20 / (n * DTYPES[dtype].itemsize)))


def case_rows(n: int, dtype: str, size: str, opts: argparse.Namespace) -> int:
    """M for a case: x of about --small-mb / --big-mb MiB; the big size has at least --min-rows rows, unless x
    would then exceed --max-mb MiB."""
    if size == "small":
        return rows_for(n, dtype, opts.small_mb)
    m = max(rows_for(n, dtype, opts.big_mb), opts.min_rows)
    return min(m, rows_for(n, dtype, opts.max_mb)) if opts.max_mb else m


@dataclass(frozen=True)
class Data:
    """Tensors shared by every case of one (dtype, size, N): inputs, parameters and upstream gradients."""

    x: Tensor
    r: Tensor
    w: Tensor
    b: Tensor
    dy: Tensor
    dh: Tensor


def make_data(m: int, n: int, dtype: torch.dtype, device: torch.device, seed: int) -> Data:
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype).mul_(scale).add_(shift)

    return Data(randn(m, n), randn(m, n), randn(n, scale=0.1, shift=1.0), randn(n, scale=0.1), randn(m, n), randn(m, n))


@dataclass(frozen=True)
class Args:
    """The arguments of one case: fresh leaves (requiring grad for fwd+bwd) over the shared storage."""

    x: Tensor
    r: Tensor | None
    w: Tensor
    b: Tensor | None
    grads: tuple[Tensor, ...]

    def leaves(self) -> list[Tensor]:
        return [t for t in (self.x, self.r, self.w, self.b) if t is not None]


def case_args(data: Data, case: Case) -> Args:
    grad = case.mode == "fwdbwd"

    def leaf(t: Tensor) -> Tensor:
        return t.detach().requires_grad_(grad)

    return Args(
        x=leaf(data.x),
        r=leaf(data.r) if case.residual else None,
        w=leaf(data.w),
        b=None if case.rms else leaf(data.b),
        grads=(data.dy, data.dh) if case.residual else (data.dy,),
    )


# ---------------------------------------------------------------------------------------------- implementations

Outputs = tuple[Tensor, ...]
NormFn = Callable[[Tensor, Tensor | None, Tensor, Tensor | None], Outputs]
Call = Callable[[], object]  # one timed call; what it returns is released after the clock stops


class Unsupported(Exception):
    """This implementation cannot run this case (reported as n/a)."""


def aten_layer_norm(x: Tensor, r: Tensor | None, w: Tensor, b: Tensor | None) -> Outputs:
    return (F.layer_norm(x, x.shape[-1:], w, b, LN_EPS),)


def aten_rms_norm(x: Tensor, r: Tensor | None, w: Tensor, b: Tensor | None) -> Outputs:
    return (F.rms_norm(x, x.shape[-1:], w, RMS_EPS),)


def aten_add_layer_norm(x: Tensor, r: Tensor | None, w: Tensor, b: Tensor | None) -> Outputs:
    h = x + r
    return F.layer_norm(h, h.shape[-1:], w, b, LN_EPS), h


def aten_add_rms_norm(x: Tensor, r: Tensor | None, w: Tensor, b: Tensor | None) -> Outputs:
    h = x + r
    return F.rms_norm(h, h.shape[-1:], w, RMS_EPS), h


def ours_layer_norm(x: Tensor, r: Tensor | None, w: Tensor, b: Tensor | None) -> Outputs:
    return (layernorm_ext.layer_norm(x, x.shape[-1:], w, b, LN_EPS),)


def ours_rms_norm(x: Tensor, r: Tensor | None, w: Tensor, b: Tensor | None) -> Outputs:
    return (layernorm_ext.rms_norm(x, x.shape[-1:], w, RMS_EPS),)


def ours_add_layer_norm(x: Tensor, r: Tensor | None, w: Tensor, b: Tensor | None) -> Outputs:
    assert r is not None
    return layernorm_ext.add_layer_norm(x, r, x.shape[-1:], w, b, LN_EPS)


def ours_add_rms_norm(x: Tensor, r: Tensor | None, w: Tensor, b: Tensor | None) -> Outputs:
    assert r is not None
    return layernorm_ext.add_rms_norm(x, r, x.shape[-1:], w, RMS_EPS)


ATEN: dict[str, NormFn] = {
    "layer_norm": aten_layer_norm,
    "rms_norm": aten_rms_norm,
    "add_layer_norm": aten_add_layer_norm,
    "add_rms_norm": aten_add_rms_norm,
}
OURS: dict[str, NormFn] = {
    "layer_norm": ours_layer_norm,
    "rms_norm": ours_rms_norm,
    "add_layer_norm": ours_add_layer_norm,
    "add_rms_norm": ours_add_rms_norm,
}


def norm_call(fn: NormFn, args: Args, mode: str) -> Call:
    """fwd: one call of fn. fwd+bwd: fn, then torch.autograd.grad of its outputs w.r.t. every leaf."""
    if mode == "fwd":
        return lambda: fn(args.x, args.r, args.w, args.b)
    leaves = args.leaves()

    def fwd_bwd() -> object:
        return torch.autograd.grad(fn(args.x, args.r, args.w, args.b), leaves, args.grads)

    return fwd_bwd


def compiled_call(case: Case, args: Args, static: bool) -> Call:
    """torch.compile (mode default) of the ATen function. N is always static; M is dynamic (one compile serves
    both sizes, as automatic-dynamic would do in a model where only batch*seq varies) unless `static`."""
    if not static:
        for t in (args.x, args.r):
            if t is not None and t.shape[0] > 1:
                torch._dynamo.mark_dynamic(t, 0)
    return norm_call(torch.compile(ATEN[case.op], dynamic=False if static else None), args, case.mode)


def copy_call(x: Tensor) -> Call:
    """The bandwidth reference, allocating its output like every implementation."""
    x = x.detach()
    return lambda: torch.empty_like(x).copy_(x)


def copy_out_call(x: Tensor) -> Call:
    """The same copy into a preallocated output: no allocation, no page faults (the machine's ceiling)."""
    x = x.detach()
    out = torch.empty_like(x).copy_(x)
    return lambda: out.copy_(x)


# ---- ONNX Runtime (CPU) --------------------------------------------------------------------------------------

ONNX_TYPES = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16}  # onnx.TensorProto data types


def onnx_model(case: Case, args: Args, fused: bool) -> bytes:
    """LayerNormalization (opset 17) or SimplifiedLayerNormalization (ORT's RMSNorm kernel, ONNX domain) over a
    fixed [M, N] shape, weight and bias as initializers. Residual variants: Add, then the norm; or, when `fused`,
    com.microsoft SkipLayerNormalization / SkipSimplifiedLayerNormalization (output 3 is input + skip = h)."""
    from onnx import helper

    etype = ONNX_TYPES[DTYPES[case.dtype]]
    shape = [case.m, case.n]

    def value(name: str) -> object:
        return helper.make_tensor_value_info(name, etype, shape)

    def init(name: str, t: Tensor) -> object:
        raw = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        return helper.make_tensor(name, etype, list(t.shape), vals=raw, raw=True)

    eps = RMS_EPS if case.rms else LN_EPS
    params = ["W"] if case.rms else ["W", "B"]
    inits = [init("W", args.w)] + ([] if case.rms else [init("B", args.b)])  # type: ignore[arg-type]
    inputs, outputs = [value("X")], [value("Y")]
    if case.residual:
        inputs.append(value("R"))
        outputs.append(value("H"))
    if case.residual and fused:
        op = "SkipSimplifiedLayerNormalization" if case.rms else "SkipLayerNormalization"
        nodes = [helper.make_node(op, ["X", "R", *params], ["Y", "", "", "H"], domain="com.microsoft", epsilon=eps)]
    else:
        nodes = [helper.make_node("Add", ["X", "R"], ["H"])] if case.residual else []
        source = "H" if case.residual else "X"
        if case.rms:
            nodes.append(helper.make_node("SimplifiedLayerNormalization", [source, *params], ["Y"], axis=-1, epsilon=eps))
        else:
            nodes.append(
                helper.make_node("LayerNormalization", [source, *params], ["Y"], axis=-1, epsilon=eps, stash_type=1)
            )
    graph = helper.make_graph(nodes, case.op, inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model.SerializeToString()


def ort_call(case: Case, args: Args) -> Call:
    """ORT InferenceSession with intra_op_num_threads = threads, run through an IOBinding: inputs bound to the
    torch tensors (no copy), outputs allocated by ORT in every call. The CPU memory arena is off so that, like
    torch's allocator, ORT mallocs (and page-faults) large outputs afresh instead of reusing warm buffers.
    Residual variants: Add + norm, which is faster on ORT's CPU provider than its fused Skip*LayerNormalization
    kernels; those are used where Add has no CPU kernel (bfloat16)."""
    if case.mode != "fwd":
        raise Unsupported("fwd+bwd (ORT inference sessions only)")
    if args.x.device.type != "cpu":
        raise Unsupported("ORT: CPU only in this harness")
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise Unsupported("onnxruntime not installed") from e
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = case.threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.enable_cpu_mem_arena = False
    opts.log_severity_level = 3
    try:
        session = ort.InferenceSession(onnx_model(case, args, False), opts, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001  (onnxruntime raises its own exception types: no kernel for Add)
        if not case.residual:
            raise
        session = ort.InferenceSession(onnx_model(case, args, True), opts, providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    etype, shape = ONNX_TYPES[args.x.dtype], [case.m, case.n]
    for name, t in (("X", args.x), ("R", args.r)):
        if t is not None:
            binding.bind_input(name, "cpu", 0, etype, shape, t.data_ptr())
    names = ["Y", "H"] if case.residual else ["Y"]

    def run() -> object:
        for name in names:
            binding.bind_output(name, "cpu")
        session.run_with_iobinding(binding)
        outs = binding.get_outputs()
        binding.clear_binding_outputs()  # outs holds the only references: freed by the timer, after the clock
        return outs

    return run


def ort_to_torch(value: object, dtype: torch.dtype) -> Tensor:
    """Copy of an ORT CPU OrtValue as a torch tensor (any dtype, bfloat16 included); for the sanity check."""
    shape = value.shape()  # type: ignore[attr-defined]
    nbytes = math.prod(shape) * dtype.itemsize
    buf = (ctypes.c_char * nbytes).from_address(value.data_ptr())  # type: ignore[attr-defined]
    return torch.frombuffer(bytearray(buf), dtype=dtype).reshape(shape)


# ---- Liger-Kernel and QuACK (CUDA, when importable) ---------------------------------------------------------


def _cuda_only(impl: str, x: Tensor) -> None:
    if x.device.type != "cuda":
        raise Unsupported(f"{impl}: CUDA only")


def liger_fn(op: str) -> NormFn:
    """Liger-Kernel's Triton LayerNorm / RMSNorm autograd functions (RMSNorm: casting_mode 'llama', not in place,
    so dY is left intact as for every other implementation). Residual variants: x + r, then the norm."""
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError as e:
        raise Unsupported("liger_kernel not installed") from e

    def norm(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        if "rms" in op:
            return LigerRMSNormFunction.apply(h, w, RMS_EPS, 0.0, "llama", False)
        return LigerLayerNormFunction.apply(h, w, b, LN_EPS)

    def fn(x: Tensor, r: Tensor | None, w: Tensor, b: Tensor | None) -> Outputs:
        if r is None:
            return (norm(x, w, b),)
        h = x + r
        return norm(h, w, b), h

    return fn


def quack_fn(op: str) -> NormFn:
    """QuACK's CuTe-DSL RMSNorm (``quack.rmsnorm``; the residual variant fused, prenorm=True). RMSNorm only."""
    if "rms" not in op:
        raise Unsupported("quack: RMSNorm only in this harness")
    try:
        from quack import rmsnorm
    except ImportError as e:
        raise Unsupported("quack not installed") from e
    if op == "rms_norm":
        return lambda x, r, w, b: (rmsnorm(x, w, eps=RMS_EPS),)
    return lambda x, r, w, b: tuple(rmsnorm(x, w, residual=r, eps=RMS_EPS, prenorm=True))


def peer_fn(impl: str, op: str) -> NormFn:
    if impl in ("ours", "aten"):
        return (OURS if impl == "ours" else ATEN)[op]
    return liger_fn(op) if impl == "liger" else quack_fn(op)


def build_call(impl: str, case: Case, args: Args, opts: argparse.Namespace) -> Call:
    if impl == "ours":
        return norm_call(OURS[case.op], args, case.mode)
    if impl == "aten":
        return norm_call(ATEN[case.op], args, case.mode)
    if impl == "compile":
        return compiled_call(case, args, opts.compile_static)
    if impl == "ort":
        return ort_call(case, args)
    if impl in ("liger", "quack"):
        _cuda_only(impl, args.x)
        return norm_call(peer_fn(impl, case.op), args, case.mode)
    if impl == "copy":
        return copy_call(args.x)
    if impl == "copy_out":
        return copy_out_call(args.x)
    raise ValueError(impl)


def first_output(impl: str, result: object, dtype: torch.dtype) -> Tensor:
    if impl == "ort":
        return ort_to_torch(result[0], dtype)  # type: ignore[index]
    return result[0]  # type: ignore[index]


# ---------------------------------------------------------------------------------------------- timing


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


@dataclass
class DecodeRow:
    op: str
    m: int
    n: int
    eager_us: dict[str, float | None]  # implementation -> microseconds per call, host included
    graph_us: dict[str, float | None]  # implementation -> microseconds per call replayed from a CUDA graph


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


# ---------------------------------------------------------------------------------------------- measuring


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
