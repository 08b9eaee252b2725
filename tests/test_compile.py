"""torch.compile (fullgraph, static and dynamic shapes, forward and backward) and torch.export of the
functional and module APIs. Most cases use the aot_eager backend (it traces exactly what inductor traces: the
fake kernels and autograd formulas, through AOTAutograd) to keep the suite fast; one case runs inductor.
"""

from __future__ import annotations

import contextlib

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch import Tensor

import layernorm_ext
from layernorm_ext import FusedLayerNorm, FusedRMSNorm

F32, BF16 = torch.float32, torch.bfloat16

# Raised inside torch while it compiles, not by us.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _leaf(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator, device: str, offset: float = 0.0) -> Tensor:
    t = torch.randn(tuple(shape), generator=gen, dtype=torch.float64) + offset
    return t.to(device=device, dtype=dtype).requires_grad_()


def _clone_leaves(ts: Sequence[Tensor | None]) -> list[Tensor | None]:
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # Same kernels in both runs; only the choice of saved tensor (memory_efficient) may differ under tracing.
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == F32 else {"rtol": 1.6e-2, "atol": 1e-2}


def _run_fwd_bwd(
    fn: Callable[..., Tensor | tuple[Tensor, ...]], leaves: Sequence[Tensor | None], seed: int = 0
) -> tuple[list[Tensor], list[Tensor | None]]:
    """Calls fn(*leaves), backpropagates a fixed random cotangent through every output, returns (outs, grads)."""
    outs = fn(*leaves)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    gen = torch.Generator().manual_seed(seed)
    cotangents = [torch.randn(o.shape, generator=gen).to(o) for o in outs]
    torch.autograd.backward(outs, cotangents)
    return [o.detach() for o in outs], [None if t is None else t.grad for t in leaves]


Results = tuple[list[Tensor], list[Tensor | None]]


def _assert_same(eager: Results, compiled: Results) -> None:
    for e, c in zip(eager[0], compiled[0], strict=True):
        assert e.dtype == c.dtype and e.shape == c.shape
        torch.testing.assert_close(c, e, **_tol(e.dtype))
    for e, c in zip(eager[1], compiled[1], strict=True):
        if e is None:
            assert c is None
            continue
        assert c is not None
        assert e.dtype == c.dtype
        torch.testing.assert_close(c, e, **_tol(e.dtype))


def _no_recompile(enabled: bool) -> contextlib.AbstractContextManager[object]:
    """After the first call, any recompilation raises (counting backend calls would also count the
    restarts dynamo does internally, e.g. to specialize float arguments under dynamic=True)."""
    return torch._dynamo.config.patch(error_on_recompile=True) if enabled else contextlib.nullcontext()


# ---- functional API --------------------------------------------------------------------------------------------

N = 48
# name -> (function of leaves, leaf shapes builder)
FUNCTIONAL: dict[str, Callable[..., Tensor | tuple[Tensor, ...]]] = {
    "layer_norm": lambda x, r, w, b: layernorm_ext.layer_norm(x, N, w, b),
    "rms_norm": lambda x, r, w, b: layernorm_ext.rms_norm(x, [N], w),
    "add_layer_norm": lambda x, r, w, b: layernorm_ext.add_layer_norm(x, r, (N,), w, b),
    "add_rms_norm": lambda x, r, w, b: layernorm_ext.add_rms_norm(x, r, torch.Size([N]), w, residual_in_fp32=True),
}


def _functional_leaves(m: int, x_dtype: torch.dtype, device: str, seed: int = 0) -> list[Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    x = _leaf((m, 3, N), x_dtype, gen, device, 0.5)
    r = _leaf((m, 3, N), x_dtype, gen, device)
    w = _leaf((N,), F32, gen, device, 1.0)
    b = _leaf((N,), F32, gen, device)
    return [x, r, w, b]


@pytest.mark.parametrize("x_dtype", [F32, BF16], ids=["fp32", "bf16_mixed"])
@pytest.mark.parametrize("name", list(FUNCTIONAL))
def test_compile_functional_static(device: str, name: str, x_dtype: torch.dtype) -> None:
    fn = FUNCTIONAL[name]
    leaves = _functional_leaves(5, x_dtype, device)
    eager = _run_fwd_bwd(fn, leaves)
    compiled_fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    _assert_same(eager, _run_fwd_bwd(compiled_fn, _clone_leaves(leaves)))
    # Unused leaves (the residual without residual; no bias for rms) get no gradient in either run.
    if name in ("layer_norm", "rms_norm"):
        assert eager[1][1] is None


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["default", "memeff"])
def test_compile_functional_dynamic(device: str, memory_efficient: bool) -> None:
    """dynamic=True: one graph serves every number of rows (no recompilation), forward and backward."""

    def fn(x: Tensor, r: Tensor, w: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        y = layernorm_ext.layer_norm(x, N, w, b, memory_efficient=memory_efficient)
        z, h = layernorm_ext.add_rms_norm(y, r, N, w, 1e-6, memory_efficient=memory_efficient)
        return y, z, h

    compiled_fn = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=True)
    for i, m in enumerate((2, 7, 3, 4)):  # not 1: torch specializes sizes 0 and 1
        leaves = _functional_leaves(m, F32, device, seed=i)
        eager = _run_fwd_bwd(fn, leaves, seed=i)
        with _no_recompile(i > 0):
            got = _run_fwd_bwd(compiled_fn, _clone_leaves(leaves), seed=i)
        _assert_same(eager, got)


# ---- modules ----------------------------------------------------------------------------------------------------


class PreNormBlock(torch.nn.Module):
    """A small pre-norm block using both fused modules, with and without residual."""

    def __init__(self, dim: int, memory_efficient: bool = False, dtype: torch.dtype = F32) -> None:
        super().__init__()
        self.ln = FusedLayerNorm(dim, memory_efficient=memory_efficient, dtype=dtype)
        self.rms = FusedRMSNorm(dim, eps=1e-6, memory_efficient=memory_efficient, dtype=dtype)
        self.proj = torch.nn.Linear(dim, dim, dtype=dtype)
        self.final = FusedLayerNorm(dim, bias=False, dtype=dtype)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(7)
            for p in (self.ln.weight, self.ln.bias, self.rms.weight, self.final.weight):
                p.add_(0.3 * torch.randn(p.shape, generator=gen).to(p))

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        y, h = self.ln(x, residual)
        y = self.proj(y)
        z, h2 = self.rms(y, h)
        return self.final(self.rms(z)), h2


def _module_case(m: int, device: str, seed: int) -> list[Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    return [_leaf((m, N), F32, gen, device, 0.2), _leaf((m, N), F32, gen, device)]


def _param_grads(mod: torch.nn.Module) -> list[Tensor | None]:
    grads = [p.grad for p in mod.parameters()]
    mod.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("memory_efficient", [False, True], ids=["default", "memeff"])
def test_compile_module(device: str, dynamic: bool, memory_efficient: bool) -> None:
    block = PreNormBlock(N, memory_efficient).to(device)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    sizes = (3, 6, 2) if dynamic else (4, 4)
    for i, m in enumerate(sizes):
        leaves = _module_case(m, device, seed=10 + i)
        eager = _run_fwd_bwd(block, leaves, seed=i)
        eager_pg = _param_grads(block)
        with _no_recompile(i > 0):
            got = _run_fwd_bwd(compiled, _clone_leaves(leaves), seed=i)
        got_pg = _param_grads(block)
        _assert_same(eager, got)
        _assert_same(([], eager_pg), ([], got_pg))


def test_compile_module_recompiles_for_new_shape_when_static(device: str) -> None:
    """dynamic=False really specializes (so the dynamic test above checks something): a new M recompiles."""
    mod = FusedRMSNorm(N).to(device)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(mod, fullgraph=True, backend=counter, dynamic=False)
    counts = []
    for m in (3, 5):
        x = torch.randn(m, N, device=device)
        torch.testing.assert_close(compiled(x), mod(x), rtol=0, atol=0)
        counts.append(counter.frame_count)
    assert counts[0] >= 1 and counts[1] > counts[0], counts


def test_compile_inductor(device: str) -> None:
    """The default backend (inductor; on CPU it generates and compiles C++ around our ops)."""
    block = PreNormBlock(N).to(device)
    compiled = torch.compile(block, fullgraph=True)
    leaves = _module_case(5, device, seed=20)
    eager = _run_fwd_bwd(block, leaves)
    eager_pg = _param_grads(block)
    got = _run_fwd_bwd(compiled, _clone_leaves(leaves))
    got_pg = _param_grads(block)
    _assert_same(eager, got)
    _assert_same(([], eager_pg), ([], got_pg))


def test_no_graph_breaks_explain() -> None:
    block = PreNormBlock(N)
    x, r = _module_case(3, "cpu", seed=30)

    def fn(x: Tensor, r: Tensor) -> Tensor:
        y, h = block(x, r)
        a = layernorm_ext.layer_norm(y, [N])
        b, _ = layernorm_ext.add_layer_norm(a, h, N, eps=1e-6)
        return layernorm_ext.rms_norm(b, N) + h

    explanation = torch._dynamo.explain(fn)(x, r)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    targets = {str(node.target) for g in explanation.graphs for node in g.graph.nodes}
    assert _has_op(targets, "layer_norm") and _has_op(targets, "rms_norm"), targets


# ---- torch.export -----------------------------------------------------------------------------------------------


def _has_op(targets: set[str], norm: str) -> bool:
    """Whether a graph calls one of our ops of this norm: the functional one (layer_norm, add_layer_norm, kept by
    dynamo and export), or the forward op it is made of (layer_norm_fwd, after decomposition)."""
    names = {f"layernorm_ext.{op}" for op in (norm, f"add_{norm}", f"{norm}_fwd")}
    return any(t.removesuffix(".default") in names for t in targets)


def _export_targets(ep: torch.export.ExportedProgram) -> set[str]:
    return {str(node.target) for node in ep.graph.nodes if node.op == "call_function"}


def test_export_module(device: str) -> None:
    block = PreNormBlock(N).to(device).eval()
    x, r = _module_case(4, device, seed=40)
    x, r = x.detach(), r.detach()
    batch = torch.export.Dim("batch", min=1, max=1024)
    ep = torch.export.export(block, (x, r), dynamic_shapes=({0: batch}, {0: batch}))
    targets = _export_targets(ep)
    assert _has_op(targets, "layer_norm") and _has_op(targets, "rms_norm"), targets
    # No decomposition into ATen norms: our kernels run in the exported program.
    assert not any("native_layer_norm" in t or "aten.rms_norm" in t for t in targets), targets
    exported = ep.module()
    for i, m in enumerate((4, 9, 1)):
        xi, ri = (t.detach() for t in _module_case(m, device, seed=41 + i))
        with torch.no_grad():
            want = block(xi, ri)
            got = exported(xi, ri)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_export_training_graph_backward(device: str) -> None:
    """An exported program (not run under no_grad) stays differentiable through our autograd formulas."""
    block = PreNormBlock(N).to(device)
    x, r = (t.detach() for t in _module_case(3, device, seed=50))
    ep = torch.export.export(block, (x, r))
    exported = ep.module()
    leaves = _module_case(3, device, seed=50)
    eager = _run_fwd_bwd(block, leaves)
    got = _run_fwd_bwd(exported, _clone_leaves(leaves))
    _assert_same(eager, got)


# ---- compiled autograd --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm_memory_efficient", "add_layer_norm_h_only", "add_rms_norm"])
def test_compiled_autograd(fn: str, backend: str) -> None:
    """The backward traced by compiled autograd (torch._dynamo.compiled_autograd) gives eager's gradients, and its
    graph holds our node's backward (not an eager fallback): the hand-written node supports compiled autograd."""
    compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")
    graphs: list[str] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable[..., Any]:
        graphs.append(gm.code)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    def run(enable: bool) -> list[Tensor]:
        gen = torch.Generator().manual_seed(60)
        x, r, w, b = (torch.randn(shape, generator=gen).requires_grad_() for shape in ((4, N), (4, N), (N,), (N,)))
        if fn == "layer_norm":
            out = layernorm_ext.layer_norm(x, N, w, b)
        elif fn == "rms_norm_memory_efficient":
            out = layernorm_ext.rms_norm(x, N, w, memory_efficient=True)
        elif fn == "add_layer_norm_h_only":  # only residual_out is used: out's gradient arrives undefined
            _, out = layernorm_ext.add_layer_norm(x, r, N, w, b)
        else:
            out, h = layernorm_ext.add_rms_norm(x, r, N, w)
            out = out * h
        compiler = torch.compile(backend=recording_backend)
        context = compiled_autograd._enable(compiler) if enable else contextlib.nullcontext()
        with context:
            (out * out).sum().backward()
        return [t.grad for t in (x, r, w, b) if t.grad is not None]

    want = run(False)
    torch._dynamo.reset()
    got = run(True)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert any("NormBackward" in code or "norm_bwd" in code for code in graphs), graphs
