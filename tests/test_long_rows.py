"""float64 statistics of long rows: no worse than ATen's, in ulps of the exact value.

The mean and rstd that the forward saves, against the exact ones (decimal arithmetic of 90 digits on the float64
inputs); ATen's (native_layer_norm; RMSNorm's composite rsqrt(mean(x^2) + eps)) against the same. Long sums lose
digits in proportion to the additions each term meets: a running total meets n / lanes of them, a pairwise one
log(n). A constant row shows it plainest: every addition of a running total rounds the same way (a row of 32767
copies of 0.1 had its rstd 12 ulps off, ATen's 0.8).

LayerNorm's float64 mean of rows whose mean is small against their spread (x = 3 * randn + 1): the shift (the
first vector's mean) plus the mean deviation from it keeps an ulp of |mean - shift| (2.5 ulps of the mean where
ATen's is 0.45), so such rows are summed again about the mean found.
"""

from __future__ import annotations

import decimal
import functools
import math
from decimal import Decimal
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import Tensor

F64 = torch.float64
_ops = torch.ops.layernorm_ext
EPS = 1e-5
ATOL_ULPS = 1.0  # ours may be one rounding further than ATen's: rstd's last roundings (sqrt, 1 / it)


def _exact_stats(row: Tensor, rms: bool) -> tuple[Decimal | None, Decimal]:
    """(mean, rstd) of a float64 row, exactly up to 90 digits (mean None for RMSNorm)."""
    with decimal.localcontext() as ctx:
        ctx.prec = 90
        xs = [Decimal(v) for v in row.tolist()]
        n = len(xs)
        if rms:
            return None, 1 / (sum(x * x for x in xs) / n + Decimal(EPS)).sqrt()
        mean = sum(xs) / n
        var = sum((x - mean) * (x - mean) for x in xs) / n
        return mean, 1 / (var + Decimal(EPS)).sqrt()


def _ulps(got: float, exact: Decimal) -> float:
    if exact == 0:
        return 0.0 if got == 0 else math.inf
    return float(abs(Decimal(got) - exact) / Decimal(math.ulp(float(abs(exact)))))


def _stats(x: Tensor, rms: bool, ops: Any = _ops) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Ours (the forward ops of ``ops``) and ATen's {'mean', 'rstd'} (RMSNorm: rstd only), one value per row."""
    n = x.shape[-1]
    if rms:
        _, _, rstd = ops.rms_norm_fwd(x, [n], None, EPS, None, False)
        aten_rstd = torch.rsqrt(x.pow(2).mean(-1) + EPS)
        return {"rstd": rstd.flatten()}, {"rstd": aten_rstd.flatten()}
    _, _, mean, rstd = ops.layer_norm_fwd(x, [n], None, None, EPS, None, False)
    _, aten_mean, aten_rstd = torch.native_layer_norm(x, [n], None, None, EPS)
    return ({"mean": mean.flatten(), "rstd": rstd.flatten()},
            {"mean": aten_mean.flatten(), "rstd": aten_rstd.flatten()})  # fmt: skip


@functools.cache
def _exact_rows(kind: str, rows: int, cols: int, rms: bool) -> list[tuple[Decimal | None, Decimal]]:
    """_exact_stats of every row (once per case: every instruction set compares with it)."""
    x = _rows(kind, rows, cols)
    return [_exact_stats(x[i], rms) for i in range(rows)]


def _rows(kind: str, rows: int, cols: int) -> Tensor:
    if kind == "random":
        gen = torch.Generator().manual_seed(cols)
        return torch.randn(rows, cols, generator=gen, dtype=F64) * 3 + 1
    value = {"const-0.1": 0.1, "const-third": 1 / 3}[kind]
    return torch.full((rows, cols), value, dtype=F64)


def _check_within_atens_error(ops: Any, rms: bool, kind: str, rows: int, cols: int) -> None:
    x = _rows(kind, rows, cols)
    ours, aten = _stats(x, rms, ops)
    for i, (exact_mean, exact_rstd) in enumerate(_exact_rows(kind, rows, cols, rms)):
        for name, exact in (("mean", exact_mean), ("rstd", exact_rstd)):
            if exact is None:
                continue
            err_ours, err_aten = _ulps(ours[name][i].item(), exact), _ulps(aten[name][i].item(), exact)
            assert err_ours <= err_aten + ATOL_ULPS + 1e-9, (
                f"row {i}: our {name} is {err_ours:.2f} ulps off, ATen's {err_aten:.2f}"
            )


# CPU: 32767 is one row per thread (the row kernels' sums); 2^17 + 5 with one row is split into column ranges.
# CUDA (emulated): 1000 is the register path's warps and their Chan merge; longer rows the long path's per-thread
# Welford merges (up to 2^17 / (2 x 1024) = 64 packs a thread) and its block all-reduce.
CASES = [
    ("const-0.1", 1, 32767), ("const-third", 1, 32767), ("random", 8, 1000), ("random", 3, 32767),
    ("random", 2, 65535), ("const-0.1", 1, (1 << 17) + 5), ("random", 1, (1 << 17) + 5),
]  # fmt: skip


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize(("kind", "rows", "cols"), CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_float64_statistics_within_atens_error(rms: bool, kind: str, rows: int, cols: int) -> None:
    _check_within_atens_error(_ops, rms, kind, rows, cols)


@pytest.fixture(scope="module")
def emulated_cuda() -> ModuleType:
    from test_cuda_emulation import build_emulation

    return build_emulation()


@pytest.mark.parametrize(("kind", "rows", "cols"), CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_float64_statistics_within_atens_error_cuda_emulated(
    emulated_cuda: ModuleType, rms: bool, kind: str, rows: int, cols: int
) -> None:
    _check_within_atens_error(emulated_cuda, rms, kind, rows, cols)
