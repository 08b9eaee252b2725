"""NaN, +Inf, -Inf and extreme rows: the same answer as ATen on every path.

Rule (``_assert_like_aten``), for the output, residual_out and every gradient: the elements that are not
finite are ATen's, element for element; where the inputs hold no infinity, the NaN pattern is ATen's element
for element; two infinities at one element have the same sign; the elements finite in ours, ATen's and the
reference meet the suite's accuracy rule. One exception: where ATen's result is not finite only because ATen
overflowed (the float32 sum of squares of values near 1e20, the float32 mean of the dtype's largest values)
while the reference is finite, ours is not finite either, or finite within OVERFLOW_ULPS ulps of the
reference (rstd of such rows is near or below float32's smallest normal number, where it keeps fewer bits).

Where an infinity is among the inputs, a NaN may face an infinity: which of the two IEEE arithmetic gives
(inf - inf is NaN, inf + inf is not) depends on the order of operations, and ATen itself has no single
answer: for layer_norm of a 3x7 float32 input with +inf in one grad_out element, ATen's eager backward gives
a row of seven NaN in grad_input, ATen's own decomposition of native_layer_norm_backward (what torch.compile
runs) gives five NaN and two +inf.

Cases: a non-finite value (NaN, +Inf, -Inf) at the first, a middle and the last element of a row and at the
first element of a vector tail (one row each, beside a clean row), in the input, the residual, grad_out or
grad_residual_out; or at those columns of the weight or the bias. Float32 across every path, the other
dtypes on one row length. Every op (both norms, the residual variants,
memory_efficient), row lengths that take every CPU path (tiny rows in double, vector rows with tails, rows
split across threads) on every CPU instruction set, and the CUDA kernels' paths (sub-warp, warp, block, long
rows staged or read twice) through the host emulation. Then extreme finite rows: sums of squares that
overflow float32, the dtype's largest values, denormal-only rows, all-zero rows with eps = 0, a huge mean
with a tiny spread, rows of 1-3 elements with and without weight.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from torch import Tensor

from conftest import assert_no_worse_than_aten, ulp_atol
from test_functional import (
    _EXTENDED_OK,
    Inputs,
    Spec,
    _aten,
    _dt_id,
    _grads,
    _make_inputs,
    _ours,
    _reference,
    _reference_extended,
    _spec,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # numpy's reference: inf - inf, 0 * inf
]

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
VALUES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
ROW_PLACES = ("input", "residual", "grad_out", "grad_residual_out")
OVERFLOW_ULPS = 8
SPLIT_COLS = 1 << 16  # csrc/cpu/norm_kernel.cpp: rows of >= 2^16 columns, fewer than 4 of them, split

Impl = Callable[[Spec, Inputs], tuple[Tensor, Tensor | None]]


def _places(fn: str) -> tuple[str, ...]:
    places = ["input", "weight", "grad_out"]
    if "layer" in fn:
        places.append("bias")
    if fn.startswith("add_"):
        places += ["residual", "grad_residual_out"]
    return tuple(places)


def _positions(n: int, lanes: int = 16) -> list[int]:
    """First, middle and last column, and the first column of the vector tail (when there is one)."""
    tail = n - n % lanes if n % lanes and n > lanes else 0
    return sorted({0, n // 2, n - 1, tail})


def _variants() -> list[tuple[str, bool]]:
    """(fn, memory_efficient)"""
    return [("layer_norm", False), ("rms_norm", False), ("add_layer_norm", False), ("add_rms_norm", False),
            ("layer_norm", True), ("rms_norm", True)]  # fmt: skip


def _poison(spec: Spec, inp: Inputs, place: str, value: float) -> None:
    """Puts ``value`` into ``place``: the rows after the first (which stays clean) get it at the positions in
    turn, one per row where there are enough rows; a weight or bias gets it at every position."""
    n = math.prod(spec.norm)
    positions = _positions(n)
    target = {"input": inp.x, "residual": inp.r, "weight": inp.w, "bias": inp.b, "grad_out": inp.g,
              "grad_residual_out": inp.gr}[place]  # fmt: skip
    assert target is not None, place
    with torch.no_grad():
        flat = target.view(-1, n)
        if place in ROW_PLACES:
            poisoned_rows = flat.shape[0] - 1
            for k, j in enumerate(positions):
                flat[1 + k % poisoned_rows, j] = value
        else:
            flat[0, positions] = value


def _fail_where(what: str, wrong: Tensor, o: Tensor, a: Tensor, message: str) -> None:
    if wrong.any():
        at = wrong.nonzero()[:4].tolist()
        vals = [(o[tuple(i)].item(), a[tuple(i)].item()) for i in at]
        raise AssertionError(f"{what}: {message} at {int(wrong.sum())} elements, e.g. at {at}: (ours, ATen) = {vals}")


def _assert_like_aten(ours: Tensor, aten: Tensor, reference: Tensor, what: str, infinite_inputs: bool) -> None:
    """The rule of this file (module docstring)."""
    assert ours.shape == aten.shape == reference.shape, (what, ours.shape, aten.shape, reference.shape)
    assert ours.dtype == aten.dtype, (what, ours.dtype, aten.dtype)
    o, a = ours.detach().cpu().double(), aten.detach().cpu().double()
    ref = reference.detach().cpu().double()
    # Where ATen's result is not finite only because ATen overflowed (the reference is finite), ours is not
    # finite either, or finite within OVERFLOW_ULPS of the reference.
    aten_overflowed = ~a.isfinite() & ref.isfinite()
    beyond_aten = aten_overflowed & o.isfinite()
    if beyond_aten.any():
        atol = OVERFLOW_ULPS * ulp_atol(ours.dtype, ref[beyond_aten])
        err = float((o[beyond_aten] - ref[beyond_aten]).abs().max())
        assert err <= atol, f"{what}: where ATen overflowed, our max error {err:.3e} > {atol:.3e}"
    rest = ~aten_overflowed
    _fail_where(what, rest & (o.isfinite() != a.isfinite()), o, a, "finite / non-finite pattern differs from ATen's")
    if not infinite_inputs:
        _fail_where(what, rest & (o.isnan() != a.isnan()), o, a, "NaN pattern differs from ATen's")
    _fail_where(what, o.isinf() & a.isinf() & (o != a), o, a, "infinities of opposite sign")
    finite = o.isfinite() & a.isfinite() & ref.isfinite()
    if finite.any():
        assert_no_worse_than_aten(ours.detach().cpu()[finite], aten.detach().cpu()[finite], ref[finite], what)


def run_mutated(spec: Spec, mutate: Callable[[Inputs], None], ours: Impl = _ours, extended: bool = False) -> None:
    """``spec``'s inputs changed by ``mutate``, then ours and ATen forward and backward, with this file's rule."""
    inp = _make_inputs(spec, "cpu")
    mutate(inp)
    infinite_inputs = any(bool(t.isinf().any()) for t in (inp.x, inp.r, inp.w, inp.b, inp.g, inp.gr) if t is not None)

    def assert_like_aten(ours: Tensor, aten: Tensor, reference: Tensor, what: str) -> None:
        _assert_like_aten(ours, aten, reference, what, infinite_inputs)

    out, res_out = ours(spec, inp)
    grads = _grads(spec, inp, out, res_out)
    a_out, a_h = _aten(spec, inp)
    a_grads = _grads(spec, inp, a_out, a_h)
    # ``extended``: the extended-precision reference where the platform has one. ATen's float64 layer_norm, as
    # a*x + b with a = rstd, b = -mean * rstd, cancels catastrophically for rows of huge values (1e20: xhat
    # off by 1e5).
    h = a_h if a_h is not None else inp.x
    ref = _reference_extended(spec, inp, h) if extended and _EXTENDED_OK else _reference(spec, inp, h)
    assert_like_aten(out, a_out, ref["out"], "out")
    ref_gh = ref["h"]
    if spec.residual:
        assert res_out is not None and a_h is not None and inp.gr is not None
        assert_like_aten(res_out, a_h, a_h.detach().double(), "residual_out")
        ref_gh = ref_gh + inp.gr.double()
    for name, g in grads.items():
        want = ref_gh if name in ("input", "residual") else ref[name]
        assert_like_aten(g, a_grads[name], want, f"grad_{name}")


def _row_spec(variant: tuple[str, bool], n: int, dtype: torch.dtype, wdtype: torch.dtype) -> Spec:
    fn, mem_eff = variant
    # A clean row and one row per position; 3 rows for the CPU's split rows (fewer than 4 rows).
    rows = 3 if n >= SPLIT_COLS else len(_positions(n)) + 1
    return _spec(fn, (rows,), (n,), dtype=dtype, wdtype=wdtype, mem_eff=mem_eff)


def _variant_id(variant: tuple[str, bool]) -> str:
    return variant[0] + ("-memeff" if variant[1] else "")


def run_nonfinite(spec: Spec, places: tuple[str, ...], ours: Impl = _ours) -> None:
    """NaN, +Inf and -Inf in turn in each of ``places`` (one at a time), with this file's rule."""
    for place in places:
        for name, value in VALUES.items():
            try:
                run_mutated(spec, lambda inp: _poison(spec, inp, place, value), ours)
            except AssertionError as e:
                raise AssertionError(f"{name} in {place}: {e}") from None


def _memeff_places(variant: tuple[str, bool]) -> tuple[str, ...]:
    """memory_efficient changes what is saved, so the places that reach the saved tensor: input and params."""
    places = _places(variant[0])
    return tuple(p for p in places if p in ("input", "weight", "bias")) if variant[1] else places


# CPU paths: rows of a few vectors (statistics in double), vector rows with a tail, rows of more than one
# vector block; and a row split across threads (fewer than 4 rows of >= 2^16 columns).
CPU_NS = (1, 3, 37, 769)


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize("n", CPU_NS)
@pytest.mark.parametrize("variant", _variants(), ids=_variant_id)
def test_nonfinite_cpu(variant: tuple[str, bool], n: int) -> None:
    run_nonfinite(_row_spec(variant, n, F32, F32), _memeff_places(variant))


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize("variant", _variants()[:2], ids=_variant_id)
def test_nonfinite_cpu_split_rows(variant: tuple[str, bool]) -> None:
    run_nonfinite(_row_spec(variant, SPLIT_COLS + 37, F32, F32), ("input", "weight", "grad_out"))


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize("dtypes", [(BF16, F32), (F16, F16), (BF16, BF16), (F64, F64)], ids=_dt_id)
@pytest.mark.parametrize("variant", _variants(), ids=_variant_id)
def test_nonfinite_cpu_dtypes(variant: tuple[str, bool], dtypes: tuple[torch.dtype, torch.dtype]) -> None:
    places = tuple(p for p in _places(variant[0]) if p in ("input", "residual", "weight"))
    run_nonfinite(_row_spec(variant, 37, *dtypes), places)


# ---- the CUDA kernels, through the host emulation ------------------------------------------------------------


@functools.cache
def _emulated_impl() -> Impl:
    from test_cuda_emulation import build_emulation, emulated_impl

    return emulated_impl(build_emulation())


# The CUDA paths for float32 (test_cuda_emulation.PATH_NS): sub-warp (1, 7, 64), warp (256), block (769,
# 4096); long rows staged in shared memory (20000) and read twice (40000), which (each emulated CUDA thread a
# fiber) take both norms and the places that reach their statistics and sums.
EMULATED_NS = (1, 7, 64, 256, 769, 4096)


@pytest.mark.parametrize("n", EMULATED_NS)
@pytest.mark.parametrize("variant", _variants(), ids=_variant_id)
def test_nonfinite_emulated_cuda(variant: tuple[str, bool], n: int) -> None:
    run_nonfinite(_row_spec(variant, n, F32, F32), _memeff_places(variant), _emulated_impl())


@pytest.mark.parametrize("n", (20000, 40000))
@pytest.mark.parametrize("variant", _variants()[:2], ids=_variant_id)
def test_nonfinite_emulated_cuda_long_rows(variant: tuple[str, bool], n: int) -> None:
    run_nonfinite(_row_spec(variant, n, F32, F32), ("input", "weight", "grad_out"), _emulated_impl())


@pytest.mark.parametrize("dtypes", [(BF16, F32), (F64, F64)], ids=_dt_id)
@pytest.mark.parametrize("variant", _variants()[:4], ids=_variant_id)
def test_nonfinite_emulated_cuda_dtypes(variant: tuple[str, bool], dtypes: tuple[torch.dtype, torch.dtype]) -> None:
    places = tuple(p for p in _places(variant[0]) if p in ("input", "residual", "weight"))
    run_nonfinite(_row_spec(variant, 769, *dtypes), places, _emulated_impl())


# ---- extreme finite rows --------------------------------------------------------------------------------------


def _extreme_rows(kind: str, dtype: torch.dtype, rows: int, n: int, gen: torch.Generator) -> Tensor:
    z = torch.randn((rows, n), generator=gen, dtype=torch.float64)
    if kind == "overflow":  # x * x overflows float32 (bfloat16 rows are computed in float32); f16 / f64: near it
        scale = {F32: 1e20, BF16: 1e20, F16: 2e4, F64: 1e150}[dtype]
        return z.clamp(-3, 3) * scale
    if kind == "max":  # the dtype's largest finite values (half of them halved), both signs
        top = torch.full_like(z, torch.finfo(dtype).max)
        return torch.where(z < 0, -top, top) * torch.where(z.abs() < 0.5, 0.5, 1.0)
    if kind == "max_split":  # the largest values, the row's first quarter negative, the rest positive: a shift
        # taken from the first values (the CUDA kernels' 16-bit LayerNorm rows) is near -max, and h - shift overflowed
        top = torch.full_like(z, torch.finfo(dtype).max)
        return torch.where(torch.arange(n).expand(rows, n) < max(1, n // 4), -top, top)
    if kind == "denormal":  # every element subnormal in the dtype
        tiny = torch.finfo(dtype).smallest_normal
        return z.clamp(-1, 1) * 0.5 * tiny
    if kind == "zero":  # all-zero rows (with eps = 0: ATen's NaN pattern)
        return torch.zeros((rows, n), dtype=torch.float64)
    if kind == "huge_mean":  # a huge mean with a tiny spread
        mean = {F32: 1e6, BF16: 1e4, F16: 1e3, F64: 1e12}[dtype]
        return mean + z * mean * 1e-6 * (100 if dtype in (F16, BF16) else 1)
    raise ValueError(kind)


EXTREME_KINDS = ("overflow", "max", "max_split", "denormal", "zero", "huge_mean")
EXTREME_VARIANTS = (("layer_norm", False), ("rms_norm", False), ("add_rms_norm", False), ("layer_norm", True))
EXTREME_DTYPES = ((F32, F32), (BF16, F32), (F16, F16), (F64, F64))


def _set_rows(spec: Spec, kind: str) -> Callable[[Inputs], None]:
    def mutate(inp: Inputs) -> None:
        n = math.prod(spec.norm)
        gen = torch.Generator().manual_seed(n)
        target = inp.r if spec.residual else inp.x
        assert target is not None
        values = _extreme_rows(kind, spec.dtype, target.numel() // n, n, gen).to(target.dtype)
        with torch.no_grad():
            target.view(-1, n).copy_(values)
            if spec.residual:  # h = x + r: the extreme rows in the residual, an exactly representable 0 in x
                inp.x.zero_()

    return mutate


def run_extremes(variant: tuple[str, bool], n: int, dtypes: tuple[torch.dtype, torch.dtype], ours: Impl) -> None:
    """Every kind of extreme row; rows of 1-3 elements also without weight (and bias)."""
    fn, mem_eff = variant
    for affine in ("none", "w") if n <= 3 else ("w",):
        if "layer" in fn and affine == "w":
            affine = "wb"
        for kind in EXTREME_KINDS:
            if dtypes[0] == F64 and kind in ("max", "max_split", "overflow", "huge_mean"):
                # No wider type to fall back to: squares of float64 values beyond ~1e154 overflow, ours as
                # ATen's. And rows of 1e150 (N = 1 LayerNorm, whose input gradient is exactly 0) or a mean
                # 1e6 times the spread cost ours and ATen the same digits, but not to the rule's 8 ulps.
                continue
            spec = _spec(fn, (3,), (n,), dtype=dtypes[0], wdtype=dtypes[1], mem_eff=mem_eff, affine=affine)
            if kind == "zero":
                spec = replace(spec, eps=0.0)
            try:
                run_mutated(spec, _set_rows(spec, kind), ours, extended=True)
            except AssertionError as e:
                raise AssertionError(f"{kind} rows, {affine}: {e}") from None


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize("dtypes", EXTREME_DTYPES, ids=_dt_id)
@pytest.mark.parametrize("n", (1, 2, 3, 37, 769))
@pytest.mark.parametrize("variant", EXTREME_VARIANTS, ids=_variant_id)
def test_extreme_rows_cpu(variant: tuple[str, bool], n: int, dtypes: tuple[torch.dtype, torch.dtype]) -> None:
    run_extremes(variant, n, dtypes, _ours)


@pytest.mark.parametrize("dtypes", EXTREME_DTYPES[:2], ids=_dt_id)
@pytest.mark.parametrize("n", (1, 64, 769, 20000))  # 20000: the long path (its statistics as 40000's)
@pytest.mark.parametrize("variant", EXTREME_VARIANTS, ids=_variant_id)
def test_extreme_rows_emulated_cuda(variant: tuple[str, bool], n: int, dtypes: tuple[torch.dtype, torch.dtype]) -> None:
    run_extremes(variant, n, dtypes, _emulated_impl())


def test_rms_norm_nan_poisons_its_row() -> None:
    """The defect of issue 11: rms_norm of a row holding one NaN returned that NaN and 63 finite numbers."""
    import layernorm_ext as L

    x = torch.randn(6, 64)
    x[1, 3] = math.nan
    y = L.rms_norm(x, (64,))
    assert y[1].isnan().all()
    assert y[[0, 2, 3, 4, 5]].isfinite().all()
