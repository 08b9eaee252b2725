"""The implementations bench.py times, each built into a Call for one case: ours, ATen eager, torch.compile,
ONNX Runtime (CPU), Liger-Kernel and QuACK (CUDA, when importable), and the copies that are the bandwidth
references."""

from __future__ import annotations

import argparse
import ctypes
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

import layernorm_ext
from bench_cases import DTYPES, LN_EPS, RMS_EPS, Args, Case
from bench_timing import Call

Outputs = tuple[Tensor, ...]
NormFn = Callable[[Tensor, Tensor | None, Tensor, Tensor | None], Outputs]


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
