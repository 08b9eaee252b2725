"""Shared fixtures and the accuracy rule of the suite (the rule itself lives in layernorm_ext.selfcheck).

Accuracy rule: for every output and gradient, our max abs error against an fp64 reference must not exceed
ATen's own max abs error (same inputs, same dtypes) by more than a tiny atol: one unit in the last place of
the result dtype at the reference's largest magnitude.
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

import layernorm_ext  # noqa: F401  (loads the library and registers the ops)
from layernorm_ext.selfcheck import compare, ulp_atol

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Every CPU instruction set this machine runs, the best first.
CPU_ISAS: list[str] = list(layernorm_ext.native.supported_cpu_isas())


def _sweep_isas() -> list[str]:
    """The instruction sets the numerics sweep runs on (fixture cpu_isa): all of CPU_ISAS, or those named in
    LAYERNORM_EXT_TEST_ISAS (comma-separated; "best" is the first of CPU_ISAS). CI's CUDA leg runs the best
    one only: its CPU kernels are the CPU leg's code from the same compiler, which that leg sweeps on all."""
    wanted = os.environ.get("LAYERNORM_EXT_TEST_ISAS", "")
    if not wanted:
        # avx512 and avx512_bf16 are one copy of the kernels, differing only in how they round to bfloat16, which
        # test_cpu_isa compares bit for bit: the sweep runs the one this CPU uses.
        return [isa for isa in CPU_ISAS if not (isa == "avx512" and "avx512_bf16" in CPU_ISAS)]
    names = {CPU_ISAS[0] if name == "best" else name for name in wanted.split(",")}
    isas = [isa for isa in CPU_ISAS if isa in names]
    if not isas:
        raise pytest.UsageError(f"LAYERNORM_EXT_TEST_ISAS={wanted!r} names none of this machine's {CPU_ISAS}")
    return isas


SWEEP_ISAS = _sweep_isas()

# (input dtype, weight/bias dtype): every supported pairing, plain and mixed (half input, float32 parameters).
DTYPE_PAIRS: tuple[tuple[torch.dtype, torch.dtype], ...] = (
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
)

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class DtypeTriple:
    """One (input, weight, bias) dtype combination of a norm (None: no such argument); ``result`` is the dtype
    of ATen's output, None where ATen refuses the combination."""

    rms: bool
    input: torch.dtype
    weight: torch.dtype | None
    bias: torch.dtype | None
    result: torch.dtype | None


def _aten_dtype_triples() -> tuple[DtypeTriple, ...]:
    """Every (input, weight, bias) dtype triple over FLOAT_DTYPES (and None for the parameters), with what the
    running torch's F.layer_norm / F.rms_norm on the CPU make of it (rms_norm has no bias)."""
    triples = []
    params = (*FLOAT_DTYPES, None)
    for rms in (False, True):
        for x_dtype, w_dtype, b_dtype in itertools.product(FLOAT_DTYPES, params, (None,) if rms else params):
            x = torch.ones(2, 3, dtype=x_dtype)
            w = None if w_dtype is None else torch.ones(3, dtype=w_dtype)
            b = None if b_dtype is None else torch.zeros(3, dtype=b_dtype)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # rms_norm's "Mismatch dtype between input and weight"
                    y = torch.nn.functional.rms_norm(x, (3,), w) if rms else torch.nn.functional.layer_norm(
                        x, (3,), w, b)
                result: torch.dtype | None = y.dtype
            except RuntimeError:
                result = None
            triples.append(DtypeTriple(rms, x_dtype, w_dtype, b_dtype, result))
    return tuple(triples)


ATEN_DTYPE_TRIPLES: tuple[DtypeTriple, ...] = _aten_dtype_triples()

__all__ = [
    "ATEN_DTYPE_TRIPLES", "CPU_ISAS", "DEVICES", "DTYPE_PAIRS", "FLOAT_DTYPES", "DtypeTriple",
    "assert_no_worse_than_aten", "ulp_atol",
]  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=SWEEP_ISAS)
def cpu_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test with the CPU kernels of one instruction set, then restore the previous one."""
    previous = layernorm_ext.native.set_cpu_isa(request.param)
    try:
        yield request.param
    finally:
        layernorm_ext.native.set_cpu_isa(previous)


def assert_no_worse_than_aten(
    ours: torch.Tensor, aten: torch.Tensor, reference: torch.Tensor, what: str = "", slack: float = 1.0
) -> None:
    """The suite's tolerance rule. ``reference`` is the fp64 result; ``slack`` multiplies the atol."""
    assert ours.shape == aten.shape == reference.shape, (what, ours.shape, aten.shape, reference.shape)
    assert ours.dtype == aten.dtype, (what, ours.dtype, aten.dtype)
    c = compare(ours, aten, reference, what, slack)
    assert c.err_ours == c.err_ours, f"{what}: NaN in our result"
    assert c.ok, f"{what}: our max error {c.err_ours:.3e} > ATen's {c.err_aten:.3e} + {c.atol:.3e}"


def compiled_and_eager(step, args: tuple, backend: str) -> tuple:
    """step(*args) under torch.compile(fullgraph=True) with `backend`, then eagerly: (compiled, eager); dynamo
    reset before and after the compile."""
    eager = step(*args)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    return compiled, eager
