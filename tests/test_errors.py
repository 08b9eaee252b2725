"""Bad arguments raise a clear RuntimeError (worded like ATen's, see csrc/norm_checks.cpp) and never crash.

Every forward case runs through the functional API and through the raw ``torch.ops.layernorm_ext`` op; the
backward ops (not reachable with bad arguments through autograd) are called raw. Each runs on every device
(the checks come before anything device-specific: on CUDA no device guard or stream is touched first), and
once more in a fresh process after a few dozen valid calls, with inputs that require grad, where a crash
would kill only that process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor

import layernorm_ext
from conftest import DEVICES
from layernorm_ext import add_layer_norm, add_rms_norm, layer_norm, rms_norm

_ops = torch.ops.layernorm_ext
_GEN_SEED = 11


_making_on = ["cpu"]  # the device _t makes tensors on (see on_device)


@contextmanager
def on_device(device: str) -> Iterator[None]:
    """Within it, _t makes its tensors on ``device`` (meta tensors stay meta)."""
    _making_on.append(device)
    try:
        yield
    finally:
        _making_on.pop()


def _t(*shape: int, dtype: torch.dtype = torch.float32, device: str | None = None) -> Tensor:
    device = _making_on[-1] if device is None else device
    gen = torch.Generator().manual_seed(_GEN_SEED)
    base = torch.randn(shape, generator=gen, dtype=torch.float64)
    if dtype == torch.bool:
        return (base > 0).to(device)
    if not dtype.is_floating_point and not dtype.is_complex:
        return (base * 10).to(dtype).to(device)
    return base.to(device=device, dtype=dtype)


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.empty(shape, device="meta", dtype=dtype)


@dataclass
class FwdCase:
    """One bad forward call: ``kinds`` says which norms it applies to ("ln", "rms")."""

    id: str
    match: str
    input: Callable[[], Tensor]
    normalized_shape: list[int]
    weight: Callable[[], Tensor | None] = lambda: None
    bias: Callable[[], Tensor | None] = lambda: None
    residual: Callable[[], Tensor | None] = lambda: None
    kinds: tuple[str, ...] = ("ln", "rms")
    extra: dict[str, Any] = field(default_factory=dict)


SAME_DEVICE = r"expected all tensors to be on the same device, but found at least two devices, (cpu|cuda:\d+) and meta"

FWD_CASES = [
    FwdCase("shape_mismatch", r"given normalized_shape=\[7\], expected input with shape \[\*, 7\], "
            r"but got input of size\s*\[4, 8\]", lambda: _t(4, 8), [7]),
    FwdCase("shape_mismatch_2d", r"given normalized_shape=\[3, 8\], expected input with shape \[\*, 3, 8\]",
            lambda: _t(2, 4, 8), [3, 8]),
    FwdCase("shape_longer_than_input", r"given normalized_shape=\[2, 8\], expected input with shape \[\*, 2, 8\]",
            lambda: _t(8), [2, 8]),
    FwdCase("shape_mismatch_empty_input", r"given normalized_shape=\[7\]", lambda: _t(0, 8), [7]),
    FwdCase("empty_normalized_shape", r"expected normalized_shape to be at least 1-dimensional", lambda: _t(4, 8), []),
    FwdCase("weight_wrong_shape", r"expected weight to be of same shape as normalized_shape, but got weight of "
            r"shape \[7\] and normalized_shape = \[8\]", lambda: _t(4, 8), [8], weight=lambda: _t(7)),
    FwdCase("weight_flat_for_2d_shape", r"expected weight to be of same shape as normalized_shape",
            lambda: _t(3, 2, 4), [2, 4], weight=lambda: _t(8)),
    FwdCase("bias_wrong_shape", r"expected bias to be of same shape as normalized_shape, but got bias of shape "
            r"\[1, 8\]", lambda: _t(4, 8), [8], weight=lambda: _t(8), bias=lambda: _t(1, 8), kinds=("ln",)),
    FwdCase("int_input", r"expected input to be a floating point tensor.*but got input of dtype Long",
            lambda: _t(4, 8, dtype=torch.int64), [8]),
    FwdCase("int32_input", r"expected input to be a floating point tensor.*dtype Int",
            lambda: _t(4, 8, dtype=torch.int32), [8]),
    FwdCase("complex_input", r"expected input to be a floating point tensor.*dtype ComplexFloat",
            lambda: _t(4, 8, dtype=torch.complex64), [8]),
    FwdCase("bool_input", r"expected input to be a floating point tensor.*dtype Bool",
            lambda: _t(4, 8, dtype=torch.bool), [8]),
    FwdCase("int_weight", r"expected weight to be a floating point tensor.*but got weight of dtype Long",
            lambda: _t(4, 8), [8], weight=lambda: _t(8, dtype=torch.int64)),
    FwdCase("int_bias", r"expected bias to be a floating point tensor.*dtype Int",
            lambda: _t(4, 8), [8], bias=lambda: _t(8, dtype=torch.int32), kinds=("ln",)),
    FwdCase("weight_bias_dtypes_differ", r"expected weight and bias to have the same dtype, but got weight of "
            r"dtype BFloat16 and bias of dtype Float", lambda: _t(4, 8, dtype=torch.bfloat16), [8],
            weight=lambda: _t(8, dtype=torch.bfloat16), bias=lambda: _t(8), kinds=("ln",)),
    # rms_norm takes a weight of any floating dtype, as ATen's (tests/test_dtypes.py holds every triple).
    FwdCase("fp32_input_bf16_weight", r"expected weight to have the input's dtype \(Float\), but got weight of "
            r"dtype BFloat16", lambda: _t(4, 8), [8], weight=lambda: _t(8, dtype=torch.bfloat16), kinds=("ln",)),
    FwdCase("fp32_input_fp64_weight", r"expected weight to have the input's dtype \(Float\), but got weight of "
            r"dtype Double", lambda: _t(4, 8), [8], weight=lambda: _t(8, dtype=torch.float64), kinds=("ln",)),
    FwdCase("fp16_input_fp64_weight", r"expected weight to have the input's dtype \(Half\) or float32, but got "
            r"weight of dtype Double", lambda: _t(4, 8, dtype=torch.float16), [8],
            weight=lambda: _t(8, dtype=torch.float64), kinds=("ln",)),
    FwdCase("bf16_input_fp16_weight", r"expected weight to have the input's dtype \(BFloat16\) or float32",
            lambda: _t(4, 8, dtype=torch.bfloat16), [8], weight=lambda: _t(8, dtype=torch.float16), kinds=("ln",)),
    FwdCase("fp32_input_bf16_bias", r"expected bias to have the input's dtype \(Float\)",
            lambda: _t(4, 8), [8], bias=lambda: _t(8, dtype=torch.bfloat16), kinds=("ln",)),
    FwdCase("weight_on_meta", SAME_DEVICE + r".*argument weight", lambda: _t(4, 8), [8], weight=lambda: _meta(8)),
    FwdCase("bias_on_meta", SAME_DEVICE + r".*argument bias", lambda: _t(4, 8), [8], weight=lambda: _t(8),
            bias=lambda: _meta(8), kinds=("ln",)),
    FwdCase("residual_on_meta", SAME_DEVICE + r".*argument residual", lambda: _t(4, 8), [8],
            residual=lambda: _meta(4, 8)),
    FwdCase("residual_wrong_shape", r"expected residual to have the same shape as input, but got residual of "
            r"shape \[8\] and input of shape \[4, 8\]", lambda: _t(4, 8), [8], residual=lambda: _t(8)),
    FwdCase("residual_wrong_shape_same_numel", r"expected residual to have the same shape as input",
            lambda: _t(4, 8), [8], residual=lambda: _t(8, 4)),
    FwdCase("int_residual", r"expected residual to be a floating point tensor.*dtype Long",
            lambda: _t(4, 8), [8], residual=lambda: _t(4, 8, dtype=torch.int64)),
    FwdCase("complex_residual", r"expected residual to be a floating point tensor.*dtype ComplexFloat",
            lambda: _t(4, 8), [8], residual=lambda: _t(4, 8, dtype=torch.complex64)),
    # The three calls that killed a process on an H200 (2026-11-30), exactly as reported.
    FwdCase("h200_empty_shape", r"expected normalized_shape to be at least 1-dimensional",
            lambda: _t(1, 2, 3), []),
    FwdCase("h200_weight_shape", r"expected weight to be of same shape as normalized_shape, but got weight of "
            r"shape \[1, 2\] and normalized_shape = \[1, 2, 3\]", lambda: _t(1, 2, 3), [1, 2, 3],
            weight=lambda: _t(1, 2)),
    FwdCase("h200_shape", r"given normalized_shape=\[2, 2\], expected input with shape \[\*, 2, 2\]",
            lambda: _t(2, 2, 3), [2, 2]),
]

_FWD_PARAMS = [
    pytest.param(case, kind, id=f"{case.id}-{kind}") for case in FWD_CASES for kind in ("ln", "rms")
    if kind in case.kinds
]


def _call_functional(case: FwdCase, kind: str) -> object:
    x, w, b, r = case.input(), case.weight(), case.bias(), case.residual()
    if kind == "ln":
        if r is None:
            return layer_norm(x, case.normalized_shape, w, b)
        return add_layer_norm(x, r, case.normalized_shape, w, b)
    assert b is None
    if r is None:
        return rms_norm(x, case.normalized_shape, w)
    return add_rms_norm(x, r, case.normalized_shape, w)


def _call_op(case: FwdCase, kind: str) -> object:
    x, w, b, r = case.input(), case.weight(), case.bias(), case.residual()
    if kind == "ln":
        return _ops.layer_norm_fwd(x, case.normalized_shape, w, b, 1e-5, r, False, False)
    return _ops.rms_norm_fwd(x, case.normalized_shape, w, None, r, False, False)


@pytest.mark.parametrize(("case", "kind"), _FWD_PARAMS)
@pytest.mark.parametrize("api", ["functional", "op"])
def test_forward_bad_args(case: FwdCase, kind: str, api: str, device: str) -> None:
    call = _call_functional if api == "functional" else _call_op
    op_name = "layer_norm" if kind == "ln" else "rms_norm"
    with on_device(device), pytest.raises(RuntimeError, match=rf"{op_name}: .*{case.match}"):
        call(case, kind)


# A fresh process: a few dozen valid calls (forward and backward, some inputs requiring grad), then every bad
# forward case of FWD_CASES with inputs that require grad, each of which must raise its error.
_AFTER_MANY_CALLS = """
import torch
import test_errors as T
from layernorm_ext import add_rms_norm, layer_norm, rms_norm

device = {device!r}
for i in range(36):
    n = (1, 7, 64, 769)[i % 4]
    x = torch.randn(3, n, device=device, requires_grad=i % 2 == 0)
    w = torch.randn(n, device=device, requires_grad=i % 3 == 0)
    y = layer_norm(x, (n,), w, None) + rms_norm(x, (n,), w) + add_rms_norm(x, x, (n,), w)[0]
    if y.requires_grad:
        y.sum().backward()
raised = 0
with T.on_device(device):
    for case, kind in ((p.values[0], p.values[1]) for p in T._FWD_PARAMS):
        def grad_leaf(t):
            return t.requires_grad_(True) if t is not None and t.is_floating_point() and not t.is_meta else t
        case.input, case.weight = (lambda f=case.input: grad_leaf(f())), (lambda f=case.weight: grad_leaf(f()))
        try:
            T._call_functional(case, kind)
        except RuntimeError as e:
            assert case.match and __import__("re").search(case.match, str(e)), (case.id, str(e))
            raised += 1
        else:
            raise AssertionError(f"{{case.id}}-{{kind}}: no error")
print("raised", raised)
"""


def test_bad_args_after_many_calls(device: str) -> None:
    """Bad calls after many valid ones, with inputs requiring grad, raise their errors (the process survives)."""
    code = textwrap.dedent(_AFTER_MANY_CALLS).format(device=device)
    tests_dir = str(__import__("pathlib").Path(__file__).resolve().parent)
    run = subprocess.run([sys.executable, "-c", code], cwd=tests_dir, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    assert f"raised {len(_FWD_PARAMS)}" in run.stdout, run.stdout


@pytest.mark.cuda
@pytest.mark.parametrize("which", ["weight", "input"])
def test_mixed_cpu_and_cuda_tensors(which: str) -> None:
    """A CPU input with a CUDA weight (or the reverse) reaches the CUDA kernel: it must say "same device"."""
    x, w = _t(4, 8, device="cpu"), _t(8, device="cpu")
    if which == "weight":
        w = w.cuda()
    else:
        x = x.cuda()
    for call in (lambda: layer_norm(x, [8], w), lambda: rms_norm(x, [8], w)):
        with pytest.raises(RuntimeError, match=r"expected all tensors to be on the same device"):
            call()


@pytest.mark.parametrize("kind", ["ln", "rms"])
def test_forward_bad_args_with_requires_grad(kind: str) -> None:
    """The autograd path checks the same way (the error comes from the op, before any context is saved)."""
    x = _t(4, 8).requires_grad_(True)
    w = _t(7).requires_grad_(True)
    with pytest.raises(RuntimeError, match="expected weight to be of same shape as normalized_shape"):
        if kind == "ln":
            layer_norm(x, [8], w)
        else:
            rms_norm(x, [8], w)


_FORWARD_AD_CALLS: dict[str, Callable[[Tensor, Tensor, Tensor], object]] = {
    "layer_norm": lambda x, r, w: layer_norm(x, (8,), w),
    "rms_norm": lambda x, r, w: rms_norm(x, (8,), w),
    "add_layer_norm": lambda x, r, w: add_layer_norm(x, r, (8,), w),
    "add_rms_norm": lambda x, r, w: add_rms_norm(x, r, (8,), w),
    "FusedRMSNorm": lambda x, r, w: layernorm_ext.FusedRMSNorm(8)(x),
    "layer_norm out=": lambda x, r, w: layer_norm(x, (8,), w, out=torch.empty_like(r)),
}


@pytest.mark.parametrize("call", list(_FORWARD_AD_CALLS))
@pytest.mark.parametrize("dual", ["input", "residual", "weight"])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_forward_ad_is_refused(call: str, dual: str, requires_grad: bool) -> None:
    """Forward-mode AD has no formula here: a dual tensor raises NotImplementedError (as ATen's ops without a
    forward derivative do) instead of an output without its tangent. Also when nothing requires grad, where no
    node is recorded, and for the inference ops (out=)."""
    if call.startswith("FusedRMSNorm") and dual != "input":
        pytest.skip("the module makes its own weight and takes no residual")
    if dual == "residual" and not call.startswith("add_"):
        pytest.skip("no residual argument")
    if requires_grad and call.endswith("out="):
        pytest.skip("out= refuses arguments that require grad anyway")
    tensors = {"input": _t(3, 8), "residual": _t(3, 8), "weight": _t(8)}
    with fwAD.dual_level():
        tensors[dual] = fwAD.make_dual(tensors[dual].requires_grad_(requires_grad), torch.ones_like(tensors[dual]))
        with pytest.raises(NotImplementedError, match="forward AD"):
            _FORWARD_AD_CALLS[call](tensors["input"], tensors["residual"], tensors["weight"])


@pytest.mark.parametrize("kind", ["ln", "rms"])
@pytest.mark.parametrize("module_arg", ["input_dtype", "input_shape"])
def test_module_bad_input(kind: str, module_arg: str) -> None:
    module = layernorm_ext.FusedLayerNorm(8) if kind == "ln" else layernorm_ext.FusedRMSNorm(8)
    if module_arg == "input_dtype":
        x, match = _t(4, 8, dtype=torch.int64), "expected input to be a floating point tensor"
    else:
        x, match = _t(4, 7), r"expected input with shape \[\*, 8\]"
    with pytest.raises(RuntimeError, match=match):
        module(x)


# ---- backward ops -------------------------------------------------------------------------------------------


@dataclass
class BwdArgs:
    grad_out: Tensor
    saved: Tensor
    mean: Tensor | None
    rstd: Tensor
    normalized_shape: list[int]
    weight: Tensor | None
    bias: Tensor | None
    saved_is_output: bool = False
    grad_residual_out: Tensor | None = None


def _valid_bwd_args(kind: str, dtype: torch.dtype = torch.float32) -> BwdArgs:
    x, w, b = _t(4, 8, dtype=dtype), _t(8, dtype=dtype), _t(8, dtype=dtype)
    if kind == "ln":
        _, _, mean, rstd = _ops.layer_norm_fwd(x, [8], w, b, 1e-5)
        return BwdArgs(_t(4, 8, dtype=dtype), x, mean, rstd, [8], w, b)
    _, _, rstd = _ops.rms_norm_fwd(x, [8], w, None)
    return BwdArgs(_t(4, 8, dtype=dtype), x, None, rstd, [8], w, None)


def _call_bwd(kind: str, a: BwdArgs) -> object:
    if kind == "ln":
        assert a.mean is not None
        return _ops.layer_norm_bwd(a.grad_out, a.saved, a.mean, a.rstd, a.normalized_shape, a.weight, a.bias,
                                   a.saved_is_output, a.grad_residual_out)
    return _ops.rms_norm_bwd(a.grad_out, a.saved, a.rstd, a.normalized_shape, a.weight, a.saved_is_output,
                             a.grad_residual_out)


BwdMutation = Callable[[BwdArgs], None]


def _set(**changes: Any) -> BwdMutation:
    def apply(a: BwdArgs) -> None:
        for name, make in changes.items():
            setattr(a, name, make(a) if callable(make) else make)

    return apply


# (id, mutation, match, kinds)
BWD_CASES: list[tuple[str, BwdMutation, str, tuple[str, ...]]] = [
    ("grad_out_wrong_shape", _set(grad_out=lambda a: _t(4, 9)),
     r"expected grad_out of shape \[4, 8\], but got grad_out of shape \[4, 9\]", ("ln", "rms")),
    ("grad_out_transposed_shape", _set(grad_out=lambda a: _t(8, 4)),
     r"expected grad_out of shape \[4, 8\], but got grad_out of shape \[8, 4\]", ("ln", "rms")),
    ("grad_out_int", _set(grad_out=lambda a: _t(4, 8, dtype=torch.int64)),
     r"expected grad_out to be a floating point tensor", ("ln", "rms")),
    ("saved_int", _set(saved=lambda a: _t(4, 8, dtype=torch.int32)),
     r"expected saved to be a floating point tensor", ("ln", "rms")),
    ("saved_shape_vs_normalized_shape", _set(normalized_shape=[7]),
     r"given normalized_shape=\[7\], expected input with shape \[\*, 7\]", ("ln", "rms")),
    ("empty_normalized_shape", _set(normalized_shape=[]),
     r"expected normalized_shape to be at least 1-dimensional", ("ln", "rms")),
    ("rstd_too_few", _set(rstd=lambda a: a.rstd[:3]),
     r"expected rstd to hold one value per row \(4\), but got rstd of shape \[3\]", ("ln", "rms")),
    ("rstd_too_many", _set(rstd=lambda a: torch.ones(5, device=a.rstd.device)),
     r"expected rstd to hold one value per row \(4\)", ("ln", "rms")),
    ("rstd_wrong_dtype", _set(rstd=lambda a: a.rstd.double()),
     r"expected rstd of dtype Float, but got Double", ("ln", "rms")),
    ("rstd_bf16", _set(rstd=lambda a: a.rstd.bfloat16()),
     r"expected rstd of dtype Float, but got BFloat16", ("ln", "rms")),
    ("mean_too_few", _set(mean=lambda a: torch.zeros(2, device=a.rstd.device)),
     r"expected mean to hold one value per row \(4\), but got mean of shape \[2\]", ("ln",)),
    ("mean_wrong_dtype", _set(mean=lambda a: a.mean.half()),
     r"expected mean of dtype Float, but got Half", ("ln",)),
    ("rstd_on_meta", _set(rstd=lambda a: _meta(4)), SAME_DEVICE + r".*argument rstd", ("ln", "rms")),
    ("grad_out_on_meta", _set(grad_out=lambda a: _meta(4, 8)), SAME_DEVICE + r".*argument grad_out",
     ("ln", "rms")),
    ("weight_on_meta", _set(weight=lambda a: _meta(8)), SAME_DEVICE + r".*argument weight", ("ln", "rms")),
    ("weight_wrong_shape", _set(weight=lambda a: _t(9)),
     r"expected weight to be of same shape as normalized_shape", ("ln", "rms")),
    ("bias_wrong_shape", _set(bias=lambda a: _t(4)),
     r"expected bias to be of same shape as normalized_shape", ("ln",)),
    ("weight_wrong_dtype", _set(weight=lambda a: a.weight.bfloat16()),
     r"expected weight to have the input's dtype \(Float\)", ("ln",)),  # rms_norm takes any
    ("weight_int", _set(weight=lambda a: _t(8, dtype=torch.int64)),
     r"expected weight to be a floating point tensor", ("ln", "rms")),
    ("saved_is_output_dtype_mismatch",
     _set(saved=lambda a: a.saved.double(), saved_is_output=True),
     r"with saved_is_output, expected saved \(the forward's output\) to have grad_out's dtype Float, but got Double",
     ("ln", "rms")),
    ("grad_residual_out_wrong_shape", _set(grad_residual_out=lambda a: _t(4, 7)),
     r"expected grad_residual_out of shape \[4, 8\], but got \[4, 7\]", ("ln", "rms")),
    ("grad_residual_out_int", _set(grad_residual_out=lambda a: _t(4, 8, dtype=torch.int64)),
     r"expected grad_residual_out to be a floating point tensor", ("ln", "rms")),
    ("grad_residual_out_on_meta", _set(grad_residual_out=lambda a: _meta(4, 8)),
     SAME_DEVICE + r".*argument grad_residual_out", ("ln", "rms")),
    # Autograd hands the backward a grad_out of the forward output's dtype, never wider than the saved rows.
    ("grad_out_wider_than_saved", _set(grad_out=lambda a: a.grad_out.double()),
     r"expected grad_out to have saved's dtype \(Float\) or a narrower one, but got grad_out of dtype Double",
     ("ln", "rms")),
]

_BWD_PARAMS = [
    pytest.param(mutate, match, kind, id=f"{case_id}-{kind}")
    for case_id, mutate, match, kinds in BWD_CASES
    for kind in kinds
]


@pytest.mark.parametrize(("mutate", "match", "kind"), _BWD_PARAMS)
def test_backward_op_bad_args(mutate: BwdMutation, match: str, kind: str, device: str) -> None:
    with on_device(device):
        args = _valid_bwd_args(kind)
        _call_bwd(kind, args)  # the unmodified arguments are fine
        mutate(args)
        op_name = "layer_norm_backward" if kind == "ln" else "rms_norm_backward"
        with pytest.raises(RuntimeError, match=rf"{op_name}: .*{match}"):
            _call_bwd(kind, args)


@pytest.mark.parametrize("kind", ["ln", "rms"])
def test_backward_stats_follow_fp64_rows(kind: str) -> None:
    """float64 rows need float64 stats: float32 ones are refused."""
    args = _valid_bwd_args(kind, torch.float64)
    _call_bwd(kind, args)
    args.rstd = args.rstd.float()
    with pytest.raises(RuntimeError, match=r"expected rstd of dtype Double, but got Float"):
        _call_bwd(kind, args)


_IN_PLACE_OVERLAPS = {
    # name: (input, residual, weight) from one buffer of 5 rows of 8; ATen refuses writes through overlapping
    # tensors. input and residual are both written (out and h).
    "rows_0_4_and_1_5": (lambda b: b[0:4], lambda b: b[1:5], lambda b: None, "input shares memory with residual"),
    "same_rows": (lambda b: b[0:4], lambda b: b[0:4], lambda b: None, "input shares memory with residual"),
    "weight_in_input": (lambda b: b[0:4], lambda b: b[4:5].expand(4, 8).clone(), lambda b: b[2],
                        "input shares memory with weight"),
    "weight_in_residual": (lambda b: b[0:4].clone(), lambda b: b[0:4], lambda b: b[3],
                           "residual shares memory with weight"),
}  # fmt: skip


@pytest.mark.parametrize("overlap", list(_IN_PLACE_OVERLAPS))
@pytest.mark.parametrize("kind", ["ln", "rms"])
def test_in_place_refuses_overlapping_arguments(overlap: str, kind: str, device: str) -> None:
    make_input, make_residual, make_weight, match = _IN_PLACE_OVERLAPS[overlap]
    buf = _t(5, 8, device=device)
    before = buf.clone()
    x, r, w = make_input(buf), make_residual(buf), make_weight(buf)
    op = "add_layer_norm_" if kind == "ln" else "add_rms_norm_"
    with pytest.raises(RuntimeError, match=rf"{op}: {match}"):
        if kind == "ln":
            layernorm_ext.add_layer_norm_(x, r, [8], w)
        else:
            layernorm_ext.add_rms_norm_(x, r, [8], w)
    assert torch.equal(buf, before)  # refused before anything was written


def test_library_still_works_after_errors() -> None:
    """Errors leave nothing behind: a valid call right after a failed one gives ATen's result."""
    x, w, b = _t(4, 8), _t(8), _t(8)
    for bad in (lambda: layer_norm(x, [7], w, b), lambda: rms_norm(x, [8], _t(8, dtype=torch.int64))):
        with pytest.raises(RuntimeError):
            bad()
    torch.testing.assert_close(layer_norm(x, [8], w, b), torch.nn.functional.layer_norm(x, [8], w, b))
    torch.testing.assert_close(rms_norm(x, [8], w), torch.nn.functional.rms_norm(x, [8], w))


# ---- the same cases under FakeTensorMode (what torch.compile / torch.export trace with) ---------------------


def _fake(mode: Any, t: Tensor | None) -> Tensor | None:
    return None if t is None else mode.from_tensor(t)


@pytest.mark.parametrize(("case", "kind"), _FWD_PARAMS)
def test_fake_forward_bad_args(case: FwdCase, kind: str) -> None:
    """The fake kernels raise what the C++ op raises, word for word (layernorm_ext/_checks.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    x, w, b, r = (_fake(mode, t) for t in (case.input(), case.weight(), case.bias(), case.residual()))
    op_name = "layer_norm" if kind == "ln" else "rms_norm"
    with mode, pytest.raises(RuntimeError, match=rf"{op_name}: .*{case.match}"):
        if kind == "ln":
            _ops.layer_norm_fwd(x, case.normalized_shape, w, b, 1e-5, r, False, False)
        else:
            _ops.rms_norm_fwd(x, case.normalized_shape, w, None, r, False, False)


@pytest.mark.parametrize(("mutate", "match", "kind"), _BWD_PARAMS)
def test_fake_backward_bad_args(mutate: BwdMutation, match: str, kind: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _valid_bwd_args(kind)
    mutate(args)
    mode = FakeTensorMode()
    for name in ("grad_out", "saved", "mean", "rstd", "weight", "bias", "grad_residual_out"):
        setattr(args, name, _fake(mode, getattr(args, name)))
    op_name = "layer_norm_backward" if kind == "ln" else "rms_norm_backward"
    with mode, pytest.raises(RuntimeError, match=rf"{op_name}: .*{match}"):
        _call_bwd(kind, args)


def test_fake_messages_equal_the_ops() -> None:
    """Not only the pattern: the fake kernel's message is the C++ op's, character for character."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for param in _FWD_PARAMS:
        case, kind = param.values
        inputs = (case.input(), case.weight(), case.bias(), case.residual())
        if any(t is not None and t.is_meta for t in inputs):
            continue  # a real call mixing meta and CPU tensors is the fake kernel's own case
        messages = []
        for fake in (False, True):
            mode = FakeTensorMode() if fake else None
            x, w, b, r = (_fake(mode, t) if fake else t for t in inputs)
            try:
                with mode if fake else _nullcontext():
                    if kind == "ln":
                        _ops.layer_norm_fwd(x, case.normalized_shape, w, b, 1e-5, r, False, False)
                    else:
                        _ops.rms_norm_fwd(x, case.normalized_shape, w, None, r, False, False)
            except RuntimeError as e:
                messages.append(str(e).splitlines()[0])
        assert len(messages) == 2 and messages[0] == messages[1], (param.id, messages)


def _nullcontext() -> Any:
    from contextlib import nullcontext

    return nullcontext()
