"""Every error and warning message of csrc/ is written by layernorm_ext::message (csrc/message.h), not streamed.

A TORCH_CHECK given several message arguments streams them into a std::ostringstream made in our library. Where the
library carries a private static libstdc++ and is linked with -Bsymbolic-functions (an H200 machine's toolchain,
2026-12-04), streaming an integer there crashed the process; .ci/static_libstdcxx relinks the library that way and
runs the bad-argument tests. This test keeps new checks from streaming again: each message is one string literal or
one message(...) call.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parent.parent / "csrc"
MACROS = ("TORCH_CHECK_NOT_IMPLEMENTED", "TORCH_CHECK_VALUE", "TORCH_CHECK", "TORCH_INTERNAL_ASSERT", "TORCH_WARN")
CALL = re.compile(r"\b(" + "|".join(MACROS) + r")\(")


def _arguments(text: str, start: int) -> list[str]:
    """The top-level arguments of the call whose '(' ends just before start."""
    depth, i, begin, args = 0, start, start, []
    while True:
        c = text[i]
        if c in "\"'":
            i += 1
            while text[i] != c:
                i += 2 if text[i] == "\\" else 1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                args.append(text[begin:i].strip())
                return args
            depth -= 1
        elif c == "," and depth == 0:
            args.append(text[begin:i].strip())
            begin = i + 1
        i += 1


def _calls() -> list[tuple[str, str, list[str]]]:
    calls = []
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in {".cpp", ".h", ".cu", ".cuh"} or path.name == "message.h":
            continue
        text = path.read_text()
        for match in CALL.finditer(text):
            line_start = text.rfind("\n", 0, match.start()) + 1
            if text[line_start:match.start()].lstrip().startswith("#"):  # a macro definition
                continue
            line = text.count("\n", 0, match.start()) + 1
            calls.append((f"{path.relative_to(CSRC)}:{line}", match.group(1), _arguments(text, match.end())))
    return calls


CALLS = _calls()


def test_the_scan_finds_the_checks() -> None:
    assert len(CALLS) > 50, len(CALLS)


def _is_string_literal(arg: str) -> bool:
    return re.fullmatch(r'(\s*"(?:[^"\\]|\\.)*"\s*)+', arg) is not None


@pytest.mark.parametrize(("where", "macro", "args"), CALLS, ids=[c[0] for c in CALLS])
def test_message_is_one_literal_or_one_message_call(where: str, macro: str, args: list[str]) -> None:
    message = args if macro == "TORCH_WARN" else args[1:]
    if not message:
        return
    ok = len(message) == 1 and (_is_string_literal(message[0]) or re.match(r"(layernorm_ext::)?message\(", message[0]))
    assert ok, f"{where}: {macro} streams {len(message)} message arguments; write them with message(...)"
