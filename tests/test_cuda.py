"""CUDA-only cases: what the device-parametrized tests (test_functional, test_determinism, ...) do not reach.

Every test here is marked ``cuda`` (conftest skips them without a GPU). Outputs and all gradients (input,
residual, weight, bias) are checked against ATen on the same device with the suite's rule
(``assert_no_worse_than_aten``), reusing test_functional's case builder, ATen wiring and fp64 / extended
reference. What is specific to the GPU:

- misaligned data pointers (a view starting one element into its allocation) of the input, residual, weight and
  grad_out, alone and all together, so 16-byte vector accesses are impossible; odd N, whose rows after the
  first start misaligned even in an aligned tensor;
- N just below, at and above every power of two a kernel might switch its thread mapping at (32 .. 65536, in
  every dtype pair), and single rows of 2^18 and 2^20;
- more rows than a grid's y/z dimension allows (> 65535);
- affine modes, residual dtypes (residual_in_fp32, mixed), memory_efficient on a few row lengths;
- CUDA graph capture and replay (bitwise equal to eager), bitwise determinism of the backward (grid-wide
  reductions for dweight / dbias), the current stream and device guard, torch.compile, no host syncs;
- build_info() must say the library was built with CUDA.

The file runs in about a minute on one H200.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from torch import Tensor

import layernorm_ext as L
from conftest import assert_no_worse_than_aten
from test_functional import (
    Inputs,
    Spec,
    _affines,
    _assert_bitwise,
    _aten,
    _grads,
    _leaf,
    _leaves,
    _make_inputs,
    _ours,
    _params,
    _reference,
    _spec,
    run_case,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning"),
]

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
FNS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
CUDA = "cuda"

# (input dtype, weight/bias dtype)
ALL_DTYPES = ((F32, F32), (BF16, BF16), (F16, F16), (F64, F64), (BF16, F32))

_INT_VIEW = {F64: torch.int64, F32: torch.int32, F16: torch.int16, BF16: torch.int16}


def _bits(t: Tensor) -> Tensor:
    return t.detach().contiguous().view(_INT_VIEW[t.dtype])


def _same_bits(a: Tensor, b: Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(_bits(a), _bits(b)), f"{what}: not bitwise equal"


def check_inputs(spec: Spec, inp: Inputs) -> None:
    """test_functional.run_case on given inputs: ours vs ATen vs the reference, outputs and every gradient."""
    out, res_out = _ours(spec, inp)
    grads = _grads(spec, inp, out, res_out)
    a_out, a_h = _aten(spec, inp)
    a_grads = _grads(spec, inp, a_out, a_h)
    ref = _reference(spec, inp, a_h if a_h is not None else inp.x)
    assert out.device == inp.x.device and out.dtype == spec.dtype and out.shape == spec.shape
    assert_no_worse_than_aten(out, a_out, ref["out"], "out")
    ref_gh = ref["h"]
    if spec.residual:
        assert res_out is not None and a_h is not None and inp.gr is not None
        _assert_bitwise(res_out, a_h, "residual_out")
        ref_gh = ref_gh + inp.gr.double().cpu()
    leaves = _leaves(inp)
    for name, g in grads.items():
        assert g.dtype == leaves[name].dtype and g.shape == leaves[name].shape, (name, g.dtype, g.shape)
        reference = ref_gh if name in ("input", "residual") else ref[name]
        assert_no_worse_than_aten(g, a_grads[name], reference, f"grad_{name}")


# ---- misaligned data pointers -------------------------------------------------------------------------------


def _misaligned(t: Tensor) -> Tensor:
    """The same values in a contiguous view that starts one element into its allocation (never 16-byte aligned)."""
    base = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = base[1:].view(t.shape)
    view.copy_(t.detach())
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    return view


_MISALIGN_WHICH = ("all", "x", "r", "w", "g")


def _misalign_inputs(inp: Inputs, which: str) -> Inputs:
    def pick(name: str, t: Tensor | None, leaf: bool) -> Tensor | None:
        if t is None or which not in ("all", name):
            return t
        return _leaf(_misaligned(t)) if leaf else _misaligned(t)

    return replace(
        inp,
        x=pick("x", inp.x, True),
        r=pick("r", inp.r, True),
        w=pick("w", inp.w, True),
        b=pick("w", inp.b, True),  # bias travels with the weight
        g=pick("g", inp.g, False),
        gr=pick("g", inp.gr, False),
    )


def _misaligned_specs() -> list[tuple[Spec, str]]:
    cases = []
    for fn in FNS:
        for n in (1, 7, 769, 1024, 4096, 5125):
            for dtype, wdtype in ((F32, F32), (BF16, BF16), (F16, F16), (BF16, F32)):
                for which in _MISALIGN_WHICH:
                    if (which == "r" and not fn.startswith("add_")) or (n == 1 and which != "all"):
                        continue
                    if which not in ("all", "x") and dtype == F16:  # one dtype pair per tensor suffices
                        continue
                    cases.append((_spec(fn, (5,), (n,), dtype=dtype, wdtype=wdtype), which))
    return cases


def _misaligned_params() -> list:
    short = {F64: "f64", F32: "f32", F16: "f16", BF16: "bf16"}
    return [
        pytest.param(s, w, id=f"{s.fn}-n{s.norm[0]}-{short[s.dtype]}-w{short[s.wdtype]}-misaligned_{w}")
        for s, w in _misaligned_specs()
    ]


@pytest.mark.parametrize("spec,which", _misaligned_params())
def test_misaligned(spec: Spec, which: str) -> None:
    inp = _misalign_inputs(_make_inputs(spec, CUDA), which)
    check_inputs(spec, inp)


# ---- N around every plausible mapping boundary; huge single rows ------------------------------------------

BOUNDARY_NS = tuple(n for p in range(5, 17) for n in (2**p - 1, 2**p, 2**p + 1))  # 31,32,33 .. 65535,65536,65537


def _boundary_specs() -> list[Spec]:
    specs = []
    for n in BOUNDARY_NS:
        rows = 5 if n <= 4097 else 3
        for dtype, wdtype in ALL_DTYPES:
            # every function for the common pairs; the plain norms for fp16, fp64 and mixed
            fns = FNS if (dtype, wdtype) in ((F32, F32), (BF16, BF16)) else ("layer_norm", "rms_norm")
            specs += [_spec(fn, (rows,), (n,), dtype=dtype, wdtype=wdtype) for fn in fns]
    return specs


@pytest.mark.parametrize("spec", _params(_boundary_specs()))
def test_boundaries(spec: Spec) -> None:
    run_case(spec, CUDA)


def _huge_row_specs() -> list[Spec]:
    return [
        _spec(fn, (m,), (n,), dtype=dtype, wdtype=wdtype)
        for n in (1 << 18, 1 << 20)
        for m in (1, 2)
        for fn in ("layer_norm", "rms_norm", "add_rms_norm")
        for dtype, wdtype in ((F32, F32), (BF16, BF16), (BF16, F32))
    ]


@pytest.mark.parametrize("spec", _params(_huge_row_specs()))
def test_huge_rows(spec: Spec) -> None:
    run_case(spec, CUDA)


# ---- more rows than a grid's y / z dimension (65535) allows ----------------------------------------------


def _many_rows_specs() -> list[Spec]:
    return [
        _spec(fn, (m,), (n,), dtype=dtype, wdtype=wdtype)
        for m, n in ((70000, 64), (131073, 8))
        for fn in ("layer_norm", "rms_norm", "add_rms_norm", "add_layer_norm")
        for dtype, wdtype in ((F32, F32), (BF16, F32))
    ]


@pytest.mark.parametrize("spec", _params(_many_rows_specs()))
def test_many_rows(spec: Spec) -> None:
    run_case(spec, CUDA)


# ---- affine modes, residual dtypes, memory_efficient ------------------------------------------------------

MODE_NS = ((1000,), (4096,), (12289,))

# (input dtype, weight dtype, residual dtype, residual_in_fp32)
RESIDUAL_MODES = (
    (F16, F16, F32, False),  # half input, float32 residual: h is float32
    (BF16, BF16, F16, False),  # bf16 input, fp16 residual: h is float32
    (BF16, F32, F16, False),
    (F16, F16, BF16, False),
    (BF16, BF16, BF16, True),  # residual_in_fp32: h is float32
    (F16, F32, F16, True),
    (F32, F32, BF16, False),
)


def _mode_specs() -> list[Spec]:
    specs = [
        _spec(fn, (7,), norm, dtype=dtype, wdtype=wdtype, affine=affine)
        for fn in FNS
        for norm in MODE_NS
        for dtype, wdtype in ((F32, F32), (BF16, BF16), (BF16, F32))
        for affine in _affines(fn)
    ]
    specs += [
        _spec(fn, (7,), norm, dtype=x, wdtype=w, rdtype=r, in_fp32=in_fp32)
        for fn in ("add_layer_norm", "add_rms_norm")
        for x, w, r, in_fp32 in RESIDUAL_MODES
        for norm in MODE_NS
    ]
    specs += [
        _spec(fn, (7,), norm, dtype=dtype, wdtype=dtype, mem_eff=True, weights=weights)
        for fn in ("layer_norm", "rms_norm")
        for norm in MODE_NS
        for dtype in (F32, BF16, F16)
        for weights in ("signed", "normal")
    ]
    specs += [
        _spec(fn, (7,), norm, dtype=BF16, wdtype=BF16, mem_eff=True) for fn in ("add_layer_norm", "add_rms_norm")
        for norm in MODE_NS
    ]  # fmt: skip
    return specs


@pytest.mark.parametrize("spec", _params(_mode_specs()))
def test_modes(spec: Spec) -> None:
    run_case(spec, CUDA)


# ---- CUDA graphs ----------------------------------------------------------------------------------------------


def _cuda_randn(
    gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0, shift: float = 0.0
) -> Tensor:
    return (torch.randn(shape, generator=gen, device=CUDA, dtype=torch.float32) * scale + shift).to(dtype)


def _capture(fn: Callable[[], list[Tensor]]) -> tuple[torch.cuda.CUDAGraph, list[Tensor]]:
    """Warm up on a side stream (as torch's docs ask), then capture fn; returns the graph and its outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs


@pytest.mark.parametrize("n", [7, 1024, 5120, 65536])
@pytest.mark.parametrize("fn", FNS)
def test_graph_forward(fn: str, n: int) -> None:
    """Forward through the functional API, captured once, replayed on new data: bitwise the eager result."""
    gen = torch.Generator(device=CUDA).manual_seed(n)
    m = 33 if n < 65536 else 4
    x = _cuda_randn(gen, m, n, dtype=BF16, shift=0.3)
    r = _cuda_randn(gen, m, n, dtype=BF16)
    w = _cuda_randn(gen, n, dtype=F32, scale=0.5, shift=1.0)
    b = _cuda_randn(gen, n, dtype=F32, scale=0.5)
    spec = _spec(fn, (m,), (n,))

    def call() -> list[Tensor]:
        inp = Inputs(x, r if spec.residual else None, w, b if fn in ("layer_norm", "add_layer_norm") else None, x, None)
        out, res_out = _ours(replace(spec, mem_eff=False), inp)
        return [out] if res_out is None else [out, res_out]

    graph, static_outs = _capture(call)
    for trial in range(3):
        x.copy_(_cuda_randn(gen, m, n, dtype=BF16, scale=1.0 + trial, shift=trial))
        r.copy_(_cuda_randn(gen, m, n, dtype=BF16))
        graph.replay()
        eager = call()
        for i, (got, want) in enumerate(zip(static_outs, eager, strict=True)):
            _same_bits(got, want, f"replay {trial} output {i}")


@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm"])
def test_graph_forward_memory_efficient(fn: str) -> None:
    """memory_efficient=True with parameters that require grad: in eager mode the forward reads the weight to
    choose what to save for backward (a wait for the GPU), which capture forbids. Under capture it saves the
    input instead, with no wait; replays equal eager calls bitwise."""
    m, n = 64, 4096
    gen = torch.Generator(device=CUDA).manual_seed(17)
    x = _cuda_randn(gen, m, n, dtype=BF16, shift=0.3)
    # Weights well away from 0 (scale 0.1): the eager verdict must let the output stand in.
    w = _cuda_randn(gen, n, dtype=BF16, scale=0.1, shift=1.0).requires_grad_(True)
    b = _cuda_randn(gen, n, dtype=BF16, scale=0.2).requires_grad_(True)
    saved: list[int] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t.untyped_storage().data_ptr())
        return t

    def call() -> list[Tensor]:
        saved.clear()  # what the latest call saved
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if fn == "layer_norm":
                return [L.layer_norm(x, n, w, b, memory_efficient=True)]
            return [L.rms_norm(x, n, w, memory_efficient=True)]

    eager_out = call()[0]
    assert eager_out.untyped_storage().data_ptr() in saved, "eager memory_efficient saved no output"
    graph, static_outs = _capture(call)
    assert x.untyped_storage().data_ptr() in saved, "under capture the input must be saved"
    assert static_outs[0].untyped_storage().data_ptr() not in saved
    for trial in range(2):
        x.copy_(_cuda_randn(gen, m, n, dtype=BF16, scale=1.0 + trial, shift=trial))
        graph.replay()
        _same_bits(static_outs[0], call()[0], f"replay {trial}")


def _raw_fwd_bwd(
    rms: bool, n: int, x: Tensor, r: Tensor | None, w: Tensor, b: Tensor | None, g: Tensor, gr: Tensor | None
) -> list[Tensor]:
    ops = torch.ops.layernorm_ext
    if rms:
        out, h, rstd = ops.rms_norm_fwd(x, [n], w, None, r, False, False)
        saved = h if r is not None else x
        grad_h, grad_w = ops.rms_norm_bwd(g, saved, rstd, [n], w, False, gr)
        return [out, h, rstd, grad_h, grad_w]
    out, h, mean, rstd = ops.layer_norm_fwd(x, [n], w, b, 1e-5, r, False, False)
    saved = h if r is not None else x
    grad_h, grad_w, grad_b = ops.layer_norm_bwd(g, saved, mean, rstd, [n], w, b, False, gr)
    return [out, h, mean, rstd, grad_h, grad_w, grad_b]


@pytest.mark.parametrize("shape", [(33, 7), (64, 4096), (4096, 1024), (3, 65536)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_graph_forward_backward_raw_ops(rms: bool, residual: bool, shape: tuple[int, int]) -> None:
    """The raw forward and backward ops captured together; replays on new data equal eager calls bitwise."""
    m, n = shape
    gen = torch.Generator(device=CUDA).manual_seed(m * 31 + n)
    x = _cuda_randn(gen, m, n, dtype=BF16, shift=0.3)
    r = _cuda_randn(gen, m, n, dtype=BF16) if residual else None
    w = _cuda_randn(gen, n, dtype=BF16, scale=0.5, shift=1.0)
    b = None if rms else _cuda_randn(gen, n, dtype=BF16, scale=0.5)
    g = _cuda_randn(gen, m, n, dtype=BF16)
    gr = _cuda_randn(gen, m, n, dtype=BF16) if residual else None

    def call() -> list[Tensor]:
        return _raw_fwd_bwd(rms, n, x, r, w, b, g, gr)

    graph, static_outs = _capture(call)
    for trial in range(3):
        for t in (x, r, g, gr):
            if t is not None:
                t.copy_(_cuda_randn(gen, m, n, dtype=t.dtype, scale=1.0 + trial, shift=0.1 * trial))
        graph.replay()
        eager = call()
        for i, (got, want) in enumerate(zip(static_outs, eager, strict=True)):
            _same_bits(got, want, f"replay {trial} output {i}")


# ---- determinism ----------------------------------------------------------------------------------------------


def _fwd_bwd(fn: str, x: Tensor, r: Tensor, w: Tensor, b: Tensor, g: Tensor, gr: Tensor) -> list[Tensor]:
    """Outputs, then gradients of every leaf, of one functional call (fresh leaves every time)."""
    n = x.shape[-1]
    x, r, w, b = (t.detach().requires_grad_(True) for t in (x, r, w, b))
    ln = fn in ("layer_norm", "add_layer_norm")
    leaves = [x, w] + ([b] if ln else [])
    if fn.startswith("add_"):
        leaves.append(r)
        if ln:
            outs = list(L.add_layer_norm(x, r, n, w, b))
        else:
            outs = list(L.add_rms_norm(x, r, n, w))
        gouts = [g, gr.to(outs[1].dtype)]
    else:
        outs = [L.layer_norm(x, n, w, b) if ln else L.rms_norm(x, n, w)]
        gouts = [g]
    grads = torch.autograd.grad(outs, leaves, gouts)
    return [o.detach() for o in outs] + list(grads)


@pytest.mark.parametrize(
    "shape", [(16384, 1024), (3000, 257), (4, 65536), (1, 1 << 20), (70000, 64)], ids=lambda s: f"{s[0]}x{s[1]}"
)
@pytest.mark.parametrize("dtypes", [(F32, F32), (BF16, BF16), (BF16, F32)], ids=["f32", "bf16", "bf16+wf32"])
@pytest.mark.parametrize("fn", FNS)
def test_deterministic_backward(fn: str, dtypes: tuple[torch.dtype, torch.dtype], shape: tuple[int, int]) -> None:
    """The same inputs twice give the same bits: grad_weight / grad_bias (reductions over all rows), grad_input
    and the outputs. A call on another shape in between dirties any reused workspace."""
    m, n = shape
    dtype, wdtype = dtypes
    gen = torch.Generator(device=CUDA).manual_seed(m + n)
    args = (
        _cuda_randn(gen, m, n, dtype=dtype, scale=2.0, shift=0.3),
        _cuda_randn(gen, m, n, dtype=dtype),
        _cuda_randn(gen, n, dtype=wdtype, scale=0.5, shift=1.0),
        _cuda_randn(gen, n, dtype=wdtype, scale=0.5),
        _cuda_randn(gen, m, n, dtype=dtype),
        _cuda_randn(gen, m, n, dtype=dtype),
    )
    first = _fwd_bwd(fn, *args)
    other = (
        _cuda_randn(gen, 513, 3001, dtype=dtype),
        _cuda_randn(gen, 513, 3001, dtype=dtype),
        _cuda_randn(gen, 3001, dtype=wdtype),
        _cuda_randn(gen, 3001, dtype=wdtype),
        _cuda_randn(gen, 513, 3001, dtype=dtype),
        _cuda_randn(gen, 513, 3001, dtype=dtype),
    )
    _fwd_bwd(fn, *other)
    again = _fwd_bwd(fn, *args)
    for i, (a, b) in enumerate(zip(first, again, strict=True)):
        _same_bits(a, b, f"{fn} result {i}")


# ---- streams and devices --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", FNS)
def test_side_stream(fn: str) -> None:
    """Every kernel runs on the current stream. On a side stream that is busy (a sleep kernel) before it writes
    the input, a kernel launched on another stream would read the stale input."""
    m, n = 64, 4096
    gen = torch.Generator(device=CUDA).manual_seed(11)
    src = [_cuda_randn(gen, m, n, dtype=BF16, shift=0.3) for _ in range(4)]  # x, r, g, gr
    w = _cuda_randn(gen, n, dtype=BF16, scale=0.5, shift=1.0)
    b = _cuda_randn(gen, n, dtype=BF16, scale=0.5)
    expected = _fwd_bwd(fn, src[0], src[1], w, b, src[2], src[3])  # default stream
    stale = [torch.zeros_like(t) for t in src]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # tens of milliseconds of work ahead of the copies on this stream
        for dst, s in zip(stale, src):
            dst.copy_(s)
        got = _fwd_bwd(fn, stale[0], stale[1], w, b, stale[2], stale[3])
    torch.cuda.synchronize()
    for i, (a, e) in enumerate(zip(got, expected, strict=True)):
        _same_bits(a, e, f"{fn} result {i} on a side stream")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
@pytest.mark.parametrize("fn", FNS)
def test_second_device(fn: str) -> None:
    """Tensors on cuda:1 while cuda:0 is current: the op must switch device (device guard)."""
    assert torch.cuda.current_device() == 0
    spec = _spec(fn, (9,), (4096,), dtype=BF16, wdtype=F32)
    inp = _make_inputs(spec, "cuda:1")
    assert inp.x.device == torch.device("cuda:1")
    check_inputs(spec, inp)
    assert torch.cuda.current_device() == 0


# ---- the inference ops (out=, in place) --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [7, 1024, 5120, 65536])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_inference_ops_equal_the_functional_ops(rms: bool, n: int) -> None:
    """out= and the in-place fused add + norm on every CUDA thread mapping: the functional ops' bits."""
    gen = torch.Generator(device=CUDA).manual_seed(n)
    m = 33 if n < 65536 else 4
    x, r = _cuda_randn(gen, m, n, dtype=BF16, shift=0.3), _cuda_randn(gen, m, n, dtype=BF16)
    w, b = _cuda_randn(gen, n, dtype=BF16, scale=0.5, shift=1.0), _cuda_randn(gen, n, dtype=BF16, scale=0.2)
    out, h, xi, ri = torch.empty_like(x), torch.empty_like(x), x.clone(), r.clone()
    if rms:
        want, want_h = L.add_rms_norm(x, r, n, w)
        L.add_rms_norm(x, r, n, w, out=out, residual_out=h)
        L.add_rms_norm_(xi, ri, n, w)
    else:
        want, want_h = L.add_layer_norm(x, r, n, w, b)
        L.add_layer_norm(x, r, n, w, b, out=out, residual_out=h)
        L.add_layer_norm_(xi, ri, n, w, b)
    for got, expected, what in ((out, want, "out"), (h, want_h, "residual_out"), (xi, want, "in place: input"),
                                (ri, want_h, "in place: residual")):  # fmt: skip
        _same_bits(got, expected, what)


def test_inference_ops_in_a_cuda_graph_without_sync() -> None:
    """A decode step of the in-place add + RMSNorm and an out= LayerNorm: no host sync, captured and replayed
    on new data with the eager bits."""
    gen = torch.Generator(device=CUDA).manual_seed(3)
    n = 4096
    x, r = _cuda_randn(gen, 8, n, dtype=BF16), _cuda_randn(gen, 8, n, dtype=BF16)
    w = _cuda_randn(gen, n, dtype=BF16, scale=0.5, shift=1.0)
    xs, rs, buf = x.clone(), r.clone(), torch.empty_like(x)

    def step() -> list[Tensor]:
        L.add_rms_norm_(xs, rs, n, w)
        L.layer_norm(xs, n, w, None, out=buf)
        return [buf]

    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    graph, _ = _capture(step)
    for trial in range(2):
        new_x, new_r = _cuda_randn(gen, 8, n, dtype=BF16), _cuda_randn(gen, 8, n, dtype=BF16)
        xs.copy_(new_x)
        rs.copy_(new_r)
        graph.replay()
        want_x, want_r = L.add_rms_norm(new_x, new_r, n, w)
        _same_bits(xs, want_x, f"replay {trial}: input")
        _same_bits(rs, want_r, f"replay {trial}: residual")
        _same_bits(buf, L.layer_norm(want_x, n, w, None), f"replay {trial}: out")


@pytest.mark.parametrize("n", [7, 1024, 5125, 65536])
@pytest.mark.parametrize("quant_dtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "i8"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_quantized_output_is_the_composite_of_the_functional_op(rms: bool, quant_dtype: torch.dtype, n: int) -> None:
    """Quantized output on every CUDA thread mapping (vectorized and element-wise), static and dynamic (capped)
    scales: the composite reference of tests/test_quantized.py applied to the functional op's output, bit for bit,
    with the CPU kernels' arithmetic (quant_math.h); no host sync, and captured in a CUDA graph the same bits."""
    from test_quantized import _same_bits as same_codes
    from test_quantized import reference_quant

    gen = torch.Generator(device=CUDA).manual_seed(n + 2)
    m = 33 if n < 65536 else 4
    x, r = _cuda_randn(gen, m, n, dtype=BF16, shift=0.3), _cuda_randn(gen, m, n, dtype=BF16)
    w, b = _cuda_randn(gen, n, dtype=BF16, scale=0.5, shift=1.0), _cuda_randn(gen, n, dtype=BF16, scale=0.2)
    want, want_h = L.add_rms_norm(x, r, n, w) if rms else L.add_layer_norm(x, r, n, w, b)
    absmax = want.float().abs().max()
    qmax = 448.0 if quant_dtype == torch.float8_e4m3fn else 127.0

    def run(scale: Tensor | None, scale_ub: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        if rms:
            return L.add_rms_norm_quant(x, r, n, w, quant_dtype=quant_dtype, scale=scale, scale_ub=scale_ub)
        return L.add_layer_norm_quant(x, r, n, w, b, quant_dtype=quant_dtype, scale=scale, scale_ub=scale_ub)

    for scale, scale_ub in ((None, None), (None, (absmax * 0.7).reshape(1)), ((absmax / qmax * 0.8).reshape(1), None)):
        codes, scales, h = run(scale, scale_ub)
        # The reference on the CPU: CUDA's division by a Python number multiplies by its reciprocal, a rounding
        # away from the division (12 of these cases failed on an H200 so); the CPU's divides.
        on_cpu = [None if t is None else t.cpu() for t in (scale, scale_ub)]
        want_codes, want_scales = reference_quant(want.cpu(), 1, quant_dtype, *on_cpu)
        same_codes(codes.cpu(), want_codes, "codes")
        same_codes((scales if scale is None else scale).cpu(), want_scales, "scales")
        _same_bits(h, want_h, "residual_out")
    run(None, None)  # outside the check: lazy init may sync
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = run(None, None)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    graph, captured = _capture(lambda: list(run(None, None)))
    graph.replay()
    for got, expected, what in zip(captured, eager, ("codes", "scales", "residual_out"), strict=True):
        same_codes(got, expected, f"graph replay: {what}")
    # Into the caller's buffers, the residual updated in place (vLLM's fused add + static fp8 quant).
    scale = (absmax / qmax * 0.8).reshape(1)
    want_codes, _, want_h = run(scale, None)
    codes, residual = torch.empty_like(want_codes), r.clone()
    if rms:
        L.add_rms_norm_quant(x, residual, n, w, scale=scale, out=codes, residual_out=residual)
    else:
        L.add_layer_norm_quant(x, residual, n, w, b, scale=scale, out=codes, residual_out=residual)
    same_codes(codes, want_codes, "into: codes")
    _same_bits(residual, want_h, "into: residual in place")


@pytest.mark.parametrize("n", [64, 768, 5120, 65536])
@pytest.mark.parametrize(("fmt", "group_size"), [("fp8", 128), ("int8-column_major", 64), ("mxfp8", 32),
                                                 ("mxfp8-swizzled", 32), ("nvfp4", 16), ("nvfp4-swizzled", 16)])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_group_quantized_output_is_the_composite_of_the_functional_op(rms: bool, fmt: str, group_size: int,
                                                                      n: int) -> None:
    """Per-group fp8 / int8, MXFP8 and NVFP4 output (strided and swizzled scales) on the CUDA mappings: the composite
    references of the CPU tests applied to the functional op's output, bit for bit, and no host sync."""
    from test_cuda_emulation import _group_call, _group_reference, same_group_output

    if n % group_size:
        pytest.skip(f"group_size {group_size} does not divide {n} (a refused call: tests/test_quantized_groups.py)")
    gen = torch.Generator(device=CUDA).manual_seed(n + group_size)
    m = 33 if n < 65536 else 4
    x, r = _cuda_randn(gen, m, n, dtype=BF16, shift=0.3), _cuda_randn(gen, m, n, dtype=BF16)
    w, b = _cuda_randn(gen, n, dtype=BF16, scale=0.5, shift=1.0), _cuda_randn(gen, n, dtype=BF16, scale=0.2)
    want, want_h = L.add_rms_norm(x, r, n, w) if rms else L.add_layer_norm(x, r, n, w, b)
    kw = _group_call(fmt, group_size, want)

    def run() -> tuple[Tensor, Tensor, Tensor]:
        if rms:
            return L.add_rms_norm_quant(x, r, n, w, **kw)
        return L.add_layer_norm_quant(x, r, n, w, b, **kw)

    run()  # outside the check: lazy init may sync
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        codes, scales, h = run()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    cpu_kw = {k: (v.cpu() if isinstance(v, Tensor) else v) for k, v in kw.items()}
    want_codes, want_scales = _group_reference(fmt, cpu_kw, want.cpu(), None)
    same_group_output(codes.cpu(), want_codes, "codes")
    same_group_output(scales.cpu(), want_scales, "scales")
    _same_bits(h, want_h, "residual_out")


# ---- no host synchronization ------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", FNS)
def test_no_sync(fn: str) -> None:
    """Forward and backward (memory_efficient off) never synchronize with the host."""
    gen = torch.Generator(device=CUDA).manual_seed(5)
    args = [_cuda_randn(gen, 128, 2048, dtype=BF16) for _ in range(2)]
    params = [_cuda_randn(gen, 2048, dtype=F32, shift=1.0) for _ in range(2)]
    grads = [_cuda_randn(gen, 128, 2048, dtype=BF16) for _ in range(2)]
    _fwd_bwd(fn, *args, *params, *grads)  # first call outside: lazy init may sync
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _fwd_bwd(fn, *args, *params, *grads)
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm"])
def test_no_sync_memory_efficient_device_verdict(fn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """memory_efficient=True with parameters that require grad (in the input's dtype, so the values decide) and
    LAYERNORM_EXT_MEMEFF_DEVICE_VERDICT=1: forwards and backwards never synchronize and still save the output,
    also after an in-place update of the weight. (By default each such forward reads its verdict: one sync.)"""
    monkeypatch.setenv("LAYERNORM_EXT_MEMEFF_DEVICE_VERDICT", "1")
    n = 2048
    ln = fn == "layer_norm"
    gen = torch.Generator(device=CUDA).manual_seed(5)
    x = _cuda_randn(gen, 128, n, dtype=BF16).requires_grad_(True)
    w = _cuda_randn(gen, n, dtype=BF16, scale=0.1, shift=1.0).requires_grad_(True)
    b = _cuda_randn(gen, n, dtype=BF16, scale=0.2).requires_grad_(True)
    g = _cuda_randn(gen, 128, n, dtype=BF16)
    saved: list[int] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t.untyped_storage().data_ptr())
        return t

    def step() -> None:
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = L.layer_norm(x, n, w, b, memory_efficient=True) if ln else L.rms_norm(x, n, w, memory_efficient=True)
        assert out.untyped_storage().data_ptr() in saved, "memory_efficient saved no output"
        torch.autograd.grad(out, [x, w, b] if ln else [x, w], g)

    def step_without_sync() -> None:
        torch.cuda.synchronize()
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    step()  # lazy init may sync
    step_without_sync()
    with torch.no_grad():
        w.mul_(1.01)  # still safe; a new version
    step_without_sync()


@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm"])
def test_memory_efficient_zero_padded_rows_exact(fn: str) -> None:
    """A batch with zero-padded rows (variance far below eps: the output cannot stand in) and a weight entry 0:
    the default way reads the verdict and saves the input, so the gradients are memory_efficient=False's, bit
    for bit (the device's way returned NaN for every dx here)."""
    n = 1024
    gen = torch.Generator(device=CUDA).manual_seed(23)
    x = _cuda_randn(gen, 16, n, dtype=BF16)
    x[3:6] = 0
    w = _cuda_randn(gen, n, dtype=BF16, scale=0.1, shift=1.0)
    w[7] = 0
    b = _cuda_randn(gen, n, dtype=BF16, scale=0.2) if fn == "layer_norm" else None
    g = _cuda_randn(gen, 16, n, dtype=BF16)
    results = []
    for memory_efficient in (True, False):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, b) if t is not None]
        if fn == "layer_norm":
            out = L.layer_norm(leaves[0], n, leaves[1], leaves[2], memory_efficient=memory_efficient)
        else:
            out = L.rms_norm(leaves[0], n, leaves[1], memory_efficient=memory_efficient)
        results.append(torch.autograd.grad(out, leaves, g))
    for i, (eff, plain) in enumerate(zip(*results, strict=True)):
        assert torch.isfinite(eff).all(), f"gradient {i} not finite"
        _same_bits(eff, plain, f"gradient {i}")


# ---- torch.compile --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_module(backend: str) -> None:
    """A pre-norm block with FusedLayerNorm and FusedRMSNorm under torch.compile(fullgraph=True): same forward
    and gradients as eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    n = 1024
    ln = L.FusedLayerNorm(n, device=CUDA, dtype=BF16)
    rms = L.FusedRMSNorm(n, device=CUDA, dtype=BF16)
    with torch.no_grad():
        for p in (ln.weight, ln.bias, rms.weight):
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if p is not ln.bias else 0.0))

    def block(x: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
        y, h = ln(x * 2, r)
        return rms(y), h

    x0 = torch.randn(8, 16, n, device=CUDA, dtype=BF16)
    r0 = torch.randn(8, 16, n, device=CUDA, dtype=BF16)
    g0 = torch.randn(8, 16, n, device=CUDA, dtype=BF16)

    def run(f: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]) -> list[Tensor]:
        for p in (ln.weight, ln.bias, rms.weight):
            p.grad = None
        x, r = x0.clone().requires_grad_(True), r0.clone().requires_grad_(True)
        y, h = f(x, r)
        (y.float() * g0.float()).sum().add((h.float() * g0.float()).mean()).backward()
        return [y.detach(), h.detach(), x.grad, r.grad, ln.weight.grad, ln.bias.grad, rms.weight.grad]

    eager = run(block)
    compiled = run(torch.compile(block, backend=backend, fullgraph=True))
    for i, (a, b) in enumerate(zip(compiled, eager, strict=True)):
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-2, msg=lambda m, i=i: f"result {i}: {m}")


# ---- the build --------------------------------------------------------------------------------------------


def test_build_reports_cuda() -> None:
    """A GPU is present: a library built without CUDA must fail here, loudly."""
    info = L.build_info()
    assert info["with_cuda"] is True, f"layernorm_ext was built without CUDA: {info}"
    out = L.layer_norm(torch.randn(2, 8, device=CUDA), (8,))
    assert out.is_cuda
