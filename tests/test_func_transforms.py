"""torch.func transforms over our ops: vmap gives ATen's results; the differentiating transforms are refused.

vmap runs through functorch's per-sample fallback (our ops have no batching rule: correct, slower, with
functorch's performance warning), also on inputs that require grad. grad / vjp / jacrev raise a
RuntimeError: nested derivatives through our hand-written autograd node under functorch came out twice ATen's
(torch.func.grad of torch.func.grad, and torch.autograd.grad over torch.func.grad), so the node refuses
functorch's levels as torch::autograd::Function does. Forward-mode transforms (jvp, jacfwd, hessian) raise
NotImplementedError (tests/test_errors.py::test_forward_ad_is_refused).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import layernorm_ext

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented")

N = 6
NormFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

# op -> (ours, ATen's composite), each f(x, r, w, b) -> one tensor
OPS: dict[str, tuple[NormFn, NormFn]] = {
    "layer_norm": (
        lambda x, r, w, b: layernorm_ext.layer_norm(x, (N,), w, b),
        lambda x, r, w, b: F.layer_norm(x, (N,), w, b),
    ),
    "rms_norm": (
        lambda x, r, w, b: layernorm_ext.rms_norm(x, (N,), w, 1e-6),
        lambda x, r, w, b: F.rms_norm(x, (N,), w, 1e-6),
    ),
    "add_layer_norm": (
        lambda x, r, w, b: torch.cat(layernorm_ext.add_layer_norm(x, r, (N,), w, b)),
        lambda x, r, w, b: torch.cat([F.layer_norm(x + r, (N,), w, b), x + r]),
    ),
    "add_rms_norm": (
        lambda x, r, w, b: torch.cat(layernorm_ext.add_rms_norm(x, r, (N,), w, 1e-6)),
        lambda x, r, w, b: torch.cat([F.rms_norm(x + r, (N,), w, 1e-6), x + r]),
    ),
}


def _args() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(5)
    return tuple(torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((3, N), (3, N), (N,), (N,)))


def _loss(f: NormFn) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    return lambda x, r, w, b: (f(x, r, w, b) ** 3).sum()


@pytest.mark.parametrize("op", list(OPS))
def test_vmap_matches_aten(op: str) -> None:
    """Over the rows, and over a batch of weights; and the gradients of a vmapped call (functorch's fallback runs
    our op per sample, outside its levels, so our node records as in eager)."""
    args = _args()
    x, r, w, b = args
    for in_dims, batched in (((0, 0, None, None), args), ((None, None, 0, None), (x, r, torch.stack([w, 2 * w]), b))):
        got = torch.func.vmap(OPS[op][0], in_dims=in_dims)(*batched)
        want = torch.func.vmap(OPS[op][1], in_dims=in_dims)(*batched)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    grads = []
    for f in OPS[op]:
        leaves = [t.clone().requires_grad_() for t in args]
        out = torch.func.vmap(f, in_dims=(0, 0, None, None))(*leaves)
        grads.append(torch.autograd.grad((out**3).sum(), leaves, allow_unused=True, materialize_grads=True))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


TRANSFORMS: dict[str, Callable[[NormFn, tuple[Tensor, ...]], object]] = {
    "grad": lambda f, a: torch.func.grad(_loss(f))(*a),
    "vjp": lambda f, a: (lambda out, fn: fn(torch.ones_like(out)))(*torch.func.vjp(lambda x: f(x, *a[1:]), a[0])),
    "jacrev": lambda f, a: torch.func.jacrev(lambda x: f(x, *a[1:]))(a[0]),
    "autograd_over_grad": lambda f, a: torch.func.grad(_loss(f))(a[0].clone().requires_grad_(), *a[1:]),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("op", list(OPS))
def test_differentiating_transforms_are_refused(op: str, transform: str) -> None:
    with pytest.raises(RuntimeError, match="torch.func transforms"):
        TRANSFORMS[transform](OPS[op][0], _args())
    TRANSFORMS[transform](OPS[op][1], _args())  # ATen's run, so the call itself is a valid one
