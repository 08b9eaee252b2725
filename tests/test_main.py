"""``python -m layernorm_ext``: reports the build, passes its self-check, prints the speed table."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import layernorm_ext
from layernorm_ext.__main__ import main
from layernorm_ext.selfcheck import check_all


def test_main_reports_and_passes() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "layernorm_ext", "--threads", "1", "--reps", "2"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert f"layernorm_ext {layernorm_ext.__version__}" in out
    assert f"instruction set used: {layernorm_ext.build_info()['cpu_isa']}" in out
    assert "self-check on cpu: 88/88" in out
    assert "| layer_norm | float32 |" in out and "| rms_norm | bfloat16 |" in out
    assert "all checks passed" in out


def test_selfcheck_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The self-check is not vacuous: outputs skewed by 4 ulps fail it, and main then exits 1."""
    import layernorm_ext.selfcheck as selfcheck

    real = selfcheck.ours.layer_norm

    def skewed(x, shape, w=None, b=None, *args, **kwargs):
        out = real(x, shape, w, b, *args, **kwargs)
        return out + 4 * torch.finfo(out.dtype).eps * out.detach().abs().amax()

    monkeypatch.setattr(selfcheck.ours, "layer_norm", skewed)
    bad = [c for c in check_all() if not c.ok]
    assert bad and all(c.what.startswith("layer_norm ") for c in bad)
    assert main(["--no-bench"]) == 1
