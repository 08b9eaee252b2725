"""Channels-first norms on contiguous (N, C, *spatial) input without a copy (issue 24, item 3).

layer_norm_2d / rms_norm_2d (and FusedLayerNorm2d / FusedRMSNorm2d) pass the op the (N, *spatial, C) view of
their input; on the CPU, a view of a contiguous NCHW tensor (each row's C elements H * W apart, the pixels
adjacent) goes to the channels-first kernels (csrc/cpu/columns.h), which read it and write out, grad_input in the
input's layout (csrc/norm_ops.cpp, column_plane). Checked here: every output and gradient against ATen's on
timm's permuted path under the suite's rule (tests/conftest.py), on every instruction set; the output's memory
format (NCHW in, NCHW out); no copy in the profiler (forward and backward); what still copies; fake strides,
opcheck, torch.compile; modules as drop-ins for timm's; replace_norms. Before the columns kernels the profiler
tests and the memory-format tests failed (the op copied the input, the output was channels_last).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import layernorm_ext as L
from conftest import SWEEP_ISAS, assert_no_worse_than_aten
from test_strided import _copies, _TimmLayerNorm2d, _TimmRmsNorm2d

pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")

OPS = torch.ops.layernorm_ext
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
EPS = 1e-5  # rms_norm's default eps (machine epsilon) would make one-element rows' gradients pure noise
PLANES = {1: (1, 1), 5: (1, 5), 64: (8, 8), 333: (9, 37)}  # H * W: odd sizes reach the vector tails


def _rows(x: Tensor) -> Tensor:
    """timm's permute: (N, C, *spatial) -> (N, *spatial, C)."""
    return x.permute(0, *range(2, x.dim()), 1)


def _back(y: Tensor) -> Tensor:
    return y.permute(0, y.dim() - 1, *range(1, y.dim() - 1))


def _ours(x: Tensor, w: Tensor | None, b: Tensor | None, rms: bool, **kwargs: object) -> Tensor:
    return L.rms_norm_2d(x, w, EPS, **kwargs) if rms else L.layer_norm_2d(x, w, b, EPS, **kwargs)


def _timm(x: Tensor, w: Tensor | None, b: Tensor | None, rms: bool) -> Tensor:
    c = x.shape[1]
    y = F.rms_norm(_rows(x), (c,), w, EPS) if rms else F.layer_norm(_rows(x), (c,), w, b, EPS)
    return _back(y)


def _run(norm: Callable[..., Tensor], leaves: list[Tensor | None], grad: Tensor) -> list[Tensor]:
    """The output and the gradients of the leaves given (None: not an argument)."""
    leaves = [t if t is None else t.detach().requires_grad_() for t in leaves]
    out = norm(*leaves)
    present = [t for t in leaves if t is not None]
    return [out, *torch.autograd.grad(out, present, grad)]


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, param_dtype: torch.dtype, affine: bool, rms: bool,
            seed: int, device: str = "cpu") -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:  # fmt: skip
    torch.manual_seed(seed)
    x = (torch.randn(shape) * 2 + 0.5).to(device, dtype)
    c = shape[1]
    w = torch.randn(c, dtype=param_dtype).to(device) if affine else None
    b = torch.randn(c, dtype=param_dtype).to(device) if affine and not rms else None
    grad = torch.randn(shape).to(device, dtype)
    return x, w, b, grad


def _extended_reference(x: Tensor, w: Tensor | None, b: Tensor | None, grad: Tensor, rms: bool) -> list[Tensor]:
    """timm's path in 80-bit long double: the reference for float64 input, where an fp64 one is ATen itself (as
    tests/test_functional.py does)."""
    ld = np.longdouble
    c = x.shape[1]

    def rows(t: Tensor) -> np.ndarray:
        return _rows(t.detach().double()).reshape(-1, c).numpy().astype(ld)

    h, g = rows(x), rows(grad)
    weight = w.detach().double().numpy().astype(ld) if w is not None else np.ones(c, dtype=ld)
    centered = h if rms else h - h.mean(axis=1, keepdims=True)
    rstd = 1 / np.sqrt((centered * centered).mean(axis=1, keepdims=True) + ld(EPS))
    xhat = centered * rstd
    out = xhat * weight + (b.detach().double().numpy().astype(ld) if b is not None else 0)
    gw = g * weight
    dx = gw - xhat * (gw * xhat).mean(axis=1, keepdims=True)
    if not rms:
        dx = dx - gw.mean(axis=1, keepdims=True)

    def back(a: np.ndarray) -> Tensor:
        return _back(torch.from_numpy(a.astype(np.float64)).reshape(_rows(x).shape))

    result = [back(out), back(dx * rstd)]
    if w is not None:
        result.append(torch.from_numpy((g * xhat).sum(axis=0).astype(np.float64)))
    if b is not None:
        result.append(torch.from_numpy(g.sum(axis=0).astype(np.float64)))
    return result


def _check_against_aten(shape: tuple[int, ...], dtype: torch.dtype, param_dtype: torch.dtype, affine: bool,
                        rms: bool, seed: int = 0, device: str = "cpu", **kwargs: object) -> list[Tensor]:  # fmt: skip
    """Ours on a contiguous NCHW input vs ATen's on timm's path, fp64 the reference; returns ours."""
    x, w, b, grad = _inputs(shape, dtype, param_dtype, affine, rms, seed, device)
    got = _run(lambda *a: _ours(*a, rms, **kwargs), [x, w, b], grad)
    aten = _run(lambda *a: _timm(*a, rms), [x, w, b], grad)
    if dtype == F64 and np.finfo(np.longdouble).eps < np.finfo(np.float64).eps:
        reference = _extended_reference(x, w, b, grad, rms)
    else:
        reference = _run(lambda *a: _timm(*a, rms), [t if t is None else t.double() for t in (x, w, b)], grad.double())
    names = ["out", "grad_input", "grad_weight", "grad_bias"][: len(got)]
    for name, g, a, r in zip(names, got, aten, reference):
        if shape[1] == 1 and name in ("grad_input", "grad_weight"):
            # One-element rows (packed: the row kernels, which tests/test_functional.py covers): dx (1 - xhat^2)
            # and LayerNorm's xhat (0) are rounding noise; RMSNorm's float64 dweight, a sum of +-1 terms, is
            # within 4 ulps of ATen's there but not within its atol.
            continue
        assert_no_worse_than_aten(g, a, r, f"{name} {shape} {dtype}")
    # NCHW in, NCHW out: the output and grad_input in the input's memory format (timm's is channels_last).
    assert got[0].is_contiguous() and got[1].is_contiguous(), (got[0].stride(), got[1].stride())
    return got


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm_2d", "rms_norm_2d"])
@pytest.mark.parametrize("dtype", [F32, BF16, F16, F64], ids=str)
@pytest.mark.parametrize("plane", list(PLANES))
@pytest.mark.parametrize("channels", [1, 7, 32, 96, 769])
def test_nchw_against_aten(channels: int, plane: int, dtype: torch.dtype, rms: bool) -> None:
    for affine in (True, False):
        _check_against_aten((2, channels, *PLANES[plane]), dtype, dtype, affine, rms, seed=channels + plane)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm_2d", "rms_norm_2d"])
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_cuda_nchw_in_place(dtype: torch.dtype, rms: bool) -> None:
    """CUDA's channels-first kernels (csrc/cuda/columns_kernels.cuh): the suite's rule against ATen on timm's path,
    NCHW out and grad_input, no copy forward or backward (tests/test_cuda_emulation.py runs them on the host)."""
    from test_strided import _copies

    for shape in ((2, 7, 1, 5), (3, 96, 9, 37), (1, 769, 3, 11), (8, 64, 56, 56)):
        _check_against_aten(shape, dtype, dtype, affine=True, rms=rms, seed=shape[1], device="cuda")
        x, w, b, grad = _inputs(shape, dtype, dtype, True, rms, seed=shape[1], device="cuda")
        with torch.no_grad():
            assert _copies(lambda: _ours(x, w, b, rms)) == []
        xl, wl, bl = (t if t is None else t.detach().requires_grad_() for t in (x, w, b))
        out = _ours(xl, wl, bl, rms)
        assert _copies(lambda: out.backward(grad)) == []


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm_2d", "rms_norm_2d"])
@pytest.mark.parametrize("shape", [(1, 96, 9, 37), (3, 7, 2, 3, 5), (1, 769, 1, 3, 7), (2, 32, 333)],
                         ids=["n1", "3d", "3d_n1", "1d"])  # fmt: skip
def test_other_spatial_ranks_and_one_image(shape: tuple[int, ...], rms: bool) -> None:
    for dtype in (F32, BF16):
        _check_against_aten(shape, dtype, dtype, affine=True, rms=rms, seed=len(shape))


@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_half_input_float32_parameters(dtype: torch.dtype) -> None:
    for rms in (False, True):
        _check_against_aten((2, 96, 9, 37), dtype, F32, affine=True, rms=rms)


@pytest.mark.parametrize("isa", SWEEP_ISAS)
def test_every_instruction_set(isa: str) -> None:
    previous = L.native.set_cpu_isa(isa)
    try:
        for channels, plane in ((7, 5), (96, 333), (769, 64)):
            for dtype in (F32, BF16, F16, F64):
                for rms in (False, True):
                    _check_against_aten((2, channels, *PLANES[plane]), dtype, dtype, True, rms, seed=channels)
    finally:
        L.native.set_cpu_isa(previous)


def test_memory_efficient() -> None:
    """memory_efficient=True saves the NCHW output, which the backward reads in place as well."""
    for rms in (False, True):
        for dtype in (F32, BF16):
            _check_against_aten((2, 96, 9, 37), dtype, dtype, affine=True, rms=rms, memory_efficient=True)


def test_gradient_of_another_layout() -> None:
    """A channels_last or expanded incoming gradient is copied into the input's layout: the same bits."""
    x, w, b, grad = _inputs((2, 96, 9, 37), F32, F32, True, False, seed=3)
    for other in (grad.contiguous(memory_format=torch.channels_last), torch.ones(()).expand(grad.shape)):
        got = _run(lambda *a: _ours(*a, False), [x, w, b], other)
        expected = _run(lambda *a: _ours(*a, False), [x, w, b], other.contiguous())
        for g, e in zip(got, expected):
            assert torch.equal(g, e)


def test_parameter_gradients_do_not_depend_on_threads() -> None:
    x, w, b, grad = _inputs((8, 96, 17, 19), F32, F32, True, False, seed=4)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(_run(lambda *a: _ours(*a, False), [x, w, b], grad))
    finally:
        torch.set_num_threads(before)
    for a, b_ in zip(*results):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm_2d", "rms_norm_2d"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e20, 3e38], ids=str)
def test_nonfinite_and_huge_values_as_the_rows(value: float, rms: bool) -> None:
    """A non-finite element poisons its pixel only; a pixel of values ~1e20 (float squares overflow: the
    statistics again in double) is normalized as the row kernels do it (channels_last input)."""
    x, w, b, _ = _inputs((2, 96, 5, 7), F32, F32, True, rms, seed=8)
    x[0, 3, 2, 4] = value
    x[1, :, 1, 1] *= 1e20
    nchw = _ours(x, w, b, rms)
    rows = _ours(x.contiguous(memory_format=torch.channels_last), w, b, rms)
    torch.testing.assert_close(nchw, rows, equal_nan=True)
    bad = ~nchw.isfinite()
    assert bad.sum() == bad[0, :, 2, 4].sum()  # the poisoned pixel only


def test_numerics_options() -> None:
    """weight_offset (the scale is weight + offset) and cast_before_weight (xhat rounded first) reach the kernel."""
    x, w, b, grad = _inputs((2, 96, 9, 37), BF16, BF16, True, False, seed=9)
    offset = _run(lambda *a: L.layer_norm_2d(*a, EPS, weight_offset=1.0), [x, w, b], grad)
    shifted = _run(lambda t, w_, b_: L.layer_norm_2d(t, w_.float() + 1.0, b_.float(), EPS), [x, w, b], grad)
    for o, s_ in zip(offset, shifted):
        torch.testing.assert_close(o, s_.to(o.dtype), rtol=0, atol=0)
    with torch.no_grad():
        cast = L.layer_norm_2d(x, w, b, EPS, cast_before_weight=True)
        rows = L.layer_norm_2d(x.contiguous(memory_format=torch.channels_last), w, b, EPS, cast_before_weight=True)
        xhat = _back(F.layer_norm(_rows(x).double(), (96,), eps=EPS)).to(BF16).double()
        reference = xhat * w.double()[:, None, None] + b.double()[:, None, None]
    assert_no_worse_than_aten(cast, rows, reference, "cast_before_weight")


def test_double_backward() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 7, 3, 5, dtype=F64, requires_grad=True)
    w = torch.randn(7, dtype=F64, requires_grad=True)
    b = torch.randn(7, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: L.layer_norm_2d(*a, EPS), (x, w, b))
    assert torch.autograd.gradgradcheck(lambda *a: L.layer_norm_2d(*a, EPS), (x, w, b))
    assert torch.autograd.gradgradcheck(lambda *a: L.rms_norm_2d(*a, EPS), (x, w))


# ---- no copy, and what still copies -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm_2d", "rms_norm_2d"])
def test_profiler_sees_no_copy_for_nchw(rms: bool, dtype: torch.dtype) -> None:
    """Failed before the columns kernels: the op copied the NCHW input (aten::copy_ via contiguous)."""
    x, w, b, grad = _inputs((2, 96, 9, 37), dtype, dtype, True, rms, seed=5)
    with torch.no_grad():
        assert _copies(lambda: _ours(x, w, b, rms)) == []
    leaves = [t for t in (x, w, b) if t is not None]
    leaves = [t.requires_grad_() for t in leaves]
    assert _copies(lambda: torch.autograd.grad(_ours(*leaves, *([None] if rms else []), rms), leaves, grad)) == []


def _channel_slice(x: Tensor) -> Tensor:
    return torch.cat([x, x[:, :3]], 1)[:, : x.shape[1]]


def _strided_plane(x: Tensor) -> Tensor:
    return torch.stack([x, x], -1).flatten(-2)[..., ::2]


@pytest.mark.parametrize("layout", [_channel_slice, _strided_plane], ids=["channel_slice", "strided_plane"])
def test_other_layouts_are_copied(layout: Callable[[Tensor], Tensor]) -> None:
    """The docstring's "anything else": copied once into channels_last rows; the result is channels_last."""
    x, w, b, grad = _inputs((2, 32, 5, 7), F32, F32, True, False, seed=6)
    view = layout(x)
    assert torch.equal(view, x) and not view.is_contiguous()
    with torch.no_grad():
        assert "aten::copy_" in _copies(lambda: L.layer_norm_2d(view, w, b))
        y = L.layer_norm_2d(view, w, b, EPS)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert_no_worse_than_aten(y, _timm(x, w, b, False), _timm(x.double(), w.double(), b.double(), False), "copied")


def test_channels_last_stays_channels_last() -> None:
    x, w, b, _ = _inputs((2, 32, 5, 7), F32, F32, True, False, seed=7)
    x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        assert _copies(lambda: L.layer_norm_2d(x, w, b)) == []
        assert L.layer_norm_2d(x, w, b).is_contiguous(memory_format=torch.channels_last)


# ---- fake kernels, opcheck, compile -------------------------------------------------------------------------------
def _op_calls(x: Tensor) -> list[tuple[object, tuple[object, ...]]]:
    c = x.shape[-1]
    w, b = torch.randn(c), torch.randn(c)
    out, _, mean, rstd = OPS.layer_norm_fwd(x, [c], w, b, 1e-5)
    _, _, rms_rstd = OPS.rms_norm_fwd(x, [c], w, None)
    grad = torch.randn_like(out)
    return [
        (OPS.layer_norm_fwd.default, (x, [c], w, b, 1e-5)),
        (OPS.rms_norm_fwd.default, (x, [c], w, None)),
        (OPS.layer_norm_bwd.default, (grad, x, mean, rstd, [c], w, b)),
        (OPS.layer_norm_bwd.default, (grad, out, mean, rstd, [c], w, b, True)),
        (OPS.rms_norm_bwd.default, (grad, x, rms_rstd, [c], w)),
    ]


@pytest.mark.parametrize("shape", [(2, 16, 3, 5), (1, 16, 7), (2, 16, 1, 1), (2, 1, 3, 5)], ids=str)
def test_fake_strides_and_opcheck(shape: tuple[int, ...]) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    x = _rows(torch.randn(shape))
    for op, args in _op_calls(x):
        real = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fake = op(*(mode.from_tensor(a) if isinstance(a, Tensor) else a for a in args))
        for r, f in zip(real, fake):
            if r.numel() > 0:
                assert (r.shape, r.stride()) == (f.shape, f.stride()), op
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(OPS.layer_norm_fwd.default, (x.detach().requires_grad_(), [shape[1]], None, None, 1e-5),
                          test_utils=("test_autograd_registration", "test_aot_dispatch_dynamic"))  # fmt: skip


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm_2d", "rms_norm_2d"])
def test_compile_fullgraph(rms: bool) -> None:
    torch.manual_seed(0)
    module = (L.FusedRMSNorm2d if rms else L.FusedLayerNorm2d)(32)
    x = torch.randn(2, 32, 9, 11)
    grad = torch.randn(2, 32, 9, 11)

    def run(fn: Callable[[Tensor], Tensor]) -> list[Tensor]:
        t = x.detach().requires_grad_()
        out = fn(t)
        return [out, *torch.autograd.grad(out, (t, *module.parameters()), grad)]

    eager = run(module)
    compiled = run(torch.compile(module, fullgraph=True, backend="aot_eager"))
    for e, c in zip(eager, compiled):
        assert e.stride() == c.stride() and torch.equal(e, c)


# ---- modules: drop-ins for timm's ---------------------------------------------------------------------------------
@pytest.mark.parametrize("rms", [False, True], ids=["LayerNorm2d", "RmsNorm2d"])
def test_module_state_dict_drop_in(rms: bool) -> None:
    torch.manual_seed(1)
    timm = (_TimmRmsNorm2d if rms else _TimmLayerNorm2d)(96)
    with torch.no_grad():
        for p in timm.parameters():
            p.normal_()
    ours = (L.FusedRMSNorm2d if rms else L.FusedLayerNorm2d)(96)
    ours.load_state_dict(timm.state_dict())
    assert ours.state_dict().keys() == timm.state_dict().keys()
    x = torch.randn(2, 96, 9, 37)
    with torch.no_grad():
        reference = timm.double()(x.double())
        timm.float()
        assert_no_worse_than_aten(ours(x), timm(x), reference, "module")
        assert _copies(lambda: ours(x)) == []


def test_replace_norms_on_nchw_model() -> None:
    """replace_norms takes timm-like *Norm2d classes; the model then runs on NCHW activations with no copy in its
    norms (each one's accuracy: the tests above; the GELU between them makes the chain's error vary either way)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), _TimmLayerNorm2d(16), torch.nn.GELU(), _TimmRmsNorm2d(16))
    x = torch.randn(2, 3, 11, 13)
    with torch.no_grad():
        expected = model(x)
        L.replace_norms(model)
        assert isinstance(model[1], L.FusedLayerNorm2d) and isinstance(model[3], L.FusedRMSNorm2d)
        got = model(x)
        activations = model[0](x)
        assert _copies(lambda: model[1](activations)) == []
    torch.testing.assert_close(got, expected)
    assert got.is_contiguous()
