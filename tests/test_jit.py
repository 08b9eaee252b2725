"""The JIT-built library gives bitwise the results of the prebuilt one, both when asked for
(``LAYERNORM_EXT_JIT=1``) and when a pure-Python install (``LAYERNORM_EXT_BUILD=0``) builds it on first import;
and no order of imports and loads of two copies of the library kills the process.

Only one native library may be loaded per process, so the JIT side runs in a subprocess (this file run as a
script) with an extension cache of the test session's own; it saves its results, which are compared with the
same computation done here on the prebuilt library. The session compiles the library once (minutes on 2 cores,
shared by the xdist workers): slow.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor

import layernorm_ext
import layernorm_ext.jit
from layernorm_ext import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from layernorm_ext._loader import native
from layernorm_ext._sources import CPU_SOURCES

pytestmark = pytest.mark.slow

_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}
# A JIT build takes a few minutes on 2 idle cores; on 2 cores shared with other builds it took over 10.
_BUILD_TIMEOUT_S = 1200
# build_info keys that must agree between the two builds (the CPU kernels' instruction set and threading).
_SAME_INFO = ("torch_version", "cpu_isa", "openmp", "compiler")


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0, shift: float = 0.0) -> Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + shift).to(dtype)


def compute() -> dict[str, Tensor]:
    """Outputs and gradients of every op for fixed, seeded inputs (CPU), keyed by name."""
    results: dict[str, Tensor] = {}
    gen = torch.Generator().manual_seed(1234)
    cases = [
        # (name, rows shape, cols, input dtype, residual dtype, param dtype)
        ("f32", (37,), 300, torch.float32, torch.float32, torch.float32),
        ("f64", (5, 3), 1031, torch.float64, torch.float64, torch.float64),
        ("bf16", (64,), 4096, torch.bfloat16, torch.bfloat16, torch.bfloat16),
        ("f16_mixed", (3, 7), 257, torch.float16, torch.float32, torch.float32),
        ("bf16_mixed", (129,), 64, torch.bfloat16, torch.bfloat16, torch.float32),
    ]
    for name, lead, cols, dt, rdt, pdt in cases:
        shape = (*lead, cols)
        x = _randn(gen, *shape, dtype=dt, scale=2.0, shift=0.5)
        r = _randn(gen, *shape, dtype=rdt)
        w = _randn(gen, cols, dtype=pdt, scale=0.5, shift=1.0)
        b = _randn(gen, cols, dtype=pdt, scale=0.5)
        g_out = _randn(gen, *shape, dtype=dt)
        for variant in ("ln", "rms", "add_ln", "add_rms", "add_ln_fp32res", "ln_memeff", "rms_memeff"):
            xi, ri, wi, bi = (t.clone().requires_grad_(True) for t in (x, r, w, b))
            me = variant.endswith("memeff")
            if variant.startswith("ln"):
                outs = [layer_norm(xi, cols, wi, bi, memory_efficient=me)]
                leaves = [xi, wi, bi]
            elif variant.startswith("rms"):
                outs = [rms_norm(xi, cols, wi, memory_efficient=me)]
                leaves = [xi, wi]
            elif variant == "add_rms":
                outs = list(add_rms_norm(xi, ri, cols, wi))
                leaves = [xi, ri, wi]
            else:
                outs = list(add_layer_norm(xi, ri, cols, wi, bi, residual_in_fp32=variant.endswith("fp32res")))
                leaves = [xi, ri, wi, bi]
            grads_in = [g_out] + [g_out.to(o.dtype) * 0.5 for o in outs[1:]]
            grads = torch.autograd.grad(outs, leaves, grads_in)
            for i, o in enumerate(outs):
                results[f"{name}/{variant}/out{i}"] = o.detach()
            for i, g in enumerate(grads):
                results[f"{name}/{variant}/grad{i}"] = g
        # The raw ops' statistics too.
        _, _, mean, rstd = torch.ops.layernorm_ext.layer_norm_fwd(x, [cols], w, b, 1e-5, r, False, False)
        results[f"{name}/op/mean"], results[f"{name}/op/rstd"] = mean, rstd
        _, _, rstd = torch.ops.layernorm_ext.rms_norm_fwd(x, [cols], None, None, None, False, False)
        results[f"{name}/op/rms_rstd"] = rstd
    return results


def _bits(t: Tensor) -> Tensor:
    return t.contiguous().view(_INT_VIEW[t.dtype])


def _jit_load_again() -> str:
    """What ``layernorm_ext.jit.load()`` does once the import loaded a library: "returns the loaded library", or
    the error it raises."""
    try:
        module = layernorm_ext.jit.load()
    except RuntimeError as err:
        return f"RuntimeError: {err}"
    return "returns the loaded library" if module is native else f"returns another library: {module!r}"


def _child_main(out_path: str) -> None:
    """The subprocess side: this module's import already loaded the library (the JIT path, or the prebuilt one
    where the install has it)."""
    info = layernorm_ext.build_info()
    payload = {
        "package_file": layernorm_ext.__file__,
        "build_info": {k: info[k] for k in (*_SAME_INFO, "load_method")},
        "prebuilt_loaded": "layernorm_ext._C" in sys.modules,
        "results": compute(),
        "jit_load_again": _jit_load_again(),
    }
    torch.save(payload, out_path)


def _run_child(tmp_path: Path, ext_dir: Path, env_extra: dict[str, str], python_prelude: str = "") -> dict:
    """Run this file as a script in a subprocess with the extension cache ``ext_dir``; return what it saved."""
    out_path = tmp_path / "jit_results.pt"
    out_path.unlink(missing_ok=True)
    env = dict(os.environ)
    env.pop("LAYERNORM_EXT_JIT", None)
    env.update(env_extra)
    env["TORCH_EXTENSIONS_DIR"] = str(ext_dir)
    # The interpreter's own bin folder first (ninja from the same environment), as in an activated venv.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    script = Path(__file__).resolve()
    code = f"{python_prelude}\nimport runpy, sys\nsys.argv = [{str(script)!r}, {str(out_path)!r}]\n" \
        f"runpy.run_path({str(script)!r}, run_name='__main__')"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, f"JIT subprocess failed:\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return torch.load(out_path, weights_only=True)


def _jit_libraries(ext_dir: Path) -> dict[Path, int]:
    """The JIT-built libraries in the cache, with their modification times (ns)."""
    return {p: p.stat().st_mtime_ns for p in ext_dir.rglob("layernorm_ext_jit*.so")}


def _assert_same_as_prebuilt(payload: dict) -> None:
    jit_info = payload["build_info"]
    assert jit_info["load_method"] == "jit"
    assert payload["prebuilt_loaded"] is False, "the JIT process also loaded the prebuilt library"
    ours_info = layernorm_ext.build_info()
    for key in _SAME_INFO:
        assert jit_info[key] == ours_info[key], (key, jit_info[key], ours_info[key])
    jit_results: dict[str, Tensor] = payload["results"]
    prebuilt_results = compute()
    assert sorted(jit_results) == sorted(prebuilt_results)
    mismatched = []
    for key, want in prebuilt_results.items():
        got = jit_results[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        if not torch.equal(_bits(got), _bits(want)):
            mismatched.append(key)
    assert not mismatched, f"JIT and prebuilt results differ bitwise: {mismatched}"


# A development install (pip install -e) puts a finder on sys.meta_path that would hand the child the prebuilt
# layernorm_ext._C; the child drops it so that it sees only the install under test.
_DROP_EDITABLE_FINDERS = (
    "import sys\n"
    "sys.meta_path[:] = [f for f in sys.meta_path if not str(getattr(f, '__module__', '')).startswith('__editable__')]"
)


def _pure_python_install(tmp_path: Path) -> Path:
    """``LAYERNORM_EXT_BUILD=0``: a wheel with the sources and no library, installed into a folder of its own."""
    repo = Path(__file__).resolve().parents[1]
    wheel_dir, site = tmp_path / "wheel", tmp_path / "site"
    env = dict(os.environ, LAYERNORM_EXT_BUILD="0")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheel_dir), str(repo)],
        env=env, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    (wheel,) = wheel_dir.glob("layernorm_ext-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert not [n for n in names if n.endswith((".so", ".pyd"))], "a LAYERNORM_EXT_BUILD=0 wheel holds a library"
    for source in CPU_SOURCES:
        assert f"layernorm_ext/csrc/{source}" in names, f"the wheel lacks csrc/{source}"
    install = subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S,
    )
    assert install.returncode == 0, install.stderr[-4000:]
    return site


@dataclass(frozen=True)
class JitInstall:
    site: Path  # the pure-Python install (LAYERNORM_EXT_BUILD=0)
    ext_dir: Path  # the extension cache holding its JIT build
    first_payload: dict  # what its first import (which compiled the library) saved


@pytest.fixture(scope="session")
def jit_install(tmp_path_factory: pytest.TempPathFactory) -> JitInstall:
    """A pure-Python install whose first import JIT-built the library into an empty extension cache: one
    compilation (minutes on 2 cores) for the whole session, xdist workers included (a file lock in their shared
    folder: the first worker builds, the others wait and reuse)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    root = root / "layernorm_ext_jit_install"
    root.mkdir(exist_ok=True)
    ext_dir, first, failed = root / "torch_extensions", root / "first_payload.pt", root / "failed.txt"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if failed.exists():  # a worker's build failed: the others do not spend minutes on the same failure
            pytest.fail(f"the session's JIT build failed:\n{failed.read_text()}")
        if not first.exists():
            try:
                site = _pure_python_install(root)
                payload = _run_child(root, ext_dir, {"PYTHONPATH": str(site)}, _DROP_EDITABLE_FINDERS)
            except BaseException as err:
                failed.write_text(f"{type(err).__name__}: {err}"[-8000:])
                raise
            torch.save(payload, first)
    return JitInstall(root / "site", ext_dir, torch.load(first, weights_only=True))


def test_jit_builds_match_prebuilt(tmp_path: Path, jit_install: JitInstall) -> None:
    """Both ways to the JIT library, with one compilation between them (a build takes minutes on 2 cores):

    1. A pure-Python install (``LAYERNORM_EXT_BUILD=0``) builds the library on first import, into an empty
       extension cache; its results are bitwise those of the prebuilt library of this process, and
       ``layernorm_ext.jit.load()`` afterwards returns that library (JIT twice: no second load).
    2. The same install given this process's prebuilt library, with ``LAYERNORM_EXT_JIT=1``: the import takes
       the JIT path all the same (the prebuilt is not loaded), finds the cached build of step 1 up to date and
       loads it without compiling again; bitwise the same results.
    3. The same install without ``LAYERNORM_EXT_JIT``: the prebuilt library loads, and ``jit.load()`` refuses
       to load a second library with a RuntimeError.
    """
    assert layernorm_ext.build_info()["load_method"] == "prebuilt", "this process must use the prebuilt library"
    site, ext_dir = jit_install.site, jit_install.ext_dir
    env = {"PYTHONPATH": str(site)}

    payload = jit_install.first_payload
    assert Path(payload["package_file"]).resolve().is_relative_to(site.resolve()), payload["package_file"]
    built = _jit_libraries(ext_dir)
    assert built, f"no JIT library under TORCH_EXTENSIONS_DIR={ext_dir}"
    _assert_same_as_prebuilt(payload)
    assert payload["jit_load_again"] == "returns the loaded library"

    # Other tests of the session use the install too: they do not care whether it has the prebuilt library.
    prebuilt = Path(native.__file__)
    shutil.copy2(prebuilt, site / "layernorm_ext" / prebuilt.name)
    payload = _run_child(tmp_path, ext_dir, {**env, "LAYERNORM_EXT_JIT": "1"}, _DROP_EDITABLE_FINDERS)
    assert _jit_libraries(ext_dir) == built, "LAYERNORM_EXT_JIT=1 rebuilt instead of reusing the cached build"
    _assert_same_as_prebuilt(payload)
    assert payload["jit_load_again"] == "returns the loaded library"

    payload = _run_child(tmp_path, ext_dir, env, _DROP_EDITABLE_FINDERS)
    assert payload["build_info"]["load_method"] == "prebuilt" and payload["prebuilt_loaded"] is True
    assert payload["jit_load_again"].startswith("RuntimeError: layernorm_ext.jit.load(): the prebuilt library")


def _run_script(tmp_path: Path, code: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **env_extra}
    env.pop("LAYERNORM_EXT_JIT", None)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=_BUILD_TIMEOUT_S, cwd=str(tmp_path))


def _assert_exited_cleanly(proc: subprocess.CompletedProcess[str], last_line: str) -> None:
    """Not killed by a signal (an abort is -6), and the script ran to its end."""
    assert proc.returncode == 0 and proc.stdout.strip().endswith(last_line), (
        f"exit status {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )


def test_build_lock_clears_a_killed_builds_baton(tmp_path: Path) -> None:
    """A build killed with its torch baton (``lock``) held left every later cpp_extension.load waiting forever
    (CI hung on one); build_lock removes it, with a warning, once no build of ours holds the flock."""
    from torch.utils.file_baton import FileBaton

    killed = subprocess.run(
        [sys.executable, "-c", "import os, sys; from torch.utils.file_baton import FileBaton\n"
         "assert FileBaton(os.path.join(sys.argv[1], 'lock')).try_acquire(); os._exit(9)", str(tmp_path)],
        capture_output=True, text=True, timeout=120)  # fmt: skip
    assert killed.returncode == 9 and (tmp_path / "lock").exists(), killed.stderr
    with pytest.warns(UserWarning, match="left behind by a build that did not finish"):
        with layernorm_ext.jit.build_lock(str(tmp_path)):
            assert FileBaton(str(tmp_path / "lock")).try_acquire()


def test_build_lock_waits_for_a_live_build(tmp_path: Path) -> None:
    """A build in progress (flock and baton held) is waited for, its baton left alone (removing it would warn)."""
    code = (
        "import os, sys, time; from layernorm_ext.jit import build_lock; from torch.utils.file_baton import FileBaton\n"
        "with build_lock(sys.argv[1]):\n"
        "    baton = FileBaton(os.path.join(sys.argv[1], 'lock')); assert baton.try_acquire()\n"
        "    print('building', flush=True); time.sleep(2); baton.release()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "building\n"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with layernorm_ext.jit.build_lock(str(tmp_path)):
                assert not (tmp_path / "lock").exists()
    finally:
        child.kill()
        child.communicate()


def test_readme_jit_example_with_prebuilt_raises(tmp_path: Path) -> None:
    """README's old JIT example with the prebuilt library installed: ``import layernorm_ext.jit`` loads the
    prebuilt library, and ``load()`` raised no Python error but aborted the process once its build loaded."""
    code = (
        "import layernorm_ext.jit\n"
        "try:\n"
        "    layernorm_ext.jit.load()\n"
        "except RuntimeError as err:\n"
        "    print('RuntimeError:', err)\n"
        "import torch\n"
        "x = torch.randn(3, 7)\n"
        "assert torch.equal(layernorm_ext.layer_norm(x, 7), torch.ops.layernorm_ext.layer_norm(x, [7]))\n"
        "print('still working')\n"
    )
    proc = _run_script(tmp_path, code, {"TORCH_EXTENSIONS_DIR": str(tmp_path / "cache")})
    _assert_exited_cleanly(proc, "still working")
    assert "RuntimeError: layernorm_ext.jit.load(): the prebuilt library (layernorm_ext._C) is already loaded" in (
        proc.stdout
    )
    assert not (tmp_path / "cache").exists(), "jit.load() started a build"


def test_second_copy_of_prebuilt_refused(tmp_path: Path) -> None:
    """After ``import layernorm_ext``: the prebuilt library's own file initialized again (as a second
    cpp_extension.load of one build does) shares its registration; a copy of it at another path (what any second
    build of the sources is, without compiling one) fails its module init with ImportError. Before, that copy's
    static TORCH_LIBRARY registration aborted the process."""
    copy = tmp_path / "copy" / Path(native.__file__).name
    copy.parent.mkdir()
    shutil.copy2(native.__file__, copy)
    code = (
        "import importlib.util, torch, layernorm_ext\n"
        # Distinct module names (any ending in _C, the init function's name): Python hands back a module it
        # initialized under the same name without initializing the new file.
        "def initialize(path, name):\n"
        "    spec = importlib.util.spec_from_file_location(name, path)\n"
        "    module = importlib.util.module_from_spec(spec)\n"
        "    spec.loader.exec_module(module)\n"
        "    return module\n"
        f"assert initialize({native.__file__!r}, 'again._C').build_info() == layernorm_ext._C.build_info()\n"
        "try:\n"
        f"    initialize({str(copy)!r}, 'copy._C')\n"
        "except ImportError as err:\n"
        "    print('ImportError:', err)\n"
        "x = torch.randn(7, 5125)\n"
        "torch.testing.assert_close(layernorm_ext.rms_norm(x, 5125), torch.nn.functional.rms_norm(x, (5125,)))\n"
        "print('still working')\n"
    )
    proc = _run_script(tmp_path, code, {})
    _assert_exited_cleanly(proc, "still working")
    assert "ImportError: layernorm_ext: torch.ops.layernorm_ext is already registered in this process, by " \
        "another copy of the native library" in proc.stdout


def _user_load_code(site: Path) -> str:
    """A user's own torch.utils.cpp_extension.load of the install's sources, with the arguments of the package's
    JIT build (so that it finds that build in the cache instead of compiling again)."""
    arguments = layernorm_ext.jit.build_arguments(with_cuda=False)
    arguments["sources"] = [str(site / "layernorm_ext" / "csrc" / name) for name in CPU_SOURCES]
    return (
        "import json, torch.utils.cpp_extension as cpp_extension\n"
        f"user_module = cpp_extension.load(**json.loads({json.dumps(arguments)!r}))\n"
    )


def test_user_load_then_import_refused(tmp_path: Path, jit_install: JitInstall) -> None:
    """A user's cpp_extension.load of our sources first, then ``import layernorm_ext``: the import refuses with an
    ImportError before loading a second library (which used to abort the process)."""
    code = (
        _DROP_EDITABLE_FINDERS + "\n" + _user_load_code(jit_install.site)
        + "assert user_module.build_info()['torch_version']\n"
        "try:\n"
        "    import layernorm_ext\n"
        "except ImportError as err:\n"
        "    print('ImportError:', err)\n"
        "print('still working')\n"
    )
    proc = _run_script(tmp_path, code, {"PYTHONPATH": str(jit_install.site),
                                        "TORCH_EXTENSIONS_DIR": str(jit_install.ext_dir)})
    _assert_exited_cleanly(proc, "still working")
    assert "ImportError: layernorm_ext: torch.ops.layernorm_ext is already registered in this process by a " \
        "library this package did not load" in proc.stdout


def test_import_then_user_load_refused(tmp_path: Path, jit_install: JitInstall) -> None:
    """``import layernorm_ext`` (prebuilt), then a user's cpp_extension.load of our sources: the second library's
    module init raises ImportError (csrc/bindings.cpp) instead of terminating in a static initializer, and the
    ops keep working."""
    code = (
        "import layernorm_ext, torch\n"
        "assert layernorm_ext.build_info()['load_method'] == 'prebuilt'\n"
        + _user_load_code(jit_install.site).replace("user_module = ", "try:\n    user_module = ")
        + "except ImportError as err:\n"
        "    print('ImportError:', err)\n"
        "x = torch.randn(5, 769, dtype=torch.float64)\n"
        "want = torch.nn.functional.layer_norm(x, (769,))\n"
        "torch.testing.assert_close(layernorm_ext.layer_norm(x, 769), want)\n"
        "print('still working')\n"
    )
    proc = _run_script(tmp_path, code, {"TORCH_EXTENSIONS_DIR": str(jit_install.ext_dir)})
    _assert_exited_cleanly(proc, "still working")
    assert "ImportError: layernorm_ext: torch.ops.layernorm_ext is already registered in this process, by " \
        "another copy of the native library" in proc.stdout


if __name__ == "__main__":
    _child_main(sys.argv[1])
