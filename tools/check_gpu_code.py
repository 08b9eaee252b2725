"""Which GPU code a built library holds: the SASS (sm_XX) and PTX (ptx_XX) entries of its CUDA fat binaries.

    python tools/check_gpu_code.py layernorm_ext/_C*.so --expect sm_80,sm_90,ptx_90
    python tools/check_gpu_code.py dist/layernorm_ext-*.whl --expect sm_80,sm_90,sm_100,sm_120,ptx_120

A wheel is read in place (its layernorm_ext/_C*.so member). Needs no GPU and no CUDA toolkit (CI's has no
cuobjdump): it walks the fat binaries itself. Prints what it found; exits 1 if an expected entry is missing.
"""

from __future__ import annotations

import argparse
import struct
import sys
import zipfile
from pathlib import Path

# A fat binary: header (magic, version, header size, size of the entries), then entries, each with its kind
# (1 = PTX, 2 = ELF cubin), its header size and payload size, and the SM number at byte 28 of its header.
_FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)
_KINDS = {1: "ptx", 2: "sm"}


def gpu_code(data: bytes) -> set[str]:
    """The entries of every fat binary in a library's bytes, as "sm_90" / "ptx_90"."""
    entries: set[str] = set()
    start = data.find(_FATBIN_MAGIC)
    while start >= 0:
        header_size, fat_size = struct.unpack_from("<HQ", data, start + 6)
        entry, end = start + header_size, start + header_size + fat_size
        while entry < end:
            kind, entry_header_size, size = struct.unpack_from("<H2xIQ", data, entry)
            arch = struct.unpack_from("<I", data, entry + 28)[0]
            entries.add(f"{_KINDS.get(kind, f'kind{kind}')}_{arch}")
            entry += entry_header_size + size
        start = data.find(_FATBIN_MAGIC, end)
    return entries


def library_bytes(path: Path) -> bytes:
    """The library itself, or the layernorm_ext._C library inside a wheel."""
    if path.suffix != ".whl":
        return path.read_bytes()
    with zipfile.ZipFile(path) as wheel:
        (member,) = [n for n in wheel.namelist() if n.startswith("layernorm_ext/_C") and n.endswith(".so")]
        return wheel.read(member)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("library", type=Path, help="a built library (.so) or a wheel holding one")
    parser.add_argument("--expect", default="", help="comma-separated entries that must be present, e.g. sm_80,ptx_90")
    args = parser.parse_args(argv)
    found = gpu_code(library_bytes(args.library))
    print(f"GPU code in {args.library}: {', '.join(sorted(found)) or 'none'}")
    missing = {e for e in args.expect.split(",") if e} - found
    if missing:
        print(f"missing: {', '.join(sorted(missing))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
