"""Quantized output (issue 27): our fused norm + quantize against the unfused composite (our norm, then torch ops
computing the same codes: absmax, scale, multiply / divide, clamp, cast), per row, per group and NVFP4, the median
of --repeats timings of one call, no grad. The composite's codes are checked equal to ours first. CPU: one thread.
CUDA: CUDA events, L2 flushed between calls (bench_timing.CudaTimer), and the fused call's GB/s (input read, codes
and scales written) as a fraction of the device's copy bandwidth.

    python benchmarks/quantized.py [--repeats 20] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import layernorm_ext as L

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_timing import CudaTimer, copy_peak_gbps  # noqa: E402
from strided import median_us  # noqa: E402

QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
MIN_SCALE = {torch.float8_e4m3fn: 1.0 / (448.0 * 512.0), torch.int8: float(torch.finfo(torch.float32).eps)}


def composite(x: torch.Tensor, w: torch.Tensor, quant_dtype: torch.dtype, group_size: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm, then the dynamic scales and codes in torch ops (per row: y / scale for fp8, y * (1 / scale) for
    int8, as vLLM; per group: y * (1 / scale))."""
    y = L.rms_norm(x, x.shape[-1], w, 1e-6).float()
    groups = y.unflatten(-1, (-1, group_size if group_size else y.shape[-1]))
    # A tensor divisor: CUDA divides by a Python number as a multiplication by its reciprocal, not a division.
    qmax = torch.full((), QMAX[quant_dtype], device=y.device)
    scale = (groups.abs().amax(-1, keepdim=True) / qmax).clamp_min(MIN_SCALE[quant_dtype])
    divide = group_size == 0 and quant_dtype == torch.float8_e4m3fn
    v = (groups / scale if divide else groups * scale.reciprocal()).flatten(-2)
    if quant_dtype == torch.int8:
        codes = v.nan_to_num(0.0).clamp(-128, 127).round().to(torch.int8)
    else:
        codes = v.clamp(-448.0, 448.0).to(quant_dtype)
    return codes, scale.squeeze(-1) if group_size else scale.view(-1, 1)


def composite_nvfp4(x: torch.Tensor, w: torch.Tensor, global_scale: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm, then NVFP4 in torch ops (vLLM's ref_nvfp4_quant): e4m3 block scales, e2m1 codes rounded to
    nearest even (steps of 0.5 below 2, 1 below 4, 2 above; torch.round is half to even), packed two per byte."""
    y = L.rms_norm(x, x.shape[-1], w, 1e-6).float()
    blocks = y.unflatten(-1, (-1, 16))
    scales = (global_scale * (blocks.abs().amax(-1, keepdim=True) * (1.0 / 6.0))).clamp(-448.0, 448.0)
    scales = scales.to(torch.float8_e4m3fn)
    inverse = scales.float() * global_scale.reciprocal()
    v = (blocks * torch.where(inverse == 0, 0.0, inverse.reciprocal())).flatten(-2)
    m = v.abs()
    value = torch.where(m < 2, (m * 2).round() / 2, torch.where(m < 4, m.round(), (m / 2).round() * 2)).clamp(max=6)
    code = torch.where(value < 2, value * 2, torch.where(value <= 4, value + 2, 7.0)).to(torch.uint8)
    code = torch.where(v.isnan(), 7, code | (v.signbit().to(torch.uint8) << 3))
    return (code[..., 0::2] | (code[..., 1::2] << 4)).view(torch.float4_e2m1fn_x2), scales.squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        timer = CudaTimer(device)
        copy_gbps = copy_peak_gbps(device)
        shapes = ((64, 4096), (8192, 4096), (8192, 8192))

        def time_us(fn: Callable[[], object]) -> float:
            timer(fn, 3)
            return statistics.median(timer(fn, args.repeats)) * 1e6
        print(f"copy bandwidth C = {copy_gbps:.0f} GB/s (read + write)\n")
        print("| shape | scales | codes | fused (us) | composite (us) | composite / fused | fused GB/s | of C |")
        print("|---|---|---|---|---|---|---|---|")
    else:
        torch.set_num_threads(1)
        shapes = ((64, 4096), (2048, 4096))

        def time_us(fn: Callable[[], object]) -> float:
            return median_us(fn, args.repeats)
        print("| shape | scales | codes | fused (us) | composite (us) | composite / fused |")
        print("|---|---|---|---|---|---|")

    def row(shape: str, kind: str, codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, ours: float,
            theirs: float) -> None:
        line = f"| {shape} | {kind} | {str(codes.dtype).removeprefix('torch.')} | {ours:.0f} | {theirs:.0f} | " \
               f"{theirs / ours:.2f}x |"
        if device.type == "cuda":
            moved = x.nbytes + codes.nbytes + scales.nbytes  # the weight stays in L2 across rows
            gbps = moved / (ours * 1e-6) / 1e9
            line += f" {gbps:.0f} | {gbps / copy_gbps:.2f} |"
        print(line)

    for rows, cols in shapes:
        x = torch.randn(rows, cols, dtype=torch.bfloat16, device=device)
        w = torch.randn(cols, dtype=torch.bfloat16, device=device)
        shape = f"{rows}x{cols} bf16"
        for group_size in (0, 128):
            for quant_dtype in (torch.float8_e4m3fn, torch.int8):
                def fused() -> tuple[torch.Tensor, torch.Tensor]:
                    return L.rms_norm_quant(x, cols, w, 1e-6, quant_dtype=quant_dtype, group_size=group_size)

                def unfused() -> tuple[torch.Tensor, torch.Tensor]:
                    return composite(x, w, quant_dtype, group_size)

                with torch.no_grad():
                    (codes, scales), (want_codes, want_scales) = fused(), unfused()
                    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
                    assert torch.equal(scales, want_scales)
                    ours, theirs = time_us(fused), time_us(unfused)
                kind = f"per group of {group_size}" if group_size else "per row"
                row(shape, kind, codes, scales, x, ours, theirs)
        global_scale = (448.0 * 6.0) / L.rms_norm(x, cols, w, 1e-6).float().abs().amax().reshape(1)

        def fused_nvfp4() -> tuple[torch.Tensor, torch.Tensor]:
            return L.rms_norm_quant(x, cols, w, 1e-6, quant_dtype=torch.float4_e2m1fn_x2, scale=global_scale)

        def unfused_nvfp4() -> tuple[torch.Tensor, torch.Tensor]:
            return composite_nvfp4(x, w, global_scale)

        with torch.no_grad():
            (codes, scales), (want_codes, want_scales) = fused_nvfp4(), unfused_nvfp4()
            assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
            assert torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8))
            ours, theirs = time_us(fused_nvfp4), time_us(unfused_nvfp4)
        row(shape, "NVFP4 (e4m3 per 16)", codes, scales, x, ours, theirs)


if __name__ == "__main__":
    main()
