"""bench.py's vocabulary and inputs: the ops, dtypes, sizes, implementations and labels it knows, the bytes each
case counts, and per case its shape (Case), its rows (case_rows), its tensors (Data) and its arguments (Args)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from torch import Tensor

OPS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NS = (256, 512, 768, 1024, 2048, 4096, 5120, 8192, 16384, 65536)
MODES = ("fwd", "fwdbwd")
SIZES = ("small", "big")
PEERS = ("aten", "compile", "ort", "liger", "quack")
CPU_IMPLS = ("ours", "aten", "compile", "ort")  # default implementations per device (Liger, Quack: CUDA only)
CUDA_IMPLS = ("ours", "aten", "compile", "liger", "quack")
IMPLS = ("ours", *PEERS)
REFS = ("copy", "copy_out")  # bandwidth references, measured once per (threads, dtype, size, N)
LABELS = {"ours": "ours", "aten": "ATen", "compile": "compile", "ort": "ORT", "liger": "Liger", "quack": "Quack",
          "copy": "copy", "copy_out": "copy_out"}  # fmt: skip
# --gpu-check: row lengths, at M >= 8192 rows (fewer where x would exceed --max-mb)
GPU_CHECK_NS = (256, 512, 768, 1024, 2048, 4096, 5120, 8192, 16384, 32768, 65536, 131072, 262144)
DECODE_MS = (1, 2, 4, 8, 16)
DECODE_NS = (4096, 8192)
DECODE_OPS = ("rms_norm", "add_rms_norm", "layer_norm")
LN_EPS = 1e-5
RMS_EPS = torch.finfo(torch.float32).eps  # what eps=None means for float32/float16/bfloat16 in ATen and ours

# Tensor passes of M*N elements (weight, bias, mean and rstd are O(N) or O(M): ignored).
PASSES = {(False, "fwd"): 2, (True, "fwd"): 4, (False, "fwdbwd"): 5, (True, "fwdbwd"): 8}
BYTES_NOTE = """\
Bytes counted per call (s = element size; weight/bias, their gradients and mean/rstd are O(N) or O(M), ignored):
- layer_norm, rms_norm, fwd: read x + write y = 2*M*N*s
- add_layer_norm, add_rms_norm, fwd: read x, r + write y, h = 4*M*N*s
- layer_norm, rms_norm, fwd+bwd: fwd + read x, dy + write dx = 5*M*N*s
- add_*, fwd+bwd: fwd + read h, dy, dh + write dx = 8*M*N*s. Both outputs get a gradient (dy for y, dh for
  h = x + r, as in a pre-norm block where h feeds the next residual); d(residual) is the same tensor as dx
  (both are dL/dh), so it is written once.
- copy, copy_out: read x + write y = 2*M*N*s"""

# ---------------------------------------------------------------------------------------------- cases and data


@dataclass(frozen=True)
class Case:
    op: str
    dtype: str
    n: int
    m: int
    size: str
    mode: str
    threads: int

    @property
    def residual(self) -> bool:
        return self.op.startswith("add_")

    @property
    def rms(self) -> bool:
        return "rms" in self.op

    @property
    def x_bytes(self) -> int:
        return self.m * self.n * DTYPES[self.dtype].itemsize

    @property
    def bytes(self) -> int:
        return PASSES[(self.residual, self.mode)] * self.x_bytes

    @property
    def copy_bytes(self) -> int:
        return 2 * self.x_bytes

    def label(self) -> str:
        return f"{self.op} {self.dtype} N={self.n} M={self.m} {self.size} {self.mode} {self.threads}t"


def rows_for(n: int, dtype: str, megabytes: float) -> int:
    """M such that x (M x N) holds about `megabytes` MiB."""
    return max(1, round(megabytes * 2**20 / (n * DTYPES[dtype].itemsize)))


def case_rows(n: int, dtype: str, size: str, opts: argparse.Namespace) -> int:
    """M for a case: x of about --small-mb / --big-mb MiB; the big size has at least --min-rows rows, unless x
    would then exceed --max-mb MiB."""
    if size == "small":
        return rows_for(n, dtype, opts.small_mb)
    m = max(rows_for(n, dtype, opts.big_mb), opts.min_rows)
    return min(m, rows_for(n, dtype, opts.max_mb)) if opts.max_mb else m


@dataclass(frozen=True)
class Data:
    """Tensors shared by every case of one (dtype, size, N): inputs, parameters and upstream gradients."""

    x: Tensor
    r: Tensor
    w: Tensor
    b: Tensor
    dy: Tensor
    dh: Tensor


def make_data(m: int, n: int, dtype: torch.dtype, device: torch.device, seed: int) -> Data:
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype).mul_(scale).add_(shift)

    return Data(randn(m, n), randn(m, n), randn(n, scale=0.1, shift=1.0), randn(n, scale=0.1), randn(m, n), randn(m, n))


@dataclass(frozen=True)
class Args:
    """The arguments of one case: fresh leaves (requiring grad for fwd+bwd) over the shared storage."""

    x: Tensor
    r: Tensor | None
    w: Tensor
    b: Tensor | None
    grads: tuple[Tensor, ...]

    def leaves(self) -> list[Tensor]:
        return [t for t in (self.x, self.r, self.w, self.b) if t is not None]


def case_args(data: Data, case: Case) -> Args:
    grad = case.mode == "fwdbwd"

    def leaf(t: Tensor) -> Tensor:
        return t.detach().requires_grad_(grad)

    return Args(
        x=leaf(data.x),
        r=leaf(data.r) if case.residual else None,
        w=leaf(data.w),
        b=None if case.rms else leaf(data.b),
        grads=(data.dy, data.dh) if case.residual else (data.dy,),
    )
