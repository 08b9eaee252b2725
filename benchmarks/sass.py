"""SASS of a built library, as data: cuobjdump's disassembly and resource usage, parsed into functions of
instructions and basic blocks, and the static analyses of benchmarks/kernel_audit.py on them (no GPU).

Only the standard library: the parser is tested on a small SASS fixture (tests/test_kernel_audit.py).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

# ---- tools ---------------------------------------------------------------------------------------------------


def _site_package_bins() -> list[Path]:
    """bin folders of the pip-installed CUDA tools (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) and triton's."""
    folders: list[Path] = []
    for site in sys.path:
        for pattern in ("nvidia/cu*/bin", "nvidia/cuda_*/bin", "triton/backends/nvidia/bin"):
            folders += [Path(p) for p in sorted(glob.glob(os.path.join(site, pattern)))]
    return folders


def find_tool(name: str) -> str:
    """A CUDA binary tool: on PATH, in $CUDA_HOME/bin, or from the pip packages; raises if none is found."""
    candidates = [shutil.which(name)]
    if os.environ.get("CUDA_HOME"):
        candidates.append(str(Path(os.environ["CUDA_HOME"]) / "bin" / name))
    candidates += [str(folder / name) for folder in _site_package_bins()]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK) and Path(candidate).is_file():
            return candidate
    raise FileNotFoundError(
        f"{name} not found on PATH, in $CUDA_HOME/bin or in the pip packages: pip install nvidia-cuda-cuobjdump "
        "nvidia-cuda-nvdisasm (the project's `audit` extra)"
    )


def _cuobjdump(args: list[str]) -> str:
    env = dict(os.environ)
    # cuobjdump -sass runs nvdisasm, which the pip package of cuobjdump does not ship.
    env["PATH"] = str(Path(find_tool("nvdisasm")).parent) + os.pathsep + env.get("PATH", "")
    return subprocess.run([find_tool("cuobjdump"), *args], check=True, capture_output=True, text=True, env=env).stdout


def resource_usage(library: str, arch: str) -> str:
    """cuobjdump -res-usage of the library's code for one architecture (e.g. sm_90): every function's name."""
    return _cuobjdump(["-res-usage", "-arch", arch, library])


def function_names(usage: str) -> list[str]:
    return [name for name, *_ in _USAGE.findall(usage)]


def disassemble(library: str, arch: str, functions: list[str]) -> str:
    """cuobjdump -sass of the named (mangled) functions for one architecture: far faster than the whole
    library (tens of MB of text per dtype)."""
    return _cuobjdump(["-sass", "-arch", arch, "-fun", ",".join(functions), library]) if functions else ""


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled -> demangled C++ names through c++filt (binutils)."""
    if not names:
        return {}
    cxxfilt = shutil.which("c++filt") or shutil.which("cu++filt")
    if cxxfilt is None:
        raise FileNotFoundError("c++filt not found (binutils)")
    out = subprocess.run([cxxfilt], input="\n".join(names) + "\n", check=True, capture_output=True, text=True).stdout
    return dict(zip(names, out.splitlines()))


# ---- instructions ----------------------------------------------------------------------------------------------

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)\s*([^;]*);")
_REG = re.compile(r"(?<![A-Z_])R(\d+)(\.64)?")
_UREG = re.compile(r"\bUR(\d+)")
_PARAM = re.compile(r"c\[0x0\]\[(0x[0-9a-f]+)\]")

GLOBAL_LOADS = ("LDG",)
ASYNC_COPIES = ("LDGSTS",)
GLOBAL_STORES = ("STG", "RED", "ATOMG")
NO_DESTINATION = GLOBAL_STORES + ("ST", "STS", "STL", "BAR", "BRA", "EXIT", "BSSY", "BSYNC", "RET", "CALL", "NOP",
                                  "WARPSYNC", "DEPBAR", "LDGDEPBAR", "MEMBAR", "ERRBAR", "CCTL", "LDGSTS", "BPT",
                                  "YIELD", "BMOV", "JMP", "BRX")
FP64_OPS = ("DADD", "DMUL", "DFMA", "DSETP", "DSET", "DMNMX")


@dataclass
class Instruction:
    address: int
    predicate: str  # "" or "@P0", "@!P1", ...
    opcode: str  # with modifiers: LDG.E.128
    operands: list[str]

    @property
    def op(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def modifiers(self) -> list[str]:
        return self.opcode.split(".")[1:]

    def width_registers(self) -> int:
        """32-bit registers per vector operand of a memory access or wide result."""
        mods = self.modifiers
        if "128" in mods:
            return 4
        if "64" in mods or self.op in FP64_OPS or (self.op == "IMAD" and "WIDE" in mods):
            return 2
        if self.op == "F2F" and mods and mods[0] == "F64":
            return 2
        return 1

    def access_bytes(self) -> int:
        """Bytes per thread of a memory access."""
        mods = self.modifiers
        for bits, size in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
            if bits in mods:
                return size
        return 4

    def destinations(self) -> set[int]:
        if self.op in NO_DESTINATION or not self.operands:
            return set()
        match = _REG.fullmatch(self.operands[0].strip().split()[0]) if self.operands[0].strip() else None
        if match is None:
            return set()
        base = int(match.group(1))
        return set(range(base, base + self.width_registers()))

    def sources(self) -> set[int]:
        """Registers read (a vector operand counts all its registers)."""
        operands = self.operands if not self.destinations() else self.operands[1:]
        regs: set[int] = set()
        for operand in operands:
            for match in _REG.finditer(operand):
                base = int(match.group(1))
                in_address = "[" in operand
                width = 2 if match.group(2) else (1 if in_address else self.width_registers())
                regs.update(range(base, base + width))
        return regs

    def params(self) -> list[int]:
        return [int(x, 16) for operand in self.operands for x in _PARAM.findall(operand)]

    @property
    def is_jump(self) -> bool:
        """A branch, or CALL.REL.NOINC: a call that leaves no return address, which nvcc uses to jump out of a
        loop (a predicated one is the loop's exit)."""
        return self.op in ("BRA", "BRX", "JMP") or (self.op == "CALL" and "NOINC" in self.opcode)

    def branch_target(self) -> int | None:
        if not self.is_jump:
            return None
        for operand in self.operands:
            operand = operand.strip()
            if operand.startswith("0x") or operand.startswith("`("):
                try:
                    return int(operand.strip("`()").split()[0], 16)
                except ValueError:
                    return None
        return None

    @property
    def is_fp64(self) -> bool:
        mods = self.modifiers
        if self.op in FP64_OPS:
            return True
        if self.op in ("F2F", "I2F", "F2I", "FRND") and "F64" in mods:
            return True
        return self.op == "MUFU" and any(m.endswith("64H") for m in mods)


def split_operands(text: str) -> list[str]:
    operands, depth, current = [], 0, ""
    for char in text:
        if char in "[(":
            depth += 1
        elif char in "])":
            depth -= 1
        if char == "," and depth == 0:
            operands.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        operands.append(current.strip())
    return operands


@dataclass
class Function:
    name: str  # mangled
    instructions: list[Instruction] = field(default_factory=list)
    registers: int = 0
    shared: int = 0  # static shared memory, bytes
    stack: int = 0
    local: int = 0


def parse_sass(text: str, wanted: set[str] | None = None) -> dict[str, Function]:
    """Functions of `cuobjdump -sass` output (only those in `wanted`, if given)."""
    functions: dict[str, Function] = {}
    current: Function | None = None
    for line in text.splitlines():
        if "Function : " in line:
            name = line.split("Function : ", 1)[1].strip()
            current = Function(name) if wanted is None or name in wanted else None
            if current is not None:
                functions[name] = current
            continue
        if current is None:
            continue
        match = _LINE.match(line)
        if match:
            address, predicate, opcode, operands = match.groups()
            current.instructions.append(
                Instruction(int(address, 16), (predicate or "").strip(), opcode, split_operands(operands))
            )
    return functions


_USAGE = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def parse_resource_usage(text: str, functions: dict[str, Function]) -> None:
    for name, regs, stack, shared, local in _USAGE.findall(text):
        if name in functions:
            f = functions[name]
            f.registers, f.stack, f.shared, f.local = int(regs), int(stack), int(shared), int(local)


# ---- control flow ----------------------------------------------------------------------------------------------


@dataclass
class Block:
    index: int
    instructions: list[Instruction]
    successors: list[int] = field(default_factory=list)

    @property
    def start(self) -> int:
        return self.instructions[0].address

    @property
    def end(self) -> int:
        return self.instructions[-1].address


def basic_blocks(function: Function) -> list[Block]:
    """Basic blocks in address order with their successors (a CALL continues after itself, but for
    CALL.REL.NOINC: a jump)."""
    instructions = [i for i in function.instructions if i.op != "NOP"]
    targets = {t for i in instructions if (t := i.branch_target()) is not None}
    leaders = {instructions[0].address} | targets
    for previous, instruction in zip(instructions, instructions[1:]):
        if previous.is_jump or previous.op in ("EXIT", "RET"):
            leaders.add(instruction.address)
    blocks: list[Block] = []
    for instruction in instructions:
        if instruction.address in leaders or not blocks:
            blocks.append(Block(len(blocks), []))
        blocks[-1].instructions.append(instruction)
    by_start = {b.start: b.index for b in blocks}
    for block in blocks:
        last = block.instructions[-1]
        # BRA.DIV branches only where the warp has diverged (to the out-of-line form of a shuffle): it falls through.
        conditional = bool(last.predicate) or (last.op == "BRA" and "DIV" in last.modifiers)
        falls_through = not ((last.is_jump or last.op in ("EXIT", "RET")) and not conditional)
        target = last.branch_target()
        if target is not None and target in by_start:
            block.successors.append(by_start[target])
        if falls_through and block.index + 1 < len(blocks):
            block.successors.append(block.index + 1)
    return blocks


@dataclass
class Loop:
    header: int  # block index
    latch: int  # block index of the back edge
    blocks: set[int]

    def contains(self, other: "Loop") -> bool:
        return other.blocks < self.blocks


def loops(blocks: list[Block]) -> list[Loop]:
    """Natural loops of back edges (a branch to an earlier address), bodies as the address range they span."""
    found = []
    for block in blocks:
        for successor in block.successors:
            if successor <= block.index:
                found.append(Loop(successor, block.index, set(range(successor, block.index + 1))))
    return found


def address_parameters(instructions: list[Instruction], position: int, depth: int = 6) -> set[int]:
    """The kernel parameters (offsets in constant bank 0) a memory access's address derives from: a backward
    slice, in address order, through the definitions of the address registers to c[0x0][...] operands. Index
    arithmetic brings in non-pointer parameters too (cols, units); the caller picks the pointer among them."""
    access = instructions[position]
    address = next((o for o in access.operands if "[" in o and not o.startswith("c[")), "")
    if access.op == "LDGSTS":  # LDGSTS [shared], [global]: the second address
        address = [o for o in access.operands if "[" in o][-1]
    regs = {int(m.group(1)) for m in _REG.finditer(address)}
    uregs = {int(m.group(1)) for m in _UREG.finditer(address.split("]")[-2] if "desc[" in address else address)}
    found: set[int] = set()
    _slice(instructions, position, regs, uregs, depth, found)
    return found


def _defines(instruction: Instruction, reg: int, uniform: bool) -> bool:
    if not instruction.operands:
        return False
    first = instruction.operands[0].strip()
    if uniform:
        match = re.fullmatch(r"UR(\d+)", first)
        width = 2 if "64" in instruction.modifiers else 1
        return match is not None and int(match.group(1)) <= reg < int(match.group(1)) + width
    return reg in instruction.destinations()


def _slice(instructions: list[Instruction], position: int, regs: set[int], uregs: set[int], depth: int,
           found: set[int]) -> None:
    if depth == 0:
        return
    for reg, uniform in [(r, False) for r in sorted(regs)] + [(u, True) for u in sorted(uregs)]:
        for back in range(position - 1, max(-1, position - 400), -1):
            instruction = instructions[back]
            if not _defines(instruction, reg, uniform):
                continue
            found.update(instruction.params())
            sources = instruction.operands[1:]
            sub_regs = {int(m.group(1)) for o in sources for m in _REG.finditer(o)}
            sub_uregs = {int(m.group(1)) for o in sources for m in _UREG.finditer(o)}
            _slice(instructions, back, sub_regs, sub_uregs, depth - 1, found)
            break
