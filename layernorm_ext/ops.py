"""Fake (meta) implementations and autograd formulas for the ops defined in csrc/bindings.cpp.

The ops run their C++ kernels on CPU and CUDA; this module only tells torch.compile / FakeTensor what they
return and wires each forward to its backward op, so that compiled graphs have no breaks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import _checks, sharding
from ._loader import native  # noqa: F401  (loading the library defines the ops)

_ops = torch.ops.layernorm_ext


def residual_out_dtype(input: Tensor, residual: Tensor, residual_in_fp32: bool) -> torch.dtype:
    """dtype of h = input + residual (mirrors residual_out_dtype in csrc/norm_checks.cpp)."""
    dtype = torch.promote_types(input.dtype, residual.dtype)
    return torch.promote_types(dtype, torch.float32) if residual_in_fp32 else dtype


def _stat_dtype(h_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if h_dtype == torch.float64 else torch.float32


# The fake kernels check their arguments as the C++ ops do (layernorm_ext/_checks.py mirrors
# csrc/norm_checks.cpp), so that torch.compile / torch.export reject what eager rejects, with the same error.


def _fake_forward(
    op: str,
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    residual_in_fp32: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    stat_shape = _checks.check_forward(op, input, normalized_shape, weight, bias, residual)
    h_dtype = input.dtype if residual is None else residual_out_dtype(input, residual, residual_in_fp32)
    out = input.new_empty(input.shape)
    residual_out = input.new_empty(input.shape if residual is not None else (0,), dtype=h_dtype)
    stat = input.new_empty(stat_shape, dtype=_stat_dtype(h_dtype))
    return out, residual_out, stat


@torch.library.register_fake("layernorm_ext::layer_norm_fwd")
def _layer_norm_fwd_fake(
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    residual: Tensor | None = None,
    residual_in_fp32: bool = False,
    memory_efficient: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out, residual_out, stat = _fake_forward(
        "layer_norm", input, normalized_shape, weight, bias, residual, residual_in_fp32
    )
    return out, residual_out, stat, torch.empty_like(stat)


@torch.library.register_fake("layernorm_ext::rms_norm_fwd")
def _rms_norm_fwd_fake(
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    eps: float | None,
    residual: Tensor | None = None,
    residual_in_fp32: bool = False,
    memory_efficient: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    return _fake_forward("rms_norm", input, normalized_shape, weight, None, residual, residual_in_fp32)


def _param_grad_placeholder(saved: Tensor, param: Tensor | None, other: Tensor | None) -> Tensor:
    if param is not None:
        return torch.empty_like(param, memory_format=torch.contiguous_format)
    dtype = other.dtype if other is not None else saved.dtype
    return saved.new_empty((0,), dtype=dtype)


@torch.library.register_fake("layernorm_ext::layer_norm_bwd")
def _layer_norm_bwd_fake(
    grad_out: Tensor,
    saved: Tensor,
    mean: Tensor,
    rstd: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    saved_is_output: bool = False,
    grad_residual_out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    _checks.check_backward(
        "layer_norm_backward", grad_out, saved, mean, rstd, normalized_shape, weight, bias, grad_residual_out,
        saved_is_output,
    )
    return (
        saved.new_empty(saved.shape),
        _param_grad_placeholder(saved, weight, bias),
        _param_grad_placeholder(saved, bias, weight),
    )


@torch.library.register_fake("layernorm_ext::rms_norm_bwd")
def _rms_norm_bwd_fake(
    grad_out: Tensor,
    saved: Tensor,
    rstd: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    saved_is_output: bool = False,
    grad_residual_out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    _checks.check_backward(
        "rms_norm_backward", grad_out, saved, None, rstd, normalized_shape, weight, None, grad_residual_out,
        saved_is_output,
    )
    return saved.new_empty(saved.shape), _param_grad_placeholder(saved, weight, None)


# ---- autograd --------------------------------------------------------------------------------------------


def _is_traced(t: Tensor) -> bool:
    """True while torch.compile / export trace with fake tensors, whose values cannot be read."""
    if torch.compiler.is_compiling():
        return True
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


# memory_efficient recovers xhat = (out - bias) / weight from the rounded output: the absolute error of xhat
# is about eps(out dtype) * (|xhat| + |bias / weight|). Columns where |bias| > this many |weight| would lose
# accuracy (weight == 0 loses xhat altogether), so such a weight makes the forward save the input instead.
MAX_BIAS_OVER_WEIGHT = 4.0


def _can_save_output(
    input: Tensor, weight: Tensor | None, bias: Tensor | None, memory_efficient: bool, has_residual: bool
) -> bool:
    """Whether the backward may recover xhat from the output instead of reading the saved input.

    Not with a residual: h is an output of the op already, so saving it costs no more than saving out. Not
    when the output is coarser than the weights (half input, float32 weight): xhat would only be as precise as
    the half output, while the gradients are float32. Not when a weight entry is 0, much smaller than its
    bias (see MAX_BIAS_OVER_WEIGHT), or either is not finite. Not while tracing (torch.compile / export), when
    the weight's values cannot be read, nor during CUDA graph capture, when reading them (a wait for the GPU)
    is forbidden. In all these cases the input is saved, so the gradients stay exact. Otherwise, on CUDA, the
    check reads one flag from the GPU: memory_efficient costs one host synchronization per call.
    """
    if not memory_efficient or has_residual:
        return False
    params = [t for t in (weight, bias) if t is not None]
    if any(t.dtype != input.dtype or _is_traced(t) for t in params):
        return False
    if not params:
        return True
    if input.is_cuda and torch.cuda.is_current_stream_capturing():
        return False  # reading the weight below waits for the GPU, which CUDA graph capture forbids
    # Written as what is safe, so that NaN (every comparison false) and infinite entries are unsafe too: the
    # output of such a column holds no xhat to recover, while the weight's gradient needs it.
    # DTensor parameters are read whole (no collective when replicated), so every rank takes the same choice.
    weight, bias = (sharding.full_tensor(t) for t in (weight, bias))
    magnitude = weight.abs() if weight is not None else torch.ones_like(bias)
    safe = (magnitude > 0) & (magnitude < math.inf)
    if bias is not None:
        safe = safe & (bias.abs() <= MAX_BIAS_OVER_WEIGHT * magnitude)
    return bool(safe.all())


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...], rms: bool) -> None:
    if rms:
        input, normalized_shape, weight, eps, residual, residual_in_fp32, memory_efficient = inputs
        bias = None
        out, residual_out, rstd = output
        mean = None
    else:
        input, normalized_shape, weight, bias, eps, residual, residual_in_fp32, memory_efficient = inputs
        out, residual_out, mean, rstd = output
    has_residual = residual is not None
    ctx.saved_is_output = _can_save_output(input, weight, bias, memory_efficient, has_residual)
    if ctx.saved_is_output:
        saved = out
    else:
        saved = residual_out if has_residual else input
    ctx.normalized_shape = list(normalized_shape)
    ctx.has_residual = has_residual
    ctx.input_dtype = input.dtype
    ctx.residual_dtype = residual.dtype if has_residual else None
    ctx.out_shape = out.shape
    ctx.out_dtype = out.dtype
    ctx.save_for_backward(saved, mean, rstd, weight, bias)
    # The gradient of an unused output comes as None, not as zeros autograd would make (plain tensors even
    # for DTensor outputs): _backward makes only the one the kernel needs, and grad_residual_out=None is free.
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(rstd)
    if mean is not None:
        ctx.mark_non_differentiable(mean)


def _backward(ctx: Any, grad_out: Tensor | None, grad_residual_out: Tensor | None, rms: bool) -> tuple[Any, ...]:
    saved, mean, rstd, weight, bias = ctx.saved_tensors
    if grad_out is None:  # only residual_out was used
        grad_out = saved.new_zeros(ctx.out_shape, dtype=ctx.out_dtype)  # a DTensor for DTensor inputs
    if not ctx.has_residual:
        grad_residual_out = None
    if rms:
        grad_h, grad_weight = _ops.rms_norm_bwd(
            grad_out, saved, rstd, ctx.normalized_shape, weight, ctx.saved_is_output, grad_residual_out
        )
        grad_bias = None
    else:
        grad_h, grad_weight, grad_bias = _ops.layer_norm_bwd(
            grad_out, saved, mean, rstd, ctx.normalized_shape, weight, bias, ctx.saved_is_output, grad_residual_out
        )
    grad_input = grad_h.to(ctx.input_dtype)
    grad_residual = grad_h.to(ctx.residual_dtype) if ctx.has_residual else None
    grad_weight = grad_weight if weight is not None else None
    grad_bias = grad_bias if bias is not None else None
    if rms:
        # input, normalized_shape, weight, eps, residual, residual_in_fp32, memory_efficient
        return grad_input, None, grad_weight, None, grad_residual, None, None
    # input, normalized_shape, weight, bias, eps, residual, residual_in_fp32, memory_efficient
    return grad_input, None, grad_weight, grad_bias, None, grad_residual, None, None


def _layer_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    _setup_context(ctx, inputs, output, rms=False)


def _layer_norm_backward(
    ctx: Any, grad_out: Tensor | None, grad_residual_out: Tensor | None, _grad_mean: Any, _grad_rstd: Any
) -> tuple[Any, ...]:
    return _backward(ctx, grad_out, grad_residual_out, rms=False)


def _rms_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    _setup_context(ctx, inputs, output, rms=True)


def _rms_norm_backward(
    ctx: Any, grad_out: Tensor | None, grad_residual_out: Tensor | None, _grad_rstd: Any
) -> tuple[Any, ...]:
    return _backward(ctx, grad_out, grad_residual_out, rms=True)


torch.library.register_autograd(
    "layernorm_ext::layer_norm_fwd", _layer_norm_backward, setup_context=_layer_norm_setup
)
torch.library.register_autograd("layernorm_ext::rms_norm_fwd", _rms_norm_backward, setup_context=_rms_norm_setup)


# DTensor sharding strategies (layernorm_ext/sharding.py), registered once torch.distributed.tensor is loaded.
sharding.register_when_imported()
