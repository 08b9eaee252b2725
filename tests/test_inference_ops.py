"""The inference ops: out= variants of the four functions (torch.ops.layernorm_ext.layer_norm_into /
rms_norm_into) and the engines' fused add + norm in place (add_layer_norm_, add_rms_norm_).

They run the very kernels of the functional ops, so their results must equal the functional ops' bit for bit,
for every dtype pairing, odd sizes and the residual variants; they store no statistics (no allocation at all);
they bump the versions of what they write, under torch.inference_mode() too (as ATen's in-place ops); they
refuse what the functional ops refuse, plus bad buffers (wrong shape or dtype, non-contiguous, overlapping an
argument), eager and under FakeTensorMode alike; they refuse arguments that require grad; opcheck passes;
torch.compile(fullgraph=True) traces them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

import layernorm_ext as L

pytestmark = pytest.mark.usefixtures("cpu_isa")

F32, F64, F16, BF16 = torch.float32, torch.float64, torch.float16, torch.bfloat16
_ops = torch.ops.layernorm_ext
FNS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
DTYPES = ((F32, F32), (F64, F64), (F16, F16), (BF16, BF16), (BF16, F32))
COLS = (1, 7, 769, 5125)
_SHORT = {F32: "f32", F64: "f64", F16: "f16", BF16: "bf16"}


def _args(fn: str, dtype: torch.dtype, wdtype: torch.dtype, cols: int, rows: int = 5) -> dict[str, Tensor | None]:
    gen = torch.Generator().manual_seed(cols + len(fn))
    x = (torch.randn(rows, cols, generator=gen) * 2 + 0.3).to(dtype)
    r = torch.randn(rows, cols, generator=gen).to(dtype) if fn.startswith("add_") else None
    w = (torch.randn(cols, generator=gen) * 0.5 + 1).to(wdtype)
    b = (torch.randn(cols, generator=gen) * 0.2).to(wdtype) if "layer" in fn else None
    return {"x": x, "r": r, "w": w, "b": b}


def _functional(fn: str, a: dict[str, Tensor | None], **kw: object) -> tuple[Tensor, Tensor | None]:
    x, r, w, b, n = a["x"], a["r"], a["w"], a["b"], a["x"].shape[-1]
    if fn == "layer_norm":
        return L.layer_norm(x, n, w, b, **kw), None
    if fn == "rms_norm":
        return L.rms_norm(x, n, w, **kw), None
    if fn == "add_layer_norm":
        return L.add_layer_norm(x, r, n, w, b, **kw)
    return L.add_rms_norm(x, r, n, w, **kw)


def _same_bits(got: Tensor, want: Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got, want), f"{what}: not the functional op's bits"


def _cases() -> list:
    return [
        pytest.param(fn, dtype, wdtype, cols, id=f"{fn}-{_SHORT[dtype]}w{_SHORT[wdtype]}-n{cols}")
        for fn in FNS for dtype, wdtype in DTYPES for cols in COLS
    ]  # fmt: skip


@pytest.mark.parametrize(("fn", "dtype", "wdtype", "cols"), _cases())
def test_out_equals_the_functional_op(fn: str, dtype: torch.dtype, wdtype: torch.dtype, cols: int) -> None:
    a = _args(fn, dtype, wdtype, cols)
    want, want_h = _functional(fn, a, weight_offset=0.5, cast_before_weight=True)
    out = torch.full_like(a["x"], float("nan"))
    kw: dict[str, object] = {"out": out}
    if want_h is not None:
        kw["residual_out"] = torch.full_like(want_h, float("nan"))
    got, got_h = _functional(fn, a, weight_offset=0.5, cast_before_weight=True, **kw)
    assert got is out
    _same_bits(out, want, "out")
    if want_h is not None:
        assert got_h is kw["residual_out"]
        _same_bits(got_h, want_h, "residual_out")


@pytest.mark.parametrize(("fn", "dtype", "wdtype", "cols"), [c for c in _cases() if c.values[0].startswith("add_")])
def test_in_place_add_norm_equals_the_functional_op(fn: str, dtype: torch.dtype, wdtype: torch.dtype, cols: int) -> None:
    """residual = input + residual, input = norm(residual), in place: what add_*_norm returns, bit for bit."""
    a = _args(fn, dtype, wdtype, cols)
    want, want_h = _functional(fn, a)
    x, r = a["x"].clone(), a["r"].clone()
    versions = (x._version, r._version)
    n = cols
    if fn == "add_layer_norm":
        got = L.add_layer_norm_(x, r, n, a["w"], a["b"])
    else:
        got = L.add_rms_norm_(x, r, n, a["w"])
    assert got[0] is x and got[1] is r
    _same_bits(x, want, "input (the normalized rows)")
    _same_bits(r, want_h, "residual (h)")
    assert x._version > versions[0] and r._version > versions[1], "an in-place op must bump the versions it wrote"


def test_residual_in_fp32_out_and_promoted_residual() -> None:
    """residual_out= takes h's dtype: float32 with residual_in_fp32 (half input), the promoted dtype otherwise."""
    a = _args("add_rms_norm", BF16, BF16, 300)
    want, want_h = L.add_rms_norm(a["x"], a["r"], 300, a["w"], residual_in_fp32=True)
    out, h = torch.empty_like(a["x"]), torch.empty(5, 300)
    L.add_rms_norm(a["x"], a["r"], 300, a["w"], residual_in_fp32=True, out=out, residual_out=h)
    _same_bits(out, want, "out")
    _same_bits(h, want_h, "residual_out")
    # In place, residual holds h: a float32 residual with a bf16 input is h's dtype, so it works there too.
    x, r = a["x"].clone(), a["r"].float()
    want, want_h = L.add_rms_norm(x, r, 300, a["w"])
    L.add_rms_norm_(x, r, 300, a["w"])
    _same_bits(x, want, "input")
    _same_bits(r, want_h, "residual")


def test_no_statistics_are_stored() -> None:
    """The functional forward allocates its statistics (rstd, and mean for LayerNorm) only where autograd records
    a graph (a backward will read them); without one it allocates its outputs alone; never residual_out's empty
    placeholder (the forward op returns one where there is no residual). The inference ops allocate nothing."""
    a = _args("add_layer_norm", F32, F32, 512, rows=64)
    out, h = torch.empty_like(a["x"]), torch.empty_like(a["x"])

    def allocations(call: Callable[[], object]) -> int:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call()
        return sum(1 for e in prof.events() if e.name in ("aten::empty", "aten::empty_strided", "aten::empty_like"))

    x, r, w, b = a["x"], a["r"], a["w"], a["b"]
    wg = w.detach().requires_grad_()
    assert allocations(lambda: L.add_layer_norm(x, r, 512, wg, b)) == 4  # out, residual_out, mean, rstd
    assert allocations(lambda: L.add_layer_norm(x, r, 512, w, b)) == 2  # out, residual_out
    assert allocations(lambda: L.rms_norm(x, 512, wg)) == 2  # out, rstd: no residual_out placeholder
    assert allocations(lambda: L.layer_norm(x, 512, wg, b)) == 3  # out, mean, rstd
    with torch.no_grad():
        assert allocations(lambda: L.rms_norm(x, 512, wg)) == 1
        assert allocations(lambda: L.layer_norm(x, 512, wg, b)) == 1
    with torch.inference_mode():
        assert allocations(lambda: L.add_rms_norm(x, r, 512, w)) == 2
    assert allocations(lambda: L.add_layer_norm(x, r, 512, w, b, out=out, residual_out=h)) == 0
    assert allocations(lambda: L.rms_norm(x, 512, w, out=out)) == 0
    assert allocations(lambda: L.add_rms_norm_(out, h, 512, w)) == 0


def test_forward_op_inside_a_functional_call_gets_every_output() -> None:
    """What a functional call leaves out is taken by its own forward op: a forward op called later inside that call
    (from a saved-tensor pack hook, which autograd runs while the functional call records its node) returns every
    output, the placeholder and the statistics included."""
    x, w = torch.randn(4, 8), torch.randn(8, requires_grad=True)
    seen: list[tuple[Tensor, ...]] = []

    def pack(t: Tensor) -> Tensor:
        if not seen:
            seen.append(torch.ops.layernorm_ext.layer_norm_fwd(x, [8], None, None, 1e-5, None, False, False, 0.0,
                                                                False))  # fmt: skip
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = L.layer_norm(x, 8, w)
    out, residual_out, mean, rstd = seen[0]
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(x, (8,)))
    assert residual_out.shape == (0,) and mean.numel() == rstd.numel() == 4
    y.sum().backward()
    assert w.grad is not None


# ---- errors ----------------------------------------------------------------------------------------------------


Tensors = tuple[Tensor, Tensor, Tensor, Tensor]


def _tensors() -> Tensors:
    """x, residual, weight, bias (made inside FakeTensorMode for the fake runs)."""
    return torch.randn(4, 8), torch.randn(4, 8), torch.randn(8), torch.randn(8)


def _bad_calls() -> list:
    cases: list[tuple[str, Callable[..., object], str]] = [
        ("out_dtype", lambda x, r, w, b: L.rms_norm(x, 8, w, out=torch.empty(4, 8, dtype=F64)),
         r"rms_norm_into: expected out of shape \[4, 8\] and dtype Float, but got out of shape \[4, 8\] and dtype Double"),
        ("out_shape", lambda x, r, w, b: L.layer_norm(x, 8, w, b, out=torch.empty(4, 9)),
         r"layer_norm_into: expected out of shape \[4, 8\] and dtype Float, but got out of shape \[4, 9\]"),
        ("out_strided", lambda x, r, w, b: L.rms_norm(x, 8, w, out=torch.empty(8, 4).t()),
         r"rms_norm_into: expected out to be contiguous"),
        ("residual_out_dtype", lambda x, r, w, b: L.add_rms_norm(x.bfloat16(), r, 8, w, out=torch.empty(4, 8, dtype=BF16),
                                                                 residual_out=torch.empty(4, 8, dtype=BF16)),
         r"rms_norm_into: expected residual_out of shape \[4, 8\] and dtype Float, but got residual_out of shape "
         r"\[4, 8\] and dtype BFloat16"),
        ("no_residual_out", lambda x, r, w, b: _ops.rms_norm_into(x, [8], w, None, torch.empty(4, 8), r),
         r"rms_norm_into: a residual needs a residual_out buffer"),
        ("stray_residual_out", lambda x, r, w, b: _ops.rms_norm_into(x, [8], w, None, torch.empty(4, 8), None,
                                                                     torch.empty(4, 8)),
         r"rms_norm_into: residual_out is given without a residual"),
        ("in_place_residual_dtype", lambda x, r, w, b: L.add_rms_norm_(x, r.bfloat16(), 8, w),
         r"add_rms_norm_: expected residual of shape \[4, 8\] and dtype Float, but got residual of shape \[4, 8\] "
         r"and dtype BFloat16"),
        ("in_place_strided", lambda x, r, w, b: L.add_layer_norm_(torch.randn(8, 4).t(), r, 8, w, b),
         r"add_layer_norm_: expected input to be contiguous"),
        ("shape", lambda x, r, w, b: L.rms_norm(x, 9, w, out=torch.empty(4, 8)),
         r"rms_norm_into: given normalized_shape=\[9\], expected input with shape \[\*, 9\]"),
        ("offset_without_weight", lambda x, r, w, b: L.rms_norm(x, 8, None, weight_offset=1.0, out=torch.empty(4, 8)),
         r"rms_norm_into: weight_offset=1 needs a weight"),
    ]  # fmt: skip
    return [pytest.param(call, match, id=name) for name, call, match in cases]


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize(("call", "match"), _bad_calls())
def test_bad_buffers_are_refused(call: Callable[..., object], match: str, fake: bool) -> None:
    """The same error, worded the same, eager and while tracing with fake tensors (torch.compile / export)."""
    if not fake:
        with pytest.raises(RuntimeError, match=match):
            call(*_tensors())
        return
    with FakeTensorMode(), pytest.raises(RuntimeError, match=match):
        call(*_tensors())  # every tensor made under the mode


def test_overlapping_buffers_are_refused() -> None:
    x, r, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match=r"rms_norm_into: out shares memory with input"):
        L.rms_norm(x, 8, w, out=x)
    with pytest.raises(RuntimeError, match=r"rms_norm_into: residual_out shares memory with residual"):
        L.add_rms_norm(x, r, 8, w, out=torch.empty_like(x), residual_out=r)
    with pytest.raises(RuntimeError, match=r"layer_norm_into: out shares memory with residual_out"):
        h = torch.empty_like(x)
        L.add_layer_norm(x, r, 8, w, None, out=h, residual_out=h)


def test_requires_grad_is_refused_and_no_grad_works() -> None:
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8)
    with pytest.raises(RuntimeError, match=r"rms_norm_into: the inference ops \(out=, in place, quantized output\) "
                                           r"don't support automatic differentiation, but input requires grad"):
        L.rms_norm(x, 8, w, out=torch.empty(4, 8))
    out = torch.empty(4, 8)
    with torch.no_grad():
        L.rms_norm(x, 8, w, out=out)
    torch.testing.assert_close(out, L.rms_norm(x.detach(), 8, w), rtol=0, atol=0)
    with torch.inference_mode():
        xi, ri = torch.randn(4, 8), torch.randn(4, 8)
        want, want_h = L.add_rms_norm(xi, ri, 8, w)
        L.add_rms_norm_(xi, ri, 8, w)
        assert torch.equal(xi, want) and torch.equal(ri, want_h)


# Each mutating op writing into `saved` (float32 [4, 8]) at one of its written arguments.
_SCALE = torch.ones(1)
_WRITERS: dict[str, Callable[[Tensor], object]] = {
    "layer_norm_into.out": lambda s: _ops.layer_norm_into(torch.randn(4, 8), [8], None, None, 1e-5, s),
    "rms_norm_into.out": lambda s: _ops.rms_norm_into(torch.randn(4, 8), [8], None, None, s),
    "rms_norm_into.residual_out": lambda s: _ops.rms_norm_into(
        torch.randn(4, 8), [8], None, None, torch.empty(4, 8), torch.randn(4, 8), s),
    "add_layer_norm_.input": lambda s: _ops.add_layer_norm_(s, torch.randn(4, 8), [8]),
    "add_rms_norm_.residual": lambda s: _ops.add_rms_norm_(torch.randn(4, 8), s, [8]),
    "layer_norm_quant_into.residual_out": lambda s: _ops.layer_norm_quant_into(
        torch.randn(4, 8), [8], None, None, 1e-5, torch.empty(4, 8, dtype=torch.int8), _SCALE,
        residual=torch.randn(4, 8), residual_out=s),
    "rms_norm_quant_into.residual_out": lambda s: _ops.rms_norm_quant_into(
        torch.randn(4, 8), [8], None, None, torch.empty(4, 8, dtype=torch.int8), _SCALE,
        residual=torch.randn(4, 8), residual_out=s),
}  # fmt: skip


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("writer", _WRITERS)
def test_writes_bump_the_version_in_inference_mode(writer: str, mode: str) -> None:
    """A graph recorded before saved h (sin saves its input); an inference op then overwrites h. As ATen's in-place
    ops, ours bump h's version also under torch.inference_mode() (the bump is on the ADInplaceOrView key, which
    inference mode keeps for normal tensors), so the backward raises instead of using the overwritten values.
    Main bumped on the Autograd key only: under inference mode x.grad came out silently wrong."""
    x = torch.randn(4, 8, requires_grad=True)
    h = x * 1.5
    y = h.sin()
    version = h._version
    with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
        _WRITERS[writer](h)
    assert h._version > version, f"{writer} under {mode} bumped no version"
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_scales_buffer_version_bump_in_inference_mode() -> None:
    scales = torch.empty(4, 1)
    version = scales._version
    with torch.inference_mode():
        _ops.rms_norm_quant_into(torch.randn(4, 8), [8], None, None, torch.empty(4, 8, dtype=torch.int8),
                                 scales=scales)  # fmt: skip
    assert scales._version > version


def test_inference_tensors_are_written_without_a_version() -> None:
    """Inference tensors have no version counter: writing them (in and outside inference mode) works."""
    with torch.inference_mode():
        x, r = torch.randn(4, 8), torch.randn(4, 8)
        L.add_rms_norm_(x, r, 8)
    L.add_rms_norm_(x, r, 8)
    assert x.is_inference() and r.is_inference()


def test_out_needs_both_buffers_with_a_residual() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match=r"add_rms_norm: out= and residual_out= go together"):
        L.add_rms_norm(x, x.clone(), 8, out=torch.empty_like(x))


# ---- opcheck and compile -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["layer_norm_into", "rms_norm_into", "add_layer_norm_", "add_rms_norm_"])
def test_opcheck(op: str) -> None:
    gen = torch.Generator().manual_seed(9)
    x, r = torch.randn(3, 40, generator=gen).bfloat16(), torch.randn(3, 40, generator=gen).bfloat16()
    w, b = torch.randn(40, generator=gen).bfloat16(), torch.randn(40, generator=gen).bfloat16()
    out, h = torch.empty_like(x), torch.empty_like(x)
    args = {
        "layer_norm_into": (x, [40], w, b, 1e-5, out, r, h, False, 0.5, True),
        "rms_norm_into": (x, [40], w, None, out, None, None, False, 1.0, False),
        "add_layer_norm_": (x.clone(), r.clone(), [40], w, b, 1e-5, 0.0, True),
        "add_rms_norm_": (x.clone(), r.clone(), [40], w, 1e-6, 1.0, False),
    }[op]
    torch.library.opcheck(getattr(_ops, op).default, args)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_decode_step_compiles_fullgraph(backend: str) -> None:
    """A decode step as an engine writes it: the fused add + RMSNorm in place on the residual stream, a
    projection, then a LayerNorm into a preallocated buffer; compiled with fullgraph, the same bits as eager."""
    torch.manual_seed(10)
    w1, w2 = torch.randn(64).bfloat16(), torch.randn(64).bfloat16()
    proj = torch.randn(64, 64).bfloat16() * 0.1

    def step(x: Tensor, residual: Tensor, buf: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        L.add_rms_norm_(x, residual, 64, w1, 1e-6)
        y = x @ proj
        L.layer_norm(y, 64, w2, None, out=buf)
        return x, residual, buf

    x, r = torch.randn(4, 64).bfloat16(), torch.randn(4, 64).bfloat16()
    eager = step(x.clone(), r.clone(), torch.empty(4, 64, dtype=BF16))
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    xc, rc, bc = x.clone(), r.clone(), torch.empty(4, 64, dtype=BF16)
    got = compiled(xc, rc, bc)
    torch._dynamo.reset()
    for g, e, name in zip(got, eager, ("x", "residual", "buf"), strict=True):
        assert torch.equal(g, e), name
    assert torch.equal(xc, eager[0]) and torch.equal(rc, eager[1]) and torch.equal(bc, eager[2]), "mutations lost"
