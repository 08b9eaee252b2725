#!/usr/bin/env python
"""End to end: stacks of transformer blocks with ATen's norms against the same stacks after ``replace_norms``.

    python benchmarks/e2e.py                       # CPU (and CUDA when available), 1 thread; ~1 min on 2 cores
    python benchmarks/e2e.py --quick               # smoke run: tiny sizes, a few seconds
    python benchmarks/e2e.py --models llama --dtypes bf16 --threads 2 --out e2e.md

What is measured: one case per (device, model, dtype). Every model is a stack of ``--layers`` blocks of width
``--hidden`` built from torch.nn alone (no model library), ``--head-dim`` wide attention heads, run on
``--batch`` x ``--seq`` tokens (``--cuda-batch`` x ``--cuda-seq`` on CUDA):

- ``gpt``: pre-norm GPT-2 block, ``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))``; ``torch.nn.LayerNorm`` (eps 1e-5),
  causal attention through ``F.scaled_dot_product_attention(is_causal=True)``, MLP Linear-GELU(tanh)-Linear
  (4x), biases; a final LayerNorm after the stack.
- ``bert``: post-norm BERT block, ``ln(x + attn(x))``, ``ln(x + mlp(x))``; ``torch.nn.LayerNorm`` (eps 1e-12)
  after each residual add, bidirectional attention, MLP Linear-GELU-Linear (4x), biases; no final norm.
- ``llama``: pre-norm Llama block: RMSNorm written as Hugging Face's ``LlamaRMSNorm`` (a local class: float32
  statistics, cast back to the input dtype, then ``weight *``; attribute ``variance_epsilon`` = 1e-6), which
  ``replace_norms`` recognises by duck typing; rotary embeddings, causal attention, SwiGLU MLP
  (``down(silu(gate(x)) * up(x))``, hidden 8/3 x rounded up to 256), no biases; a final RMSNorm.
- ``llama-nn``: the same block with ``torch.nn.RMSNorm(eps=1e-6)`` (replaced by class, not by duck typing).

Every norm's weight (and bias) is drawn at random (weight in [0.5, 1.5], bias in [-0.2, 0.2]), so that a
mishandled parameter shows. How, per case: the model is built in float32 from ``--seed``, cast to the dtype,
deep-copied, and ``layernorm_ext.replace_norms`` runs on the copy; the case fails unless its report replaced
exactly the norms the model holds (2 per block, plus the final one) with the expected classes and left none alone.
Then:

- accuracy: the same input x and the same fixed cotangent g through both (``torch.autograd.grad(out, (x,
  *params), g)``): max |ours - ATen| of the output, of the gradient of x and of every parameter's gradient
  (relative = divided by max |ATen|); and, for scale, each one's error against a float64 copy of the ATen model
  (its weights the exact upcast of the case's; the Hugging Face norm computes in float32 there too).
- time: ``fwd`` = ``model(x)`` under ``torch.inference_mode``; ``fwd+bwd`` = forward and
  ``torch.autograd.grad(out, (x, *params), g)`` (no ``.grad`` accumulation). After ``--warmup`` untimed calls,
  K calls per loop (K such that a loop takes about ``--target-ms``, at least 1), ``--rounds`` rounds of one loop
  per implementation, which goes first alternating per round, Python's garbage collector off; reported: the
  median over rounds of the per-call time, and the ratio of the medians ours/ATen (> 1: ours slower). CPU:
  ``time.perf_counter`` at ``torch.set_num_threads(--threads)``; CUDA: a synchronize before and after each loop,
  and CUDA events around it.

The norms are a small part of a block's time (its matmuls and attention dominate), so the ratios say what the
replacement is worth in a whole model, not what the kernels are worth: ``bench.py`` measures those.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import layernorm_ext
from common import comma_list, finish_report, report_head

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
IMPLS = ("ours", "aten")
MODES = ("fwd", "fwd+bwd")

Rope = tuple[Tensor, Tensor]
Call = Callable[[], object]


# ---- the models --------------------------------------------------------------------------------------------


class LlamaRMSNorm(nn.Module):
    """RMSNorm as Hugging Face's transformers writes it (LlamaRMSNorm), copied so that no model library is needed."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm, LlamaRMSNorm)


def rope_tables(seq: int, head_dim: int, device: torch.device, dtype: torch.dtype, base: float = 10000.0) -> Rope:
    """(cos, sin) of the rotary angles, (seq, head_dim), computed in float32 and cast (as Hugging Face does)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(t: Tensor, rope: Rope) -> Tensor:
    """Rotary embedding of t (..., seq, head_dim), rotate-half convention."""
    cos, sin = rope
    half = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    """Multi-head self-attention: fused qkv projection, scaled_dot_product_attention, output projection."""

    def __init__(self, dim: int, head_dim: int, *, bias: bool, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = dim // head_dim, causal
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.out = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: Tensor, rope: Rope | None = None) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


def gelu_mlp(dim: int, approximate: str) -> nn.Sequential:
    return nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate=approximate), nn.Linear(4 * dim, dim))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GPTBlock(nn.Module):
    """Pre-norm: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, dim: int, head_dim: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-5)
        self.attn = Attention(dim, head_dim, bias=True, causal=True)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-5)
        self.mlp = gelu_mlp(dim, "tanh")

    def forward(self, x: Tensor, rope: Rope | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class BertBlock(nn.Module):
    """Post-norm: ln(x + attn(x)), then ln(x + mlp(x))."""

    def __init__(self, dim: int, head_dim: int) -> None:
        super().__init__()
        self.attn = Attention(dim, head_dim, bias=True, causal=False)
        self.attention_norm = nn.LayerNorm(dim, eps=1e-12)
        self.mlp = gelu_mlp(dim, "none")
        self.output_norm = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x: Tensor, rope: Rope | None = None) -> Tensor:
        x = self.attention_norm(x + self.attn(x))
        return self.output_norm(x + self.mlp(x))


class LlamaBlock(nn.Module):
    """Pre-norm, RMSNorm, rotary causal attention, SwiGLU, no biases."""

    def __init__(self, dim: int, head_dim: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.input_layernorm = norm(dim)
        self.self_attn = Attention(dim, head_dim, bias=False, causal=True)
        self.post_attention_layernorm = norm(dim)
        self.mlp = SwiGLU(dim, llama_hidden(dim))

    def forward(self, x: Tensor, rope: Rope | None = None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


def llama_hidden(dim: int, multiple_of: int = 256) -> int:
    hidden = int(2 * 4 * dim / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


class Stack(nn.Module):
    """Blocks in sequence, then the final norm (if any); rotary tables when rope_head_dim is set."""

    def __init__(self, blocks: Sequence[nn.Module], norm: nn.Module | None, rope_head_dim: int | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.norm = norm
        self.rope_head_dim = rope_head_dim

    def forward(self, x: Tensor) -> Tensor:
        rope = None
        if self.rope_head_dim is not None:
            rope = rope_tables(x.shape[1], self.rope_head_dim, x.device, x.dtype)
        for block in self.blocks:
            x = block(x, rope)
        return x if self.norm is None else self.norm(x)


@dataclass(frozen=True)
class ModelSpec:
    description: str
    build: Callable[[int, int, int], Stack]  # (layers, hidden, head_dim) -> model
    replaced_class: str  # the class replace_norms must put in place of every norm


def build_gpt(layers: int, dim: int, head_dim: int) -> Stack:
    return Stack([GPTBlock(dim, head_dim) for _ in range(layers)], nn.LayerNorm(dim, eps=1e-5), None)


def build_bert(layers: int, dim: int, head_dim: int) -> Stack:
    return Stack([BertBlock(dim, head_dim) for _ in range(layers)], None, None)


def build_llama(layers: int, dim: int, head_dim: int) -> Stack:
    def norm(d: int) -> nn.Module:
        return LlamaRMSNorm(d, eps=1e-6)

    return Stack([LlamaBlock(dim, head_dim, norm) for _ in range(layers)], norm(dim), head_dim)


def build_llama_nn(layers: int, dim: int, head_dim: int) -> Stack:
    def norm(d: int) -> nn.Module:
        return nn.RMSNorm(d, eps=1e-6)

    return Stack([LlamaBlock(dim, head_dim, norm) for _ in range(layers)], norm(dim), head_dim)


MODELS: dict[str, ModelSpec] = {
    "gpt": ModelSpec("pre-norm GPT-2 block, nn.LayerNorm, causal, GELU MLP", build_gpt, "FusedLayerNorm"),
    "bert": ModelSpec("post-norm BERT block, nn.LayerNorm, bidirectional, GELU MLP", build_bert, "FusedLayerNorm"),
    "llama": ModelSpec("pre-norm Llama block, Hugging Face-style RMSNorm, RoPE, SwiGLU", build_llama, "FusedRMSNorm"),
    "llama-nn": ModelSpec("the Llama block with nn.RMSNorm", build_llama_nn, "FusedRMSNorm"),
}
DEFAULT_MODELS = ("gpt", "bert", "llama", "llama-nn")


def randomize_norms(model: nn.Module, seed: int) -> None:
    """Norm weights uniform in [0.5, 1.5], biases in [-0.2, 0.2] (instead of ones and zeros)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, NORM_TYPES):
                module.weight.copy_(torch.rand(module.weight.shape, generator=gen) + 0.5)
                if getattr(module, "bias", None) is not None:
                    module.bias.copy_(torch.rand(module.bias.shape, generator=gen) * 0.4 - 0.2)


def make_model(name: str, opts: argparse.Namespace, device: str, dtype: torch.dtype) -> Stack:
    """The ATen model of the case: built in float32 from the seed, norms randomized, cast, in eval mode."""
    torch.manual_seed(opts.seed)
    model = MODELS[name].build(opts.layers, opts.hidden, opts.head_dim)
    randomize_norms(model, opts.seed + 1)
    return model.to(device=device, dtype=dtype).eval()


def norm_names(model: nn.Module) -> dict[str, str]:
    """Qualified name -> class name of every norm module of model."""
    return {name: type(m).__name__ for name, m in model.named_modules() if type(m) in NORM_TYPES}


def replaced_copy(model: Stack, name: str, opts: argparse.Namespace) -> nn.Module:
    """A deep copy of model with replace_norms applied; raises unless it replaced every norm, as expected."""
    expected = norm_names(model)
    count = 2 * opts.layers + (model.norm is not None)
    if len(expected) != count:
        raise AssertionError(f"{name}: the model holds {len(expected)} norms, {count} expected")
    ours = copy.deepcopy(model)
    report = layernorm_ext.replace_norms(ours)
    want = sorted((n, cls, MODELS[name].replaced_class) for n, cls in expected.items())
    # A replacement reads "FusedRMSNorm(cast_before_weight=True)" where it reproduces the original's numerics.
    got = sorted((n, cls, new.split("(")[0]) for n, cls, new in report.replaced)
    if got != want or report.skipped or report.model is not ours:
        raise AssertionError(
            f"{name}: replace_norms replaced {len(report.replaced)} module(s) where {len(want)} norms were expected, "
            f"left {len(report.skipped)} alone: {'; '.join(line.strip() for line in str(report).splitlines()[1:])}"
        )
    if norm_names(ours):
        raise AssertionError(f"{name}: norms left after replace_norms: {norm_names(ours)}")
    return ours


# ---- accuracy ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Diff:
    abs: float
    rel: float  # abs / max |reference|

    def __str__(self) -> str:
        return f"{self.abs:.2e} ({self.rel:.1e})"


def diff(got: Tensor, want: Tensor) -> Diff:
    d = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    scale = want.double().abs().max().item() if want.numel() else 0.0
    return Diff(d, d / scale if scale else (0.0 if d == 0 else math.inf))


@dataclass(frozen=True)
class Result:
    out: Tensor
    grad_x: Tensor
    grads: dict[str, Tensor]  # parameter name -> gradient


def forward_backward(model: nn.Module, x: Tensor, g: Tensor) -> Result:
    x = x.detach().clone().requires_grad_()
    params = dict(model.named_parameters())
    out = model(x)
    grad_x, *grads = torch.autograd.grad(out, (x, *params.values()), g)
    return Result(out.detach(), grad_x, dict(zip(params, grads, strict=True)))


@dataclass(frozen=True)
class Accuracy:
    out: Diff
    grad_x: Diff
    worst_param: str  # the parameter whose gradient differs most (relative)
    grad_param: Diff
    ref: dict[str, tuple[Diff, Diff]] | None  # "out", "grad_x" -> (ours, ATen) against float64; None: not run


def accuracy(ours: nn.Module, aten: Stack, x: Tensor, g: Tensor, reference: bool) -> Accuracy:
    a, b = forward_backward(ours, x, g), forward_backward(aten, x, g)
    if a.grads.keys() != b.grads.keys():
        raise AssertionError(f"parameter names differ: {sorted(a.grads.keys() ^ b.grads.keys())}")
    param_diffs = {name: diff(a.grads[name], b.grads[name]) for name in b.grads}
    worst = max(param_diffs, key=lambda name: param_diffs[name].rel)
    ref = None
    if reference:
        r = forward_backward(copy.deepcopy(aten).double(), x.double(), g.double())
        ref = {
            "out": (diff(a.out, r.out), diff(b.out, r.out)),
            "grad_x": (diff(a.grad_x, r.grad_x), diff(b.grad_x, r.grad_x)),
        }
    return Accuracy(diff(a.out, b.out), diff(a.grad_x, b.grad_x), worst, param_diffs[worst], ref)


# ---- timing ------------------------------------------------------------------------------------------------


def time_loop(call: Call, calls: int, device: str) -> float:
    """Milliseconds per call of `calls` back-to-back calls (CUDA: synchronized, timed by events)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            call()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / calls
    begin = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - begin) * 1e3 / calls


def make_calls(ours: nn.Module, aten: nn.Module, x: Tensor, g: Tensor, mode: str) -> dict[str, Call]:
    if mode == "fwd":
        return {"ours": lambda: ours(x), "aten": lambda: aten(x)}
    xg = x.detach().clone().requires_grad_()

    def fwd_bwd(model: nn.Module) -> Call:
        inputs = (xg, *model.parameters())
        return lambda: torch.autograd.grad(model(xg), inputs, g)

    return {"ours": fwd_bwd(ours), "aten": fwd_bwd(aten)}


def mode_context(mode: str) -> AbstractContextManager[object]:
    return torch.inference_mode() if mode == "fwd" else torch.enable_grad()


def measure(calls: dict[str, Call], mode: str, device: str, opts: argparse.Namespace) -> dict[str, float]:
    """Median ms per call of each implementation over the rounds."""
    with mode_context(mode):
        per_call = max(time_loop(calls[impl], opts.warmup, device) for impl in IMPLS)
        k = max(1, min(1000, round(opts.target_ms / max(per_call, 1e-6))))
        times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
        gc.collect()
        gc.disable()
        try:
            for r in range(opts.rounds):
                for impl in IMPLS if r % 2 == 0 else IMPLS[::-1]:
                    times[impl].append(time_loop(calls[impl], k, device))
        finally:
            gc.enable()
    return {impl: statistics.median(t) for impl, t in times.items()}


# ---- a case ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    device: str
    model: str
    dtype: str


@dataclass(frozen=True)
class Row:
    case: Case
    acc: Accuracy
    ms: dict[str, dict[str, float]]  # mode -> impl -> median ms per call

    def ratio(self, mode: str) -> float:
        return self.ms[mode]["ours"] / self.ms[mode]["aten"]


def tokens(device: str, opts: argparse.Namespace) -> tuple[int, int]:
    return (opts.cuda_batch, opts.cuda_seq) if device == "cuda" else (opts.batch, opts.seq)


def run_case(case: Case, opts: argparse.Namespace) -> Row:
    dtype = DTYPES[case.dtype]
    aten = make_model(case.model, opts, case.device, dtype)
    ours = replaced_copy(aten, case.model, opts)
    batch, seq = tokens(case.device, opts)
    gen = torch.Generator().manual_seed(opts.seed + 2)
    x = torch.randn(batch, seq, opts.hidden, generator=gen).to(case.device, dtype)
    g = torch.randn(batch, seq, opts.hidden, generator=gen).to(case.device, dtype)
    acc = accuracy(ours, aten, x, g, opts.reference)
    ms = {mode: measure(make_calls(ours, aten, x, g, mode), mode, case.device, opts) for mode in MODES}
    return Row(case, acc, ms)


# ---- report ------------------------------------------------------------------------------------------------


def main_table(rows: Sequence[Row]) -> list[str]:
    lines = [
        "| device | model | dtype | max diff out | max diff grad | fwd ms ours | fwd ms ATen | ratio "
        "| fwd+bwd ms ours | ATen | ratio |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        c, f, fb = row.case, row.ms["fwd"], row.ms["fwd+bwd"]
        lines.append(
            f"| {c.device} | {c.model} | {c.dtype} | {row.acc.out} | {row.acc.grad_x} | {f['ours']:.2f} | "
            f"{f['aten']:.2f} | {row.ratio('fwd'):.3f} | {fb['ours']:.2f} | {fb['aten']:.2f} | "
            f"{row.ratio('fwd+bwd'):.3f} |"
        )
    return lines


def accuracy_table(rows: Sequence[Row]) -> list[str]:
    lines = [
        "| device | model | dtype | worst parameter gradient | its max diff | out vs fp64: ours | ATen "
        "| grad x vs fp64: ours | ATen |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        c, acc = row.case, row.acc
        ref = "| - | - | - | - |" if acc.ref is None else (
            f"| {acc.ref['out'][0]} | {acc.ref['out'][1]} | {acc.ref['grad_x'][0]} | {acc.ref['grad_x'][1]} |"
        )  # fmt: skip
        lines.append(f"| {c.device} | {c.model} | {c.dtype} | `{acc.worst_param}` | {acc.grad_param} {ref}")
    return lines


def summary(rows: Sequence[Row]) -> str:
    parts = []
    for device in dict.fromkeys(row.case.device for row in rows):
        for mode in MODES:
            ratios = [row.ratio(mode) for row in rows if row.case.device == device]
            geomean = math.exp(statistics.fmean(math.log(r) for r in ratios))
            parts.append(f"{device} {mode} {geomean:.3f} (range {min(ratios):.3f} to {max(ratios):.3f})")
    return "ours/ATen, geometric mean over cases: " + "; ".join(parts)


def header(opts: argparse.Namespace, wall_s: float, load: str) -> list[str]:
    shapes = [f"{d}: x of {' x '.join(map(str, (*tokens(d, opts), opts.hidden)))}" for d in opts.devices]
    lines = report_head("layernorm_ext end to end: transformer stacks, ATen norms vs replace_norms", wall_s,
                        when=f"; load average at start {load}")  # fmt: skip
    if "cuda" in opts.devices:
        lines.append(f"- cuda: {torch.cuda.get_device_name()} (torch CUDA {torch.version.cuda}); TF32 matmul "
                     f"{'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}")  # fmt: skip
    lines += [
        f"- models: {opts.layers} blocks, hidden {opts.hidden}, head dim {opts.head_dim} "
        f"({opts.hidden // opts.head_dim} heads); {'; '.join(shapes)} (batch x seq x hidden)",
        *(f"  - `{name}`: {MODELS[name].description}" for name in opts.models),
        f"- method: {opts.rounds} rounds of one loop (K calls, about {opts.target_ms:g} ms, at least 1) per "
        f"implementation after {opts.warmup} warm-up calls, alternating which goes first; median per-call time; "
        "ratio = ours/ATen of the medians (> 1: ours slower); "
        + ("CUDA events after a synchronize, synchronized at the end; " if "cuda" in opts.devices else "")
        + "CPU: time.perf_counter",
        "- fwd = model(x) under inference_mode; fwd+bwd = forward + torch.autograd.grad(out, (x, *params), g), "
        "g fixed",
        "- max diff = max |ours - ATen| (in parentheses: relative to max |ATen|) of the output and of the "
        "gradient of x (\"grad\"); the second table gives the parameter gradient that differs most and each "
        "implementation's error against a float64 copy of the ATen model",
        "",
    ]
    return lines


# ---- main --------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--devices", type=comma_list(("cpu", "cuda")), default=None,
                   help="comma list (default: cpu, and cuda when available)")  # fmt: skip
    p.add_argument("--models", type=comma_list(tuple(MODELS)), default=list(DEFAULT_MODELS),
                   help=f"comma list of: {', '.join(MODELS)} (default: {','.join(DEFAULT_MODELS)})")  # fmt: skip
    p.add_argument("--dtypes", type=comma_list(tuple(DTYPES)), default=["fp32", "bf16"], help="default fp32,bf16")
    p.add_argument("--layers", type=int, default=4, help="blocks per model (default 4)")
    p.add_argument("--hidden", type=int, default=1024, help="model width (default 1024)")
    p.add_argument("--head-dim", type=int, default=64, help="attention head width (default 64)")
    p.add_argument("--batch", type=int, default=2, help="CPU batch (default 2)")
    p.add_argument("--seq", type=int, default=32, help="CPU sequence length (default 32)")
    p.add_argument("--cuda-batch", type=int, default=4, help="CUDA batch (default 4)")
    p.add_argument("--cuda-seq", type=int, default=1024, help="CUDA sequence length (default 1024)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per case and mode (default 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per implementation and mode (default 2)")
    p.add_argument("--target-ms", type=float, default=50.0, help="length of one timed loop (default 50 ms)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip the float64 reference (its columns show -)")  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 blocks of width 128, 2 x 8 tokens (CUDA too), 3 rounds, 5 ms loops")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.layers, opts.hidden, opts.head_dim = 2, 128, 32
        opts.batch, opts.seq, opts.cuda_batch, opts.cuda_seq = 2, 8, 2, 8
        opts.rounds, opts.warmup, opts.target_ms = 3, 1, 5.0
    if opts.devices is None:
        opts.devices = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    if "cuda" in opts.devices and not torch.cuda.is_available():
        p.error("--devices cuda: CUDA is not available")
    if opts.hidden % opts.head_dim or opts.head_dim % 2:
        p.error("--hidden must be a multiple of --head-dim, and --head-dim even")
    if min(opts.layers, opts.batch, opts.seq, opts.cuda_batch, opts.cuda_seq, opts.rounds, opts.warmup) < 1:
        p.error("--layers, --batch, --seq, --cuda-batch, --cuda-seq, --rounds and --warmup must be at least 1")
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    torch.set_num_threads(opts.threads)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    started = time.perf_counter()
    cases = [Case(d, m, t) for d in opts.devices for m in opts.models for t in opts.dtypes]
    rows: list[Row] = []
    failures: list[str] = []
    for i, case in enumerate(cases, 1):
        name = f"{case.device} {case.model} {case.dtype}"
        try:
            row = run_case(case, opts)
        except Exception as e:  # noqa: BLE001  (one broken case must not lose the rest of the table)
            message = str(e).strip().splitlines()[0] if str(e).strip() else ""
            failures.append(f"{name}: {type(e).__name__}: {message}")
            print(f"[{i}/{len(cases)}] FAILED {failures[-1]}", file=sys.stderr, flush=True)
            continue
        rows.append(row)
        print(f"[{i}/{len(cases)}] {name}: out {row.acc.out}, fwd {row.ms['fwd']['ours']:.2f} / "
              f"{row.ms['fwd']['aten']:.2f} ms, fwd+bwd {row.ms['fwd+bwd']['ours']:.2f} / "
              f"{row.ms['fwd+bwd']['aten']:.2f} ms", file=sys.stderr, flush=True)  # fmt: skip
    report = [*header(opts, time.perf_counter() - started, load), *main_table(rows), "", *accuracy_table(rows), ""]
    return finish_report(report, failures, summary(rows) if rows else "", opts.out)


if __name__ == "__main__":
    sys.exit(main())
