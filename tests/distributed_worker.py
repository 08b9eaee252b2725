"""One rank of a distributed test (tests/test_sharding.py starts two): `python distributed_worker.py SCENARIO
BACKEND RANK WORLD_SIZE STORE_FILE`. Every check is an assert; a failing rank exits non-zero with the traceback.

Scenarios:
- ops: every function on DTensors (sharded on each leading dim, on a normalized dim, replicated; with and
  without parameters, residual, memory_efficient): placements, collectives and values, forward and backward,
  the same as ATen's norms on the same DTensors and our own kernels on the whole tensors; the quantized-output
  functions' placements and bits.
- fsdp: a small model of our modules under FSDP2 (fully_shard), a few SGD steps on half a batch per rank:
  losses and parameters as one process training on the whole batch; collectives as with torch.nn's norms.
- sequence_parallel: a transformer MLP block with our norms under SequenceParallel / Colwise / Rowwise plans
  (the fused residual norm included), eager and torch.compile: outputs, gradients and a few SGD steps as one
  process; collectives, forward and backward, exactly those of the same plan with torch.nn's norms.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import layernorm_ext
from layernorm_ext import FusedLayerNorm, FusedRMSNorm
from layernorm_ext.sharding import sequence_parallel

# DTensor is imported after layernorm_ext on purpose: the strategies must register when it is first imported.
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh

_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


class Collectives(TorchDispatchMode):
    """Counts the collectives issued while active, by op (DTensor's functional ones and plain c10d, as FSDP
    issues them); waits are not counted. CommDebugMode's module hooks break under FSDP2 in some versions."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if DTensor in types:
            return NotImplemented  # let DTensor run first and issue its collectives, then count those
        name = func.__name__.split(".")[0]
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional") and name not in _NOT_COLLECTIVES:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    def as_dict(self) -> dict[str, int]:
        return dict(self.counts)


def _no_more(ours: dict[str, int], aten: dict[str, int]) -> bool:
    return all(n <= aten.get(op, 0) for op, n in ours.items())


def _close(ours: Tensor, ref: Tensor, what: str) -> None:
    # Same kernels on the same rows; only sums over rows (weight / bias gradients) are added in another order.
    tol = {"rtol": 2e-5, "atol": 2e-5} if ours.dtype != torch.bfloat16 else {"rtol": 1.6e-2, "atol": 1e-2}
    torch.testing.assert_close(ours, ref, **tol, msg=lambda m: f"{what}: {m}")


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


# ---- ops ---------------------------------------------------------------------------------------------------


def _whole_rows(x: Tensor, normalized: Any) -> Tensor:
    """x redistributed to Replicate if a normalized dim is sharded, as ATen's rms_norm strategy would (its CPU
    composite, which runs instead of that strategy, raises on such input: an in-place add_ on a Partial)."""
    axis = x.dim() - len(normalized)
    if isinstance(x, DTensor) and any(isinstance(p, Shard) and p.dim >= axis for p in x.placements):
        return x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
    return x


def _aten(name: str) -> Callable[..., Any]:
    """ATen's composite of each of our functions, same arguments."""

    def layer_norm(x: Tensor, shape: Any, w: Any, b: Any, **_: Any) -> Tensor:
        return F.layer_norm(x, shape, w, b)

    def rms_norm(x: Tensor, shape: Any, w: Any, **_: Any) -> Tensor:
        return F.rms_norm(_whole_rows(x, shape), shape, w)

    def add_layer_norm(x: Tensor, r: Tensor, shape: Any, w: Any, b: Any, **_: Any) -> tuple[Tensor, Tensor]:
        h = x + r
        return F.layer_norm(h, shape, w, b), h

    def add_rms_norm(x: Tensor, r: Tensor, shape: Any, w: Any, **_: Any) -> tuple[Tensor, Tensor]:
        h = x + r
        return F.rms_norm(_whole_rows(h, shape), shape, w), h

    return locals()[name]


def _run(fn: Callable[..., Any], leaves: list[Tensor | None], normalized: list[int], kwargs: dict[str, Any],
         residual: bool, rms: bool) -> tuple[list[Tensor], list[Tensor | None], dict[str, int], dict[str, int]]:
    """fn's outputs and the leaves' gradients, and the collectives of the forward and of the backward."""
    x, r, w, b = leaves
    inputs = (x, r) if residual else (x,)
    params = (w,) if rms else (w, b)
    with Collectives() as fwd:
        outs = fn(*inputs, normalized, *params, **kwargs)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    loss = sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs))
    with Collectives() as bwd:
        loss.backward()
    return outs, [None if t is None else t.grad for t in leaves], fwd.as_dict(), bwd.as_dict()


def scenario_ops(mesh: Any, device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (4, 6, 16)
    cases = 0
    for name in ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"):
        residual = name.startswith("add_")
        rms = "rms" in name
        ours_fn = getattr(layernorm_ext, name)
        for normalized in ((16,), (6, 16)):
            for placement in (Shard(0), Shard(1), Shard(2), Replicate()):
                for affine in (True, False):
                    for dtype in (torch.float32, torch.bfloat16) if name == "layer_norm" else (torch.float32,):
                        for memory_efficient in (False, True) if not residual else (False,):
                            full = [torch.randn(shape, generator=gen).to(device, dtype)]
                            full.append(torch.randn(shape, generator=gen).to(device, dtype) if residual else None)
                            full += [torch.randn(normalized, generator=gen).to(device, dtype) + 1 if affine
                                     else None for _ in range(2)]  # fmt: skip
                            if rms:
                                full[3] = None
                            what = f"{name} {normalized} {placement} affine={affine} {dtype} me={memory_efficient}"
                            _check_op(mesh, name, ours_fn, full, normalized, placement, residual, rms,
                                      memory_efficient, what)  # fmt: skip
                            cases += 1
    # Under inference_mode the functions' ops reach DTensor whole (no autograd to decompose them first).
    for name in ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"):
        fn = getattr(layernorm_ext, name)
        full = [torch.randn(shape, generator=gen).to(device) for _ in range(2)]
        for placement in (Shard(0), Shard(1), Shard(2), Replicate()):
            sharded = [distribute_tensor(t, mesh, [placement]) for t in full]
            with torch.inference_mode():
                got = fn(*(sharded if name.startswith("add_") else sharded[:1]), [16])
                want = fn(*(full if name.startswith("add_") else full[:1]), [16])
            got = got if isinstance(got, tuple) else (got,)
            want = want if isinstance(want, tuple) else (want,)
            expected = (Replicate(),) if placement == Shard(2) else (placement,)
            for i, (g, w) in enumerate(zip(got, want)):
                assert g.placements == expected, f"inference {name} {placement}: output {i} placed {g.placements}"
                _close(g.full_tensor(), w, f"inference {name} {placement}: output {i}")
    # The quantized output (inference ops): codes, dynamic scales and residual_out keep the rows' placement (a
    # sharded normalized dim is gathered first), with the bits of the whole tensor's codes.
    full = [torch.randn(shape, generator=gen).to(device).bfloat16() for _ in range(2)]
    weight = (torch.randn(16, generator=gen) + 1).to(device).bfloat16()
    for name in ("layer_norm_quant", "rms_norm_quant", "add_layer_norm_quant", "add_rms_norm_quant"):
        fn = getattr(layernorm_ext, name)
        for placement in (Shard(0), Shard(1), Shard(2), Replicate()):
            for kw in ({}, {"quant_dtype": torch.int8, "scale_ub": torch.tensor([2.0], device=device)},
                       {"scale": torch.tensor([0.01], device=device)}):  # fmt: skip
                what = f"{name} {placement} {sorted(kw)}"
                sharded = [distribute_tensor(t, mesh, [placement]) for t in full]
                dkw = {k: distribute_tensor(v, mesh, [Replicate()]) if isinstance(v, Tensor) else v
                       for k, v in kw.items()}  # fmt: skip
                dweight = distribute_tensor(weight, mesh, [Replicate()])
                inputs = 2 if name.startswith("add_") else 1
                with torch.inference_mode():
                    got = fn(*sharded[:inputs], [16], dweight, **dkw)
                    want = fn(*full[:inputs], [16], weight, **kw)
                expected = (Replicate(),) if placement == Shard(2) else (placement,)
                assert got[0].placements == expected, f"{what}: codes placed {got[0].placements}"
                # Gathered as bytes: gloo has no float8 collectives.
                codes = DTensor.from_local(got[0].to_local().view(torch.uint8), mesh, got[0].placements)
                assert torch.equal(codes.full_tensor(), want[0].view(torch.uint8)), what
                if "scale" not in kw:
                    assert got[1].placements == expected, f"{what}: scales placed {got[1].placements}"
                    assert torch.equal(got[1].full_tensor(), want[1]), f"{what}: scales"
                if inputs == 2:
                    assert torch.equal(got[2].full_tensor(), want[2]), f"{what}: residual_out"
                cases += 1
    # The statistics (raw op) keep the rows' placement too.
    x = distribute_tensor(torch.randn(shape, generator=gen).to(device), mesh, [Shard(1)])
    _, _, mean, rstd = torch.ops.layernorm_ext.layer_norm_fwd(x, [16], None, None, 1e-5)
    assert mean.placements == rstd.placements == (Shard(1),), (mean.placements, rstd.placements)
    assert mean.shape == rstd.shape == shape[:2]
    print(f"ops: {cases} cases")


def _check_op(mesh: Any, name: str, ours_fn: Callable[..., Any], full: list[Tensor | None], normalized: tuple[int, ...],
              placement: Any, residual: bool, rms: bool, memory_efficient: bool, what: str) -> None:
    def leaves(distributed: bool) -> list[Tensor | None]:
        result: list[Tensor | None] = []
        for i, t in enumerate(full):
            if t is None:
                result.append(None)
                continue
            if distributed:
                t = distribute_tensor(t, mesh, [placement if i < 2 else Replicate()])
            result.append(t.detach().clone().requires_grad_() if not distributed else t.requires_grad_())
        return result

    kwargs: dict[str, Any] = {"memory_efficient": memory_efficient} if not residual else {}
    ours = _run(ours_fn, leaves(True), list(normalized), kwargs, residual, rms)
    aten = _run(_aten(name), leaves(True), list(normalized), kwargs, residual, rms)
    local = _run(ours_fn, leaves(False), list(normalized), kwargs, residual, rms)
    (ours_outs, ours_grads, ours_fwd, ours_bwd), (aten_outs, aten_grads, aten_fwd, aten_bwd) = ours, aten
    normalized_dim_sharded = isinstance(placement, Shard) and placement.dim >= full[0].dim() - len(normalized)
    gathered_for_aten = rms and normalized_dim_sharded
    if residual and normalized_dim_sharded:
        # The fused op needs whole rows of input and residual: it gathers both (ATen's unfused x + r keeps the
        # sharding and its norm gathers h) and returns out, h and the gradients replicated; h, saved for
        # backward, is whole already, so the backward needs no gather (ATen's layer_norm gathers h again).
        gathers = {"all_gather_into_tensor": 2}
        assert ours_fwd == gathers and ours_bwd == {}, f"{what}: collectives {ours_fwd}, {ours_bwd}"
        for i, (o, ref) in enumerate(zip(ours_outs, local[0])):
            assert o.placements == (Replicate(),), f"{what}: output {i} placed {o.placements}"
            _close(o.full_tensor(), ref, f"{what}: output {i}")
        for i, (g, ref) in enumerate(zip(ours_grads, local[1])):
            if g is not None:
                assert g.placements == (Replicate(),), f"{what}: gradient {i} placed {g.placements}"
                _close(g.full_tensor(), ref, f"{what}: gradient {i}")
        return
    if gathered_for_aten:
        # _whole_rows gathered the input before ATen's op, so ATen's backward needed no gather and gave the
        # input's gradient the input's placement; ATen's layer_norm, like ours, saves the sharded input, gathers
        # it again in backward and returns a replicated input gradient.
        aten_bwd = aten_fwd
    for i, (o, a, ref) in enumerate(zip(ours_outs, aten_outs, local[0])):
        assert isinstance(o, DTensor), f"{what}: output {i} is not a DTensor"
        assert o.placements == a.placements, f"{what}: output {i} placed {o.placements}, ATen's {a.placements}"
        _close(o.full_tensor(), ref, f"{what}: output {i}")
    # No collective beyond ATen's (memory_efficient may save a tensor that needs none where ATen's does).
    assert _no_more(ours_fwd, aten_fwd), f"{what}: forward collectives {ours_fwd}, ATen's {aten_fwd}"
    assert _no_more(ours_bwd, aten_bwd), f"{what}: backward collectives {ours_bwd}, ATen's {aten_bwd}"
    if not memory_efficient:
        assert ours_bwd == aten_bwd, f"{what}: backward collectives {ours_bwd}, ATen's {aten_bwd}"
    for i, (g, a, ref) in enumerate(zip(ours_grads, aten_grads, local[1])):
        assert (g is None) == (a is None) == (ref is None), f"{what}: gradient {i} missing"
        if g is None:
            continue
        expected = (Replicate(),) if gathered_for_aten and i < 2 else a.placements
        assert g.placements == expected, f"{what}: gradient {i} placed {g.placements}, ATen's {a.placements}"
        if not isinstance(placement, Replicate) and i >= 2 and placement.dim < len(full[0].shape) - len(normalized):
            assert g.placements == (Partial(),), f"{what}: parameter gradient {i} placed {g.placements}"
        _close(g.full_tensor(), ref, f"{what}: gradient {i}")


# ---- models ------------------------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm MLP block: norm1 -> up -> gelu -> down, residual add, norm2 (fused with the add for ours)."""

    def __init__(self, ours: bool, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.ours = ours
        self.norm1 = FusedLayerNorm(dim) if ours else nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.norm2 = FusedRMSNorm(dim) if ours else nn.RMSNorm(dim)

    def forward(self, x: Tensor) -> Tensor:
        y = self.down(F.gelu(self.up(self.norm1(x))))
        if self.ours:
            out, _ = self.norm2(y, x)
            return out
        return self.norm2(x + y)


def _init(model: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + (1.0 if p.dim() == 1 and p.shape[0] == 16 else 0.0))
    return model


def _train(model: nn.Module, batches: list[Tensor]) -> tuple[list[float], Collectives]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with Collectives() as comm:
        for x in batches:
            opt.zero_grad()
            out = model(x)
            loss = (out.float() ** 2).mean()
            loss.backward()
            opt.step()
            full_loss = _full(loss).detach().clone()
            losses.append(full_loss)
    return [float(v) for v in losses], comm


def _fully_shard() -> Callable[..., Any]:
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard  # torch 2.5
    return fully_shard


def scenario_fsdp(mesh: Any, device: str) -> None:
    fully_shard = _fully_shard()
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 5, 16, generator=gen).to(device) for _ in range(3)]
    reference = _init(Block(ours=True), 2).to(device)
    ref_losses, _ = _train(reference, batches)

    results = {}
    for ours in (True, False):
        model = _init(Block(ours=ours), 2).to(device)
        for module in (model.norm1, model.up, model.down, model.norm2):
            fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        local = [x.chunk(world)[rank] for x in batches]
        # Each rank's loss is the mean over its half; FSDP averages the gradients: the whole batch's mean.
        losses, comm = _train(model, local)
        gathered = [torch.zeros(len(losses), device=device) for _ in range(world)]
        dist.all_gather(gathered, torch.tensor(losses, device=device))
        results[ours] = (torch.stack(gathered).mean(0), {k: _full(v).detach() for k, v in model.state_dict().items()},
                         comm.as_dict())  # fmt: skip
    ours_losses, ours_state, ours_comm = results[True]
    _, _, aten_comm = results[False]
    _close(ours_losses.cpu(), torch.tensor(ref_losses), "fsdp losses")
    for key, value in reference.state_dict().items():
        _close(ours_state[key], value, f"fsdp parameter {key}")
    assert ours_comm == aten_comm, f"fsdp collectives {ours_comm}, with torch.nn's norms {aten_comm}"
    print(f"fsdp: losses {[round(v, 6) for v in ours_losses.tolist()]}, collectives {ours_comm}")


def _sequence_parallel(model: Block, mesh: Any) -> Block:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan = {
        "norm1": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        # torch's SequenceParallel passes on only the first argument: ours takes (y, residual).
        "norm2": sequence_parallel() if model.ours else SequenceParallel(),
    }
    return parallelize_module(model, mesh, plan)


def scenario_sequence_parallel(mesh: Any, device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(2, 8, 16, generator=gen).to(device) for _ in range(3)]
    reference = _init(Block(ours=True), 4).to(device)
    ref_losses, _ = _train(reference, batches)

    results = {}
    for ours in (True, False):
        model = _sequence_parallel(_init(Block(ours=ours), 4).to(device), mesh)
        sharded = [distribute_tensor(x, mesh, [Shard(1)]) for x in batches]
        losses, comm = _train(model, sharded)
        results[ours] = (losses, {k: _full(v).detach() for k, v in model.state_dict().items()}, comm.as_dict())
        if ours:
            out = model(sharded[0])
            assert out.placements == (Shard(1),), f"sequence-parallel output placed {out.placements}"
    ours_losses, ours_state, ours_comm = results[True]
    _, _, aten_comm = results[False]
    _close(torch.tensor(ours_losses), torch.tensor(ref_losses), "sequence-parallel losses")
    for key, value in reference.state_dict().items():
        _close(ours_state[key], value, f"sequence-parallel parameter {key}")
    assert ours_comm == aten_comm, f"sequence-parallel collectives {ours_comm}, with torch.nn's norms {aten_comm}"

    # torch.compile of the sharded block: the same output and input gradient as eager.
    model = _sequence_parallel(_init(Block(ours=True), 4).to(device), mesh)
    eager_x = distribute_tensor(batches[0], mesh, [Shard(1)]).requires_grad_()
    compiled_x = distribute_tensor(batches[0], mesh, [Shard(1)]).requires_grad_()
    eager_out = model(eager_x)
    compiled_out = torch.compile(model, fullgraph=True)(compiled_x)
    assert compiled_out.placements == eager_out.placements, (compiled_out.placements, eager_out.placements)
    _close(compiled_out.full_tensor(), eager_out.full_tensor(), "compiled sequence-parallel output")
    eager_out.sum().backward()
    compiled_out.sum().backward()
    _close(compiled_x.grad.full_tensor(), eager_x.grad.full_tensor(), "compiled sequence-parallel input gradient")
    print(f"sequence_parallel: losses {[round(v, 6) for v in ours_losses]}, collectives {ours_comm}")


SCENARIOS = {"ops": scenario_ops, "fsdp": scenario_fsdp, "sequence_parallel": scenario_sequence_parallel}


def main() -> None:
    scenario, backend, rank, world, store = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh(device, (world,))
        SCENARIOS[scenario](mesh, device)
        dist.barrier()  # no rank tears its connections down while another still uses them
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
        status = 0
    except BaseException:
        traceback.print_exc()
        status = 1
    # Leave without running interpreter teardown: torch's background threads (gloo's among them) sometimes
    # abort a finished process there ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
