"""Norms on strided rows without a copy (issue 24): the normalized dims packed, the leading dims any strides and a
storage offset (QK-norm's view of a fused qkv projection, a slice x[..., :d], transposed or expanded leading
dims). The kernels read and write such rows in place (csrc/row_layout.h); normalized dims that are not packed
are copied first (the "columns" layout), but for channels-first rows on the CPU (tests/test_norm_2d.py).

Every case runs the op on the strided view and on its contiguous copy: the results must be the same bits (the
kernels do the same arithmetic row by row), and no worse than ATen's on the contiguous tensor under the suite's
rule (tests/conftest.py). Then: the profiler sees no copy for these layouts; destinations with a stride-0 dim are
refused (eager and fake alike); the fake kernels give the real output strides (opcheck, torch.compile
fullgraph).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import layernorm_ext as L
from conftest import assert_no_worse_than_aten

pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
OPS = torch.ops.layernorm_ext
# rms_norm's eps as the suite's (tests/test_functional.py): its default (machine epsilon) makes the gradient of
# rows of one element (1 - xhat^2) pure rounding noise, which compares nothing.
EPS = 1e-5


# ---- layouts: views of shape (A, B, D) --------------------------------------------------------------------------
def _qkv(a: int, b: int, d: int, dtype: torch.dtype) -> Tensor:
    """k of a fused [tokens, 3 * heads * head_dim] projection viewed as [tokens, heads, head_dim]: strides
    (3 * B * D, D, 1), storage offset B * D, rows not evenly spaced."""
    qkv = torch.randn(a, 3 * b * d, dtype=dtype)
    return qkv[:, b * d : 2 * b * d].view(a, b, d)


def _slice(a: int, b: int, d: int, dtype: torch.dtype) -> Tensor:
    """x[..., 2 : 2 + d] of a wider tensor: evenly spaced rows, a storage offset."""
    return torch.randn(a, b, d + 5, dtype=dtype)[..., 2 : 2 + d]


def _transposed(a: int, b: int, d: int, dtype: torch.dtype) -> Tensor:
    return torch.randn(b, a, d, dtype=dtype).transpose(0, 1)


def _expanded(a: int, b: int, d: int, dtype: torch.dtype) -> Tensor:
    """A stride-0 leading dim (read only: a destination like this is refused)."""
    return torch.randn(1, b, d, dtype=dtype).expand(a, b, d)


def _columns(a: int, b: int, d: int, dtype: torch.dtype) -> Tensor:
    """The normalized dim not packed (stride 2 * A * B) and the rows not adjacent (stride 2): copied before the
    kernels. (With adjacent rows, a channels-first layout, the CPU's columns kernels read it: tests/test_norm_2d.py.)"""
    return torch.randn(d, b, 2 * a, dtype=dtype)[..., ::2].permute(2, 1, 0)


LAYOUTS: dict[str, Callable[[int, int, int, torch.dtype], Tensor]] = {
    "qkv": _qkv, "slice": _slice, "transposed": _transposed, "expanded": _expanded, "columns": _columns,
}  # fmt: skip
WRITABLE = ("qkv", "slice", "transposed")  # layouts a destination may have
SIZES = (1, 7, 769, 5125)
DTYPES = (F32, BF16, F16)


def _lead(d: int) -> tuple[int, int]:
    return (2, 3) if d > 1024 else (3, 5)


def _view(layout: str, d: int, dtype: torch.dtype, seed: int) -> Tensor:
    torch.manual_seed(seed)
    v = LAYOUTS[layout](*_lead(d), d, dtype)
    assert not v.is_contiguous() or d == 1
    return v


def _params(d: int, dtype: torch.dtype, rms: bool) -> tuple[Tensor, Tensor | None]:
    torch.manual_seed(100 + d)
    weight = torch.randn(d, dtype=dtype)
    return weight, None if rms else torch.randn(d, dtype=dtype)


def _aten(x: Tensor, d: int, weight: Tensor, bias: Tensor | None, rms: bool) -> Tensor:
    if rms:
        return F.rms_norm(x, (d,), weight, eps=EPS)
    return F.layer_norm(x, (d,), weight, bias, 1e-5)


def _as_bytes(t: Tensor) -> Tensor:
    """Quantized codes (float8, float4) as their bytes, for a comparison of bits; other tensors as they are."""
    return t.view(torch.uint8) if t.dtype in (torch.float4_e2m1fn_x2, torch.float8_e4m3fn) else t


def _same_bits(ours: Tensor, expected: Tensor, what: str) -> None:
    assert ours.shape == expected.shape and ours.dtype == expected.dtype, what
    assert torch.equal(ours, expected), f"{what}: strided result differs from the contiguous one"


# ---- forward and backward of layer_norm / rms_norm ----------------------------------------------------------------
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_norm_forward_backward(layout: str, d: int, dtype: torch.dtype, rms: bool) -> None:
    x = _view(layout, d, dtype, seed=d)
    weight, bias = _params(d, dtype, rms)
    params = [weight] if rms else [weight, bias]
    norm = (lambda t, w: L.rms_norm(t, d, w, EPS)) if rms else (lambda t, w, b: L.layer_norm(t, d, w, b))

    def run(t: Tensor) -> tuple[Tensor, ...]:
        t = t.detach().requires_grad_()
        ps = [p.detach().requires_grad_() for p in params]
        out = norm(t, *ps)
        torch.manual_seed(7)
        grad = torch.randn_like(out)
        return (out, *torch.autograd.grad(out, (t, *ps), grad))

    strided = run(x)
    contiguous = run(x.contiguous())
    assert strided[0].is_contiguous()  # new outputs are contiguous, as ATen's
    for name, a, b in zip(("out", "grad_input", "grad_weight", "grad_bias"), strided, contiguous):
        _same_bits(a, b, name)

    def aten_run(t: Tensor, *ps: Tensor) -> Tensor:
        return _aten(t, d, *ps, None, rms) if rms else _aten(t, d, *ps, rms)

    aten_in = (x, *params)
    aten = aten_run(*(a.contiguous() for a in aten_in))
    reference = aten_run(*(a.double() for a in aten_in))
    assert_no_worse_than_aten(strided[0], aten, reference, "out")
    if d == 1:
        return  # dx of one-element rows is rounding noise (1 - xhat^2) with random rows; test_functional controls it
    # dx against ATen's on the contiguous rows (float64 reference with the same incoming gradient).
    torch.manual_seed(7)
    grad = torch.randn_like(aten)
    leaves = [a.detach().contiguous().requires_grad_() for a in aten_in]
    aten_dx = torch.autograd.grad(aten_run(*leaves), leaves[0], grad)[0]
    leaves64 = [a.detach().double().requires_grad_() for a in aten_in]
    ref_dx = torch.autograd.grad(aten_run(*leaves64), leaves64[0], grad.double())[0]
    assert_no_worse_than_aten(strided[1], aten_dx, ref_dx, "grad_input")


# ---- residual variants, the inference ops, the quantized output ---------------------------------------------------
@pytest.mark.parametrize("rms", [False, True], ids=["add_layer_norm", "add_rms_norm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_residual_forward_backward(layout: str, d: int, dtype: torch.dtype, rms: bool) -> None:
    x = _view(layout, d, dtype, seed=d)
    residual = _view("qkv" if layout != "qkv" else "transposed", d, dtype, seed=d + 1)
    weight, bias = _params(d, dtype, rms)
    params = [weight] if rms else [weight, bias]

    def run(t: Tensor, r: Tensor) -> tuple[Tensor, ...]:
        t, r = t.detach().requires_grad_(), r.detach().requires_grad_()
        ps = [p.detach().requires_grad_() for p in params]
        out, h = L.add_rms_norm(t, r, d, *ps, EPS) if rms else L.add_layer_norm(t, r, d, *ps)
        torch.manual_seed(7)
        g_out, g_h = torch.randn_like(out), torch.randn_like(h)
        return (out, h, *torch.autograd.grad((out, h), (t, r, *ps), (g_out, g_h)))

    strided = run(x, residual)
    contiguous = run(x.contiguous(), residual.contiguous())
    for i, (a, b) in enumerate(zip(strided, contiguous)):
        _same_bits(a, b, f"result {i}")
    h = (x.contiguous() + residual.contiguous())
    aten = _aten(h, d, weight, bias, rms)
    reference = _aten(x.double() + residual.double(), d, weight.double(), None if bias is None else bias.double(), rms)
    assert_no_worse_than_aten(strided[0], aten, reference, "out")


def _buffer_view(layout: str, d: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(a NaN-filled storage, a writable view of it of shape (A, B, D)), for out= and the in-place ops."""
    a, b = _lead(d)
    if layout == "qkv":
        storage = torch.full((a, 3 * b * d), float("nan"), dtype=dtype)
        return storage, storage[:, b * d : 2 * b * d].view(a, b, d)
    if layout == "slice":
        storage = torch.full((a, b, d + 5), float("nan"), dtype=dtype)
        return storage, storage[..., 2 : 2 + d]
    storage = torch.full((b, a, d), float("nan"), dtype=dtype)
    return storage, storage.transpose(0, 1)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("layout", WRITABLE)
def test_inference_ops_write_strided_rows(layout: str, d: int, dtype: torch.dtype, rms: bool) -> None:
    x = _view(layout, d, dtype, seed=d)
    residual = _view("slice", d, dtype, seed=d + 1)
    weight, bias = _params(d, dtype, rms)
    params = [weight] if rms else [weight, bias]
    with torch.no_grad():
        expected_out, expected_h = (L.add_rms_norm if rms else L.add_layer_norm)(
            x.contiguous(), residual.contiguous(), d, *params
        )
        # out= and residual_out= into strided views: exactly the rows written, nothing around them.
        out_storage, out = _buffer_view(layout, d, dtype)
        h_storage, h = _buffer_view("qkv", d, dtype)
        (L.add_rms_norm if rms else L.add_layer_norm)(x, residual, d, *params, out=out, residual_out=h)
        _same_bits(out, expected_out, "out=")
        _same_bits(h, expected_h, "residual_out=")
        for storage, view in ((out_storage, out), (h_storage, h)):
            assert int(storage.isnan().sum()) == storage.numel() - view.numel()
        # In place into the strided views themselves.
        x_storage, x_view = _buffer_view(layout, d, dtype)
        r_storage, r_view = _buffer_view("slice", d, dtype)
        x_view.copy_(x)
        r_view.copy_(residual)
        (L.add_rms_norm_ if rms else L.add_layer_norm_)(x_view, r_view, d, *params)
        _same_bits(x_view, expected_out, "in-place input")
        _same_bits(r_view, expected_h, "in-place residual")
        assert int(x_storage.isnan().sum()) == x_storage.numel() - x_view.numel()


@pytest.mark.parametrize("quant_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("layout", WRITABLE + ("expanded",))
def test_quantized_strided(layout: str, d: int, dtype: torch.dtype, quant_dtype: torch.dtype) -> None:
    x = _view(layout, d, dtype, seed=d)
    residual = _view("qkv", d, dtype, seed=d + 1)
    weight, _ = _params(d, dtype, rms=True)
    codes, scales = L.rms_norm_quant(x, d, weight, quant_dtype=quant_dtype)
    expected_codes, expected_scales = L.rms_norm_quant(x.contiguous(), d, weight, quant_dtype=quant_dtype)
    _same_bits(codes.view(torch.uint8), expected_codes.view(torch.uint8), "codes")
    _same_bits(scales, expected_scales, "scales")
    # Into a strided codes buffer, h over the strided residual itself.
    expected = L.add_rms_norm_quant(x.contiguous(), residual.contiguous(), d, weight, quant_dtype=quant_dtype)
    storage = torch.zeros(*_lead(d), 2 * d, dtype=torch.uint8)
    out = storage[..., d:].view(quant_dtype)
    scales_out = torch.empty(*_lead(d), 1)
    h = residual.clone() if layout == "expanded" else residual
    L.add_rms_norm_quant(x, h, d, weight, quant_dtype=quant_dtype, out=out, scales=scales_out, residual_out=h)
    _same_bits(out.view(torch.uint8), expected[0].view(torch.uint8), "codes out=")
    _same_bits(scales_out, expected[1], "scales out=")
    _same_bits(h, expected[2], "h over residual")
    assert int(storage[..., :d].count_nonzero()) == 0


@pytest.mark.parametrize("rms", [False, True], ids=["add_layer_norm", "add_rms_norm"])
def test_long_rows_split_across_threads(rms: bool) -> None:
    """Rows of 2^16 + elements split into column ranges (csrc/cpu/norm_kernel.cpp, forward_split and the split
    backward) on strided rows: the same bits as on contiguous ones."""
    d = 70001
    torch.manual_seed(0)
    x = torch.randn(2, 3 * d)[:, d : 2 * d]
    residual = torch.randn(2, d + 3)[:, 3:]
    weight = torch.randn(d)

    def run(t: Tensor, r: Tensor) -> tuple[Tensor, ...]:
        t, r, w = t.detach().requires_grad_(), r.detach().requires_grad_(), weight.detach().requires_grad_()
        out, h = L.add_rms_norm(t, r, d, w, EPS) if rms else L.add_layer_norm(t, r, d, w)
        return (out, h, *torch.autograd.grad((out, h), (t, r, w), (torch.ones_like(out), torch.ones_like(h))))

    for i, (a, b) in enumerate(zip(run(x, residual), run(x.contiguous(), residual.contiguous()))):
        _same_bits(a, b, f"result {i}")


def test_leading_dims_beyond_two() -> None:
    """Leading dims that do not coalesce into two: the input is copied, out= written through a temporary."""
    d = 33
    torch.manual_seed(0)
    x = torch.randn(4, 3, 2, d).permute(2, 1, 0, 3)  # strides (d, 2d, 6d, 1)
    weight = torch.randn(d)
    storage = torch.full((4, 3, 2, d), float("nan"))
    out = storage.permute(2, 1, 0, 3)
    with torch.no_grad():
        L.rms_norm(x, d, weight, out=out)
        _same_bits(out, L.rms_norm(x.contiguous(), d, weight), "out= through a temporary")
        _same_bits(L.rms_norm(x, d, weight), L.rms_norm(x.contiguous(), d, weight), "copied input")
    assert not storage.isnan().any()


# ---- no copy --------------------------------------------------------------------------------------------------
def _copies(fn: Callable[[], object]) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    # (aten::to of a tensor already of the dtype returns it: the copies go through _to_copy or copy_)
    names = {"aten::copy_", "aten::contiguous", "aten::clone", "aten::_to_copy"}
    return [e.name for e in prof.events() if e.name in names]


@pytest.mark.parametrize("layout", ["qkv", "slice", "transposed", "expanded"])
def test_profiler_sees_no_copy(layout: str) -> None:
    d = 128
    x = _view(layout, d, F32, seed=0)
    weight, bias = _params(d, F32, rms=False)
    residual = _view("qkv", d, F32, seed=1)
    _, out = _buffer_view("qkv", d, F32)
    _, h = _buffer_view("slice", d, F32)
    with torch.no_grad():
        calls: dict[str, Callable[[], object]] = {
            "rms_norm": lambda: L.rms_norm(x, d, weight),
            "layer_norm": lambda: L.layer_norm(x, d, weight, bias),
            "add_rms_norm": lambda: L.add_rms_norm(x, residual, d, weight),
            "rms_norm out=": lambda: L.rms_norm(x, d, weight, out=out),
            "add_layer_norm out=": lambda: L.add_layer_norm(x, residual, d, weight, bias, out=out, residual_out=h),
            "rms_norm_quant": lambda: L.rms_norm_quant(x, d, weight, quant_dtype=torch.int8),
        }
        if layout != "expanded":
            y = x.clone() if layout == "transposed" else _view(layout, d, F32, seed=2)
            calls["add_rms_norm_"] = lambda: L.add_rms_norm_(y, h, d, weight)
        for name, call in calls.items():
            assert _copies(call) == [], name
    xg = x.detach().requires_grad_()
    wg = weight.detach().requires_grad_()

    grad = torch.ones(x.shape)

    def backward() -> None:
        torch.autograd.grad(L.rms_norm(xg, d, wg), (xg, wg), grad)

    assert _copies(backward) == [], "rms_norm forward + backward"


def test_profiler_sees_the_copy_of_unpacked_rows() -> None:
    """The "columns" layout is copied (the test above can see a copy)."""
    x = _view("columns", 64, F32, seed=0)
    assert "aten::copy_" in _copies(lambda: L.rms_norm(x, 64))


# ---- destinations refused ---------------------------------------------------------------------------------------
def _bad_destinations() -> list:
    x, r, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
    expanded = torch.empty(1, 8).expand(4, 8)
    cases = [
        ("out_expanded", lambda: L.rms_norm(x, 8, w, out=expanded),
         r"rms_norm_into: unsupported operation: more than one element of out refers to a single memory location"),
        ("in_place_expanded", lambda: L.add_rms_norm_(torch.randn(1, 8).expand(4, 8), r, 8, w),
         r"add_rms_norm_: unsupported operation: more than one element of input refers to a single memory"),
        ("residual_out_expanded", lambda: L.add_layer_norm(x, r, 8, w, out=torch.empty(4, 8), residual_out=expanded),
         r"layer_norm_into: unsupported operation: more than one element of residual_out"),
        ("out_columns", lambda: L.rms_norm(x, 8, w, out=torch.empty(8, 4).t()),
         r"rms_norm_into: expected out to be contiguous in its normalized dims .*strides \[1, 4\]"),
        ("quant_out_expanded", lambda: L.rms_norm_quant(x, 8, w, out=torch.empty(1, 8, dtype=torch.int8).expand(4, 8),
                                                        scales=torch.empty(4, 1)),
         r"rms_norm_quant_into: unsupported operation: more than one element of out"),
    ]  # fmt: skip
    return [pytest.param(call, match, id=name) for name, call, match in cases]


@pytest.mark.parametrize("call,match", _bad_destinations())
def test_refuses_destinations(call: Callable[[], object], match: str) -> None:
    with pytest.raises(RuntimeError, match=match):
        call()


def test_fake_refuses_expanded_destination_alike() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w = torch.randn(4, 8), torch.randn(8)
        with pytest.raises(RuntimeError, match="rms_norm_into: unsupported operation: more than one element of out"):
            OPS.rms_norm_into(x, [8], w, None, torch.empty(1, 8).expand(4, 8))
        with pytest.raises(RuntimeError, match="expected out to be contiguous in its normalized dims"):
            OPS.rms_norm_into(x, [8], w, None, torch.empty(8, 4).t())
        OPS.rms_norm_into(x, [8], w, None, torch.empty(4, 16)[:, 3:11])  # a strided destination is fine


# ---- fake kernels, opcheck, compile -------------------------------------------------------------------------------
def _op_calls(x: Tensor, residual: Tensor, d: int) -> list[tuple[object, tuple[object, ...]]]:
    w, b = torch.randn(d), torch.randn(d)
    return [
        (OPS.layer_norm_fwd.default, (x, [d], w, b, 1e-5)),
        (OPS.rms_norm_fwd.default, (x, [d], w, None)),
        (OPS.rms_norm_fwd.default, (x, [d], w, None, residual)),
        (OPS.rms_norm_quant.default, (x, [d], w, None, torch.int8)),
    ]


@pytest.mark.parametrize("layout", ["qkv", "slice", "transposed", "expanded"])
def test_fake_strides_and_opcheck(layout: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    d = 16
    x = _view(layout, d, F32, seed=0)
    residual = _view("qkv", d, F32, seed=1)
    for op, args in _op_calls(x, residual, d):
        real = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fake_args = tuple(mode.from_tensor(a) if isinstance(a, Tensor) else a for a in args)
            fake = op(*fake_args)
        for r, f in zip(real, fake):
            if r.numel() > 0:
                assert (r.shape, r.stride()) == (f.shape, f.stride()), op
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    xg = x.detach().requires_grad_()
    torch.library.opcheck(OPS.rms_norm_fwd.default, (xg, [d], torch.randn(d), None),
                          test_utils=("test_autograd_registration", "test_aot_dispatch_dynamic"))  # fmt: skip


def test_compile_fullgraph_qk_norm() -> None:
    """The Qwen3 pattern: q and k views of one fused projection, each RMS-normalized over head_dim."""
    tokens, heads, head_dim = 5, 4, 16
    torch.manual_seed(0)
    qkv = torch.randn(tokens, 3 * heads * head_dim)
    q_weight, k_weight = torch.randn(head_dim), torch.randn(head_dim)

    def qk_norm(qkv: Tensor) -> tuple[Tensor, Tensor]:
        q, k, _ = qkv.split(heads * head_dim, dim=-1)
        q = L.rms_norm(q.view(tokens, heads, head_dim), head_dim, q_weight, 1e-6)
        k = L.rms_norm(k.view(tokens, heads, head_dim), head_dim, k_weight, 1e-6)
        return q, k

    eager = qk_norm(qkv)
    compiled = torch.compile(qk_norm, fullgraph=True, backend="aot_eager")(qkv)
    for e, c in zip(eager, compiled):
        assert c.stride() == e.stride() == (heads * head_dim, head_dim, 1)
        _same_bits(c, e, "compiled")


class _QkNormAttention(torch.nn.Module):
    """The QK-norm of Qwen3 / Gemma 3 / OLMo 2: RMSNorm over head_dim of q and k, views of one fused projection."""

    def __init__(self, hidden: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = torch.nn.Linear(hidden, 3 * heads * head_dim, bias=False)
        self.q_norm = torch.nn.RMSNorm(head_dim, eps=1e-6)
        self.k_norm = torch.nn.RMSNorm(head_dim, eps=1e-6)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        q, k, _ = self.qkv(x).split(self.heads * self.head_dim, dim=-1)
        shape = (x.shape[0], self.heads, self.head_dim)
        return self.q_norm(q.view(shape)), self.k_norm(k.view(shape))


def test_replace_norms_on_qk_norm() -> None:
    torch.manual_seed(0)
    model = _QkNormAttention(64, 4, 32)
    for norm in (model.q_norm, model.k_norm):
        torch.nn.init.normal_(norm.weight)
    x = torch.randn(9, 64)
    with torch.no_grad():
        expected = model(x)
        reference = model.double()(x.double())
        model.float()
        report = L.replace_norms(model)
        assert isinstance(model.q_norm, L.FusedRMSNorm) and isinstance(model.k_norm, L.FusedRMSNorm), report
        ours = model(x)
        for o, e, r in zip(ours, expected, reference):
            assert_no_worse_than_aten(o, e, r, "qk-norm")
        assert _copies(lambda: model(x)) == []


# ---- channels-first norms: FusedLayerNorm2d / FusedRMSNorm2d against timm's formulas ------------------------------
class _TimmLayerNorm2d(torch.nn.LayerNorm):
    """timm's LayerNorm2d, as timm writes it: permute, layer_norm, permute."""

    def __init__(self, num_channels: int, eps: float = 1e-6, affine: bool = True) -> None:
        super().__init__(num_channels, eps=eps, elementwise_affine=affine)

    def forward(self, x: Tensor) -> Tensor:
        x = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class _TimmRmsNorm2d(torch.nn.Module):
    def __init__(self, num_channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(num_channels))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.permute(0, 2, 3, 1), self.weight.shape, self.weight, self.eps).permute(0, 3, 1, 2)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm_2d", "rms_norm_2d"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channels", (1, 7, 769))
@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.contiguous_format], ids=["nhwc", "nchw"])
def test_norm_2d(memory_format: torch.memory_format, channels: int, dtype: torch.dtype, rms: bool) -> None:
    torch.manual_seed(channels)
    timm = (_TimmRmsNorm2d if rms else _TimmLayerNorm2d)(channels).to(dtype)
    with torch.no_grad():
        for p in timm.parameters():
            p.normal_()
    ours = (L.FusedRMSNorm2d if rms else L.FusedLayerNorm2d)(channels, dtype=dtype)
    ours.load_state_dict(timm.state_dict())  # the same state_dict
    x = torch.randn(2, channels, 3, 5, dtype=dtype).contiguous(memory_format=memory_format)
    grad = torch.randn(2, channels, 3, 5, dtype=dtype)

    def run(module: torch.nn.Module, t: Tensor) -> tuple[Tensor, ...]:
        t = t.detach().requires_grad_()
        out = module(t)
        return (out, *torch.autograd.grad(out, (t, *module.parameters()), grad))

    got = run(ours, x)
    expected = run(timm, x)
    reference = run(timm.double(), x.double())
    # channels_last in, channels_last out, as timm's permute back gives; NCHW in, NCHW out (timm: channels_last)
    assert got[0].is_contiguous(memory_format=memory_format)
    assert len(got) == len(expected)
    for i, (g, e, r) in enumerate(zip(got, expected, reference)):
        if i == 1 and channels == 1:
            continue  # dx of one-element rows: rounding noise (test_norm_forward_backward)
        assert_no_worse_than_aten(g, e, r, f"result {i}")
    if memory_format != torch.channels_last:
        assert _module_copies(ours, x) == []  # NCHW: the channels-first kernels read it in place (tests/test_norm_2d.py)
        return
    rows = x.permute(0, 2, 3, 1).contiguous()
    flat = L.rms_norm(rows, channels, ours.weight, ours.eps) if rms else L.layer_norm(rows, channels, ours.weight,
                                                                                      ours.bias, ours.eps)  # fmt: skip
    _same_bits(got[0].detach(), flat.detach().permute(0, 3, 1, 2), "out vs the rows normalized")
    assert _module_copies(ours, x) == []


def _module_copies(module: torch.nn.Module, x: Tensor) -> list[str]:
    with torch.no_grad():
        return _copies(lambda: module(x))


def test_replace_norms_on_channels_first_norms() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), _TimmLayerNorm2d(16), torch.nn.GELU(), _TimmRmsNorm2d(16))
    with torch.no_grad():
        for norm in (model[1], model[3]):
            for p in norm.parameters():
                p.normal_()
    x = torch.randn(2, 3, 9, 9).contiguous(memory_format=torch.channels_last)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        expected = model(x)
        reference = model.double()(x.double())
        model.float()
        report = L.replace_norms(model)
        assert isinstance(model[1], L.FusedLayerNorm2d) and isinstance(model[3], L.FusedRMSNorm2d), str(report)
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
        assert_no_worse_than_aten(model(x), expected, reference, "replaced model")


# ---- the CUDA kernels (host emulation): strided rows in place on the register paths (StridedRows, residual
# included), copied around the long paths and the quantized output (csrc/norm_ops.cpp, launch_on_rows) --------------
@pytest.fixture(scope="module")
def emulated():  # noqa: ANN201 (the JIT-built module)
    from test_cuda_emulation import build_emulation

    return build_emulation()


@pytest.mark.parametrize("dtype", (F32, BF16), ids=str)
@pytest.mark.parametrize("d", (7, 769, 5125))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_emulated_cuda_kernels_on_strided_rows(emulated, layout: str, d: int, dtype: torch.dtype) -> None:  # noqa: ANN001
    x = _view(layout, d, dtype, seed=d)
    residual = _view("qkv" if layout != "qkv" else "slice", d, dtype, seed=d + 1)
    weight, bias = _params(d, dtype, rms=False)
    for args in ((None,), (residual,)):
        strided = emulated.layer_norm_fwd(x, [d], weight, bias, 1e-5, *args, False)
        expected = emulated.layer_norm_fwd(x.contiguous(), [d], weight, bias, 1e-5,
                                           *(a if a is None else a.contiguous() for a in args), False)  # fmt: skip
        for i, (a, b) in enumerate(zip(strided, expected)):
            _same_bits(a, b, f"layer_norm_fwd result {i}")
    out, _, mean, rstd = emulated.layer_norm_fwd(x.contiguous(), [d], weight, bias, 1e-5, None, False)
    grad = _view("transposed", d, dtype, seed=3)
    strided = emulated.layer_norm_bwd(grad, x, mean, rstd, [d], weight, bias, False, residual)
    expected = emulated.layer_norm_bwd(grad.contiguous(), x.contiguous(), mean, rstd, [d], weight, bias, False,
                                       residual.contiguous())  # fmt: skip
    for i, (a, b) in enumerate(zip(strided, expected)):
        _same_bits(a, b, f"layer_norm_bwd result {i}")
    codes, scales, _ = emulated.rms_norm_quant(x, [d], weight, None, torch.int8, None, None, None)
    expected_codes, expected_scales, _ = emulated.rms_norm_quant(x.contiguous(), [d], weight, None, torch.int8, None,
                                                                 None, None)  # fmt: skip
    _same_bits(codes, expected_codes, "codes")
    _same_bits(scales, expected_scales, "scales")
    if layout in WRITABLE:
        storage, out_view = _buffer_view(layout, d, dtype)
        emulated.rms_norm_into(x, [d], weight, None, out_view, None, None)
        _same_bits(out_view, emulated.rms_norm_fwd(x.contiguous(), [d], weight, None, None, False)[0], "out=")
        assert int(storage.isnan().sum()) == storage.numel() - out_view.numel()
        _, x_view = _buffer_view(layout, d, dtype)
        _, r_view = _buffer_view("qkv", d, dtype)
        x_view.copy_(x)
        r_view.copy_(residual)
        emulated.add_rms_norm_(x_view, r_view, [d], weight, None)
        expected_out, expected_h, _ = emulated.rms_norm_fwd(x.contiguous(), [d], weight, None, residual.contiguous(),
                                                            False)  # fmt: skip
        _same_bits(x_view, expected_out, "in-place input")
        _same_bits(r_view, expected_h, "in-place residual")


def _aligned_view(layout: str, d: int, dtype: torch.dtype, seed: int) -> Tensor:
    """As _view, but a slice whose rows start on 16 bytes (x[..., 8 : 8 + d] of rows of d + 8) where d allows: the
    kernels then take the rows in 16-byte packs, as they take their contiguous copy."""
    if layout != "slice" or d % 8 != 0:
        return _view(layout, d, dtype, seed)
    torch.manual_seed(seed)
    return torch.randn(*_lead(d), d + 8, dtype=dtype)[..., 8 : 8 + d]


def _aligned_buffer_view(layout: str, d: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """As _buffer_view, with _aligned_view's slice."""
    if layout != "slice" or d % 8 != 0:
        return _buffer_view(layout, d, dtype)
    storage = torch.full((*_lead(d), d + 8), float("nan"), dtype=dtype)
    return storage, storage[..., 8 : 8 + d]


@pytest.mark.parametrize("dtype", (F32, BF16), ids=str)
@pytest.mark.parametrize("d", (64, 128, 769))
@pytest.mark.parametrize("layout", ["qkv", "slice", "transposed", "expanded"])
def test_emulated_register_paths_take_strided_rows_in_place(emulated, layout: str, d: int, dtype: torch.dtype) -> None:  # noqa: ANN001
    """QK-norm's head_dim (64, 128) and an odd width (single elements): forward (into strided destinations too,
    with a residual, h in float32 or in place over the residual) and backward with strided grad_out, saved and
    grad_residual_out, without a copy (the profiler), and the same bits as on the contiguous copies."""
    x = _aligned_view(layout, d, dtype, seed=d)
    residual = _aligned_view("qkv" if layout != "qkv" else "transposed", d, dtype, seed=d + 1)
    weight, bias = _params(d, dtype, rms=False)
    for args in ((None, False), (residual, False), (residual, True)):
        fwd = lambda t, r, fp32: emulated.layer_norm_fwd(t, [d], weight, bias, 1e-5, r, fp32)  # noqa: E731
        assert _copies(lambda: fwd(x, *args)) == [], f"layer_norm_fwd residual={args[0] is not None}"
        expected = fwd(x.contiguous(), None if args[0] is None else args[0].contiguous(), args[1])
        for i, (a, b) in enumerate(zip(fwd(x, *args), expected)):
            _same_bits(a, b, f"layer_norm_fwd result {i}, residual={args[0] is not None}, in fp32={args[1]}")
    _, _, mean, rstd = emulated.layer_norm_fwd(x.contiguous(), [d], weight, bias, 1e-5, None, False)
    grad = _aligned_view("transposed" if layout != "transposed" else "qkv", d, dtype, seed=3)
    bwd = lambda g, t, *r: emulated.layer_norm_bwd(g, t, mean, rstd, [d], weight, bias, False, *r)  # noqa: E731
    for r in (None, residual):
        assert _copies(lambda: bwd(grad, x, r)) == [], f"layer_norm_bwd grad_residual_out={r is not None}"
        contiguous = bwd(grad.contiguous(), x.contiguous(), None if r is None else r.contiguous())
        for i, (a, b) in enumerate(zip(bwd(grad, x, r), contiguous)):
            _same_bits(a, b, f"layer_norm_bwd result {i}, grad_residual_out={r is not None}")
    _, _, rms_rstd = emulated.rms_norm_fwd(x.contiguous(), [d], weight, EPS, None, False)
    rms_bwd = lambda g, t: emulated.rms_norm_bwd(g, t, rms_rstd, [d], weight, False, None)  # noqa: E731
    assert _copies(lambda: rms_bwd(grad, x)) == [], "rms_norm_bwd"
    for i, (a, b) in enumerate(zip(rms_bwd(grad, x), rms_bwd(grad.contiguous(), x.contiguous()))):
        _same_bits(a, b, f"rms_norm_bwd result {i}")
    if layout in WRITABLE:
        _, out_view = _aligned_buffer_view(layout, d, dtype)
        assert _copies(lambda: emulated.rms_norm_into(x, [d], weight, EPS, out_view, None, None)) == [], "out="
        _same_bits(out_view, emulated.rms_norm_fwd(x.contiguous(), [d], weight, EPS, None, False)[0], "out=")
        # The in-place residual add: out over the input, h over the residual, both strided.
        _, x_view = _aligned_buffer_view(layout, d, dtype)
        _, r_view = _aligned_buffer_view("qkv" if layout != "qkv" else "slice", d, dtype)
        x_view.copy_(x)
        r_view.copy_(residual)
        expected_out, expected_h, _ = emulated.rms_norm_fwd(x.contiguous(), [d], weight, EPS, residual.contiguous(),
                                                            False)  # fmt: skip
        assert _copies(lambda: emulated.add_rms_norm_(x_view, r_view, [d], weight, EPS)) == [], "add_rms_norm_"
        _same_bits(x_view, expected_out, "in-place input")
        _same_bits(r_view, expected_h, "in-place residual")


def _codes_view(layout: str, d: int, quant_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(a zeroed byte storage, a writable (A, B, D) view of it of quant_dtype), for the quantized ops' out=: the codes'
    rows strided as layout's (NVFP4: D / 2 bytes a row, two codes a byte)."""
    a, b = _lead(d)
    width = d // 2 if quant_dtype == torch.float4_e2m1fn_x2 else d
    if layout == "qkv":
        storage = torch.zeros(a, 3 * b * width, dtype=torch.uint8)
        view = storage[:, b * width : 2 * b * width].view(a, b, width)
    elif layout == "slice":
        storage = torch.zeros(a, b, width + 16, dtype=torch.uint8)
        view = storage[..., 16 : 16 + width]
    else:
        storage = torch.zeros(b, a, width, dtype=torch.uint8)
        view = storage.transpose(0, 1)
    return storage, view.view(quant_dtype)


# (quant_dtype, group_size): a dynamic scale per row (vLLM's per-token fp8 / int8), per group, NVFP4's blocks of 16.
QUANT_FORMATS = ((torch.float8_e4m3fn, 0), (torch.int8, 0), (torch.float8_e4m3fn, 32), (torch.float4_e2m1fn_x2, 16))


@pytest.mark.parametrize(("quant_dtype", "group_size"), QUANT_FORMATS,
                         ids=[f"{str(q)[6:]}-g{g}" for q, g in QUANT_FORMATS])  # fmt: skip
@pytest.mark.parametrize("dtype", (F32, BF16), ids=str)
@pytest.mark.parametrize("d", (64, 769))
@pytest.mark.parametrize("layout", ["qkv", "slice", "transposed", "expanded"])
def test_emulated_quantized_output_of_strided_rows(
    emulated, layout: str, d: int, dtype: torch.dtype, quant_dtype: torch.dtype, group_size: int  # noqa: ANN001
) -> None:
    """The quantized forward on strided rows: strided input, then (writable layouts) codes into a strided out=, the
    residual strided and h written over it. The CUDA kernels' register variants, per token and per group (NVFP4's
    codes two a byte), take them in place (the profiler sees no copy); codes, scales and h are the same bits as on
    the contiguous copies. (Per-group rows of single elements are copied: the test below.)"""
    if group_size and d % group_size:
        pytest.skip("groups must divide the row")
    x = _aligned_view(layout, d, dtype, seed=d)
    weight, _ = _params(d, dtype, rms=True)
    nvfp4 = quant_dtype == torch.float4_e2m1fn_x2
    scale = torch.tensor([448.0 * 6.0 / 4.0]) if nvfp4 else None  # NVFP4's global scale

    def quant(t: Tensor, residual: Tensor | None = None) -> tuple[Tensor, ...]:
        return emulated.rms_norm_quant(t, [d], weight, EPS, quant_dtype, scale, None, residual, group_size)

    assert _copies(lambda: quant(x)) == [], "rms_norm_quant"
    for i, (a, b) in enumerate(zip(quant(x), quant(x.contiguous()))):
        if a is not None:
            _same_bits(_as_bytes(a), _as_bytes(b), f"rms_norm_quant result {i}")
    if layout not in WRITABLE:
        return
    residual = _aligned_view("qkv" if layout != "qkv" else "slice", d, dtype, seed=d + 1)
    expected_codes, expected_scales, expected_h = quant(x.contiguous(), residual.contiguous())
    storage, out = _codes_view(layout, d, quant_dtype)
    _, h = _aligned_buffer_view("qkv" if layout != "qkv" else "slice", d, dtype)
    h.copy_(residual)
    scales = torch.empty_like(expected_scales)
    call = lambda: emulated.rms_norm_quant_into(x, [d], weight, EPS, out, scale, scales, h, h,  # noqa: E731
                                                group_size=group_size)
    assert _copies(call) == [], "rms_norm_quant_into"
    _same_bits(_as_bytes(out), _as_bytes(expected_codes), "codes out=")
    _same_bits(_as_bytes(scales), _as_bytes(expected_scales), "scales out=")
    _same_bits(h, expected_h, "h over the residual")
    assert int(storage.count_nonzero()) == int(_as_bytes(out).count_nonzero()), "bytes written outside out="


def test_emulated_strided_rows_copied_beyond_the_register_paths(emulated) -> None:  # noqa: ANN001
    """What the CUDA kernels do not take in place is copied around them (launch_on_rows), with the same bits: rows
    beyond the registers of a block (the long forward and backward), and per-group quantized rows of single elements
    (no register variant: the long kernel)."""
    d = 5125  # odd: single elements, beyond 512 lanes x 4
    x = _view("qkv", d, F32, seed=0)
    weight, bias = _params(d, F32, rms=False)
    assert "aten::copy_" in _copies(lambda: emulated.layer_norm_fwd(x, [d], weight, bias, 1e-5, None, False))
    out, _, mean, rstd = emulated.layer_norm_fwd(x, [d], weight, bias, 1e-5, None, False)
    _same_bits(out, emulated.layer_norm_fwd(x.contiguous(), [d], weight, bias, 1e-5, None, False)[0], "long forward")
    grad = _view("transposed", d, F32, seed=1)
    bwd = lambda g, t: emulated.layer_norm_bwd(g, t, mean, rstd, [d], weight, bias, False, None)  # noqa: E731
    assert "aten::copy_" in _copies(lambda: bwd(grad, x))
    for i, (a, b) in enumerate(zip(bwd(grad, x), bwd(grad.contiguous(), x.contiguous()))):
        _same_bits(a, b, f"long backward result {i}")
    x = _view("slice", 64, F32, seed=2)  # rows 2 elements into 69: no 16-byte packs
    weight = _params(64, F32, rms=True)[0]
    quant = lambda t: emulated.rms_norm_quant(t, [64], weight, EPS, torch.float8_e4m3fn, None, None, None, 32)  # noqa: E731
    assert "aten::copy_" in _copies(lambda: quant(x))
    for i, (a, b) in enumerate(zip(quant(x), quant(x.contiguous()))):
        _same_bits(_as_bytes(a), _as_bytes(b), f"per-group result {i}")


def _on_cuda(v: Tensor) -> Tensor:
    """v's whole storage on the GPU, viewed with v's sizes, strides and offset (v.cuda() makes a gapped view dense)."""
    flat = torch.empty(0, dtype=v.dtype).set_(v.untyped_storage(), 0, (v.untyped_storage().nbytes() // v.element_size(),))
    return flat.cuda().as_strided(v.shape, v.stride(), v.storage_offset())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", (F32, BF16), ids=str)
@pytest.mark.parametrize("d", (64, 128, 769))
@pytest.mark.parametrize("layout", ["qkv", "slice", "transposed", "expanded"])
def test_cuda_register_paths_take_strided_rows_in_place(layout: str, d: int, dtype: torch.dtype) -> None:
    """The emulated tests above on a GPU, through the library's ops: QK-norm forward + backward on strided views, no
    copy (the profiler), nor for the per-token and per-group fp8 output or the in-place residual add on strided input
    and residual, the same bits as on contiguous copies."""
    x = _on_cuda(_aligned_view(layout, d, dtype, seed=d))
    assert x.stride() == _aligned_view(layout, d, dtype, seed=d).stride()
    weight = _params(d, dtype, rms=True)[0].cuda()

    def run(t: Tensor) -> tuple[Tensor, ...]:
        leaves = [t.detach().requires_grad_(), weight.detach().requires_grad_()]
        out = L.rms_norm(leaves[0], d, leaves[1], EPS)
        torch.manual_seed(7)
        return (out, *torch.autograd.grad(out, leaves, torch.randn_like(out)))

    assert _copies(lambda: run(x)) == []
    for name, a, b in zip(("out", "grad_input", "grad_weight"), run(x), run(x.contiguous())):
        _same_bits(a, b, name)
    def quant(t: Tensor, group_size: int) -> tuple[Tensor, ...]:
        return L.rms_norm_quant(t, d, weight, EPS, quant_dtype=torch.float8_e4m3fn, group_size=group_size)

    for group_size in (0, 64) if d % 64 == 0 else (0,):  # a scale per row, per group
        assert _copies(lambda: quant(x, group_size)) == [], f"rms_norm_quant, group_size={group_size}"  # noqa: B023
        for name, a, b in zip(("codes", "scales"), quant(x, group_size), quant(x.contiguous(), group_size)):
            _same_bits(_as_bytes(a), _as_bytes(b), f"{name}, group_size={group_size}")
    if layout in WRITABLE:
        _, x_view = _aligned_buffer_view(layout, d, dtype)
        _, r_view = _buffer_view("qkv", d, dtype)
        x_view, r_view = _on_cuda(x_view), _on_cuda(r_view)
        x_view.copy_(x)
        r_view.normal_()
        r = r_view.clone()
        with torch.no_grad():
            assert _copies(lambda: L.add_rms_norm_(x_view, r_view, d, weight, EPS)) == [], "add_rms_norm_"
            out, h = L.add_rms_norm(x.contiguous(), r.contiguous(), d, weight, EPS)
        _same_bits(x_view, out, "in-place input")
        _same_bits(r_view, h, "in-place residual")
