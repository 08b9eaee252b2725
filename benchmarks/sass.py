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


def _evaluate(instruction: Instruction, state: dict[str, Known], params: dict[int, int]) -> dict[str, Known]:
    """What the instruction writes: name -> known bits."""
    op, mods, ops = instruction.op, instruction.modifiers, instruction.operands
    out = {name: _UNKNOWN for name in _written(instruction)}
    dest = ops[0].strip().split(".")[0] if ops else ""

    def v(k: int, size: int = 4) -> Known:
        return _value(ops[k], state, params, size) if k < len(ops) else _UNKNOWN

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
        if None not in (a, b, c, chain) and combine is not None and (not extended or mods[0] in ("EQ", "NE")):
            x, y = (a, b) if unsigned else (_signed(a), _signed(b))
            result = compare(x, y)
            if extended:  # the high words of a 64-bit equality test, chained with the low words' result
                result = (result and chain) if mods[0] == "EQ" else (result or chain)
            out[dest] = _const(int(combine(result, bool(c))), 1)
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


def decided_successors(blocks: list[Block], params: dict[int, int]) -> list[list[int]]:
    """Each block's successors that can be taken when the kernel parameters hold `params` (byte offset in
    constant bank 0 -> byte): blocks never reached get none. A forward propagation of known bits to a fixed point
    (a bit stays known in a block where every path into it agrees on it)."""
    entry_states: list[dict[str, Known] | None] = [None] * len(blocks)
    entry_states[0] = {}
    taken: list[list[int]] = [[] for _ in blocks]
    work = [0]
    while work:
        b = work.pop()
        state = dict(entry_states[b])
        block = blocks[b]
        for instruction in block.instructions:
            if instruction.is_jump or instruction.op in ("EXIT", "RET"):
                continue
            guard = _full(_value(instruction.predicate.lstrip("@"), state, params), 1) if instruction.predicate else 1
            if guard == 0:
                continue
            for name, known in _evaluate(instruction, state, params).items():
                known = known if guard == 1 else _meet(known, state.get(name, _UNKNOWN))
                if known[0]:
                    state[name] = known
                else:
                    state.pop(name, None)
        last = block.instructions[-1]
        successors = list(block.successors)
        if last.predicate and (last.is_jump or last.op == "EXIT") and "DIV" not in last.modifiers:
            guard = _full(_value(last.predicate.lstrip("@"), state, params), 1)
            target = last.branch_target()
            if guard == 1:
                successors = [s for s in successors if target is not None and blocks[s].start == target][:1]
            elif guard == 0:
                successors = [s for s in successors if s == b + 1][:1]
        taken[b] = successors
        for s in successors:
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

    def parameters(block: int, index: int, depth: int = 6) -> set[int]:
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


def attributed_accesses(function: Function, known: dict[int, int] | None = None
                        ) -> tuple[list[Block], list[list[int]], dict[int, set[int]]]:
    """(basic blocks, the successors taken when the kernel parameters hold `known` (decided_successors; every edge
    without), and for every global access (load, store, reduction, async copy) by address: the parameters its
    address derives from along those edges (reaching_parameters)). Kept in function.cache: the audit analyzes a
    kernel once per launch shape, the attribution depends on the parameters only."""
    key = ("attributed_accesses", tuple(sorted((known or {}).items())))
    if key not in function.cache:
        if "basic_blocks" not in function.cache:
            function.cache["basic_blocks"] = basic_blocks(function)
        blocks = function.cache["basic_blocks"]
        successors = decided_successors(blocks, known) if known else [list(b.successors) for b in blocks]
        reaching = reaching_parameters(blocks, successors)
        parameters = {instruction.address: reaching(block.index, k)
                      for block in blocks for k, instruction in enumerate(block.instructions)
                      if instruction.op in GLOBAL_LOADS + GLOBAL_STORES + ASYNC_COPIES}
        function.cache[key] = (blocks, successors, parameters)
    return function.cache[key]
