"""memory_efficient=True reads the parameters once per version (issue 14, item 2).

With ``memory_efficient=True`` the forward saves its output (not its input) for backward only when every weight
entry is finite, nonzero and at least a quarter of its bias; deciding that reads the parameters' values (on CUDA a
host synchronization). The decision is cached per parameter version (csrc/saved_output_cache.cpp). Held here, on
CPU, where the check shows up as ATen ops in the profiler (``aten::all``, ``aten::item``,
``aten::_local_scalar_dense``: the read of the result):

- a second forward with the same, unchanged weight (and bias) runs no check and still saves the output;
- an in-place update (``w[3] = 0``, ``w.zero_()``, ``b[5] = 100`` under no_grad) makes the next forward check
  again and save the input; its gradients are those of ``memory_efficient=False`` bit for bit; restoring a safe
  value switches back to saving the output (checked once more), with gradients close to the exact ones;
- a freed weight whose memory a new tensor could take is not confused with it, nor one weight with two biases;
- ``w.data = other`` (which keeps the version) is seen; ``w.data[3] = 0`` is not (the documented blind spot),
  and gives non-finite gradients in that column, not silently wrong ones;
- inference tensors (no version counter) are checked on every call; more parameter pairs than the cache holds
  keep getting right answers.

The CUDA side (no host sync on the second call, the input saved under graph capture) is in tests/test_cuda.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

import layernorm_ext as L
from layernorm_ext import native

FNS = ("layer_norm", "rms_norm")
M, N = 8, 64
# The ATen ops that only the check of the parameters' values runs in a forward (on CUDA the last two are the sync).
CHECK_OPS = frozenset({"aten::all", "aten::item", "aten::_local_scalar_dense"})


def _randn(seed: int, *shape: int, scale: float = 1.0, shift: float = 0.0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * scale + shift


def _leaves(fn: str, seed: int = 0) -> tuple[Tensor, Tensor, Tensor | None]:
    """Input, weight and (layer_norm) bias requiring grad; the weight is far from 0 and from its bias: safe."""
    x = _randn(seed, M, N).requires_grad_(True)
    w = (torch.rand(N, generator=torch.Generator().manual_seed(seed + 1)) * 0.5 + 0.75).requires_grad_(True)
    b = _randn(seed + 2, N, scale=0.2).requires_grad_(True) if fn == "layer_norm" else None
    return x, w, b


def _call(fn: str, x: Tensor, w: Tensor | None, b: Tensor | None, memory_efficient: bool = True) -> Tensor:
    if fn == "layer_norm":
        return L.layer_norm(x, N, w, b, memory_efficient=memory_efficient)
    return L.rms_norm(x, N, w, memory_efficient=memory_efficient)


def _saved(fn: str, x: Tensor, w: Tensor | None, b: Tensor | None) -> tuple[Tensor, str]:
    """One memory_efficient forward; returns its output and what it saved for backward: "output" or "input"."""
    ptrs: list[int] = []

    def pack(t: Tensor) -> Tensor:
        ptrs.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _call(fn, x, w, b)
    saved_out = out.untyped_storage().data_ptr() in ptrs
    saved_in = x.untyped_storage().data_ptr() in ptrs
    assert saved_out != saved_in, f"saved both or neither of input and output: {ptrs}"
    return out, "output" if saved_out else "input"


@contextmanager
def _check_ops() -> Iterator[set[str]]:
    """The CHECK_OPS that the code in the with block ran (profiled on CPU)."""
    found: set[str] = set()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield found
    found.update(e.name for e in prof.events() if e.name in CHECK_OPS)


def _profiled_saved(fn: str, x: Tensor, w: Tensor | None, b: Tensor | None) -> tuple[Tensor, str, set[str]]:
    with _check_ops() as ops:
        out, saved = _saved(fn, x, w, b)
    return out, saved, ops


def _grads(fn: str, x: Tensor, w: Tensor | None, b: Tensor | None, memory_efficient: bool) -> list[Tensor]:
    """Gradients of every leaf (torch.autograd.grad: nothing accumulates into .grad, the leaves stay as they are)."""
    leaves = [t for t in (x, w, b) if t is not None]
    out = _call(fn, x, w, b, memory_efficient)
    g = _randn(7, *out.shape)
    return list(torch.autograd.grad(out, leaves, g))


def _assert_same(got: list[Tensor], want: list[Tensor], what: str) -> None:
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, e), f"{what}: gradient {i} differs from memory_efficient=False"


@pytest.mark.parametrize("fn", FNS)
def test_second_call_runs_no_check(fn: str) -> None:
    """The first forward with new parameters checks them; later ones with the same, unchanged parameters do
    not (also after a backward), and keep saving the output."""
    x, w, b = _leaves(fn)
    _, saved, ops = _profiled_saved(fn, x, w, b)
    assert saved == "output"
    assert ops == CHECK_OPS, f"the first call should check the parameters, ran {sorted(ops)}"
    for call in range(3):
        out, saved, ops = _profiled_saved(fn, x, w, b)
        assert saved == "output", f"call {call + 2}"
        assert not ops, f"call {call + 2} read the parameters again: {sorted(ops)}"
        torch.autograd.grad(out, [t for t in (x, w, b) if t is not None], torch.ones_like(out))


# In-place updates that make the parameters unsafe, and the ones that make them safe again.
Update = Callable[[Tensor, Tensor | None], None]


def _zero_entry(w: Tensor, b: Tensor | None) -> None:
    w[3] = 0


def _restore_entry(w: Tensor, b: Tensor | None) -> None:
    w[3] = 1.0


def _zero_all(w: Tensor, b: Tensor | None) -> None:
    w.zero_()


def _restore_all(w: Tensor, b: Tensor | None) -> None:
    w.fill_(0.9)


def _big_bias(w: Tensor, b: Tensor | None) -> None:
    assert b is not None
    b[5] = 100.0


def _restore_bias(w: Tensor, b: Tensor | None) -> None:
    assert b is not None
    b[5] = 0.1


UPDATES: dict[str, tuple[tuple[str, ...], Update, Update]] = {
    "w[3]=0": (FNS, _zero_entry, _restore_entry),
    "w.zero_()": (FNS, _zero_all, _restore_all),
    "b[5]=100": (("layer_norm",), _big_bias, _restore_bias),
}


@pytest.mark.parametrize(
    ("fn", "update"), [(fn, name) for name, (fns, _, _) in UPDATES.items() for fn in fns]
)
def test_inplace_update_checks_again(fn: str, update: str) -> None:
    """An in-place update bumps the version: the next forward checks again and saves the input (gradients
    bitwise those of memory_efficient=False); restoring a safe value switches back to the output."""
    _, spoil, restore = UPDATES[update]
    x, w, b = _leaves(fn)
    assert _saved(fn, x, w, b)[1] == "output"
    assert _profiled_saved(fn, x, w, b)[2] == set()  # cached

    with torch.no_grad():
        spoil(w, b)
    _, saved, ops = _profiled_saved(fn, x, w, b)
    assert ops == CHECK_OPS, f"after {update} the parameters were not checked again"
    assert saved == "input", f"after {update} the output was saved: its backward cannot recover xhat"
    _assert_same(_grads(fn, x, w, b, True), _grads(fn, x, w, b, False), update)
    assert _profiled_saved(fn, x, w, b)[1:] == ("input", set())  # the new decision is cached too

    with torch.no_grad():
        restore(w, b)
    _, saved, ops = _profiled_saved(fn, x, w, b)
    assert ops == CHECK_OPS and saved == "output", "restored parameters: the output should be saved again"
    for a, e in zip(_grads(fn, x, w, b, True), _grads(fn, x, w, b, False), strict=True):
        torch.testing.assert_close(a, e)


def test_bias_only() -> None:
    """layer_norm with a bias and no weight: the weight's slot of the key is empty; a bias update is seen."""
    x, _, b = _leaves("layer_norm")
    assert b is not None
    assert _profiled_saved("layer_norm", x, None, b)[1:] == ("output", CHECK_OPS)
    assert _profiled_saved("layer_norm", x, None, b)[1:] == ("output", set())
    with torch.no_grad():
        b[0] = 10.0  # |bias| > 4 * the implicit weight 1
    assert _profiled_saved("layer_norm", x, None, b)[1:] == ("input", CHECK_OPS)


def test_one_weight_two_biases() -> None:
    """The key is the (weight, bias) pair: a weight shared by a safe and an unsafe bias gets both answers."""
    x, w, safe = _leaves("layer_norm")
    unsafe = torch.full((N,), 100.0, requires_grad=True)
    for _ in range(2):
        assert _saved("layer_norm", x, w, safe)[1] == "output"
        assert _saved("layer_norm", x, w, unsafe)[1] == "input"


@pytest.mark.parametrize("fn", FNS)
def test_freed_weight_not_confused(fn: str) -> None:
    """A weight over memory that outlives it (``torch.empty(0).set_(storage)``: a new TensorImpl with a version
    counter of its own, at 1 after the set_, over the same storage) is checked, cached and freed; the storage
    then gets a zero entry, which that counter never sees, and is wrapped again. The allocator hands the freed
    TensorImpl's memory to the new one, so the new weight has the old one's address, version, storage and data
    pointer: with raw pointers as keys it is taken for the freed weight (in every trial, when tried). The cache
    holds weak pointers: while its entry lives the freed TensorImpl's memory is not given back, no new tensor can
    sit at its address, and the new weight is checked. The decision is asked of native.can_save_output, the
    forward's own function: a forward's autograd graph frees more objects in between, which leaves the reuse to
    allocator luck."""
    x, _, b = _leaves(fn)
    x, b = x.detach(), None if b is None else b.detach()
    buf = _leaves(fn, seed=3)[1].detach().clone()

    def wrap() -> Tensor:
        return torch.empty(0).set_(buf.untyped_storage(), 0, buf.shape)

    for trial in range(20):
        buf[3] = 1.0
        # Plain locals, not assert expressions: pytest's assertion rewriting may keep a tensor alive longer.
        w = wrap()
        safe = native.can_save_output(x, w, b, True, False)
        del w
        assert safe, f"trial {trial}"
        buf[3] = 0.0
        bad = wrap()
        confused = native.can_save_output(x, bad, b, True, False)
        del bad
        assert not confused, f"trial {trial}: the new weight was taken for the freed one"
    # The forward agrees.
    assert _saved(fn, x.requires_grad_(True), wrap().requires_grad_(True), b)[1] == "input"


def test_data_replaced() -> None:
    """``w.data = other`` keeps the version counter but swaps the storage: seen, the next forward checks again."""
    x, w, b = _leaves("layer_norm")
    assert _saved("layer_norm", x, w, b)[1] == "output"
    other = w.detach().clone()
    other[3] = 0
    w.data = other
    assert _profiled_saved("layer_norm", x, w, b)[1:] == ("input", CHECK_OPS)


@pytest.mark.parametrize("fn", FNS)
def test_data_mutation_is_not_seen(fn: str) -> None:
    """The documented blind spot: a write through ``.data`` bumps no version, so the cached decision stands. A
    weight entry zeroed that way makes that column's gradients non-finite (loud), never silently wrong."""
    x, w, b = _leaves(fn)
    assert _saved(fn, x, w, b)[1] == "output"
    w.data[3] = 0
    assert _saved(fn, x, w, b)[1] == "output"
    grad_w = _grads(fn, x, w, b, True)[1]
    assert not torch.isfinite(grad_w[3]), "a zero weight entry behind the cache's back gave a finite gradient"


def test_inference_tensors_checked_every_call() -> None:
    """Inference tensors have no version counter: never cached, checked on every call, right each time."""
    x = _randn(0, M, N)
    with torch.inference_mode():
        w = torch.rand(N) + 0.5
        bad = w.clone()
        bad[3] = 0
    assert w.is_inference()
    for _ in range(2):
        with _check_ops() as ops:
            assert native.can_save_output(x, w, None, True, False)
        assert ops == CHECK_OPS
        with _check_ops() as ops:
            assert not native.can_save_output(x, bad, None, True, False)
        assert ops == CHECK_OPS


def test_more_pairs_than_the_cache_holds() -> None:
    """200 weights, every third unsafe, twice over: entries are evicted (the cache holds 64) and every answer is
    still right; the most recent ones are answered from the cache."""
    x = _randn(0, M, N)
    weights = [torch.rand(N, generator=torch.Generator().manual_seed(i)) + 0.5 for i in range(200)]
    for i in range(0, 200, 3):
        weights[i][i % N] = 0
    for _ in range(2):
        for i, w in enumerate(weights):
            assert native.can_save_output(x, w, None, True, False) == (i % 3 != 0), f"weight {i}"
    with _check_ops() as ops:
        native.can_save_output(x, weights[-1], None, True, False)
    assert not ops
