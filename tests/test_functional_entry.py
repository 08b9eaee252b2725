"""How the functional API enters the ops (layernorm_ext/functional.py, csrc/python_functions.cpp): the eager
entry points parse arguments as torch's own bindings do, call the same op as the OpOverload, and leave
``__torch_function__`` overrides and torch function modes their say, as torch.nn.functional does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import layernorm_ext as L
from layernorm_ext import native

ops = torch.ops.layernorm_ext


def _calls() -> list[tuple[str, Callable[..., Any], Callable[..., Any], tuple[Any, ...]]]:
    """(name, functional, its op, the op's positional arguments) for one small case of each function."""
    gen = torch.Generator().manual_seed(0)
    x, r = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    w, b = torch.randn(5, generator=gen), torch.randn(5, generator=gen)
    return [
        ("layer_norm", lambda: L.layer_norm(x, 5, w, b, 1e-3), ops.layer_norm, (x, [5], w, b, 1e-3)),
        ("rms_norm", lambda: L.rms_norm(x, (5,), w, 1e-3), ops.rms_norm, (x, [5], w, 1e-3)),
        ("add_layer_norm", lambda: L.add_layer_norm(x, r, [5], w, b, 1e-3), ops.add_layer_norm,
         (x, r, [5], w, b, 1e-3)),
        ("add_rms_norm", lambda: L.add_rms_norm(x, r, torch.Size([5]), w), ops.add_rms_norm, (x, r, [5], w)),
    ]  # fmt: skip


@pytest.mark.parametrize("index", range(4), ids=["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_eager_entry_equals_the_op(index: int) -> None:
    _, functional, op, args = _calls()[index]
    got, want = functional(), op(*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w)


def test_keyword_arguments_and_defaults() -> None:
    x, w = torch.randn(2, 4), torch.randn(4)
    want = ops.layer_norm(x, [4], w, None, 1e-5, False)
    assert torch.equal(native.layer_norm(input=x, normalized_shape=[4], weight=w), want)
    assert torch.equal(L.layer_norm(x, normalized_shape=4, weight=w), want)
    assert torch.equal(native.rms_norm(x, [4]), ops.rms_norm(x, [4]))


def test_argument_types_are_checked() -> None:
    with pytest.raises(TypeError, match=r"layer_norm\(\): argument 'input' \(position 1\) must be Tensor"):
        native.layer_norm(3.0, [4])
    with pytest.raises(TypeError, match=r"rms_norm\(\): argument 'weight' .*must be Tensor"):
        native.rms_norm(torch.randn(2, 4), [4], weight="w")


def test_op_errors_come_through() -> None:
    with pytest.raises(RuntimeError, match=r"given normalized_shape=\[3\], expected input with shape \[\*, 3\]"):
        L.layer_norm(torch.randn(2, 4), 3)


class _Tagged(torch.Tensor):
    """A subclass whose __torch_function__ records what it is called with."""

    seen: list[Any] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.seen.append(func)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("index", range(4), ids=["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_torch_function_override_sees_our_function(index: int) -> None:
    name, _, op, args = _calls()[index]
    functional = getattr(L, name)
    tagged = args[0].as_subclass(_Tagged)
    _Tagged.seen.clear()
    rest = list(args[1:])
    got = functional(tagged, *rest)
    assert _Tagged.seen and _Tagged.seen[0] is functional
    want = op(*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g.as_subclass(torch.Tensor), w)


def test_torch_function_mode_sees_our_function() -> None:
    seen: list[Any] = []

    class Recorder(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 4)
    with Recorder():
        out = L.rms_norm(x, 4)
    assert L.rms_norm in seen
    assert torch.equal(out, ops.rms_norm(x, [4]))


def test_autograd_through_the_entry() -> None:
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    out, h = L.add_layer_norm(x, x.detach() * 2, 6, w)
    (gx, gw) = torch.autograd.grad((out * h).sum(), (x, w))
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    h2 = x2 + x.detach() * 2
    out2 = torch.nn.functional.layer_norm(h2, (6,), w2)
    (gx2, gw2) = torch.autograd.grad((out2 * h2).sum(), (x2, w2))
    torch.testing.assert_close(gx, gx2)
    torch.testing.assert_close(gw, gw2)


def test_eager_entry_keeps_torch_dtype_promotion_errors_of_the_op() -> None:
    """Nothing is converted on the way: an integer tensor reaches the op's own check."""
    with pytest.raises(RuntimeError, match="expected input to be a floating point tensor"):
        L.layer_norm(torch.ones(2, 4, dtype=torch.int64), 4)


def test_a_single_size_of_any_integer_type() -> None:
    """normalized_shape as an int, a numpy integer, or a SymInt while tracing with symbolic shapes."""
    np = pytest.importorskip("numpy")
    x = torch.randn(3, 5)
    want = ops.layer_norm(x, [5])
    assert torch.equal(L.layer_norm(x, np.int64(5)), want)
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(lambda t: L.rms_norm(t, t.shape[-1]), tracing_mode="symbolic")(x)
    assert graph(torch.randn(2, 7)).shape == (2, 7)
