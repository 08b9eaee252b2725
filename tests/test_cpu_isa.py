"""CPU instruction-set dispatch: chosen once at load, LAYERNORM_EXT_CPU_ISA forces a lower one, every path agrees."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import layernorm_ext
from conftest import CPU_ISAS
from layernorm_ext import _sources, native


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
    assert "LAYERNORM_EXT_CPU_ISA must be one of scalar, avx2, avx512, avx512_bf16, but got 'sse9'" in proc.stderr


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


def _bf16(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def _rounding_cases() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, r (4 rows of 80: five vectors of 16, so the tail path too) and a weight whose float sums, products and
    normalized values hit every rounding case: ties both ways, subnormal sums (exact in bfloat16, flushed to 0 by
    vcvtneps2bf16), infinities, NaNs with payloads, and random values."""
    gen = torch.Generator().manual_seed(3)
    n = 80
    x = torch.randn(4, n, generator=gen).to(torch.bfloat16)
    r = torch.randn(4, n, generator=gen).to(torch.bfloat16)
    k = torch.arange(n, dtype=torch.float32)
    x[1] = (1.0 + k * 2.0**-7).to(torch.bfloat16)  # + 2^-8: halfway between two bfloat16s, odd and even
    r[1] = 2.0**-8
    x[2] = (k * 2.0**-133).to(torch.bfloat16)  # subnormal bfloat16 values, and their sums
    r[2] = 2.0**-131
    x[3, :8] = _bf16([0x7F80, 0xFF80, 0x7F81, 0xFFC3, 0x7FFF, 0x0001, 0x8001, 0x007F])
    r[3, :8] = 0.0
    weight = torch.randn(n, generator=gen).to(torch.bfloat16)
    weight[::3] = _bf16([0x0003, 0x8011, 0x0070] * (n // 9) + [0x0001] * (len(weight[::3]) - 3 * (n // 9)))
    return x, r, weight


@pytest.mark.skipif("avx512_bf16" not in CPU_ISAS, reason="the CPU lacks AVX512_BF16")
def test_avx512_bf16_rounds_as_the_integer_path() -> None:
    """avx512_bf16 is the AVX-512 copy rounding float -> bfloat16 with vcvtneps2bf16: the same bits as its integer
    rounding (and, but for NaN bits, torch's) on ties, subnormals (which that instruction flushes: those vectors
    take the integer path), NaN payloads and infinities, in the residual output, the normalized output and the
    backward's dx. The numerics sweep runs one of the two (conftest.SWEEP_ISAS); this compares them."""
    x, r, weight = _rounding_cases()
    results = {}
    previous = native.set_cpu_isa("avx512_bf16")
    try:
        for isa in ("avx512_bf16", "avx512"):
            native.set_cpu_isa(isa)
            xg = x.clone().requires_grad_()
            out, h = layernorm_ext.add_rms_norm(xg, r, x.shape[-1], weight)
            (out.float() * torch.linspace(-1e-36, 1e-36, x.numel()).view_as(out)).nansum().backward()
            results[isa] = [t.detach().view(torch.int16) for t in (out, h, xg.grad)]
    finally:
        native.set_cpu_isa(previous)
    for name, got, want in zip(("out", "residual_out", "dx"), results["avx512_bf16"], results["avx512"]):
        assert torch.equal(got, want), name
    # torch's bits where the sum is a number (its vectorized rounding writes 0xffff for every NaN; ours keeps the
    # payload, quieted, as its scalar c10::BFloat16 rounding does).
    torch_sum = x.float() + r.float()
    number = ~torch_sum.isnan()
    assert torch.equal(results["avx512_bf16"][1][number], torch_sum.to(torch.bfloat16).view(torch.int16)[number])


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


# The row kernels' translation units and the one function each may define for other objects to link to.
ISA_OBJECTS = {
    "cpu/rows_portable.cpp": "layernorm_ext::cpu::portable_row_kernels()",
    "cpu/rows_avx2.cpp": "layernorm_ext::cpu::avx2_row_kernels()",
    "cpu/rows_avx512.cpp": "layernorm_ext::cpu::avx512_row_kernels()",
}


def _toolchain() -> tuple[str, str]:
    """The C++ compiler torch's cpp_extension would use ($CXX, else c++) and nm; skips where either is missing
    or the sources' x86-64 intrinsics and GCC target pragmas do not apply."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not sys.platform.startswith("linux"):
        pytest.skip(f"the instruction-set sources are for x86-64 Linux (here {sys.platform}, {platform.machine()})")
    cxx = os.environ.get("CXX", "c++")
    found_cxx, nm = shutil.which(cxx), shutil.which("nm")
    if found_cxx is None or nm is None:
        pytest.skip(f"needs a C++ compiler ({cxx!r}: {found_cxx}) and nm ({nm}) to inspect the objects")
    return found_cxx, nm


@pytest.mark.parametrize("source", sorted(ISA_OBJECTS))
def test_isa_object_defines_only_its_entry(source: str) -> None:
    """An object compiled for an instruction set must not define, for the linker to share, any function another
    object could also define (inline functions of the shared headers, std:: template instantiations): the
    linker keeps one copy of such a weak symbol for every caller, and if it picks the AVX-512 one, code that
    never checked the CPU runs AVX-512 instructions (illegal instruction elsewhere). -O0 (debug builds) is
    where such copies were emitted: nothing is inlined there."""
    cxx, nm = _toolchain()
    path = _sources.csrc_dir() / source
    flags = [flag for flag in _sources.CXX_FLAGS if not flag.startswith("-O")]
    with tempfile.TemporaryDirectory() as tmp:
        obj = Path(tmp) / "rows.o"
        cmd = [cxx, "-std=c++17", "-O0", "-fPIC", *flags, "-c", str(path), "-o", str(obj)]
        compiled = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert compiled.returncode == 0, f"{' '.join(cmd)}\n{compiled.stderr}"
        listed = subprocess.run([nm, "-C", "--defined-only", "-g", str(obj)], capture_output=True, text=True)
        assert listed.returncode == 0, listed.stderr
    # Lines "address type name"; the name may hold spaces.
    defined = {line.split(maxsplit=2)[2] for line in listed.stdout.splitlines() if line.strip()}
    assert defined == {ISA_OBJECTS[source]}, sorted(defined)
