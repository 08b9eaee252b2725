"""Bitwise determinism: the same inputs give the same bits on every run and for every thread count.

Parameter gradients (dweight, dbias) are reductions over rows, the usual place for nondeterminism (atomics,
per-thread partial sums); they are checked over many rows and over wide rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import Tensor

from layernorm_ext import add_layer_norm, add_rms_norm, layer_norm, rms_norm

_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}

# Many short rows (many dweight chunks), mid rows, a few very long rows (split into column ranges), and long
# rows in fewer dweight chunks than column ranges (the backward splits their columns: under 16 rows of 2^16,
# or rows over 2^18, one chunk). On CUDA, 70 odd rows of 16385 take the long backward's column slices in 8 row
# groups of 9 rows, the last one of 7 (H100 / H200).
SHAPES = [(3000, 257), (64, 4096), (2, 1 << 17), (12, 1 << 16), (5, (1 << 18) + 3), (70, 16385)]
# (input dtype, parameter dtype)
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]


@contextmanager
def _num_threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _bits(t: Tensor) -> Tensor:
    return t.detach().contiguous().view(_INT_VIEW[t.dtype])


def _inputs(rows: int, cols: int, dtype: torch.dtype, p_dtype: torch.dtype, device: str) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(rows * 7919 + cols)

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0, dt: torch.dtype = dtype) -> Tensor:
        t = torch.randn(shape, generator=gen, dtype=torch.float64) * scale + shift
        return t.to(device=device, dtype=dt)

    return {
        "x": randn(rows, cols, scale=2.0, shift=0.3),
        "r": randn(rows, cols),
        "w": randn(cols, scale=0.5, shift=1.0, dt=p_dtype),
        "b": randn(cols, scale=0.5, dt=p_dtype),
        "g_out": randn(rows, cols),
        "g_res": randn(rows, cols),
    }


def _forward_backward(kind: str, residual: bool, memory_efficient: bool, data: dict[str, Tensor]) -> list[Tensor]:
    """Every output and every gradient of one call, in a fixed order."""
    x = data["x"].clone().requires_grad_(True)
    w = data["w"].clone().requires_grad_(True)
    b = data["b"].clone().requires_grad_(True)
    r = data["r"].clone().requires_grad_(True)
    cols = x.shape[-1]
    leaves = [x, w] + ([b] if kind == "ln" else []) + ([r] if residual else [])
    if residual:
        if kind == "ln":
            out, h = add_layer_norm(x, r, cols, w, b, memory_efficient=memory_efficient)
        else:
            out, h = add_rms_norm(x, r, cols, w, memory_efficient=memory_efficient)
        outputs = [out, h]
        grads = torch.autograd.grad(outputs, leaves, [data["g_out"], data["g_res"].to(h.dtype)])
    else:
        if kind == "ln":
            out = layer_norm(x, cols, w, b, memory_efficient=memory_efficient)
        else:
            out = rms_norm(x, cols, w, memory_efficient=memory_efficient)
        outputs = [out]
        grads = torch.autograd.grad(outputs, leaves, [data["g_out"]])
    return [o.detach() for o in outputs] + list(grads)


def _names(kind: str, residual: bool) -> list[str]:
    outs = ["out", "residual_out"] if residual else ["out"]
    return outs + ["grad_input", "grad_weight"] + (["grad_bias"] if kind == "ln" else []) + (
        ["grad_residual"] if residual else [])


def _assert_same_bits(a: list[Tensor], b: list[Tensor], names: list[str], what: str) -> None:
    assert len(a) == len(b) == len(names)
    for name, x, y in zip(names, a, b):
        assert x.dtype == y.dtype and x.shape == y.shape, (what, name)
        assert torch.equal(_bits(x), _bits(y)), f"{what}: {name} differs bitwise"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{str(d[0])[6:]}-{str(d[1])[6:]}")
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("kind", ["ln", "rms"])
def test_repeat_and_thread_count(
    device: str, kind: str, residual: bool, dtypes: tuple[torch.dtype, torch.dtype], shape: tuple[int, int]
) -> None:
    data = _inputs(*shape, *dtypes, device)
    names = _names(kind, residual)
    first = _forward_backward(kind, residual, False, data)
    again = _forward_backward(kind, residual, False, data)
    _assert_same_bits(first, again, names, "repeat")
    if device != "cpu":
        return
    for threads in (1, 2, 4):
        with _num_threads(threads):
            got = _forward_backward(kind, residual, False, data)
        _assert_same_bits(first, got, names, f"{threads} thread(s) vs {torch.get_num_threads()}")


@pytest.mark.parametrize("kind", ["ln", "rms"])
def test_memory_efficient_deterministic(device: str, kind: str) -> None:
    data = _inputs(3000, 257, torch.float32, torch.float32, device)
    names = _names(kind, False)
    first = _forward_backward(kind, False, True, data)
    _assert_same_bits(first, _forward_backward(kind, False, True, data), names, "repeat")
    if device == "cpu":
        for threads in (1, 2):
            with _num_threads(threads):
                got = _forward_backward(kind, False, True, data)
            _assert_same_bits(first, got, names, f"{threads} thread(s)")


@pytest.mark.parametrize(("rows", "cols"), [(12, 1 << 16), (5, (1 << 18) + 3)], ids=["12x65536", "5x262147"])
@pytest.mark.parametrize("kind", ["ln", "rms"])
def test_long_rows_backward_splits_columns(kind: str, rows: int, cols: int) -> None:
    """Long rows in fewer dweight chunks than column ranges: the backward runs each row's column ranges in
    parallel, as for one row alone (not the rows on one thread). Seen in the bits: each row's grad_input is the
    same as from a backward of that row alone (which always splits), on 1 and 2 threads."""
    ops = torch.ops.layernorm_ext
    data = _inputs(rows, cols, torch.float32, torch.float32, "cpu")
    x, w, b, g = data["x"], data["w"], data["b"], data["g_out"]

    if kind == "ln":
        _, _, mean, rstd = ops.layer_norm_fwd(x, [cols], w, b, 1e-5)
    else:
        _, _, rstd = ops.rms_norm_fwd(x, [cols], w, 1e-6)

    def grad_input(i0: int, i1: int) -> Tensor:
        if kind == "ln":
            return ops.layer_norm_bwd(g[i0:i1], x[i0:i1], mean[i0:i1], rstd[i0:i1], [cols], w, b)[0]
        return ops.rms_norm_bwd(g[i0:i1], x[i0:i1], rstd[i0:i1], [cols], w)[0]

    for threads in (1, 2):
        with _num_threads(threads):
            batch = grad_input(0, rows)
            for i in range(rows):
                assert torch.equal(_bits(batch[i : i + 1]), _bits(grad_input(i, i + 1))), (
                    f"row {i} of {rows}, {threads} thread(s): grad_input differs from the row's own backward"
                )


def test_thread_count_restored() -> None:
    before = torch.get_num_threads()
    with _num_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
