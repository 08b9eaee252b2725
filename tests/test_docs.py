"""Every code block of README.md and docs/*.md: the ```python blocks run (each in a fresh interpreter of its own,
reported at its own line), so the docs cannot drift from the code. A block that cannot run here (a GPU, a distributed launch) is preceded by
``<!-- docs-test: skip (the reason) -->``; shell and text blocks (```bash, ```console, ```text) are not run
(CI runs README's quick-start and wheel commands itself: .ci/run, .ci/wheel_check)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LANGUAGES = {"python", "bash", "console", "text"}
FENCE = re.compile(r"^(?P<indent> *)```(?P<language>\S*)\s*$")
SKIP = re.compile(r"^\s*<!--\s*docs-test:\s*skip\b(?P<rest>.*?)-->\s*$")
BLOCK_SECONDS = 120


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    language: str
    code: str  # dedented by the fence's indent; line i of the code is line `line + i` of the file
    skip_reason: str | None


def parse_blocks(text: str, path: str) -> list[Block]:
    """The fenced blocks of a markdown text. A skip marker must give its reason in parentheses."""
    blocks: list[Block] = []
    lines = text.split("\n")
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent = len(opening["indent"])
        start = index
        index += 1
        body: list[str] = []
        while index < len(lines) and not re.match(r"^ *```\s*$", lines[index]):
            body.append(lines[index][indent:] if lines[index][:indent].strip() == "" else lines[index])
            index += 1
        if index == len(lines):
            raise ValueError(f"{path}:{start + 1}: code block never closed")
        index += 1
        previous = next((lines[i] for i in range(start - 1, -1, -1) if lines[i].strip()), "")
        skip_reason = None
        if marker := SKIP.match(previous):
            reason = re.fullmatch(r"\s*\((.*\S.*)\)\s*", marker["rest"])
            if not reason:
                raise ValueError(f"{path}:{start}: a docs-test skip marker must give its reason: (needs ...)")
            skip_reason = reason[1].strip()
        blocks.append(Block(path, start + 1, opening["language"], "\n".join(body), skip_reason))
    return blocks


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def all_blocks() -> list[Block]:
    return [block for path in doc_files() for block in parse_blocks(path.read_text(), str(path.relative_to(REPO)))]


# Runs blocks in order in one interpreter, each in a fresh namespace, its outcome recorded on its own (the tests
# give it one block: a process per block, so that no block leans on what another imported or set).
PAGE_RUNNER = """
import json, sys, traceback
blocks, results = json.load(sys.stdin), []
for path, line, code in blocks:
    try:
        exec(compile("\\n" * line + code + "\\n", path, "exec"), {"__name__": "__main__"})
        results.append(None)
    except BaseException:
        results.append(traceback.format_exc())
    with open(sys.argv[1], "w") as out:
        json.dump(results, out)
"""


def run_blocks(blocks: list[Block], workdir: Path) -> list[str | None]:
    """Runs the blocks in order in one fresh interpreter: None for each that passed, else its traceback, whose
    lines name the markdown file and its line numbers. A block that kills the process fails with the rest."""

    results_path = workdir / "results.json"
    results_path.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", PAGE_RUNNER, str(results_path)], cwd=workdir, env=env,
                          input=json.dumps([(b.path, b.line, b.code) for b in blocks]), capture_output=True,
                          text=True, timeout=BLOCK_SECONDS * len(blocks))
    results: list[str | None] = json.loads(results_path.read_text()) if results_path.exists() else []
    died = f"the process died (exit {proc.returncode})\n{proc.stderr[-4000:]}"
    return results + [died] * (len(blocks) - len(results))


def failure_message(block: Block, error: str) -> str:
    return f"{block.path}:{block.line}: the python block failed\n{error}"


def block_result(block: Block, tmp_path_factory: pytest.TempPathFactory) -> str | None:
    """The block run in a fresh interpreter of its own, in an empty folder."""
    (result,) = run_blocks([block], tmp_path_factory.mktemp("docs"))
    return result


BLOCKS = all_blocks()
PYTHON_BLOCKS = [block for block in BLOCKS if block.language == "python"]


def test_every_block_names_a_known_language() -> None:
    unknown = [f"{b.path}:{b.line}: ```{b.language}" for b in BLOCKS if b.language not in LANGUAGES]
    assert not unknown, f"blocks without a language the docs test knows ({sorted(LANGUAGES)}): {unknown}"
    assert len(PYTHON_BLOCKS) >= 10, [f"{b.path}:{b.line}" for b in PYTHON_BLOCKS]


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[f"{b.path}:{b.line}" for b in PYTHON_BLOCKS])
def test_python_block_runs(block: Block, tmp_path_factory: pytest.TempPathFactory) -> None:
    if block.skip_reason is not None:
        pytest.skip(f"{block.path}:{block.line}: {block.skip_reason}")
    error = block_result(block, tmp_path_factory)
    if error is not None:
        pytest.fail(failure_message(block, error), pytrace=False)


def test_a_broken_block_fails_with_its_file_and_line(tmp_path: Path) -> None:
    text = "# Page\n\n```python\nimport torch\n```\n\nText.\n\n  ```python\n  x = 1\n  assert x == 2, 'wrong'\n  ```\n"
    blocks = parse_blocks(text, "docs/page.md")
    first, second = run_blocks(blocks, tmp_path)
    assert first is None, first
    assert second is not None and 'File "docs/page.md", line 11' in second, second  # the assert's line in the page
    assert failure_message(blocks[1], second).startswith("docs/page.md:9: ")
    (died,) = run_blocks(parse_blocks("```python\nimport os\nos._exit(3)\n```\n", "a.md"), tmp_path)
    assert died is not None and "exit 3" in died


def test_a_skip_marker_needs_a_reason() -> None:
    (block,) = parse_blocks("<!-- docs-test: skip (needs CUDA) -->\n```python\nx\n```\n", "a.md")
    assert block.skip_reason == "needs CUDA"
    for marker in ("<!-- docs-test: skip -->", "<!-- docs-test: skip () -->"):
        with pytest.raises(ValueError, match="must give its reason"):
            parse_blocks(f"{marker}\n```python\nx\n```\n", "a.md")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (but - and _), spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_point_at_files_and_headings() -> None:
    broken = []
    for path in doc_files():
        text = path.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # an absolute URL
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{path.relative_to(REPO)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md":
                headings = {_anchor(h) for h in re.findall(r"^#+ (.*)$", linked.read_text(), flags=re.M)}
                if anchor not in headings:
                    broken.append(f"{path.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, broken
