"""The loader refuses a prebuilt library built against another torch, with a message that says how to rebuild."""

from __future__ import annotations

import subprocess
import sys

import layernorm_ext


def _import_with_torch_version(version: str) -> subprocess.CompletedProcess[str]:
    code = f"import torch\ntorch.__version__ = {version!r}\nimport layernorm_ext\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_mismatched_torch_fails_with_rebuild_hint() -> None:
    assert layernorm_ext.build_info()["load_method"] == "prebuilt"
    built = layernorm_ext.build_info()["torch_version"]
    proc = _import_with_torch_version("2.99.1")
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr
    assert f"built against torch {built}, but torch 2.99.1 is running" in proc.stderr
    assert "pip install --no-build-isolation --force-reinstall --no-deps ." in proc.stderr
    assert "LAYERNORM_EXT_JIT=1" in proc.stderr


def test_local_version_suffix_is_not_a_mismatch() -> None:
    built = str(layernorm_ext.build_info()["torch_version"])
    proc = _import_with_torch_version(f"{built}+cu999")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_torch_older_than_supported_warns() -> None:
    from layernorm_ext._sources import OLDEST_TORCH

    major, minor = (int(part) for part in OLDEST_TORCH.split("."))
    older = f"{major}.{minor - 1}.0"
    proc = _import_with_torch_version(older)
    # The warning comes first; the import then refuses a library built against another torch.
    assert f"UserWarning: layernorm_ext supports torch {OLDEST_TORCH} and newer; torch {older} is running" in proc.stderr
    proc = _import_with_torch_version(str(layernorm_ext.build_info()["torch_version"]))
    assert proc.returncode == 0 and "supports torch" not in proc.stderr, proc.stderr[-2000:]
