#!/usr/bin/env python
"""Every op once per kernel path, small enough to run under compute-sanitizer (memcheck, racecheck).

    compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize_cases.py
    python benchmarks/sanitize_cases.py --device cpu        # the same calls on the CPU (a dry run of this script)

Row lengths N = 7 (through a misaligned view: no vector access), 256, 1024, 4096, 16384, 65536 and 2^20 (one
row); fp32 and bf16 (with bf16 also a float32 weight); LayerNorm and RMSNorm, each plain and with a residual;
forward and backward (the raw ops, so that every kernel runs once per case). Few rows per case: the sanitizer
slows kernels down by orders of magnitude. Run it with PYTORCH_NO_CUDA_MEMORY_CACHING=1 so that every tensor
is its own allocation and an access past its end is reported instead of landing in a cached block.
The quantized output (dynamic per-row fp8 scale, LayerNorm and RMSNorm): rows of several warps (N = 5120 bf16: 5,
a warp count not a power of two) and a long row: the absmax's one barrier per row is racecheck's to confirm.
Then every bad-argument case of tests/test_errors.py (forward and backward ops) on the device, after those valid
calls and with inputs that require grad: each must raise its RuntimeError (on an H200 three of them once
killed the process). Exits 0 when every call returned or raised as it should (the sanitizer's exit code says
whether it found errors).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

import layernorm_ext  # noqa: F401  (registers the ops)

ops = torch.ops.layernorm_ext

# (M, N): M small, and odd where it is cheap, so that partial blocks of rows occur.
SHAPES = ((5, 7), (3, 256), (3, 1024), (3, 4096), (2, 16384), (2, 65536), (1, 1 << 20))
QUICK_SHAPES = ((5, 7), (3, 1024), (2, 65536))
DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32))


def misaligned(t: Tensor) -> Tensor:
    """Same values, one element into a fresh allocation: never 16-byte aligned."""
    base = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = base[1:].view(t.shape)
    view.copy_(t)
    return view


def one_case(m: int, n: int, dtype: torch.dtype, wdtype: torch.dtype, rms: bool, residual: bool, device: str) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n)

    def randn(*shape: int, dt: torch.dtype, scale: float = 1.0, shift: float = 0.0) -> Tensor:
        t = (torch.randn(shape, generator=gen) * scale + shift).to(dt).to(device)
        return misaligned(t) if n == 7 else t

    x = randn(m, n, dt=dtype, shift=0.3)
    r = randn(m, n, dt=dtype) if residual else None
    w = randn(n, dt=wdtype, scale=0.5, shift=1.0)
    b = None if rms else randn(n, dt=wdtype, scale=0.5)
    g = randn(m, n, dt=dtype)
    if rms:
        out, h, rstd = ops.rms_norm_fwd(x, [n], w, None, r, False, False)
        gr = randn(m, n, dt=h.dtype) if residual else None
        grads = ops.rms_norm_bwd(g, h if residual else x, rstd, [n], w, False, gr)
        # memory-efficient backward: recover xhat from the output (plain variant only)
        if not residual and wdtype == dtype:
            grads += ops.rms_norm_bwd(g, out, rstd, [n], w, True, None)
    else:
        out, h, mean, rstd = ops.layer_norm_fwd(x, [n], w, b, 1e-5, r, False, False)
        gr = randn(m, n, dt=h.dtype) if residual else None
        grads = ops.layer_norm_bwd(g, h if residual else x, mean, rstd, [n], w, b, False, gr)
        if not residual and wdtype == dtype:
            grads += ops.layer_norm_bwd(g, out, mean, rstd, [n], w, b, True, None)
    if device != "cpu":
        torch.cuda.synchronize()
    for t in (out, *grads):
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            raise RuntimeError(f"non-finite result for M={m} N={n} {dtype} rms={rms} residual={residual}")


# (M, N) of the quantized cases: several warps per row (5120 bf16: 5 warps; 4096: 4) and a long row.
QUANT_SHAPES = ((5, 5120), (3, 4096), (2, 65536))


def quant_case(m: int, n: int, dtype: torch.dtype, rms: bool, device: str) -> None:
    gen = torch.Generator().manual_seed(m * 7 + n)
    x = (torch.randn(m, n, generator=gen) + 0.3).to(dtype).to(device)
    w = (torch.randn(n, generator=gen) * 0.5 + 1.0).to(dtype).to(device)
    fp8 = torch.float8_e4m3fn
    if rms:
        codes, scales, _ = ops.rms_norm_quant(x, [n], w, 1e-6, fp8)
    else:
        b = (torch.randn(n, generator=gen) * 0.5).to(dtype).to(device)
        codes, scales, _ = ops.layer_norm_quant(x, [n], w, b, 1e-5, fp8)
    if device != "cpu":
        torch.cuda.synchronize()
    if codes.shape != (m, n) or not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
        raise RuntimeError(f"quantized output: bad scales for M={m} N={n} {dtype} rms={rms}")


def bad_calls(device: str) -> int:
    """Every bad-argument case of tests/test_errors.py on ``device``; returns how many raised as they should."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_errors as cases  # noqa: PLC0415  (the suite's own list of bad calls)

    count = 0
    with cases.on_device(device):
        for param in cases._FWD_PARAMS:
            case, kind = param.values
            for call in (cases._call_functional, cases._call_op):
                try:
                    call(case, kind)
                except RuntimeError as e:
                    if not re.search(case.match, str(e)):
                        raise AssertionError(f"{case.id}-{kind}: unexpected error {e}") from e
                    count += 1
                else:
                    raise AssertionError(f"{case.id}-{kind}: no error")
        for param in cases._BWD_PARAMS:
            mutate, match, kind = param.values
            args = cases._valid_bwd_args(kind)
            mutate(args)
            try:
                cases._call_bwd(kind, args)
            except RuntimeError as e:
                if not re.search(match, str(e)):
                    raise AssertionError(f"{param.id}: unexpected error {e}") from e
                count += 1
            else:
                raise AssertionError(f"{param.id}: no error")
    if device != "cpu":
        torch.cuda.synchronize()
    return count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help=f"only the shapes {QUICK_SHAPES} (for racecheck)")
    opts = p.parse_args(argv)
    if opts.device != "cpu" and not torch.cuda.is_available():
        print("sanitize_cases: no CUDA device", file=sys.stderr)
        return 2
    started = time.perf_counter()
    count = 0
    for m, n in QUICK_SHAPES if opts.quick else SHAPES:
        for dtype, wdtype in DTYPES:
            for rms in (False, True):
                for residual in (False, True):
                    one_case(m, n, dtype, wdtype, rms, residual, opts.device)
                    count += 1
        print(f"  N={n} M={m}: done ({time.perf_counter() - started:.1f} s)", flush=True)
    for m, n in QUANT_SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            for rms in (False, True):
                quant_case(m, n, dtype, rms, opts.device)
                count += 1
    print(f"  quantized output: done ({time.perf_counter() - started:.1f} s)", flush=True)
    raised = bad_calls(opts.device)
    print(f"sanitize_cases: {count} cases, every op forward and backward, and {raised} bad calls that raised, "
          f"{time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
