"""Numerics sweep of the functional API against ATen.

Every case runs one of ``layer_norm``, ``rms_norm``, ``add_layer_norm``, ``add_rms_norm`` forward and backward
(gradients of input, residual, weight and bias; a non-zero gradient also flows into ``residual_out``), runs the
ATen equivalent on the same inputs (``F.layer_norm`` / ``F.rms_norm``; ``h = x + r`` first for the residual
variants) and checks every result with the suite's rule (``assert_no_worse_than_aten``): our max error against a
high-precision reference must not exceed ATen's by more than ~1 ulp.

The reference is fp64 (inputs cast to float64, the residual sum done in the h dtype first). When h is itself
float64, an fp64 reference is just ATen again, so those cases use an extended-precision (80-bit ``long double``)
numpy implementation of the same formulas instead.

The cross product is cut to keep the file fast: the core sweep (every N x every dtype x every affine mode) runs
contiguous inputs with one row count; layouts, row counts, residual modes, memory_efficient, eps, hard rows and
the huge row each get their own, smaller sweep.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import layernorm_ext as L
from conftest import DTYPE_PAIRS, assert_no_worse_than_aten

# ATen's rms_norm warns on every mixed-dtype call (half input, float32 weight) that it takes its slower path
# Every test runs on every CPU instruction set this machine supports (fixture cpu_isa in conftest).
pytestmark = [
    pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning"),
    pytest.mark.usefixtures("cpu_isa"),
]

# ---- parameters --------------------------------------------------------------------------------------------

FNS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
LN_FNS = ("layer_norm", "add_layer_norm")
RESIDUAL_FNS = ("add_layer_norm", "add_rms_norm")

# normalized shapes: every required N, plus multi-dim ones
NORM_SHAPES: tuple[tuple[int, ...], ...] = (
    (1,), (2,), (7,), (8,), (31,), (64,), (127,), (256,), (384,), (769,), (1024,),
    (4096,), (5125,), (8192,), (65536,), (4, 7), (3, 5, 11),
)  # fmt: skip

# (input dtype, weight/bias dtype): plain and mixed precision
DTYPE_CONFIGS = DTYPE_PAIRS

_SHORT = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}  # fmt: skip

_EXTENDED_OK = np.finfo(np.longdouble).eps < np.finfo(np.float64).eps


def _dt_id(cfg: tuple[torch.dtype, torch.dtype]) -> str:
    x, w = cfg
    return _SHORT[x] if x == w else f"{_SHORT[x]}+w{_SHORT[w]}"


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _rows_for(norm: tuple[int, ...], cap: int = 37, budget: int = 1 << 16) -> int:
    """A row count that keeps one case at about ``budget`` elements (but at least 2 rows)."""
    return min(cap, max(2, budget // _numel(norm)))


def _affines(fn: str) -> tuple[str, ...]:
    return ("none", "w", "wb") if fn in LN_FNS else ("none", "w")


# ---- one case ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    fn: str
    lead: tuple[int, ...]
    norm: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    wdtype: torch.dtype | None = None  # weight/bias dtype (None: same as input)
    affine: str = "wb"  # "none" | "w" (weight only) | "wb" (weight and bias; LayerNorm only)
    rdtype: torch.dtype | None = None  # residual dtype (None: same as input)
    in_fp32: bool = False  # residual_in_fp32
    x_layout: str = "contig"
    r_layout: str = "contig"
    g_layout: str = "contig"  # layout of grad_out (and grad_residual_out)
    w_layout: str = "contig"
    eps: float | None = 1e-5
    mem_eff: bool = False
    mean: float = 0.3  # input distribution
    std: float = 1.0
    x_share: float = 0.5  # residual variants: input = x_share * randn, residual = rows - input
    jitter: bool = True  # vary each row's mean and std around mean / std
    weights: str = "normal"  # "normal" | "signed" (|w| >= 0.5 >= |b|) | "small" (some |w| ~ 1e-3) | "zero" (some 0)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.lead + self.norm

    @property
    def rms(self) -> bool:
        return "rms" in self.fn

    @property
    def residual(self) -> bool:
        return self.fn.startswith("add_")

    @property
    def h_dtype(self) -> torch.dtype:
        if not self.residual:
            return self.dtype
        d = torch.promote_types(self.dtype, self.rdtype or self.dtype)
        return torch.promote_types(d, torch.float32) if self.in_fp32 else d


def _seed(spec: Spec) -> int:
    """Seed from the case (but not from memory_efficient: both modes of a case see the same data)."""
    return zlib.crc32(repr(replace(spec, mem_eff=False)).encode())


def _randn(gen: torch.Generator, shape: tuple[int, ...], mean: float = 0.0, std: float = 1.0) -> Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64) * std + mean


def _rows(gen: torch.Generator, spec: Spec) -> Tensor:
    """Input rows with controlled statistics: each row is standardized noise scaled to a row std and shifted
    to a row mean (with ``jitter``, both vary per row around ``spec.mean`` / ``spec.std``).

    Controlling each row's spread keeps the cases well-conditioned also for tiny N: two random values can be
    arbitrarily close, and then every implementation's error is dominated by cancellation noise (for N = 2
    LayerNorm the input gradient is ``rstd * (g1 - g2) / 2 * eps / (var + eps)``), which compares nothing.
    For the residual variants these are the rows of h = input + residual.
    """
    rows, n = _numel(spec.lead), _numel(spec.norm)
    z = _randn(gen, (rows, n))
    if n == 1:  # one element: a value of magnitude std (RMSNorm of a value near 0 is as ill-conditioned)
        z = torch.where(z < 0, -1.0, 1.0)
    elif rows:
        z = (z - z.mean(dim=1, keepdim=True)) / z.std(dim=1, correction=0, keepdim=True)
    mean = torch.full((rows, 1), spec.mean if n >= 2 else 0.0, dtype=torch.float64)
    std = torch.full((rows, 1), spec.std, dtype=torch.float64)
    if spec.jitter:
        mean = mean + 0.2 * abs(spec.mean) * _randn(gen, (rows, 1))
        std = std * torch.exp(0.5 * _randn(gen, (rows, 1)).clamp(-2.0, 2.0))
    return (mean + std * z).reshape(spec.shape)


def _place(t: Tensor, layout: str, dtype: torch.dtype, device: str) -> Tensor:
    """``t`` (cpu) cast to ``dtype`` on ``device``, laid out as ``layout`` (same values, other strides)."""
    t = t.to(dtype)
    if layout == "contig":
        return t.to(device)
    if layout == "T":  # every dim reversed: a transposed view
        rev = tuple(reversed(range(t.dim())))
        return t.permute(rev).contiguous().to(device).permute(rev)
    if layout == "step2":  # every stride doubled
        base = torch.zeros(*t.shape, 2, dtype=dtype, device=device)
        base[..., 0] = t.to(device)
        return base[..., 0]
    if layout == "padded":  # rows of a wider matrix: last dim contiguous, padded row stride
        n = t.shape[-1]
        base = torch.full((*t.shape[:-1], n + 3), float("nan"), dtype=dtype, device=device)
        base[..., :n] = t.to(device)
        return base[..., :n]
    raise ValueError(layout)


def _leaf(t: Tensor) -> Tensor:
    return t.detach().requires_grad_(True)


@dataclass
class Inputs:
    x: Tensor
    r: Tensor | None
    w: Tensor | None
    b: Tensor | None
    g: Tensor  # grad of out
    gr: Tensor | None  # grad of residual_out


def _make_inputs(spec: Spec, device: str) -> Inputs:
    gen = torch.Generator().manual_seed(_seed(spec))
    shape = spec.shape
    rows = _rows(gen, spec)
    r = None
    if spec.residual:  # split the rows into input + residual (the residual carries the rows' mean)
        x0 = (spec.x_share * _randn(gen, shape)).to(spec.dtype).double()
        r = _leaf(_place(rows - x0, spec.r_layout, spec.rdtype or spec.dtype, device))
        rows = x0
    x = _leaf(_place(rows, spec.x_layout, spec.dtype, device))
    wdtype = spec.wdtype or spec.dtype
    w = b = None
    wv = 1.0 + 0.5 * _randn(gen, spec.norm)
    bv = 0.5 * _randn(gen, spec.norm)
    if spec.weights == "signed":  # both signs, away from 0, and no bias larger than its weight
        wv = torch.where(wv < 1.0, -1.0, 1.0) * (0.5 + wv.sub(1.0).abs()).clamp(max=2.5)
        bv = bv.clamp(-0.5, 0.5)
    elif spec.weights == "small":
        wv.view(-1)[::5] *= 1e-3
    elif spec.weights == "zero":
        wv.view(-1)[::3] = 0.0
    if spec.affine in ("w", "wb"):
        w = _leaf(_place(wv, spec.w_layout, wdtype, device))
    if spec.affine == "wb":
        b = _leaf(_place(bv, spec.w_layout, wdtype, device))
    g = _place(_randn(gen, shape), spec.g_layout, spec.dtype, device)
    gr = _place(_randn(gen, shape), spec.g_layout, spec.h_dtype, device) if spec.residual else None
    return Inputs(x, r, w, b, g, gr)


def _leaves(inp: Inputs) -> dict[str, Tensor]:
    named = {"input": inp.x, "residual": inp.r, "weight": inp.w, "bias": inp.b}
    return {k: v for k, v in named.items() if v is not None}


def _ours(spec: Spec, inp: Inputs) -> tuple[Tensor, Tensor | None]:
    kw = {"memory_efficient": spec.mem_eff}
    if spec.fn == "layer_norm":
        return L.layer_norm(inp.x, spec.norm, inp.w, inp.b, spec.eps, **kw), None
    if spec.fn == "rms_norm":
        return L.rms_norm(inp.x, spec.norm, inp.w, spec.eps, **kw), None
    if spec.fn == "add_layer_norm":
        return L.add_layer_norm(inp.x, inp.r, spec.norm, inp.w, inp.b, spec.eps, spec.in_fp32, **kw)
    return L.add_rms_norm(inp.x, inp.r, spec.norm, inp.w, spec.eps, spec.in_fp32, **kw)


def _aten_params(h: Tensor, w: Tensor | None, b: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """ATen takes params of h's dtype, or float32 params with a half h; otherwise cast them (differentiably)."""
    if w is None or w.dtype == h.dtype:
        return w, b
    if h.dtype in (torch.float16, torch.bfloat16) and w.dtype == torch.float32:
        return w, b
    return w.to(h.dtype), (b.to(h.dtype) if b is not None else None)


def aten_lacks_mixed_layer_norm(h: Tensor, w: Tensor | None, b: Tensor | None) -> bool:
    """ATen's CUDA layer_norm takes no float32 weight / bias with a float16 / bfloat16 input (it raises
    "expected scalar type BFloat16 but found Float"); its CPU kernel and both devices' rms_norm do."""
    params = [t for t in (w, b) if t is not None]
    return h.is_cuda and h.dtype in (torch.float16, torch.bfloat16) and any(t.dtype == torch.float32 for t in params)


def _aten(spec: Spec, inp: Inputs) -> tuple[Tensor, Tensor | None]:
    h = inp.x
    if spec.residual:
        assert inp.r is not None
        h = inp.x.to(spec.h_dtype) + inp.r.to(spec.h_dtype)
    w, b = _aten_params(h, inp.w, inp.b)
    if spec.rms:
        out = F.rms_norm(h, spec.norm, w, spec.eps)
    elif aten_lacks_mixed_layer_norm(h, w, b):
        # The stand-in for ATen where it has no such kernel: ATen's float32 layer_norm of the exactly upcast
        # input, rounded to the input's dtype (the casts are differentiable: the gradient of the half input is
        # ATen's float32 gradient rounded). This is the most a float32 computation can achieve, so the rule
        # holds ours to at least what ATen's CPU mixed-dtype kernel would reach.
        out = F.layer_norm(h.float(), spec.norm, w, b, spec.eps)
    else:
        out = F.layer_norm(h, spec.norm, w, b, spec.eps)
    return out.to(spec.dtype), (h if spec.residual else None)


def _grads(spec: Spec, inp: Inputs, out: Tensor, res_out: Tensor | None) -> dict[str, Tensor]:
    leaves = _leaves(inp)
    outs, gouts = [out], [inp.g]
    if res_out is not None:
        outs.append(res_out)
        gouts.append(inp.gr)
    gs = torch.autograd.grad(outs, list(leaves.values()), gouts)
    return dict(zip(leaves, gs))


def _none_eps(dtype: torch.dtype) -> float:
    """What eps=None means for RMSNorm of ``dtype``, as in ATen: finfo of the op-math dtype (float32 for half)."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _eps_value(spec: Spec) -> float:
    return _none_eps(spec.h_dtype) if spec.eps is None else spec.eps


def _reference_fp64(spec: Spec, inp: Inputs, h: Tensor) -> dict[str, Tensor]:
    h64 = _leaf(h.detach().cpu().double())  # the reference runs on the CPU whatever the device
    w64 = _leaf(inp.w.detach().cpu().double()) if inp.w is not None else None
    b64 = _leaf(inp.b.detach().cpu().double()) if inp.b is not None else None
    eps = _eps_value(spec)
    if spec.rms:
        out = F.rms_norm(h64, spec.norm, w64, eps)
    else:
        out = F.layer_norm(h64, spec.norm, w64, b64, eps)
    params = [t for t in (w64, b64) if t is not None]
    gs = torch.autograd.grad(out, [h64, *params], inp.g.cpu().double())
    ref = {"out": out.detach(), "h": gs[0]}
    if w64 is not None:
        ref["weight"] = gs[1]
    if b64 is not None:
        ref["bias"] = gs[2]
    return ref


def _reference_extended(spec: Spec, inp: Inputs, h: Tensor) -> dict[str, Tensor]:
    """The same formulas in 80-bit long double (for float64 h, where fp64 is no reference)."""
    ld = np.longdouble
    n = _numel(spec.norm)

    def arr(t: Tensor) -> np.ndarray:
        return t.detach().double().cpu().reshape(-1, n).numpy().astype(ld)

    hh, g = arr(h), arr(inp.g)
    w = arr(inp.w)[0] if inp.w is not None else np.ones(n, dtype=ld)
    eps = ld(_eps_value(spec))
    if spec.rms:
        rstd = 1 / np.sqrt((hh * hh).mean(axis=1, keepdims=True) + eps)
        xhat = hh * rstd
    else:
        mu = hh.mean(axis=1, keepdims=True)
        rstd = 1 / np.sqrt(((hh - mu) ** 2).mean(axis=1, keepdims=True) + eps)
        xhat = (hh - mu) * rstd
    out = xhat * w
    if inp.b is not None:
        out = out + arr(inp.b)[0]
    gx = g * w
    dh = gx - xhat * (gx * xhat).mean(axis=1, keepdims=True)
    if not spec.rms:
        dh = dh - gx.mean(axis=1, keepdims=True)
    dh = dh * rstd

    def back(a: np.ndarray, shape: tuple[int, ...]) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a.astype(np.float64))).reshape(shape)

    ref = {"out": back(out, spec.shape), "h": back(dh, spec.shape)}
    if inp.w is not None:
        ref["weight"] = back((g * xhat).sum(axis=0), spec.norm)
    if inp.b is not None:
        ref["bias"] = back(g.sum(axis=0), spec.norm)
    return ref


def _reference(spec: Spec, inp: Inputs, h: Tensor) -> dict[str, Tensor]:
    if h.dtype == torch.float64 and _EXTENDED_OK:
        return _reference_extended(spec, inp, h)
    return _reference_fp64(spec, inp, h)  # no wider float on this platform: fp64 (then ATen f64 is exact)


def _assert_bitwise(ours: Tensor, expected: Tensor, what: str) -> None:
    assert ours.dtype == expected.dtype, (what, ours.dtype, expected.dtype)
    assert ours.shape == expected.shape, (what, ours.shape, expected.shape)
    iv = _INT_VIEW[ours.dtype]
    same = torch.equal(ours.detach().contiguous().view(iv), expected.detach().contiguous().view(iv))
    assert same, f"{what}: not bitwise equal, max diff {(ours.double() - expected.double()).abs().max():.3e}"


@dataclass
class Result:
    out: Tensor
    res_out: Tensor | None
    grads: dict[str, Tensor]  # our gradients, by leaf name
    refs: dict[str, Tensor]  # the reference for "out" and for each gradient
    saved: set[str]  # which of "input", "residual", "out", "residual_out" our forward saved for backward


def run_case(
    spec: Spec, device: str, ours: Callable[[Spec, Inputs], tuple[Tensor, Tensor | None]] | None = None
) -> Result:
    """Runs ``spec`` with our op (or ``ours``: another implementation of it, e.g. the emulated CUDA kernels) and
    ATen; checks outputs and all gradients with the suite's rule."""
    ours = _ours if ours is None else ours
    inp = _make_inputs(spec, device)
    leaves = _leaves(inp)
    ptrs: list[int] = []  # storages our forward saves for backward

    def pack(t: Tensor) -> Tensor:
        ptrs.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, res_out = ours(spec, inp)
    named = {"input": inp.x, "residual": inp.r, "out": out, "residual_out": res_out}
    saved = {k for k, t in named.items() if t is not None and t.numel() and t.untyped_storage().data_ptr() in ptrs}
    grads = _grads(spec, inp, out, res_out)
    a_out, a_h = _aten(spec, inp)
    a_grads = _grads(spec, inp, a_out, a_h)
    ref = _reference(spec, inp, a_h if a_h is not None else inp.x)

    assert out.dtype == spec.dtype and out.shape == spec.shape and out.device == inp.x.device
    assert_no_worse_than_aten(out, a_out, ref["out"], "out")
    refs = {"out": ref["out"]}
    if spec.residual:
        assert res_out is not None and a_h is not None and inp.gr is not None
        _assert_bitwise(res_out, a_h, "residual_out")  # exactly torch's x + r, in the promoted dtype
        ref_gh = ref["h"] + inp.gr.double().cpu()
    else:
        assert res_out is None
        ref_gh = ref["h"]
    for name, g in grads.items():
        assert g.dtype == leaves[name].dtype and g.shape == leaves[name].shape, (name, g.dtype, g.shape)
        refs[name] = ref_gh if name in ("input", "residual") else ref[name]
        assert_no_worse_than_aten(g, a_grads[name], refs[name], f"grad_{name}")
    return Result(out.detach(), None if res_out is None else res_out.detach(), grads, refs, saved)


def _shape_id(spec: Spec) -> str:
    return f"m{'x'.join(map(str, spec.lead))}-n{'x'.join(map(str, spec.norm))}"


def _id(spec: Spec) -> str:
    parts = [spec.fn, _shape_id(spec), _dt_id((spec.dtype, spec.wdtype or spec.dtype))]
    parts.append({"none": "noaffine", "w": "weight", "wb": "affine"}[spec.affine])
    if spec.rdtype is not None:
        parts.append(f"r{_SHORT[spec.rdtype]}")
    if spec.in_fp32:
        parts.append("res_in_fp32")
    for name in ("x", "r", "g", "w"):
        layout = getattr(spec, f"{name}_layout")
        if layout != "contig":
            parts.append(f"{name}_{layout}")
    if spec.eps != _default_eps(spec.fn):
        parts.append(f"eps{spec.eps}")
    if spec.mean != 0.3 or spec.std != 1.0:
        parts.append(f"mean{spec.mean:g}_std{spec.std:g}")
    if spec.mem_eff:
        parts.append("memeff")
    if spec.weights != "normal":
        parts.append(f"{spec.weights}_weights")
    return "-".join(parts)


def _params(specs: list[Spec]) -> list:
    ids = [_id(s) for s in specs]
    assert len(set(ids)) == len(ids), "duplicate test ids"
    return [pytest.param(s, id=i) for s, i in zip(specs, ids)]


def _default_eps(fn: str) -> float | None:
    return 1e-6 if "rms" in fn else 1e-5


def _spec(fn: str, lead: tuple[int, ...], norm: tuple[int, ...], **kw) -> Spec:
    kw.setdefault("eps", _default_eps(fn))
    kw.setdefault("affine", "w" if "rms" in fn else "wb")
    return Spec(fn, lead, norm, **kw)


# ---- core sweep: every function x N x dtype config x affine mode (contiguous) -----------------------------


def _core_specs() -> list[Spec]:
    return [
        _spec(fn, (_rows_for(norm),), norm, dtype=dtype, wdtype=wdtype, affine=affine)
        for fn in FNS
        for norm in NORM_SHAPES
        for dtype, wdtype in DTYPE_CONFIGS
        for affine in _affines(fn)
    ]


@pytest.mark.parametrize("spec", _params(_core_specs()))
def test_core(spec: Spec, device: str) -> None:
    run_case(spec, device)


# ---- row counts: M = 0, 1, several; leading dims with more than one dim ------------------------------------

LEADS: tuple[tuple[int, ...], ...] = ((0,), (1,), (3,), (2, 3), (3, 1, 5), (2, 0, 3))


def _rows_specs() -> list[Spec]:
    return [
        _spec(fn, lead, norm, dtype=dtype, wdtype=wdtype)
        for fn in FNS
        for lead in LEADS
        for norm in ((1,), (8,), (769,), (8192,), (4, 7))
        for dtype, wdtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32))
    ]


@pytest.mark.parametrize("spec", _params(_rows_specs()))
def test_rows(spec: Spec, device: str) -> None:
    run_case(spec, device)


# ---- layouts: non-contiguous input / residual / grad_out / weight -----------------------------------------

_LAYOUTS: tuple[dict[str, str], ...] = (
    {"x_layout": "T"},
    {"x_layout": "step2"},
    {"x_layout": "padded"},
    {"g_layout": "T"},
    {"g_layout": "step2"},
    {"w_layout": "step2"},
)
_RESIDUAL_LAYOUTS: tuple[dict[str, str], ...] = (
    {"r_layout": "T"},
    {"x_layout": "T", "r_layout": "padded", "g_layout": "step2"},
)


def _layout_specs() -> list[Spec]:
    specs = []
    for fn in FNS:
        layouts = _LAYOUTS + (_RESIDUAL_LAYOUTS if fn in RESIDUAL_FNS else ())
        for layout in layouts:
            for norm in ((7,), (1024,), (5125,), (3, 5, 11)):
                lead = (3, 5) if _numel(norm) < 4096 else (3,)
                for dtype, wdtype in DTYPE_CONFIGS:
                    if dtype == torch.float64 or (dtype == torch.float16 and wdtype == torch.float16):
                        continue
                    specs.append(_spec(fn, lead, norm, dtype=dtype, wdtype=wdtype, **layout))
    return specs


@pytest.mark.parametrize("spec", _params(_layout_specs()))
def test_layouts(spec: Spec, device: str) -> None:
    run_case(spec, device)


# ---- residual dtypes: residual of another dtype, residual_in_fp32 ----------------------------------------

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64

# (input dtype, weight dtype, residual dtype, residual_in_fp32)
_RESIDUAL_MODES: tuple[tuple[torch.dtype, torch.dtype, torch.dtype, bool], ...] = (
    (F16, F16, F32, False),
    (F16, F32, F32, False),
    (BF16, BF16, F32, False),
    (BF16, F32, F32, False),
    (F16, F16, F16, True),
    (F16, F32, F16, True),
    (BF16, BF16, BF16, True),
    (BF16, F32, BF16, True),
    (BF16, F32, F32, True),
    (F16, F16, BF16, False),
    (F32, F32, F16, False),
    (F32, F32, BF16, False),
    (F32, F32, F32, True),
    (F32, F32, F64, False),
    (F64, F64, F64, True),
)


def _residual_specs() -> list[Spec]:
    return [
        _spec(fn, (_rows_for(norm, cap=13),), norm, dtype=x, wdtype=w, rdtype=r, in_fp32=in_fp32, affine=affine)
        for fn in RESIDUAL_FNS
        for x, w, r, in_fp32 in _RESIDUAL_MODES
        for norm in ((8,), (384,), (4096,), (4, 7))
        for affine in _affines(fn)
    ]


@pytest.mark.parametrize("spec", _params(_residual_specs()))
def test_residual_dtypes(spec: Spec, device: str) -> None:
    run_case(spec, device)


# ---- memory_efficient: same accuracy as the default path; bitwise the same with zero weights -------------


def _memeff_specs() -> list[Spec]:
    specs = [
        _spec(fn, (_rows_for(norm),), norm, dtype=dtype, wdtype=wdtype, affine=affine, mem_eff=True, weights=weights)
        for fn in FNS
        for norm in ((31,), (1024,), (4, 7))
        for dtype, wdtype in DTYPE_CONFIGS
        for affine in _affines(fn)
        for weights in (("signed", "normal") if affine != "none" else ("normal",))
    ]
    specs += [  # tiny (not zero) weights: xhat = (out - bias) / weight would be inexact there
        _spec(fn, (_rows_for(norm),), norm, dtype=dtype, wdtype=dtype, affine=affine, mem_eff=True, weights="small")
        for fn in FNS
        for affine in _affines(fn)
        if affine != "none"
        for norm in ((8,), (1024,))
        for dtype in (F32, F64, F16, BF16)
    ]
    return specs


def _compare_with_default(spec: Spec, mem: Result, device: str, bitwise: bool) -> None:
    default = run_case(replace(spec, mem_eff=False), device)
    _assert_bitwise(mem.out, default.out, "out (memeff vs default)")
    if mem.res_out is not None:
        assert default.res_out is not None
        _assert_bitwise(mem.res_out, default.res_out, "residual_out (memeff vs default)")
    assert mem.grads.keys() == default.grads.keys()
    for name, g in mem.grads.items():
        if bitwise:
            _assert_bitwise(g, default.grads[name], f"grad_{name} (memeff vs default)")
        else:  # the rule, with the default path in ATen's place
            assert_no_worse_than_aten(g, default.grads[name], mem.refs[name], f"grad_{name} (memeff vs default)")


@pytest.mark.parametrize("spec", _params(_memeff_specs()))
def test_memory_efficient(spec: Spec, device: str) -> None:
    """memory_efficient=True: checked against ATen, and against the default path (the same forward bits,
    gradients no less accurate). With weights safely away from 0 (or none), it saves the output, not the input."""
    mem = run_case(spec, device)
    _compare_with_default(spec, mem, device, bitwise=False)
    same_dtype_params = spec.wdtype in (None, spec.dtype)
    if not spec.residual and same_dtype_params and (spec.affine == "none" or spec.weights == "signed"):
        assert mem.saved & {"input", "out"} == {"out"}, mem.saved


def _zero_weight_specs() -> list[Spec]:
    return [
        _spec(fn, (_rows_for(norm),), norm, dtype=dtype, wdtype=wdtype, affine=affine, mem_eff=True, weights="zero")
        for fn in FNS
        for affine in _affines(fn)
        if affine != "none"
        for norm in ((8,), (1024,), (3, 5, 11))
        for dtype, wdtype in DTYPE_CONFIGS
    ]


@pytest.mark.parametrize("spec", _params(_zero_weight_specs()))
def test_memory_efficient_zero_weight(spec: Spec, device: str) -> None:
    """Some weight entries are exactly 0: the input is saved then, so the gradients are bitwise the default's."""
    mem = run_case(spec, device)
    _compare_with_default(spec, mem, device, bitwise=True)
    if not spec.residual:
        assert mem.saved & {"input", "out"} == {"input"}, mem.saved


# ---- numerically hard rows: large mean, tiny spread -----------------------------------------------------


def _hard_specs() -> list[Spec]:
    return [
        _spec(fn, (_rows_for(norm, cap=16),), norm, mean=mean, std=1e-2, x_share=1e-3, jitter=False, mem_eff=mem)
        for fn in FNS
        for norm in ((8,), (64,), (1024,), (4096,), (65536,))
        for mean in (1e4, -1e4)
        for mem in (False, True)
        if not (mem and fn in RESIDUAL_FNS)
    ]


@pytest.mark.parametrize("spec", _params(_hard_specs()))
def test_hard_rows(spec: Spec, device: str) -> None:
    run_case(spec, device)


# ---- a huge row ---------------------------------------------------------------------------------------------


def _huge_specs() -> list[Spec]:
    n = (1 << 20,)
    specs = [_spec(fn, (2,), n) for fn in FNS]
    specs += [_spec(fn, (1,), n, dtype=BF16, wdtype=BF16) for fn in ("layer_norm", "add_rms_norm")]
    return specs


@pytest.mark.slow
@pytest.mark.parametrize("spec", _params(_huge_specs()))
def test_huge_row(spec: Spec, device: str) -> None:
    run_case(spec, device)


# ---- eps: None (finfo of the normalized dtype) and large values that matter -------------------------------


def _eps_specs() -> list[Spec]:
    specs = [
        # RMS of about 0.03: eps=None (finfo(dtype).eps) changes the result by far more than an ulp
        _spec(fn, (9,), norm, dtype=dtype, wdtype=wdtype, eps=None, mean=0.0, std=0.03)
        for fn in ("rms_norm", "add_rms_norm")
        for norm in ((8,), (1024,))
        for dtype, wdtype in DTYPE_CONFIGS
    ]
    specs += [  # residual_in_fp32: eps=None means finfo(float32).eps, not finfo(half).eps
        _spec("add_rms_norm", (9,), norm, dtype=dtype, wdtype=dtype, rdtype=dtype, in_fp32=True, eps=None,
              mean=0.0, std=0.03, x_share=0.01)
        for norm in ((8,), (1024,))
        for dtype in (F16, BF16)
    ]  # fmt: skip
    specs += [
        _spec(fn, (9,), (64,), dtype=dtype, wdtype=dtype, eps=eps, mean=0.0, std=0.1, x_share=0.05)
        for fn in FNS
        for dtype in (F32, BF16, F64)
        for eps in (0.0, 0.1)
    ]
    return specs


@pytest.mark.parametrize("spec", _params(_eps_specs()))
def test_eps(spec: Spec, device: str) -> None:
    run_case(spec, device)


@pytest.mark.parametrize("dtype", [F32, F64, F16, BF16], ids=_SHORT.get)
def test_rms_norm_eps_none_value(dtype: torch.dtype, device: str) -> None:
    """eps=None is bitwise the same as passing ATen's value (finfo of float32 for half inputs, of float64 for
    float64), for rms_norm and for add_rms_norm (of h's dtype); and ATen's F.rms_norm agrees on that value."""
    gen = torch.Generator().manual_seed(7)
    x = (0.03 * torch.randn(5, 64, generator=gen, dtype=torch.float64)).to(dtype).to(device)
    r = (0.01 * torch.randn(5, 64, generator=gen, dtype=torch.float64)).to(dtype).to(device)
    w = (1 + 0.5 * torch.randn(64, generator=gen, dtype=torch.float64)).to(dtype).to(device)
    eps = _none_eps(dtype)
    _assert_bitwise(F.rms_norm(x, (64,), w), F.rms_norm(x, (64,), w, eps), "ATen eps=None")
    _assert_bitwise(L.rms_norm(x, (64,), w), L.rms_norm(x, (64,), w, eps), "rms_norm eps=None")
    out, h = L.add_rms_norm(x, r, (64,), w)
    out_eps, h_eps = L.add_rms_norm(x, r, (64,), w, eps)
    _assert_bitwise(out, out_eps, "add_rms_norm eps=None")
    _assert_bitwise(h, h_eps, "add_rms_norm residual_out")
    for other in (1e-5, 1e-6, torch.finfo(torch.float16).eps):  # eps matters at this scale: not one of these
        assert not torch.equal(L.rms_norm(x, (64,), w), L.rms_norm(x, (64,), w, other)), other


# ---- empty tensors ------------------------------------------------------------------------------------------


def _empty_specs() -> list[Spec]:
    return [
        _spec(fn, lead, norm, dtype=dtype, wdtype=wdtype)
        for fn in FNS
        for lead in ((0,), (0, 3), (4, 0))
        for norm in ((8,), (4, 7))
        for dtype, wdtype in ((F32, F32), (BF16, F32))
    ]


@pytest.mark.parametrize("spec", _params(_empty_specs()))
def test_empty(spec: Spec, device: str) -> None:
    res = run_case(spec, device)
    assert res.out.shape == spec.shape and res.out.numel() == 0
    if spec.residual:
        assert res.res_out is not None and res.res_out.shape == spec.shape and res.res_out.dtype == spec.h_dtype
    for name in ("weight", "bias"):
        if name in res.grads:
            g = res.grads[name]
            assert g.shape == spec.norm and torch.equal(g, torch.zeros_like(g)), (name, g)
    assert res.grads["input"].shape == spec.shape


@pytest.mark.parametrize("fn", FNS)
def test_rows_of_no_elements(fn: str, device: str) -> None:
    """normalized_shape with a 0 in it and rows > 0: empty results, as ATen (which reports mean 0, rstd NaN)."""
    x = torch.randn(3, 0, device=device, requires_grad=True)
    r = torch.randn(3, 0, device=device, requires_grad=True)
    w = torch.randn(0, device=device, requires_grad=True)
    b = torch.randn(0, device=device, requires_grad=True)
    if fn == "layer_norm":
        out = L.layer_norm(x, (0,), w, b)
    elif fn == "rms_norm":
        out = L.rms_norm(x, (0,), w)
    elif fn == "add_layer_norm":
        out = L.add_layer_norm(x, r, (0,), w, b)[0]
    else:
        out = L.add_rms_norm(x, r, (0,), w)[0]
    assert out.shape == (3, 0)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == (3, 0)
    assert w.grad is not None and w.grad.shape == (0,)
    if fn in LN_FNS:
        _, _, mean, rstd = torch.ops.layernorm_ext.layer_norm_fwd(x.detach(), [0], None, None, 1e-5)
        _, aten_mean, aten_rstd = torch.native_layer_norm(x.detach(), [0], None, None, 1e-5)
        assert torch.equal(mean, aten_mean.view(3)) and rstd.isnan().all() and aten_rstd.isnan().all()
    else:
        _, _, rstd = torch.ops.layernorm_ext.rms_norm_fwd(x.detach(), [0], None, None)
        assert rstd.shape == (3,) and rstd.isnan().all()


# ---- many rows: dweight / dbias are sums over tens of thousands of rows -------------------------------------


@pytest.mark.parametrize(
    "spec",
    _params([_spec("rms_norm", (70000,), (64,)), _spec("add_layer_norm", (70000,), (64,), dtype=BF16, wdtype=F32)]),
)
def test_many_rows(spec: Spec, device: str) -> None:
    run_case(spec, device)
