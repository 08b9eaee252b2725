"""CPU instruction-set dispatch: chosen once at load, LAYERNORM_EXT_CPU_ISA forces a lower one, every path agrees."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import layernorm_ext
from conftest import CPU_ISAS
from layernorm_ext import native


def _isa_in_subprocess(value: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, LAYERNORM_EXT_CPU_ISA=value)
    code = "import layernorm_ext\nprint(layernorm_ext.build_info()['cpu_isa'])"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_default_is_the_best_supported() -> None:
    env = {k: v for k, v in os.environ.items() if k != "LAYERNORM_EXT_CPU_ISA"}
    code = "import layernorm_ext\nprint(layernorm_ext.build_info()['cpu_isa'])"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == CPU_ISAS[0]


@pytest.mark.parametrize("isa", CPU_ISAS)
def test_environment_forces_an_isa(isa: str) -> None:
    proc = _isa_in_subprocess(isa)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == isa


def test_environment_rejects_unknown_isa() -> None:
    proc = _isa_in_subprocess("sse9")
    assert proc.returncode != 0
    assert "LAYERNORM_EXT_CPU_ISA must be one of scalar, avx2, avx512, but got 'sse9'" in proc.stderr


def test_set_cpu_isa_rejects_unknown_and_restores() -> None:
    before = layernorm_ext.build_info()["cpu_isa"]
    with pytest.raises(RuntimeError, match="unknown CPU instruction set 'neon'"):
        native.set_cpu_isa("neon")
    assert layernorm_ext.build_info()["cpu_isa"] == before


def test_scalar_is_always_supported() -> None:
    assert "scalar" in CPU_ISAS and CPU_ISAS[-1] == "scalar"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paths_agree_closely(dtype: torch.dtype) -> None:
    """The ISA paths differ only by rounding (FMA contraction, lane order): within 2 ulps of the output's
    magnitude of each other."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(33, 1000, generator=gen).to(dtype)
    r = torch.randn(33, 1000, generator=gen).to(dtype)
    w = torch.randn(1000, generator=gen).to(dtype)
    b = torch.randn(1000, generator=gen).to(dtype)
    results = {}
    previous = native.set_cpu_isa(CPU_ISAS[0])
    try:
        for isa in CPU_ISAS:
            native.set_cpu_isa(isa)
            results[isa] = (
                layernorm_ext.add_layer_norm(x, r, 1000, w, b)[0].double(),
                layernorm_ext.rms_norm(x, 1000, w).double(),
            )
    finally:
        native.set_cpu_isa(previous)
    ulp = torch.finfo(dtype).eps
    for isa in CPU_ISAS[1:]:
        for got, want in zip(results[isa], results[CPU_ISAS[0]]):
            tolerance = 2 * ulp * float(want.abs().max())
            assert float((got - want).abs().max()) <= tolerance, isa


def test_wide_call_keeps_no_wide_scratch() -> None:
    """The CPU kernels keep per-thread scratch between calls (converted parameters, dweight / dbias partials),
    but a buffer grown past 4 MiB by one very wide call is freed when the call ends: before, every thread kept
    cols-sized buffers for the life of the process."""
    n = 1 << 21  # 8 MiB per float row
    small = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    layernorm_ext.layer_norm(small, (64,), torch.ones(64, dtype=torch.bfloat16), None).sum().backward()
    before = native.cpu_scratch_bytes()
    x = torch.randn(2, n, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, dtype=torch.bfloat16, requires_grad=True)  # converted to float: a scratch row
    b = torch.randn(n, dtype=torch.bfloat16, requires_grad=True)
    layernorm_ext.layer_norm(x, (n,), w, b).float().sum().backward()
    layernorm_ext.rms_norm(x, (n,), w).float().sum().backward()
    assert w.grad is not None and b.grad is not None
    assert native.cpu_scratch_bytes() <= before, (before, native.cpu_scratch_bytes())
