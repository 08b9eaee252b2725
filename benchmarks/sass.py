"""SASS of a built library, as data: cuobjdump's disassembly and resource usage, parsed into functions of
instructions and basic blocks, and the static analyses of benchmarks/kernel_audit.py on them (no GPU).

Only the standard library: the parser is tested on a small SASS fixture (tests/test_kernel_audit.py).
"""

from __future__ import annotations

import bisect
import glob
import math
import os
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
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
    # Analyses of the instructions that do not depend on the audited case (attributed_accesses'), by their inputs.
    cache: dict = field(default_factory=dict, repr=False, compare=False)


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
    addresses = [i.address for i in instructions]

    def landing(target: int | None) -> int | None:  # a branch to a NOP (dropped) lands on the next instruction
        k = bisect.bisect_left(addresses, target) if target is not None else len(addresses)
        return addresses[k] if k < len(addresses) else None

    targets = {t for i in instructions if (t := landing(i.branch_target())) is not None}
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
        target = landing(last.branch_target())
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


def reachable(successors: list[list[int]], entry: int = 0) -> set[int]:
    """The blocks reachable from `entry` along `successors` (e.g. decided_successors' taken edges)."""
    seen, stack = {entry}, [entry]
    while stack:
        for s in successors[stack.pop()]:
            if s not in seen:
                seen.add(s)
                stack.append(s)
    return seen


def _address_registers(access: Instruction) -> tuple[set[int], set[int]]:
    """The registers and uniform registers of a memory access's global address."""
    address = next((o for o in access.operands if "[" in o and not o.startswith("c[")), "")
    if access.op == "LDGSTS":  # LDGSTS [shared], [global]: the second address
        address = [o for o in access.operands if "[" in o][-1]
    regs = {int(m.group(1)) for m in _REG.finditer(address)}
    uregs = {int(m.group(1)) for m in _UREG.finditer(address.split("]")[-2] if "desc[" in address else address)}
    return regs, uregs


# ---- branches decided by known kernel parameters -------------------------------------------------------------
# The quantized kernels test their QuantArgs at run time (static or dynamic scale, per row or per group, which
# code): to follow one variant, the parameters it fixes are propagated over the control-flow graph as known bits,
# and a branch whose predicate they decide keeps one successor. Bits rather than whole values, because nvcc keeps
# some of these flags as single bits of a register (set and cleared by LOP3 under a predicate, tested by a LOP3
# into a predicate). Only the few operations that carry such a value from a parameter to a branch are evaluated
# (constant loads, moves, byte permutes, selects, integer compares, logic on bits and predicates); any other
# instruction makes what it writes unknown. A subroutine call (CALL.REL.NOINC, nvcc's out-of-line slow paths) has
# no edge back in the graph: the code after it is reached by the branch around it only.

Known = tuple[int, int]  # (mask of the known bits, their values)
_UNKNOWN: Known = (0, 0)
_FULL = 0xFFFFFFFF
_CONST = re.compile(r"c\[0x0\]\[(0x[0-9a-f]+)\]")
_PRED_OPERAND = re.compile(r"(!?)(U?P[0-6T])")
_REG_OPERAND = re.compile(r"(U?R(?:\d+|Z))(?:\.reuse)?")
_COMPARE = {"EQ": lambda a, b: a == b, "NE": lambda a, b: a != b, "LT": lambda a, b: a < b,
            "LE": lambda a, b: a <= b, "GT": lambda a, b: a > b, "GE": lambda a, b: a >= b}
_BOOL = {"AND": lambda a, b: a and b, "OR": lambda a, b: a or b, "XOR": lambda a, b: a != b}
# FSETP's comparisons: ordered (false where either side is NaN) and unordered (the U forms: true there).
_FLOAT_COMPARE = {**{name: (lambda compare: lambda a, b: not (math.isnan(a) or math.isnan(b)) and compare(a, b))(f)
                     for name, f in _COMPARE.items()},
                  **{name + "U": (lambda compare: lambda a, b: math.isnan(a) or math.isnan(b) or compare(a, b))(f)
                     for name, f in _COMPARE.items()},
                  "NUM": lambda a, b: not (math.isnan(a) or math.isnan(b)),
                  "NAN": lambda a, b: math.isnan(a) or math.isnan(b)}
_FLOAT_LITERAL = re.compile(r"[-+]?(\d+(\.\d*)?(e[+-]?\d+)?|inf|nan)", re.IGNORECASE)
# Instructions that write predicates only (their register operands are read).
_PREDICATE_SETTERS = ("ISETP", "UISETP", "FSETP", "DSETP", "HSETP2", "FCHK", "PLOP3", "UPLOP3")


def _const(value: int, bits: int = 32) -> Known:
    mask = (1 << bits) - 1
    return mask, value & mask


def _full(known: Known, bits: int = 32) -> int | None:
    return known[1] if known[0] == (1 << bits) - 1 else None


def _meet(a: Known, b: Known) -> Known:
    """What two paths agree on."""
    mask = a[0] & b[0] & ~(a[1] ^ b[1])
    return mask, a[1] & mask


def _signed(value: int) -> int:
    return value - (1 << 32) if value & 0x80000000 else value


def _lut(table: int, a: Known, b: Known, c: Known, bits: int = 32) -> Known:
    """LOP3 / PLOP3: bit k of the result is table[(a_k << 2) | (b_k << 1) | c_k]; known where every value the
    unknown input bits may take gives the same."""
    mask = value = 0
    for k in range(bits):
        options = [[(x[1] >> k) & 1] if (x[0] >> k) & 1 else [0, 1] for x in (a, b, c)]
        results = {(table >> (i << 2 | j << 1 | l)) & 1 for i in options[0] for j in options[1] for l in options[2]}
        if len(results) == 1:
            mask |= 1 << k
            value |= results.pop() << k
    return mask, value


def _param(params: dict[int, int], offset: int, size: int) -> Known:
    """The parameters' bytes from `offset` (little-endian), each known or not."""
    mask = value = 0
    for k in range(size):
        if offset + k in params:
            mask |= 0xFF << (8 * k)
            value |= params[offset + k] << (8 * k)
    return mask, value


def _value(operand: str, state: dict[str, Known], params: dict[int, int], size: int = 4) -> Known:
    operand = operand.strip()
    if operand[:1] in "-~" and _REG_OPERAND.fullmatch(operand[1:]) is not None:  # IADD3's -R3, ~R5 (full values only)
        value = _full(_value(operand[1:], state, params))
        if value is None:
            return _UNKNOWN
        return _const(-value if operand[0] == "-" else ~value)
    if (match := _CONST.fullmatch(operand)) is not None:
        return _param(params, int(match.group(1), 16), size)
    if (match := _REG_OPERAND.fullmatch(operand)) is not None:
        name = match.group(1)
        return _const(0) if name in ("RZ", "URZ") else state.get(name, _UNKNOWN)
    if (match := _PRED_OPERAND.fullmatch(operand)) is not None:
        negate, name = match.groups()
        mask, value = _const(1, 1) if name in ("PT", "UPT") else state.get(name, _UNKNOWN)
        return mask, value ^ (mask if negate else 0)
    if re.fullmatch(r"-?0x[0-9a-f]+", operand):
        return _const(int(operand, 16))
    return _UNKNOWN  # negated or absolute registers, floats, addresses: not followed


def _float_operand(operand: str, state: dict[str, Known], params: dict[int, int]) -> float | None:
    """A float32 operand's value where all its bits are known: a register, a constant, or a float literal."""
    operand = operand.strip()
    if _FLOAT_LITERAL.fullmatch(operand):
        return struct.unpack("<f", struct.pack("<f", float(operand)))[0]
    if operand[:1] in "-|~":
        return None
    bits = _full(_value(operand, state, params))
    return None if bits is None else struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def _written_width(instruction: Instruction) -> int:
    """Registers of a destination: width_registers(), and 64-bit results of conversions (I2F.F64.S64, F2I.S64.F64:
    the first type is the result's) and of UIMAD.WIDE. Not a funnel shift's (SHF.R.S64 writes 32 bits)."""
    mods = instruction.modifiers
    if instruction.op in ("F2F", "I2F", "F2I", "I2I", "FRND"):
        types = [m for m in mods if re.fullmatch(r"[FSU](8|16|32|64)", m)]
        return 2 if types and types[0].endswith("64") else 1
    if instruction.op == "UIMAD" and "WIDE" in mods:
        return 2
    return instruction.width_registers()


def _written(instruction: Instruction) -> list[str]:
    """Every register and predicate an instruction may write, generously (an extra one only loses a constant):
    leading predicates (ISETP P0, ...; SHFL PT, R3, ...), then the first register and the predicates right
    after it (carry outs: IADD3 R0, P2, ...)."""
    if instruction.is_jump:
        return []
    if instruction.op in ("R2P", "UR2UP"):  # predicates from a register's bits
        return [f"{prefix}{k}" for prefix in ("P", "UP") for k in range(7)]
    names: list[str] = []
    operands = [o.strip() for o in instruction.operands]
    k = 0
    while k < len(operands) and (match := _PRED_OPERAND.fullmatch(operands[k])) is not None:
        names += [] if match.group(2) in ("PT", "UPT") else [match.group(2)]
        k += 1
    if instruction.op in _PREDICATE_SETTERS or k >= len(operands):
        return names
    if (match := _REG_OPERAND.fullmatch(operands[k])) is not None:
        name = match.group(1)
        if name not in ("RZ", "URZ"):
            prefix = "UR" if name.startswith("U") else "R"
            base = int(name[len(prefix):])
            names += [f"{prefix}{base + j}" for j in range(_written_width(instruction))]
        k += 1
        while k < len(operands) and (match := _PRED_OPERAND.fullmatch(operands[k])) is not None:
            names += [] if match.group(2) in ("PT", "UPT") else [match.group(2)]
            k += 1
    return names


def _pair(name: str) -> str:
    """The register after `name` (the high word of a 64-bit pair)."""
    prefix = "UR" if name.startswith("UR") else "R"
    return f"{prefix}{int(name[len(prefix):]) + 1}"


def _integer(instruction: Instruction, state: dict[str, Known], params: dict[int, int],
             specials: dict[str, int]) -> dict[str, Known]:
    """What an integer instruction writes, where its sources are whole known values (the index arithmetic of a
    thread whose special registers `specials` gives, e.g. lane 0 of block 0): name -> known bits; {} where it
    cannot tell. Address-sized sums carry through predicates (IADD3 R6, P2, ...; LEA.HI.X ..., P2)."""
    op, mods, ops = instruction.op, instruction.modifiers, [o.strip() for o in instruction.operands]
    base_op = op[1:] if op.startswith("U") else op  # UIADD3, UIMAD, ULEA, USHF: the same arithmetic
    if op in ("S2R", "S2UR") and len(ops) == 2 and ops[1] in specials:
        return {ops[0]: _const(specials[ops[1]])}
    if op == "CS2R" and len(ops) == 2 and ops[1] == "SRZ" and _REG_OPERAND.fullmatch(ops[0]):
        return {ops[0]: _const(0), _pair(ops[0]): _const(0)}
    if op == "R2UR" and len(ops) == 2:
        return {ops[0]: _value(ops[1], state, params)}
    if op == "P2R" and not mods and len(ops) == 4 and ops[1] == "PR":  # P2R Rd, PR, Ra, mask: predicates -> bits 0-6
        mask_bits, base = _full(_value(ops[3], state, params)), _value(ops[2], state, params)
        if mask_bits is None:
            return {}
        known, value = base[0] & ~mask_bits & _FULL, base[1] & ~mask_bits & _FULL
        for k in range(7):
            if mask_bits >> k & 1 and (p := state.get(f"P{k}")) is not None and p[0]:
                known, value = known | 1 << k, value | (p[1] & 1) << k
        return {ops[0]: (known, value)}
    if op == "R2P" and not mods and len(ops) == 3 and ops[0] == "PR":  # R2P PR, Ra, mask: bits 0-6 -> predicates
        mask_bits, source = _full(_value(ops[2], state, params)), _value(ops[1], state, params)
        if mask_bits is None:
            return {}
        return {f"P{k}": ((source[0] >> k) & 1, (source[1] >> k) & 1) for k in range(7) if mask_bits >> k & 1}
    if op == "HFMA2" and "MMA" in mods and ops[1:3] == ["-RZ", "RZ"] and ops[3:] == ["0", "0"]:
        return {ops[0]: _const(0)}  # nvcc's zeroing idiom

    # Destination, carry-out predicates, sources, carry-in predicates.
    dest, k = ops[0] if ops else "", 1
    carry_out: list[str] = []
    while k < len(ops) and _PRED_OPERAND.fullmatch(ops[k]):
        carry_out.append(ops[k])
        k += 1
    sources = ops[k:]
    carry_in: list[str] = []
    while sources and _PRED_OPERAND.fullmatch(sources[-1]):
        carry_in.insert(0, sources.pop())
    if not _REG_OPERAND.fullmatch(dest) or not set(mods) <= _INTEGER_MODIFIERS.get(base_op, set()):
        return {}  # a form whose modifiers are not all understood (P2R.B1, SHF.W, ...): nothing known

    def full(operand: str, size: int = 4) -> int | None:
        return _full(_value(operand, state, params, size), 8 * size)

    def wide(operand: str) -> int | None:  # a 64-bit pair (R8 = R8:R9) or a 64-bit constant
        if _CONST.fullmatch(operand):
            return full(operand, 8)
        low = full(operand)
        if operand in ("RZ", "URZ"):
            return 0
        high = _full(state.get(_pair(operand.split(".")[0]), _UNKNOWN)) if _REG_OPERAND.fullmatch(operand) else None
        return None if low is None or high is None else low | high << 32

    def carries() -> int | None:
        total = 0
        for predicate in carry_in:
            bit = _full(_value(predicate, state, params), 1)
            if bit is None:
                return None
            total += bit
        return total

    def result(value: int, carry: int | None = None) -> dict[str, Known]:
        written = {dest: _const(value)}
        # The first carry-out predicate: the sum's bit 32, where the sum carries at most 1 (a second one, PT in
        # nvcc's code, then 0); otherwise not followed.
        if carry_out and carry_out[0] not in ("PT", "!PT") and not carry_out[0].startswith("!"):
            written[carry_out[0]] = _const(carry, 1) if carry is not None and carry <= 1 else _UNKNOWN
        return written

    def addend(operand: str) -> int | None:  # a two's complement operand as the adder sees it: -x = ~x + 1
        if operand.startswith("-"):
            value = full(operand[1:])
            return None if value is None else ((~value) & _FULL) + 1
        return full(operand)

    if base_op in ("IADD3", "VIADD") and len(sources) in (2, 3):
        values = [addend(o) for o in sources]
        carry = carries() if "X" in mods else 0
        if None in values or carry is None:
            return {}
        total = sum(values) + carry
        return result(total & _FULL, total >> 32)
    if base_op == "IMAD" and len(sources) == 3:
        a, b = full(sources[0]), full(sources[1])
        zero = a == 0 or b == 0
        if "WIDE" in mods:
            if "X" in mods:
                return {}
            c = wide(sources[2])
            if c is None or (not zero and (a is None or b is None)):
                return {}
            product = 0 if zero else (a * b if "U32" in mods else _signed(a) * _signed(b))
            total = (product + c) & 0xFFFFFFFFFFFFFFFF
            return {dest: _const(total & _FULL), _pair(dest): _const(total >> 32)}
        if "HI" in mods:  # the high word of a * b + c, c a 64-bit pair ({R3:R2} in IMAD.HI.U32 R3, R3, R5, R2)
            c = wide(sources[2])
            if "X" in mods or c is None or (not zero and (a is None or b is None)):
                return {}
            product = 0 if zero else (a * b if "U32" in mods else _signed(a) * _signed(b))
            return result(((product + c) >> 32) & _FULL)
        c = addend(sources[2])
        carry = carries() if "X" in mods else 0
        if c is None or carry is None or (not zero and (a is None or b is None)):
            return {}
        total = (0 if zero else a * b) + c + carry
        return result(total & _FULL)
    if base_op == "LEA" and sources:
        shift = full(sources[-1])
        if shift is None:
            return {}
        if "HI" in mods:  # b + the high word of ({c:a} << s), c = a's sign with SX32
            a, b = full(sources[0]), full(sources[1])
            if a is None or b is None:
                return {}
            c = (_FULL if a & 0x80000000 else 0) if "SX32" in mods else full(sources[2]) if len(sources) == 4 else None
            carry = carries() if "X" in mods else 0
            if c is None or carry is None:
                return {}
            total = b + ((((c << 32) | a) << shift) >> 32 & _FULL) + carry
            return result(total & _FULL, total >> 32)
        a, b = full(sources[0]), full(sources[1])
        if a is None or b is None or len(sources) != 3:
            return {}
        total = ((a << shift) & _FULL) + b
        return result(total & _FULL, total >> 32)
    if base_op == "SHF" and len(sources) == 3:
        # A funnel shift of the pair {c:a}: .HI takes the high word of the result, else the low word.
        a, shift, c = full(sources[0]), full(sources[1]), full(sources[2])
        if a is None or shift is None or c is None or shift >= (64 if "U64" in mods or "S64" in mods else 32):
            return {}
        pair = (c << 32) | a
        if "L" in mods:
            value = pair << shift
        elif "S32" in mods or "S64" in mods:
            value = (pair - (1 << 64) if pair >> 63 else pair) >> shift
        else:
            value = pair >> shift
        return result((value >> 32 if "HI" in mods else value) & _FULL)
    if base_op in ("IMNMX", "VIMNMX") and len(sources) == 2 and carry_in:
        a, b, smaller = full(sources[0]), full(sources[1]), _full(_value(carry_in[0], state, params), 1)
        if a is None or b is None or smaller is None:
            return {}
        x, y = (a, b) if "U32" in mods else (_signed(a), _signed(b))
        return result((min(x, y) if smaller else max(x, y)) & _FULL)
    if base_op == "IABS" and len(sources) == 1 and (a := full(sources[0])) is not None:
        return result(abs(_signed(a)) & _FULL)
    return {}


# The modifiers _integer understands, by operation (its uniform form too): any other makes it give up.
_INTEGER_MODIFIERS = {"IADD3": {"X"}, "VIADD": set(), "IMAD": {"MOV", "U32", "IADD", "SHL", "WIDE", "HI", "X"},
                      "LEA": {"HI", "X", "SX32"}, "SHF": {"L", "R", "U32", "U64", "S32", "S64", "HI"},
                      "IMNMX": {"U32"}, "VIMNMX": {"U32"}, "IABS": set()}


def _evaluate(instruction: Instruction, state: dict[str, Known], params: dict[int, int],
              specials: dict[str, int] | None = None) -> dict[str, Known]:
    """What the instruction writes: name -> known bits. With `specials` (a thread's special registers), integer
    arithmetic on whole known values too (_integer)."""
    op, mods, ops = instruction.op, instruction.modifiers, instruction.operands
    out = {name: _UNKNOWN for name in _written(instruction)}
    dest = ops[0].strip().split(".")[0] if ops else ""

    def v(k: int, size: int = 4) -> Known:
        return _value(ops[k], state, params, size) if k < len(ops) else _UNKNOWN

    if specials is not None and (computed := _integer(instruction, state, params, specials)):
        out.update(computed)
        return out
    if op in ("LDC", "ULDC"):
        size = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8}.get(mods[0] if mods else "", 4)
        mask, value = v(1, size)
        if mods and mods[0] in ("U8", "U16"):  # zero-extended
            mask |= _FULL & ~((1 << (8 * size)) - 1)
        elif mods and mods[0] in ("S8", "S16"):  # sign-extended: known once the sign bit is
            sign = 1 << (8 * size - 1)
            if mask & sign:
                high = _FULL & ~((1 << (8 * size)) - 1)
                mask, value = mask | high, value | (high if value & sign else 0)
        if size == 8 and dest in out:
            prefix = "UR" if dest.startswith("UR") else "R"
            base = int(dest[len(prefix):])
            out[f"{prefix}{base}"] = (mask & _FULL, value & _FULL)
            out[f"{prefix}{base + 1}"] = (mask >> 32, value >> 32)
        elif dest in out:
            out[dest] = (mask, value)
    elif op in ("MOV", "UMOV") and dest in out:
        out[dest] = v(1)
    elif op == "IMAD" and mods == ["MOV", "U32"] and dest in out and _full(v(1)) == 0 and _full(v(2)) == 0:
        out[dest] = v(3)
    elif op in ("SEL", "USEL") and dest in out:
        p = _full(v(3), 1)
        out[dest] = _meet(v(1), v(2)) if p is None else (v(1) if p else v(2))
    elif op in ("PRMT", "UPRMT") and dest in out and not mods:
        selector = _full(v(2))
        if selector is not None:
            a, b = v(1), v(3)
            source_mask = (a[0] | b[0] << 32).to_bytes(8, "little")
            source = (a[1] | b[1] << 32).to_bytes(8, "little")
            mask = value = 0
            for k in range(4):
                nibble = (selector >> (4 * k)) & 0xF
                byte_mask, byte = source_mask[nibble & 7], source[nibble & 7]
                if nibble & 8:  # the byte's sign bit, replicated
                    byte_mask, byte = (0xFF, 0xFF if byte & 0x80 else 0) if byte_mask & 0x80 else (0, 0)
                mask |= byte_mask << (8 * k)
                value |= byte << (8 * k)
            out[dest] = (mask, value)
    elif op in ("ISETP", "UISETP") and mods and mods[0] in _COMPARE:
        compare, unsigned, extended = _COMPARE[mods[0]], "U32" in mods, "EX" in mods
        combine = next((_BOOL[m] for m in mods if m in _BOOL), None)
        a, b, c = _full(v(2)), _full(v(3)), _full(v(4), 1)
        chain = _full(v(5), 1) if extended else 1
        if None not in (a, b, c, chain) and combine is not None:
            x, y = (a, b) if unsigned else (_signed(a), _signed(b))
            result = compare(x, y)
            # The high words of a 64-bit test, chained with the low words' (unsigned) result: equality needs both,
            # an order the high words' strict order or, where they are equal, the low words'.
            if extended and mods[0] in ("EQ", "NE"):
                result = (result and chain) if mods[0] == "EQ" else (result or chain)
            elif extended:
                result = (x != y and result) or (x == y and bool(chain))
            out[dest] = _const(int(combine(result, bool(c))), 1)
    elif op == "FSETP" and mods and mods[0] in _FLOAT_COMPARE and dest in out:
        # A float test of known bits (the audited call's weight_offset): plain registers, constants and literals
        # only (a negated or absolute operand stays unknown).
        combine = next((_BOOL[m] for m in mods if m in _BOOL), None)
        a, b, c = _float_operand(ops[2], state, params), _float_operand(ops[3], state, params), _full(v(4), 1)
        if None not in (a, b, c) and combine is not None:
            if "FTZ" in mods:
                a, b = (0.0 if abs(x) < 2.0 ** -126 else x for x in (a, b))
            out[dest] = _const(int(combine(_FLOAT_COMPARE[mods[0]](a, b), bool(c))), 1)
    elif op in ("LOP3", "ULOP3") and "LUT" in mods:
        predicate_out = _PRED_OPERAND.fullmatch(ops[0].strip()) is not None
        k = 2 if predicate_out else 1
        table = _full(v(k + 3))
        if table is not None:
            result = _lut(table, v(k), v(k + 1), v(k + 2))
            if not predicate_out and dest in out:
                out[dest] = result
            elif predicate_out:
                if (register := ops[1].strip()) in out:
                    out[register] = result
                # The predicate: whether the result is non-zero (with !PT as the last operand: nothing or'ed in).
                if dest in out and _full(v(k + 4), 1) == 0 and (result[0] & result[1] or result[0] == _FULL):
                    out[dest] = _const(int(result[1] != 0), 1)
    elif op in ("PLOP3", "UPLOP3") and "LUT" in mods and dest in out:
        table = _full(v(5))
        if table is not None:
            out[dest] = _lut(table, v(2), v(3), v(4), bits=1)
    return out


def decided_successors(blocks: list[Block], params: dict[int, int], specials: dict[str, int] | None = None,
                       first_pass: frozenset[tuple[int, int]] = frozenset(),
                       observe: Callable[[Instruction, dict[str, Known]], None] | None = None) -> list[list[int]]:
    """Each block's successors that can be taken when the kernel parameters hold `params` (byte offset in
    constant bank 0 -> byte): blocks never reached get none. A forward propagation of known bits to a fixed point
    (a bit stays known in a block where every path into it agrees on it).

    One thread's branches: with `specials` (special register -> value, e.g. SR_TID.X: 0) the thread's integer
    arithmetic is followed too (_integer), and with `first_pass` (back edges (latch, header)) what flows along
    those edges is dropped: the loop's first iteration decides its branches (block 0's first row of a loop over
    rows, whose induction variable would otherwise make every row index, and each test of it, unknown). The
    loop's exits stay open, the latch's branch and any other out of the loop (the loop still ends). `observe` sees each instruction with the state
    before it (as the propagation visits it; tests read a thread's addresses with it). A BRA.DIV (to the out-of-line
    form of a shuffle, vote or match, for a diverged warp) falls through: the audited call's warps run converged."""
    # Left open: the latch's branch and every other branch out of the loop (a loop tested at its top exits there).
    open_blocks = {b for latch, header in first_pass for b in range(header, latch + 1)
               if b == latch or any(s < header or s > latch for s in blocks[b].successors)}
    entry_states: list[dict[str, Known] | None] = [None] * len(blocks)
    entry_states[0] = {}
    taken: list[list[int]] = [[] for _ in blocks]
    work = [0]
    while work:
        b = work.pop()
        state = dict(entry_states[b])
        block = blocks[b]
        for instruction in block.instructions:
            if observe is not None:
                observe(instruction, state)
            if instruction.is_jump or instruction.op in ("EXIT", "RET"):
                continue
            guard = _full(_value(instruction.predicate.lstrip("@"), state, params), 1) if instruction.predicate else 1
            if guard == 0:
                continue
            for name, known in _evaluate(instruction, state, params, specials).items():
                known = known if guard == 1 else _meet(known, state.get(name, _UNKNOWN))
                if known[0]:
                    state[name] = known
                else:
                    state.pop(name, None)
        last = block.instructions[-1]
        successors = list(block.successors)
        decidable = last.predicate and (last.is_jump or last.op == "EXIT") and "DIV" not in last.modifiers
        if last.op == "BRA" and "DIV" in last.modifiers:
            # Taken, its edge back into the code made a cycle through the row loop's back edge that looked like a
            # larger loop (forward_long_kernel with two bodies: the row region became the copy the call does not run).
            assert b + 1 in successors, f"BRA.DIV at {last.address:#x} without a fall-through"
            successors = [b + 1]
        elif decidable and b not in open_blocks:
            guard = _full(_value(last.predicate.lstrip("@"), state, params), 1)
            target = last.branch_target()
            if guard == 1:  # the block at the target (after it, where the target is a NOP)
                landing = min((s for s in successors if target is not None and blocks[s].start >= target),
                              key=lambda s: blocks[s].start, default=None)
                successors = [] if landing is None else [landing]
            elif guard == 0:
                successors = [s for s in successors if s == b + 1][:1]
        taken[b] = successors
        for s in successors:
            if (b, s) in first_pass:
                if entry_states[s] is None:  # the header reached along its back edge only: nothing known there
                    entry_states[s] = {}
                    work.append(s)
                continue
            before = entry_states[s]
            merged = dict(state) if before is None else {
                name: known for name in before.keys() & state.keys() if (known := _meet(before[name], state[name]))[0]}
            if before is None or merged != before:
                entry_states[s] = merged
                work.append(s)
    return taken


def reaching_parameters(blocks: list[Block], successors: list[list[int]]) -> Callable[[int, int], set[int]]:
    """The kernel parameters (offsets in constant bank 0) a memory access's global address derives from, as a
    function of (block, index of the access in it): each address register's definitions that reach the access (the
    first one back on every path through `successors`, e.g. decided_successors' taken edges), then theirs, to
    c[0x0][...] operands, 6 definitions deep. Index arithmetic brings in non-pointer parameters too (cols, units);
    the caller picks the pointer among them. Along the graph rather than back in address order: the nearest
    definition in address order may belong to a branch that does not lead to the access (the quantized kernels'
    variants lie side by side), and an address computed once per row may lie a thousand instructions before its
    first use (the long forward's out, the quantized kernels' codes). A value reloaded from the stack (LDL, a
    spill) is followed to the stores (STL) of its stack words that reach the reload (the long backward's
    partial_dweight address, spilled in its bf16 LayerNorm kernel on sm_90)."""
    predecessors: list[list[int]] = [[] for _ in blocks]
    for b, targets in enumerate(successors):
        for s in targets:
            predecessors[s].append(b)
    # What each instruction defines: registers, uniform registers (prefix "U") and stack words (prefix "L").
    defined = [[{str(r) for r in i.destinations()} | _uniform_destinations(i) | _stack_words(i, "STL")
                for i in block.instructions] for block in blocks]

    def definitions(b: int, k: int, name: str) -> list[tuple[int, int]]:
        hits, seen, stack = [], set(), [(b, k)]
        while stack:
            b, k = stack.pop()
            for j in range(k - 1, -1, -1):
                if name in defined[b][j]:
                    hits.append((b, j))
                    break
            else:
                for p in predecessors[b]:
                    if p not in seen:
                        seen.add(p)
                        stack.append((p, len(blocks[p].instructions)))
        return hits

    def parameters(block: int, index: int, depth: int = 16) -> set[int]:
        found: set[int] = set()
        done: set[tuple[int, int, int]] = set()

        def follow(b: int, k: int, names: set[str], depth: int) -> None:
            if depth == 0:
                return
            for name in sorted(names):
                for db, dk in definitions(b, k, name):
                    if (db, dk, depth) in done:
                        continue
                    done.add((db, dk, depth))
                    instruction = blocks[db].instructions[dk]
                    found.update(instruction.params())
                    if instruction.op == "LDL":  # a reload: the stack words it reads, not the stack pointer
                        follow(db, dk, _stack_words(instruction, "LDL"), depth - 1)
                        continue
                    sources = instruction.operands[1:]
                    follow(db, dk, {str(int(m.group(1))) for o in sources for m in _REG.finditer(o)}
                           | {f"U{m.group(1)}" for o in sources for m in _UREG.finditer(o)}, depth - 1)

        regs, uregs = _address_registers(blocks[block].instructions[index])
        follow(block, index, {str(r) for r in regs} | {f"U{u}" for u in uregs}, depth)
        return found

    return parameters


_STACK_ADDRESS = re.compile(r"\[R1(?:\+(0x[0-9a-f]+))?\]")


def _stack_words(instruction: Instruction, op: str) -> set[str]:
    """The 4-byte stack words ("L<byte offset>") that an `op` (STL: writes, LDL: reads) addresses off the stack
    pointer R1 ([R1], [R1+0x8]): spill slots."""
    if instruction.op != op:
        return set()
    match = next((m for o in instruction.operands if (m := _STACK_ADDRESS.fullmatch(o.strip()))), None)
    if match is None:
        return set()
    offset = int(match.group(1) or "0", 16)
    return {f"L{offset + 4 * k}" for k in range(instruction.access_bytes() // 4 or 1)}


def _uniform_destinations(instruction: Instruction) -> set[str]:
    if not instruction.operands:
        return set()
    match = re.fullmatch(r"UR(\d+)", instruction.operands[0].strip())
    if match is None:
        return set()
    width = 2 if "64" in instruction.modifiers else 1
    return {f"U{int(match.group(1)) + k}" for k in range(width)}


def attributed_accesses(function: Function, known: dict[int, int] | None = None,
                        specials: dict[str, int] | None = None, first_pass: frozenset[tuple[int, int]] = frozenset()
                        ) -> tuple[list[Block], list[list[int]], dict[int, set[int]]]:
    """(basic blocks, the successors taken when the kernel parameters hold `known` (decided_successors; every edge
    without), and for every global access (load, store, reduction, async copy) by address: the parameters its
    address derives from along those edges (reaching_parameters)). Kept in function.cache: the audit analyzes a
    kernel once per launch shape, the attribution depends on the parameters only."""
    key = ("attributed_accesses", tuple(sorted((known or {}).items())), tuple(sorted((specials or {}).items())),
           tuple(sorted(first_pass)))
    if key not in function.cache:
        if "basic_blocks" not in function.cache:
            function.cache["basic_blocks"] = basic_blocks(function)
        blocks = function.cache["basic_blocks"]
        successors = (decided_successors(blocks, known or {}, specials, first_pass) if known or specials
                      else [list(b.successors) for b in blocks])
        reaching = reaching_parameters(blocks, successors)
        parameters = {instruction.address: reaching(block.index, k)
                      for block in blocks for k, instruction in enumerate(block.instructions)
                      if instruction.op in GLOBAL_LOADS + GLOBAL_STORES + ASYNC_COPIES}
        function.cache[key] = (blocks, successors, parameters)
    return function.cache[key]
