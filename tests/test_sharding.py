"""DTensor sharding strategies (layernorm_ext/sharding.py): when they register, and two-process runs of every op
on DTensors, of FSDP2 training and of a sequence-parallel block (tests/distributed_worker.py holds the checks).

The two ranks are processes of their own, started here with the gloo backend on the loopback interface (and
with NCCL where two GPUs are present), rendezvous through a file, each bounded in time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

WORKER = Path(__file__).with_name("distributed_worker.py")
WORLD_SIZE = 2
TIMEOUT_S = 300

BACKENDS = []
if dist.is_available() and dist.is_gloo_available():
    BACKENDS.append("gloo")
if dist.is_available() and dist.is_nccl_available() and torch.cuda.device_count() >= WORLD_SIZE:
    BACKENDS.append("nccl")

pytestmark = pytest.mark.skipif(not BACKENDS, reason="torch.distributed with the gloo backend is not available")


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


REGISTERED = """
import torch
from torch.distributed.tensor import DTensor
funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
print(sorted(name for name in ("layer_norm_fwd", "rms_norm_fwd", "layer_norm_bwd", "rms_norm_bwd", "layer_norm",
                                "rms_norm", "add_layer_norm", "add_rms_norm")
             if getattr(torch.ops.layernorm_ext, name).default in funcs))
"""
ALL_OPS = (
    "['add_layer_norm', 'add_rms_norm', 'layer_norm', 'layer_norm_bwd', 'layer_norm_fwd', 'rms_norm', "
    "'rms_norm_bwd', 'rms_norm_fwd']"
)


def test_import_does_not_load_dtensor_and_registers_when_it_loads() -> None:
    code = "import sys\nimport layernorm_ext\nprint('torch.distributed.tensor' in sys.modules)\n" + REGISTERED
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["False", ALL_OPS], proc.stdout


def test_registers_when_dtensor_was_loaded_first() -> None:
    proc = _python("import torch.distributed.tensor\nimport layernorm_ext\n" + REGISTERED)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ALL_OPS, proc.stdout


def test_a_look_up_does_not_disarm_the_hook() -> None:
    code = "import importlib.util\nimport layernorm_ext\nimportlib.util.find_spec('torch.distributed.tensor')\n"
    proc = _python(code + REGISTERED)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ALL_OPS, proc.stdout


def test_a_failing_registration_warns_and_never_breaks_dtensor() -> None:
    """register() uses private DTensor APIs; should they change, DTensor (FSDP2, tensor parallelism) must
    still import, and the failure be said."""
    code = """
import warnings
import layernorm_ext.sharding as sharding
def broken():
    raise AttributeError("no such API")
sharding.register = broken
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch.distributed.tensor
from torch.distributed.tensor import DTensor
print([str(w.message) for w in caught if "sharding strategies" in str(w.message)])
"""
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert "could not register DTensor sharding strategies (AttributeError: no such API)" in proc.stdout


def _python_warnings_as_errors(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120)


def test_a_failing_registration_never_breaks_dtensor_under_warnings_as_errors() -> None:
    """With -W error the failure's warning is an exception: it must not become the import's."""
    code = """
import layernorm_ext.sharding as sharding
def broken():
    raise AttributeError("no such API")
sharding.register = broken
import torch.distributed.tensor
from torch.distributed.tensor import DTensor
print("imported")
"""
    proc = _python_warnings_as_errors(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "imported"
    assert "could not register DTensor sharding strategies (AttributeError: no such API)" in proc.stderr


def test_a_look_up_gets_the_modules_own_loader_api() -> None:
    """find_spec before the first import: the spec's loader answers what the module's own loader answers
    (runpy, pkgutil and inspect ask is_package, get_code, get_source), and the import still registers."""
    code = """
import importlib.util
import layernorm_ext
name = "torch.distributed.tensor"
spec = importlib.util.find_spec(name)
print(spec.loader.is_package(name), type(spec.loader.get_code(name)).__name__,
      "DTensor" in spec.loader.get_source(name))
import torch.distributed.tensor
print(type(torch.distributed.tensor.__spec__.loader).__name__ == type(spec.loader._loader).__name__)
"""
    proc = _python(code + REGISTERED)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["True code True", "True", ALL_OPS], proc.stdout


def test_the_hook_answers_every_thread() -> None:
    """While one thread's look-up asks the other finders (here parked in a slow one), an import on another
    thread still goes through the hook and registers."""
    code = """
import sys, threading
import layernorm_ext.sharding as sharding
hook = next(f for f in sys.meta_path if isinstance(f, sharding._RegisterAfterImport))
parked, release = threading.Event(), threading.Event()
class Slow:
    def find_spec(self, name, path, target=None):
        if threading.current_thread().name == "slow" and name == "torch.distributed.tensor":
            parked.set()
            release.wait(30)
        return None
sys.meta_path.insert(1, Slow())
slow = threading.Thread(target=hook.find_spec, args=("torch.distributed.tensor", None), name="slow")
slow.start()
assert parked.wait(30)
import torch.distributed.tensor
release.set()
slow.join()
"""
    proc = _python(code + REGISTERED)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ALL_OPS, proc.stdout


def test_sequence_parallel_pickles_as_torchs_style() -> None:
    """One class for every call, a module attribute, so that the style pickles (torch's SequenceParallel does);
    the copy keeps its settings and its class."""
    code = """
import pickle
from layernorm_ext.sharding import sequence_parallel
from torch.distributed.tensor.parallel import SequenceParallel
torchs = pickle.loads(pickle.dumps(SequenceParallel(sequence_dim=0)))
style = sequence_parallel(sequence_dim=0, use_local_output=True)
copy = pickle.loads(pickle.dumps(style))
print(type(style) is type(sequence_parallel()), type(copy) is type(style), isinstance(copy, SequenceParallel))
print(copy.sequence_sharding == torchs.sequence_sharding, copy.use_local_output)
"""
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["True True True", "True True"], proc.stdout


def test_cache_key_holds_normalized_shape() -> None:
    """DTensor reuses a strategy for equal input specs and equal arguments from static_argnum on: that must
    include normalized_shape, or (4, 6, 16) sharded on dim 1 would stay sharded when (6, 16) is normalized."""
    code = """
import layernorm_ext, torch
from torch.distributed.tensor import DTensor
info = DTensor._op_dispatcher.sharding_propagator.op_to_schema_info
ops = torch.ops.layernorm_ext
for name, index in (("layer_norm_fwd", 1), ("rms_norm_fwd", 1), ("layer_norm_bwd", 4), ("rms_norm_bwd", 3),
                    ("layer_norm", 1), ("rms_norm", 1), ("add_layer_norm", 2), ("add_rms_norm", 2),
                    ("layer_norm_quant", 1), ("rms_norm_quant", 1)):
    op = getattr(ops, name).default
    assert op._schema.arguments[index].name == "normalized_shape", name
    assert info[op].static_argnum == index, (name, info[op].static_argnum)
print("ok")
"""
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scenario", ["ops", "fsdp", "sequence_parallel"])
def test_two_processes(scenario: str, backend: str, tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    store = tmp_path / "store"
    ranks = [
        subprocess.Popen(
            [sys.executable, str(WORKER), scenario, backend, str(rank), str(WORLD_SIZE), str(store)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(WORLD_SIZE)
    ]  # fmt: skip
    outputs = []
    try:
        for proc in ranks:
            outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for proc in ranks:
            proc.kill()
        outputs += [proc.communicate()[0] for proc in ranks[len(outputs):]]
        pytest.fail(f"{scenario} ({backend}) did not finish in {TIMEOUT_S} s:\n" + "\n".join(outputs))
    report = "\n".join(f"--- rank {rank} (exit {proc.returncode}):\n{out}" for rank, (proc, out) in
                       enumerate(zip(ranks, outputs)))  # fmt: skip
    assert all(proc.returncode == 0 for proc in ranks), report
    assert all(f"{scenario}:" in out for out in outputs), report
    print(report)
