"""torch.func transforms over our ops give ATen's results (float64): grad, vjp, jacrev, vmap, their nestings
(second derivatives: jacrev of jacrev, grad of grad, vmap of grad) and autograd over torch.func.grad.

The autograd node is a hand-written ``torch::autograd::Node`` (csrc/norm_autograd.cpp), which functorch drives
level by level as it drives ATen's generated nodes; vmap runs through functorch's per-sample fallback (our ops
have no batching rule: correct, slower, with functorch's performance warning). The nested cases failed before
the backward ops detached their kernel's result: the derivatives came out twice ATen's. Forward-mode transforms
(jvp, jacfwd, hence torch.func.hessian) are refused: see tests/test_errors.py::test_forward_ad_is_refused.
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
NormFn = Callable[[Tensor, Tensor, Tensor | None, Tensor | None], Tensor]

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


def _args(affine: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    gen = torch.Generator().manual_seed(5)
    x, r, w, b = (torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((3, N), (3, N), (N,), (N,)))
    return (x, r, w, b) if affine else (x, r, None, None)


def _loss(f: NormFn) -> Callable[..., Tensor]:
    return lambda x, r, w, b: (f(x, r, w, b) ** 3).sum()


def _weights(x: Tensor) -> Tensor:
    return torch.arange(x.numel(), dtype=x.dtype).view_as(x)


# transform -> g(f, args) computing it; every one differentiates in x (and r), the affine cases in w and b too
TRANSFORMS: dict[str, Callable[[NormFn, tuple], object]] = {
    "grad": lambda f, a: torch.func.grad(_loss(f), argnums=(0, 1) if a[2] is None else (0, 1, 2, 3))(*a),
    "vjp": lambda f, a: (lambda out, pull: pull(_weights(out)))(*torch.func.vjp(lambda x: f(x, *a[1:]), a[0])),
    "jacrev": lambda f, a: torch.func.jacrev(lambda x, r: f(x, r, *a[2:]), argnums=(0, 1))(*a[:2]),
    "vmap": lambda f, a: torch.func.vmap(f, in_dims=(0, 0, None, None))(*a),
    "jacrev_of_jacrev": lambda f, a: torch.func.jacrev(torch.func.jacrev(lambda x: _loss(f)(x, *a[1:])))(a[0]),
    "grad_of_grad": lambda f, a: torch.func.grad(
        lambda x: (torch.func.grad(_loss(f))(x, *a[1:]) * _weights(x)).sum()
    )(a[0]),
    "vmap_of_grad": lambda f, a: torch.func.vmap(
        torch.func.grad(lambda x, r: _loss(f)(x, r, *a[2:])), in_dims=(0, 0)
    )(a[0].unsqueeze(1), a[1].unsqueeze(1)),
    "autograd_over_grad": lambda f, a: (
        lambda x: torch.autograd.grad((torch.func.grad(_loss(f))(x, *a[1:]) * _weights(x)).sum(), x)
    )(a[0].clone().requires_grad_()),
}


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("op", list(OPS))
def test_func_transform_matches_aten(op: str, transform: str, affine: bool) -> None:
    ours, aten = OPS[op]
    got = TRANSFORMS[transform](ours, _args(affine))
    want = TRANSFORMS[transform](aten, _args(affine))
    flat_got, flat_want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    assert len(flat_got) == len(flat_want) > 0
    for g, w in zip(flat_got, flat_want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_module_under_grad_of_grad() -> None:
    """A gradient penalty written with torch.func on the module, through torch.func.functional_call."""
    x = _args(True)[0]
    ours, theirs = layernorm_ext.FusedLayerNorm(N).double(), torch.nn.LayerNorm(N).double()
    results = []
    for module in (ours, theirs):
        params = dict(module.named_parameters())

        def penalty(params: dict[str, Tensor], module: torch.nn.Module = module) -> Tensor:
            g = torch.func.grad(lambda x: (torch.func.functional_call(module, params, (x,)) ** 3).sum())(x)
            return (g**2).sum()

        results.append(torch.func.grad(penalty)(params))
    for name in results[0]:
        torch.testing.assert_close(results[0][name], results[1][name], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "hessian"])
def test_forward_mode_transforms_are_refused(transform: str) -> None:
    """No forward-mode formula: NotImplementedError, never an output without its tangent."""
    x, r, w, b = _args(True)
    f = lambda x: layernorm_ext.layer_norm(x, (N,), w, b)  # noqa: E731
    calls = {
        "jvp": lambda: torch.func.jvp(f, (x,), (torch.ones_like(x),)),
        "jacfwd": lambda: torch.func.jacfwd(f)(x),
        "hessian": lambda: torch.func.hessian(lambda x: f(x).sum())(x),
    }
    with pytest.raises(NotImplementedError, match="forward AD"):
        calls[transform]()
