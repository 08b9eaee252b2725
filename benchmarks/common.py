"""What the benchmark scripts (overhead.py, e2e.py) share: comma-list options, the report's head and end."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import layernorm_ext


def comma_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of some of ``choices``."""

    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        bad = [item for item in items if item not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(choices)}")
        return items

    return parse


def report_head(title: str, wall_s: float, when: str = "", build: str = "") -> list[str]:
    """Title, command line, date and wall time (``when`` appended), torch and the library (``build``
    appended), machine, threads."""
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return [
        f"# {title}",
        "",
        f"- command: `{shlex.join([os.path.basename(sys.executable), *sys.argv])}`",
        f"- date: {now}; wall time {wall_s:.0f} s{when}",
        f"- torch {torch.__version__}; layernorm_ext.build_info(): {layernorm_ext.build_info()}{build}",
        f"- machine: {platform.machine()} {platform.processor() or platform.platform()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}",
        f"- threads: {torch.get_num_threads()} (torch.set_num_threads)",
    ]


def finish_report(lines: list[str], failures: Sequence[str], summary: str, out: Path | None) -> int:
    """Prints the report (lines, then the failed cases, then the summary line), writes it to ``out`` if given;
    the exit status: 1 if any case failed."""
    if failures:
        lines = [*lines, f"Failed cases ({len(failures)}):", "", *(f"- {f}" for f in failures), ""]
    text = "\n".join([*lines, summary] if summary else lines) + "\n"
    print(text, end="")
    if out is not None:
        out.write_text(text)
    return 1 if failures else 0
