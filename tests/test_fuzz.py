"""Differential fuzz of the functional API and the modules against ATen (issue 22).

Hypothesis draws a case (``Case``: op, shape, the dtype of every tensor, layouts, eps, which arguments require
grad, memory_efficient, residual_in_fp32, functions or modules, the values) and the test runs it three times on
the same tensors: ours; ATen (``F.layer_norm`` / ``F.rms_norm``; for the residual ops ``h = input + residual`` in
the promoted dtype, at least float32 with residual_in_fp32, then ATen's norm of h, rounded to the input's dtype);
and a reference (ATen's norm in float64 of exactly ATen's h; for float64 h, where that would be ATen itself, the
same formulas in long double). Then:

- raising: ATen raises iff we raise, in forward and in backward (ours with a RuntimeError). Which dtype pairs
  are valid is ATen's answer, asked at run time; for the residual ops the parameters pair with the input's dtype
  (the output's), so ATen is asked about its norm of a tensor of the input's dtype (and where h is wider than
  the input, the ATen side casts the parameters to h's dtype, exactly);
- the output and the gradient of every argument that requires grad (of the view the op receives) obey the
  suite's accuracy rule (``layernorm_ext.selfcheck.compare``) where the reference and ATen are finite; a
  non-finite element of ours must be ATen's, or the reference's rounded to our dtype, of the same kind;
- residual_out is ATen's h bit for bit.

Arguments are laid out contiguous, transposed, strided, row-padded (NaN padding), offset by one element
(unaligned) or broadcast (stride-0 expands), each independently. The values are rows of a drawn mean and spread,
standardized so that no row is ill-conditioned by chance (for the residual ops, h's rows), with options for
constant rows, a NaN / inf element, and weights for memory_efficient's corner cases.

CI runs ``EXAMPLES`` cases (derandomized: the same ones for the same code; 400 take about 10 s of CPU);
``LAYERNORM_EXT_FUZZ_EXAMPLES=3000`` runs more. A failure prints the Case and a ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import layernorm_ext as L
from conftest import SWEEP_ISAS
from layernorm_ext.selfcheck import compare

pytest.importorskip("hypothesis", reason="the [test] extra installs it")  # a bare GPU box (gpu_check.sh) may lack it
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")

EXAMPLES = int(os.environ.get("LAYERNORM_EXT_FUZZ_EXAMPLES", "400"))
MAX_ELEMENTS = 300_000  # per tensor: keeps one case at a few milliseconds
MAX_COLS = 70_000

# 80-bit (x86) or 128-bit long double: the reference of float64 results (float64 there is ATen itself)
EXTENDED_OK = np.finfo(np.longdouble).eps < np.finfo(np.float64).eps

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _row_lengths() -> list[int]:
    """0, 1, primes, and powers of two and their neighbours, up to MAX_COLS (short ones first: they shrink)."""
    primes = [2, 3, 5, 7, 13, 31, 61, 127, 251, 509, 769, 1021, 2039, 4093, 8191, 16381, 32749, 65521, 69997]
    powers = [n for k in range(1, 17) for n in (2**k - 1, 2**k, 2**k + 1)]
    return sorted({0, 1, 5125, *primes, *powers} - {n for n in powers if n > MAX_COLS})


ROW_LENGTHS = _row_lengths()
LEAD_SIZES = (1, 2, 3, 0, 4, 5, 7, 8, 16, 17, 31, 33, 64, 65, 128, 257)
INNER_SIZES = (1, 2, 3, 4, 5, 7, 8, 16, 17, 31)  # the dims of a multi-dim normalized_shape

INPUT_LAYOUTS = ("contig", "transposed", "strided", "padded", "offset", "bcast_rows", "bcast_all")
PARAM_LAYOUTS = ("contig", "strided", "offset", "bcast_all")
BROADCAST = ("bcast_rows", "bcast_all")

# (mean, std) of the rows: centred, offset (LayerNorm's cancellation), tiny and large spreads
ROW_STATS = ((0.0, 1.0), (0.3, 1.0), (4.0, 0.5), (-20.0, 0.01), (1.0, 1e-3), (0.0, 30.0), (1000.0, 1.0), (1e4, 1e-2))
ROW_KINDS = ("normal", "normal", "constant_rows", "special")
# For memory_efficient (xhat recovered from the output): zeros and a bias far above its weight (the input must be
# saved), tiny entries (1e-3; 2e-6, a float16 subnormal), a bias just under the 4 |weight| up to which the output
# is saved (bias_near_limit)
WEIGHT_KINDS = ("normal", "signed", "small", "zeros", "big_bias", "bias_near_limit")


@dataclass(frozen=True)
class Case:
    fn: str  # layer_norm | rms_norm | add_layer_norm | add_rms_norm
    api: str  # functional | module
    lead: tuple[int, ...]
    norm: tuple[int, ...]
    dtype: torch.dtype  # input
    rdtype: torch.dtype | None  # residual
    wdtype: torch.dtype | None  # weight (None: no weight)
    bdtype: torch.dtype | None  # bias (None: no bias)
    x_layout: str
    r_layout: str
    w_layout: str
    b_layout: str
    g_layout: str  # of the output gradients
    eps: float | None
    memory_efficient: bool
    residual_in_fp32: bool
    requires_grad: tuple[bool, bool, bool, bool]  # input, residual, weight, bias
    grad_residual_out: bool  # a gradient also flows into residual_out
    mean: float
    std: float
    rows_kind: str
    weights_kind: str
    isa: str
    seed: int

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
        assert self.rdtype is not None
        h = torch.promote_types(self.dtype, self.rdtype)
        return torch.promote_types(h, torch.float32) if self.residual_in_fp32 else h

    @property
    def eps_value(self) -> float:
        """eps=None (RMSNorm) as ATen reads it: the machine epsilon of h's compute dtype."""
        if self.eps is not None:
            return self.eps
        return torch.finfo(torch.float64 if self.h_dtype == torch.float64 else torch.float32).eps


# ---- the strategy ------------------------------------------------------------------------------------------


@st.composite
def _shapes(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(leading dims, normalized_shape) with at most MAX_ELEMENTS elements: long rows get few rows."""
    if draw(st.integers(0, 3)) == 0:  # a normalized_shape of 2 or 3 dims
        norm = tuple(draw(st.lists(st.sampled_from(INNER_SIZES), min_size=2, max_size=3)))
    else:
        norm = (draw(st.sampled_from(ROW_LENGTHS)),)
    budget = MAX_ELEMENTS // max(1, math.prod(norm))
    lead: list[int] = []
    for _ in range(draw(st.integers(0, 3))):
        size = draw(st.sampled_from([n for n in LEAD_SIZES if n <= budget]))
        lead.append(size)
        budget //= max(1, size)
    return tuple(lead), norm


def _dtype_near(draw: st.DrawFn, of: torch.dtype) -> torch.dtype:
    """A parameter dtype: mostly the input's or float32 (the pairs in use), sometimes any."""
    return draw(st.sampled_from((of, of, torch.float32, *FLOATS)))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    fn = draw(st.sampled_from(("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")))
    rms, residual = "rms" in fn, fn.startswith("add_")
    lead, norm = draw(_shapes())
    dtype = draw(st.sampled_from(FLOATS))
    rdtype = draw(st.sampled_from((dtype, *FLOATS))) if residual else None
    wdtype = _dtype_near(draw, dtype) if draw(st.integers(0, 3)) else None
    bdtype = None
    if not rms and draw(st.integers(0, 3)):
        bdtype = wdtype if wdtype is not None and draw(st.integers(0, 3)) else _dtype_near(draw, dtype)
    api = draw(st.sampled_from(("functional", "functional", "module")))
    x_layout = draw(st.sampled_from(INPUT_LAYOUTS))
    r_layout = draw(st.sampled_from(INPUT_LAYOUTS)) if residual else "contig"
    if r_layout in BROADCAST and x_layout in BROADCAST:  # h's rows are made as one broadcast leaf + a full one
        r_layout = "contig"
    w_layout, b_layout = draw(st.sampled_from(PARAM_LAYOUTS)), draw(st.sampled_from(PARAM_LAYOUTS))
    if api == "module" and not (bdtype is None or bdtype == wdtype):  # torch's modules: a bias needs a weight
        api = "functional"
    if api == "module":  # a module's parameters are plain contiguous tensors of its one dtype
        w_layout = b_layout = "contig"
    eps_choices: tuple[float | None, ...] = (1e-5, 1e-6, 0.0, 1e-12, 0.1, 1.0)
    eps = draw(st.sampled_from(((None, *eps_choices) if rms else eps_choices)))
    rows_kind = draw(st.sampled_from(ROW_KINDS))
    mean, std = draw(st.sampled_from(ROW_STATS))
    requires_grad = tuple(draw(st.lists(st.booleans(), min_size=4, max_size=4)))
    case = Case(
        fn=fn, api=api, lead=lead, norm=norm, dtype=dtype, rdtype=rdtype, wdtype=wdtype, bdtype=bdtype,
        x_layout=x_layout, r_layout=r_layout, w_layout=w_layout, b_layout=b_layout,
        g_layout=draw(st.sampled_from(INPUT_LAYOUTS[:5])), eps=eps, memory_efficient=draw(st.booleans()),
        residual_in_fp32=residual and api == "functional" and draw(st.booleans()),  # the modules don't take it
        requires_grad=requires_grad, grad_residual_out=residual and draw(st.booleans()), mean=mean, std=std,
        rows_kind=rows_kind, weights_kind=draw(st.sampled_from(WEIGHT_KINDS)), isa=draw(st.sampled_from(SWEEP_ISAS)),
        seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip
    if case.eps_value == 0.0 and case.h_dtype == torch.float64 and not EXTENDED_OK and _degenerate_rows(case):
        # A zero-variance row with eps=0 is 0/0; a float64 reference (ATen itself there) may round to garbage.
        case = replace(case, eps=1e-5)
    return case


def _degenerate_rows(case: Case) -> bool:
    """Whether some row of h may be exactly constant (constant rows, a broadcast row, one element)."""
    broadcast_row = "bcast_all" in (case.x_layout, case.r_layout)
    return case.rows_kind == "constant_rows" or broadcast_row or math.prod(case.norm) == 1


# ---- the tensors -------------------------------------------------------------------------------------------


@dataclass
class Leaf:
    """A tensor as stored (``base``, what requires grad) and how the op sees it (``view(base)``)."""

    base: Tensor
    view: Callable[[Tensor], Tensor]


def _layout_base_shape(shape: tuple[int, ...], layout: str, norm_dims: int) -> tuple[int, ...]:
    """The shape of the values a layout stores (broadcast layouts store fewer)."""
    if layout == "bcast_all":
        return (1,) * len(shape)
    if layout == "bcast_rows":
        return (1,) * (len(shape) - norm_dims) + shape[len(shape) - norm_dims :]
    return shape


def _lay_out(values: Tensor, shape: tuple[int, ...], layout: str, dtype: torch.dtype) -> Leaf:
    """``values`` (float64, of _layout_base_shape) stored as ``dtype`` in ``layout``; the view has ``shape``."""
    v = values.to(dtype)
    if layout in BROADCAST:
        return Leaf(v, lambda b: b.expand(shape))
    if layout == "transposed":  # every dim reversed
        rev = tuple(reversed(range(v.dim())))
        return Leaf(v.permute(rev).contiguous(), lambda b: b.permute(rev))
    if layout == "strided":  # every stride doubled
        base = torch.zeros(*shape, 2, dtype=dtype)
        base[..., 0] = v
        return Leaf(base, lambda b: b[..., 0])
    if layout == "padded":  # rows of a wider matrix, the padding NaN (a kernel reading it would show)
        n = shape[-1] if shape else 1
        base = torch.full((*shape[:-1], n + 3), float("nan"), dtype=dtype)
        base[..., :n] = v
        return Leaf(base, lambda b: b[..., :n])
    if layout == "offset":  # one element into the storage: unaligned for every vector width
        base = torch.zeros(v.numel() + 1, dtype=dtype)
        base[1:] = v.reshape(-1)
        return Leaf(base, lambda b: b[1:].view(shape))
    assert layout == "contig", layout
    return Leaf(v.contiguous(), lambda b: b)


def _rows(gen: torch.Generator, case: Case, shape: tuple[int, ...]) -> Tensor:
    """float64 rows of ``shape`` with the case's mean and spread: standardized noise, each row's mean and std
    jittered around the case's, so that no row is nearly constant by chance."""
    n = math.prod(shape[len(shape) - len(case.norm) :])
    rows = math.prod(shape) // n if n else 0
    z = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    if n == 1:  # one element: magnitude std, away from 0
        z = torch.where(z < 0, -1.0, 1.0)
    elif rows and n:
        z = (z - z.mean(dim=1, keepdim=True)) / z.std(dim=1, correction=0, keepdim=True)
    jitter = torch.randn(rows, 2, generator=gen, dtype=torch.float64)
    mean = (case.mean if n > 1 else 0.0) * (1 + 0.2 * jitter[:, :1])
    std = case.std * torch.exp(0.5 * jitter[:, 1:].clamp(-2, 2))
    if case.rows_kind == "constant_rows":
        std[::3] = 0.0
    out = mean + std * z
    if case.rows_kind == "special" and out.numel():
        pick = int(torch.randint(out.numel(), (1,), generator=gen))
        out.view(-1)[pick] = (float("nan"), float("inf"), float("-inf"))[pick % 3]
    return out.reshape(shape)


def _params(gen: torch.Generator, case: Case) -> tuple[Tensor, Tensor]:
    w = 1.0 + 0.5 * torch.randn(case.norm, generator=gen, dtype=torch.float64)
    b = 0.5 * torch.randn(case.norm, generator=gen, dtype=torch.float64)
    flat_w = w.view(-1)
    if case.weights_kind == "signed":  # both signs, away from 0
        w = torch.where(w < 1.0, -1.0, 1.0) * (0.5 + (w - 1.0).abs()).clamp(max=2.5)
    elif case.weights_kind == "small":  # some 1e-3, some +-2e-6 (a float16 subnormal, not rounded to 0)
        flat_w[::5] *= 1e-3
        flat_w[3::7] = torch.where(flat_w[3::7] < 0, -2e-6, 2e-6)
    elif case.weights_kind == "zeros":
        flat_w[::3] = 0.0
    elif case.weights_kind == "big_bias":
        b = b * 100.0
    elif case.weights_kind == "bias_near_limit":
        b = torch.where(b < 0, -3.9, 3.9) * w.abs()
    return w, b


@dataclass
class Tensors:
    leaves: dict[str, Leaf]  # input, residual, weight, bias: those the case has
    grad_out: Tensor
    grad_residual_out: Tensor | None


def _make(case: Case) -> Tensors:
    gen = torch.Generator().manual_seed(case.seed)
    shape, nd = case.shape, len(case.norm)
    leaves: dict[str, Leaf] = {}
    if case.residual:
        assert case.rdtype is not None
        # h's rows (from _rows) = a free part (the broadcast leaf, if either is one) + the rest; free is 0 where
        # rows are meant to be exactly constant.
        x_free = case.r_layout not in BROADCAST
        free_name, rest_name = ("input", "residual") if x_free else ("residual", "input")
        layout = {"input": (case.x_layout, case.dtype), "residual": (case.r_layout, case.rdtype)}
        free_layout, free_dtype = layout[free_name]
        scale = 0.0 if case.rows_kind == "constant_rows" else 0.5 * case.std
        free_shape = _layout_base_shape(shape, free_layout, nd)
        free = (scale * torch.randn(free_shape, generator=gen, dtype=torch.float64)).to(free_dtype).double()
        rest = _rows(gen, case, shape) - free.expand(shape)
        leaves[free_name] = _lay_out(free, shape, free_layout, free_dtype)
        leaves[rest_name] = _lay_out(rest, shape, *layout[rest_name])
    else:
        x = _rows(gen, case, _layout_base_shape(shape, case.x_layout, nd))
        leaves["input"] = _lay_out(x, shape, case.x_layout, case.dtype)
    w, b = _params(gen, case)
    for name, dtype, layout, values in (
        ("weight", case.wdtype, case.w_layout, w), ("bias", case.bdtype, case.b_layout, b)
    ):  # fmt: skip
        if dtype is not None:
            stored = values[tuple(slice(0, size) for size in _layout_base_shape(case.norm, layout, nd))]
            leaves[name] = _lay_out(stored, case.norm, layout, dtype)

    def grad(dtype: torch.dtype) -> Tensor:
        leaf = _lay_out(torch.randn(shape, generator=gen, dtype=torch.float64), shape, case.g_layout, dtype)
        return leaf.view(leaf.base)

    return Tensors(leaves, grad(case.dtype), grad(case.h_dtype) if case.grad_residual_out else None)


# ---- the three runs ----------------------------------------------------------------------------------------

_LEAF_NAMES = ("input", "residual", "weight", "bias")


class _Rounded(torch.autograd.Function):
    """The value of ``rounded``, the gradient of ``exact``: the reference's h is ATen's (rounded) h, while its
    gradient reaches the leaves as through ``input + residual``."""

    @staticmethod
    def forward(ctx: object, exact: Tensor, rounded: Tensor) -> Tensor:
        return rounded.clone()

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


@dataclass
class Run:
    out: Tensor | None = None
    residual_out: Tensor | None = None
    grads: dict[str, Tensor] | None = None  # by leaf name, of the leaves requiring grad
    forward_error: Exception | None = None
    backward_error: Exception | None = None


def _arguments(case: Case, tensors: Tensors, dtype: torch.dtype | None = None) -> dict[str, Tensor | None]:
    """The op's tensor arguments, by name: views of fresh leaves (copies of the stored tensors, cast to ``dtype``
    if given) that require grad as the case says. Gradients are taken of these (not of the leaves behind them:
    summing a broadcast view's gradient is autograd's, not ours to test)."""
    wanted = dict(zip(_LEAF_NAMES, case.requires_grad))
    args: dict[str, Tensor | None] = dict.fromkeys(_LEAF_NAMES)
    for name, leaf in tensors.leaves.items():
        base = leaf.base.detach().to(dtype or leaf.base.dtype, copy=True).requires_grad_(wanted[name])
        args[name] = leaf.view(base)
    return args


def _ours(case: Case, args: dict[str, Tensor | None]) -> tuple[Tensor, Tensor | None]:
    if case.api == "module":
        return _ours_module(case, args)
    x, r, w, b = (args[name] for name in _LEAF_NAMES)
    assert x is not None
    if case.fn == "layer_norm":
        return L.layer_norm(x, case.norm, w, b, case.eps, memory_efficient=case.memory_efficient), None
    if case.fn == "rms_norm":
        return L.rms_norm(x, case.norm, w, case.eps, memory_efficient=case.memory_efficient), None
    add = L.add_rms_norm if case.rms else L.add_layer_norm
    params = (w,) if case.rms else (w, b)
    return add(x, r, case.norm, *params, case.eps, case.residual_in_fp32, memory_efficient=case.memory_efficient)


def _ours_module(case: Case, args: dict[str, Tensor | None]) -> tuple[Tensor, Tensor | None]:
    """FusedLayerNorm / FusedRMSNorm holding the case's parameters (which replace them in ``args``)."""
    affine = case.wdtype is not None
    module: torch.nn.Module
    if case.rms:
        module = L.FusedRMSNorm(case.norm, case.eps, affine, memory_efficient=case.memory_efficient)
    else:
        assert case.eps is not None
        module = L.FusedLayerNorm(case.norm, case.eps, affine, case.bdtype is not None,
                                  memory_efficient=case.memory_efficient)  # fmt: skip
    for name in ("weight", "bias"):
        t = args[name]
        if t is not None:
            args[name] = torch.nn.Parameter(t.detach(), requires_grad=t.requires_grad)
            setattr(module, name, args[name])
    x, r = args["input"], args["residual"]
    result = module(x) if r is None else module(x, r)
    return result if isinstance(result, tuple) else (result, None)


def _aten_norm(case: Case, h: Tensor, w: Tensor | None, b: Tensor | None, eps: float | None) -> Tensor:
    if case.rms:
        return F.rms_norm(h, case.norm, w, eps)
    if w is None and b is not None and b.dtype != h.dtype:
        # ATen's CPU layer_norm takes a float32 bias alone with a half input, but its backward then raises
        # ("expected scalar type Half but found Float"); the same function with a weight of ones does not.
        w = torch.ones(case.norm, dtype=b.dtype)
    return F.layer_norm(h, case.norm, w, b, eps if eps is not None else 1e-5)


def _aten(case: Case, args: dict[str, Tensor | None]) -> tuple[Tensor, Tensor | None]:
    x, r, w, b = (args[name] for name in _LEAF_NAMES)
    assert x is not None
    if not case.residual:
        return _aten_norm(case, x, w, b, case.eps), None
    assert r is not None
    # Which parameters the op takes: ATen's answer for its norm of a tensor of the input's dtype (the output's).
    with torch.no_grad():
        _aten_norm(case, torch.zeros(x.shape, dtype=x.dtype), w, b, case.eps)
    h = x.to(case.h_dtype) + r.to(case.h_dtype)
    try:
        out = _aten_norm(case, h, w, b, case.eps)
    except RuntimeError:  # h is wider than the input (e.g. residual_in_fp32): ATen's norm of h wants h's dtype
        cast = [t.to(h.dtype) if t is not None else None for t in (w, b)]
        out = _aten_norm(case, h, cast[0], cast[1], case.eps)
    return out.to(case.dtype), h


def _reference(case: Case, tensors: Tensors, h_aten: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
    """The output and the arguments' gradients: ATen's norm in float64 of exactly ATen's h (eps=None resolved as
    ATen resolves it for h's dtype); for float64 h, where that is ATen again, the same formulas in long double."""
    args = _arguments(case, tensors, torch.float64)
    x, r, w, b = (args[name] for name in _LEAF_NAMES)
    assert x is not None
    h = x
    if case.residual:
        assert r is not None and h_aten is not None
        h = _Rounded.apply(x + r, h_aten.detach().double())
    if not (case.h_dtype == torch.float64 and EXTENDED_OK and h.numel()):
        out = _aten_norm(case, h, w, b, case.eps_value)
        return out, _backward(tensors, (out, h if case.residual else None), args, torch.float64)
    out, dh, dw, db = _extended_norm(case, h, w, b, tensors.grad_out)
    if tensors.grad_residual_out is not None:
        dh = dh + tensors.grad_residual_out.double()
    grads = {"input": dh, "residual": dh, "weight": dw, "bias": db}  # h = input + residual
    return out, {name: grads[name] for name, t in args.items() if t is not None and t.requires_grad}


def _extended_norm(
    case: Case, h: Tensor, w: Tensor | None, b: Tensor | None, grad_out: Tensor
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """out, dh, dweight, dbias of the norm of ``h`` (float64 values) in long double, as float64."""
    n = math.prod(case.norm)

    def rows(t: Tensor) -> np.ndarray:
        return t.detach().double().reshape(-1, n).numpy().astype(np.longdouble)

    def back(a: np.ndarray, shape: tuple[int, ...]) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a.astype(np.float64))).reshape(shape)

    with np.errstate(all="ignore"):  # NaN / inf rows give NaN / inf, as in ATen
        hh, g = rows(h), rows(grad_out)
        scale = rows(w)[0] if w is not None else np.ones(n, dtype=np.longdouble)
        centred = hh if case.rms else hh - hh.mean(axis=1, keepdims=True)
        rstd = 1 / np.sqrt((centred * centred).mean(axis=1, keepdims=True) + np.longdouble(case.eps_value))
        xhat = centred * rstd
        out = xhat * scale + (rows(b)[0] if b is not None else 0)
        gx = g * scale
        dh = gx - xhat * (gx * xhat).mean(axis=1, keepdims=True)
        if not case.rms:
            dh = dh - gx.mean(axis=1, keepdims=True)
        dh = dh * rstd
        dw = back((g * xhat).sum(axis=0), case.norm) if w is not None else None
        db = back(g.sum(axis=0), case.norm) if b is not None else None
    return back(out, case.shape), back(dh, case.shape), dw, db


def _backward(
    tensors: Tensors, outs: Sequence[Tensor | None], args: dict[str, Tensor | None], dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    wanted = {name: t for name, t in args.items() if t is not None and t.requires_grad}
    grads_out = (tensors.grad_out, tensors.grad_residual_out)
    pairs = [(o, g if dtype is None else g.to(dtype)) for o, g in zip(outs, grads_out)
             if o is not None and g is not None and o.requires_grad]  # fmt: skip
    if not wanted or not pairs:
        return {}
    got = torch.autograd.grad([o for o, _ in pairs], list(wanted.values()), [g for _, g in pairs], allow_unused=True)
    return {name: g if g is not None else torch.zeros_like(t) for (name, t), g in zip(wanted.items(), got)}


def _run(case: Case, tensors: Tensors, forward: Callable[..., tuple[Tensor, Tensor | None]]) -> Run:
    run = Run()
    args = _arguments(case, tensors)
    try:
        run.out, run.residual_out = forward(case, args)
    except Exception as error:  # noqa: BLE001  (compared with the other side's)
        run.forward_error = error
        return run
    try:
        run.grads = _backward(tensors, (run.out, run.residual_out), args)
    except Exception as error:  # noqa: BLE001
        run.backward_error = error
    return run


@contextmanager
def _cpu_isa(isa: str) -> Iterator[None]:
    previous = L.native.set_cpu_isa(isa)
    try:
        yield
    finally:
        L.native.set_cpu_isa(previous)


# ---- the checks --------------------------------------------------------------------------------------------

_KINDS = (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf))


def _assert_close(what: str, ours: Tensor, aten: Tensor, ref: Tensor) -> None:
    assert ours.dtype == aten.dtype, f"{what}: dtype {ours.dtype}, ATen's {aten.dtype}"
    assert ours.shape == aten.shape == ref.shape, f"{what}: shape {ours.shape}, ATen's {aten.shape}"
    o, a, r = (t.detach().double() for t in (ours, aten, ref.to(ours.dtype)))  # r: what ours can be at best
    for kind, test in _KINDS:
        extra = test(o) & ~test(a) & ~test(r)
        assert not extra.any(), f"{what}: {int(extra.sum())} {kind} where ATen and the reference have none"
        missing = test(a) & test(r) & ~test(o)
        assert not missing.any(), f"{what}: {int(missing.sum())} elements not {kind} where ATen and the reference are"
    finite = torch.isfinite(a) & torch.isfinite(ref) & torch.isfinite(o)
    c = compare(ours.detach()[finite], aten.detach()[finite], ref.detach()[finite], what)
    assert c.ok, f"{what}: our max error {c.err_ours:.3e} > ATen's {c.err_aten:.3e} + {c.atol:.3e}"


def _assert_same_raising(stage: str, ours: Exception | None, aten: Exception | None) -> None:
    if (ours is None) != (aten is None):
        raise AssertionError(f"{stage}: ours raised {ours!r}, ATen raised {aten!r}")
    if ours is not None:
        assert isinstance(ours, RuntimeError), f"{stage}: ours raised {ours!r} (ATen: {aten!r})"


@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    print_blob=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=cases())
def test_matches_aten(case: Case) -> None:
    tensors = _make(case)
    with _cpu_isa(case.isa):
        ours = _run(case, tensors, _ours)
    aten = _run(case, tensors, _aten)
    _assert_same_raising("forward", ours.forward_error, aten.forward_error)
    if aten.forward_error is not None:
        return
    assert ours.out is not None and aten.out is not None
    assert ours.out.requires_grad == aten.out.requires_grad, "out.requires_grad"
    _assert_same_raising("backward", ours.backward_error, aten.backward_error)

    ref_out, ref_grads = _reference(case, tensors, aten.residual_out)
    _assert_close("out", ours.out, aten.out, ref_out)
    if case.residual:
        assert ours.residual_out is not None and aten.residual_out is not None
        # exactly torch's x + r in h's dtype
        torch.testing.assert_close(ours.residual_out, aten.residual_out, rtol=0, atol=0, equal_nan=True)
    if aten.backward_error is not None:
        return
    assert ours.grads is not None and aten.grads is not None
    assert ours.grads.keys() == aten.grads.keys() == ref_grads.keys()
    for name, grad in ours.grads.items():
        _assert_close(f"grad of {name}", grad, aten.grads[name], ref_grads[name])
