"""The JIT-built library gives bitwise the results of the prebuilt one, both when asked for
(``LAYERNORM_EXT_JIT=1``) and when a pure-Python install (``LAYERNORM_EXT_BUILD=0``) builds it on first import.

Only one native library may be loaded per process, so the JIT side runs in a subprocess (this file run as a
script) with an extension cache of the test's own; it saves its results, which are compared with the same
computation done here on the prebuilt library. The test compiles the library once (minutes on 2 cores): slow.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import torch
from torch import Tensor

import layernorm_ext
from layernorm_ext import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from layernorm_ext._loader import native
from layernorm_ext._sources import CPU_SOURCES

try:  # pytest is not needed by the subprocess side
    import pytest

    pytestmark = pytest.mark.slow
except ImportError:  # pragma: no cover
    pass

_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}
_BUILD_TIMEOUT_S = 600
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


def _child_main(out_path: str) -> None:
    """The subprocess side: this module's import already loaded the library through the JIT path."""
    info = layernorm_ext.build_info()
    payload = {
        "package_file": layernorm_ext.__file__,
        "build_info": {k: info[k] for k in (*_SAME_INFO, "load_method")},
        "prebuilt_loaded": "layernorm_ext._C" in sys.modules,
        "results": compute(),
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


def test_jit_builds_match_prebuilt(tmp_path: Path) -> None:
    """Both ways to the JIT library, with one compilation between them (a build takes minutes on 2 cores):

    1. A pure-Python install (``LAYERNORM_EXT_BUILD=0``) builds the library on first import, into an empty
       extension cache; its results are bitwise those of the prebuilt library of this process.
    2. The same install given this process's prebuilt library, with ``LAYERNORM_EXT_JIT=1``: the import takes
       the JIT path all the same (the prebuilt is not loaded), finds the cached build of step 1 up to date and
       loads it without compiling again; bitwise the same results.
    3. The same install without ``LAYERNORM_EXT_JIT``: the prebuilt library loads.
    """
    assert layernorm_ext.build_info()["load_method"] == "prebuilt", "this process must use the prebuilt library"
    site = _pure_python_install(tmp_path)
    ext_dir = tmp_path / "torch_extensions"
    env = {"PYTHONPATH": str(site)}

    payload = _run_child(tmp_path, ext_dir, env, _DROP_EDITABLE_FINDERS)
    assert Path(payload["package_file"]).resolve().is_relative_to(site.resolve()), payload["package_file"]
    built = _jit_libraries(ext_dir)
    assert built, f"no JIT library under TORCH_EXTENSIONS_DIR={ext_dir}"
    _assert_same_as_prebuilt(payload)

    prebuilt = Path(native.__file__)
    shutil.copy2(prebuilt, site / "layernorm_ext" / prebuilt.name)
    payload = _run_child(tmp_path, ext_dir, {**env, "LAYERNORM_EXT_JIT": "1"}, _DROP_EDITABLE_FINDERS)
    assert _jit_libraries(ext_dir) == built, "LAYERNORM_EXT_JIT=1 rebuilt instead of reusing the cached build"
    _assert_same_as_prebuilt(payload)

    payload = _run_child(tmp_path, ext_dir, env, _DROP_EDITABLE_FINDERS)
    assert payload["build_info"]["load_method"] == "prebuilt" and payload["prebuilt_loaded"] is True


if __name__ == "__main__":
    _child_main(sys.argv[1])
