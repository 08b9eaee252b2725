"""The end-to-end benchmark's smoke run: every model and dtype replaced as expected, the run's exit status 0.

benchmarks/e2e.py checks that replace_norms replaced exactly the norms each model holds, with the expected
classes; a change of replace_norms' report (its numerics options in the class column, say) once broke that
check in the bfloat16 Llama case without any test noticing. The smoke run (--quick: tiny sizes) takes seconds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_e2e_quick_run_passes(tmp_path: Path) -> None:
    out = tmp_path / "e2e.md"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "e2e.py"), "--quick", "--devices", "cpu", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = out.read_text()
    assert "Failed cases" not in report
    for model in ("gpt", "bert", "llama", "llama-nn"):
        for dtype in ("fp32", "bf16"):
            assert f"| cpu | {model} | {dtype} |" in report, (model, dtype)
