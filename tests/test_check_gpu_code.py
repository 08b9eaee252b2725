"""tools/check_gpu_code.py (CI's check of a CUDA build's or wheel's GPU code) on fat binaries made here, laid
out as nvcc lays them out: it must find every entry of every fat binary, in a library and inside a wheel."""

from __future__ import annotations

import struct
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import check_gpu_code  # noqa: E402

_ENTRY_HEADER_SIZE = 64


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    header = bytearray(_ENTRY_HEADER_SIZE)
    struct.pack_into("<H2xIQ", header, 0, kind, _ENTRY_HEADER_SIZE, len(payload))
    struct.pack_into("<I", header, 28, arch)
    return bytes(header) + payload


def _fatbin(entries: list[tuple[int, int]]) -> bytes:
    body = b"".join(_entry(kind, arch, bytes(range(arch % 7 + 5))) for kind, arch in entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def _library(fatbins: list[list[tuple[int, int]]]) -> bytes:
    return b"\x7fELF" + b"\0" * 61 + b"".join(_fatbin(f) + b"\0" * 13 for f in fatbins)


@pytest.mark.parametrize(
    ("fatbins", "want"),
    [
        ([[(2, 80), (2, 90), (1, 90)]], {"sm_80", "sm_90", "ptx_90"}),
        ([[(2, 80)], [(2, 100), (2, 120), (1, 120)]], {"sm_80", "sm_100", "sm_120", "ptx_120"}),
        ([], set()),
    ],
)
def test_finds_every_entry(tmp_path: Path, fatbins: list[list[tuple[int, int]]], want: set[str]) -> None:
    library = tmp_path / "_C.cpython-311-x86_64-linux-gnu.so"
    library.write_bytes(_library(fatbins))
    assert check_gpu_code.gpu_code(check_gpu_code.library_bytes(library)) == want
    wheel = tmp_path / "layernorm_ext-0.1.0+torch2.14.1cu130-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("layernorm_ext/__init__.py", "")
        archive.writestr(f"layernorm_ext/{library.name}", library.read_bytes())
    assert check_gpu_code.gpu_code(check_gpu_code.library_bytes(wheel)) == want


def test_missing_entry_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    library = tmp_path / "_C.so"
    library.write_bytes(_library([[(2, 80), (2, 90)]]))
    assert check_gpu_code.main([str(library), "--expect", "sm_80,sm_90"]) == 0
    assert check_gpu_code.main([str(library), "--expect", "sm_80,sm_90,ptx_90"]) == 1
    assert "missing: ptx_90" in capsys.readouterr().err
