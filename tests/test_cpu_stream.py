"""Non-temporal stores of the CPU forward's output (a caller's buffer at least the last-level cache's size): the same
bits as plain stores on every instruction set and path (rows one by one, rows grouped with a weight, a residual, a
few long rows split into column ranges, outputs whose rows are not aligned for a vector, in place), and the
threshold's default."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor

from conftest import CPU_ISAS
from layernorm_ext import add_rms_norm, add_rms_norm_, layer_norm, native, rms_norm

NEVER = 2**63 - 1
_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}


@pytest.fixture
def isa_restored() -> Iterator[None]:
    before = native.set_cpu_isa(CPU_ISAS[0])
    threshold = native.set_cpu_stream_bytes(-1)
    native.set_cpu_stream_bytes(threshold)
    yield
    native.set_cpu_isa(before)
    native.set_cpu_stream_bytes(threshold)


def _unaligned_like(t: Tensor) -> Tensor:
    """An empty tensor like t whose storage starts one element past an allocation (no row aligned for a vector
    store unless its offset happens to make it so)."""
    return torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)


def _calls(dtype: torch.dtype, rows: int, cols: int) -> dict[str, Callable[[], list[Tensor]]]:
    """Calls into the caller's buffers (only those stream: a new tensor's pages fault in on the first store)."""
    gen = torch.Generator().manual_seed(rows * 7919 + cols)
    x = (torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 2 + 0.5).to(dtype)
    r = torch.randn(rows, cols, generator=gen, dtype=torch.float64).to(dtype)
    w = (torch.randn(cols, generator=gen, dtype=torch.float64) * 0.5 + 1).to(dtype)
    b = (torch.randn(cols, generator=gen, dtype=torch.float64) * 0.2).to(dtype)

    def into(make: Callable[[Tensor], Tensor], op: str) -> Callable[[], list[Tensor]]:
        def call() -> list[Tensor]:
            out = make(x)
            if op == "layer_norm":  # rows grouped (a weight and bias)
                layer_norm(x, cols, w, b, out=out)
                return [out]
            if op == "rms_norm":  # rows one by one
                rms_norm(x, cols, out=out)
                return [out]
            h = torch.empty_like(x)
            add_rms_norm(x, r, cols, w, out=out, residual_out=h)
            return [out, h]

        return call

    def in_place() -> list[Tensor]:  # out is the input: never streamed, the same bits either way
        xi, ri = x.clone(), r.clone()
        add_rms_norm_(xi, ri, cols, w)
        return [xi, ri]

    return {
        "layer_norm": into(torch.empty_like, "layer_norm"),
        "rms_norm": into(torch.empty_like, "rms_norm"),
        "add_rms_norm": into(torch.empty_like, "add_rms_norm"),
        "layer_norm_unaligned_out": into(_unaligned_like, "layer_norm"),
        "rms_norm_unaligned_out": into(_unaligned_like, "rms_norm"),
        "add_rms_norm_": in_place,
    }


def _same_bits(got: Tensor, want: Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.view(_INT_VIEW[got.dtype]), want.view(_INT_VIEW[want.dtype])), what


# (rows, cols): odd and even widths, a row of one vector or less, and (rows < 4, cols >= 2^16) rows split into column
# ranges across threads.
SHAPES = ((37, 1), (37, 7), (37, 64), (19, 769), (9, 4096), (5, 5125), (2, (1 << 16) + 24))


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d)[6:])
@pytest.mark.parametrize(("rows", "cols"), SHAPES, ids=[f"{m}x{n}" for m, n in SHAPES])
def test_streamed_output_has_the_same_bits(isa_restored: None, isa: str, dtype: torch.dtype, rows: int,
                                           cols: int) -> None:
    native.set_cpu_isa(isa)
    for name, call in _calls(dtype, rows, cols).items():
        native.set_cpu_stream_bytes(NEVER)
        want = call()
        native.set_cpu_stream_bytes(0)  # every output streams
        got = call()
        for i, (g, w) in enumerate(zip(got, want)):
            _same_bits(g, w, f"{isa} {name} output {i}")


def _sysfs_cache_bytes() -> int:
    largest = 0
    for size_file in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")):
        text = size_file.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        largest = max(largest, int(text.rstrip("KMG")) * scale)
    return largest


def test_default_threshold_is_the_last_level_cache(isa_restored: None) -> None:
    native.set_cpu_stream_bytes(123)
    assert native.set_cpu_stream_bytes(-1) == 123
    default = native.set_cpu_stream_bytes(-1)
    assert default == (_sysfs_cache_bytes() or NEVER)
