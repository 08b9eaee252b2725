"""The deterministic parts of benchmarks/kernel_audit.py: the SASS parser and path analysis on a small fixture
(tests/data/tiny.sass), the occupancy arithmetic, the known-miss bookkeeping of --check, and the launch plan the
CUDA dispatcher exposes (layernorm_ext._C.cuda_launch_plan, CUDA builds only; no GPU needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import kernel_audit  # noqa: E402
import sass  # noqa: E402

FIXTURE = REPO / "tests" / "data" / "tiny.sass"
SM90 = kernel_audit.ARCHS["sm_90"]


def _tiny() -> sass.Function:
    (function,) = sass.parse_sass(FIXTURE.read_text()).values()
    return function


def test_parse_instructions_and_operands():
    function = _tiny()
    assert function.name == "_Z4tinyv"
    assert len(function.instructions) == 34  # NOP included; the encodings' comment lines are not instructions
    load = function.instructions[8]
    assert (load.address, load.opcode, load.operands) == (0x80, "LDG.E.128", ["R8", "desc[UR6][R4.64]"])
    assert load.destinations() == {8, 9, 10, 11} and load.access_bytes() == 16
    store = next(i for i in function.instructions if i.op == "STG")
    assert store.destinations() == set() and store.sources() == {4, 5, 12, 13, 14, 15}
    predicated = function.instructions[12]
    assert predicated.predicate == "@P1" and predicated.op == "LDG"
    assert sum(i.is_fp64 for i in function.instructions) == 3  # F2F.F64.F32, DADD, F2F.F32.F64


def test_blocks_loops_and_address_parameters():
    function = _tiny()
    blocks = sass.basic_blocks(function)
    assert [(b.start, b.successors) for b in blocks] == [
        (0x0, [1]), (0x110, [1, 2]), (0x160, [4, 3]), (0x180, [4]), (0x1A0, []), (0x200, [5])]
    assert [(loop.header, loop.latch) for loop in sass.loops(blocks)] == [(1, 1), (5, 5)]
    reaching = sass.reaching_parameters(blocks, [b.successors for b in blocks])
    params = {i.address: reaching(b.index, k) for b in blocks for k, i in enumerate(b.instructions)
              if i.op in ("LDG", "STG")}
    assert params == {0x80: {0x210}, 0x90: {0x210}, 0xC0: {0x218}, 0x1E0: {0x230}}
    # The same, cached on the function for every global access, with the blocks and their successors.
    cached_blocks, successors, by_address = sass.attributed_accesses(function)
    assert by_address == params and successors == [b.successors for b in blocks]
    assert sass.attributed_accesses(function)[0] is cached_blocks


@pytest.mark.parametrize("lanes, barriers", [(64, 1), (16, 0)])
def test_row_path_figures(lanes, barriers):
    plan = {"lanes": lanes, "threads": lanes, "vec": 8, "cols": lanes * 8, "packs": 1, "staged": False}
    figures = kernel_audit.analyze_row_path(_tiny(), SM90, plan, "layer_norm", "forward")
    # Two 16-byte loads of the input issued before the first add reads one; the residual's load is predicated
    # on its pointer (unused by the audited call) and not counted.
    assert figures.loads_before_use == figures.row_loads_before_use == 32
    shuffle_iterations = 5 if lanes >= 32 else 4
    assert figures.instructions == 17 + 5 * shuffle_iterations + 2 + 2 * barriers + 6
    assert figures.barriers == barriers  # the cross-warp step only where a row spans warps
    assert figures.fp64 == 2 + shuffle_iterations
    assert figures.element_bytes == 48 and figures.streams_found == {"input", "out"}


def test_divergence_branch_falls_through_and_cold_path_is_left_out():
    """tests/data/cold.sass: a shuffle behind BRA.DIV (taken only where the warp has diverged), then after the
    row's barrier a branch to a block opened by PMTRIG (kernel_common.cuh's cold_path(): the forward's double
    statistics of a row whose float ones overflowed) holding a second shared-memory write, barrier and FP64.
    Reading BRA.DIV as an unconditional jump cut the path before the shuffle (0 barriers); taking the cold
    block (its write scores like the all-reduce's) counted 2 barriers and 2 FP64 instructions."""
    (function,) = sass.parse_sass((REPO / "tests" / "data" / "cold.sass").read_text()).values()
    blocks = sass.basic_blocks(function)
    assert (blocks[0].instructions[-1].opcode, blocks[0].successors) == ("BRA.DIV", [7, 1])
    plan = {"lanes": 64, "threads": 64, "vec": 8, "cols": 64 * 8, "packs": 1, "staged": False}
    figures = kernel_audit.analyze_row_path(function, SM90, plan, "layer_norm", "forward")
    assert figures.barriers == 1 and figures.fp64 == 0
    assert figures.streams_found == {"input", "out"}


def _function(lines: str) -> sass.Function:
    """A function of hand-written SASS, one instruction per line: `address opcode operands`."""
    body = "\n".join(f"        /*{int(a, 16):04x}*/ {rest.strip()} ;" for a, rest in
                     (line.strip().split(" ", 1) for line in lines.strip().splitlines()))
    (function,) = sass.parse_sass("\t\tFunction : _Z1fv\n" + body).values()
    return function


# A quantized kernel's branches, as nvcc writes them: the code (QuantArgs.code at 0x2a8) sign-extended and compared,
# a flag kept as bit 0 of a register of unknown bits (cleared, set under a predicate, tested by a LOP3 into a
# predicate), and the static scale's null test (a 64-bit pointer at 0x290).
BRANCHES = """
0x00 LDC.U8 R4, c[0x0][0x2a8]
0x10 PRMT R5, R4, 0x9910, RZ
0x20 ISETP.NE.AND P0, PT, R5, 0x2, PT
0x30 LOP3.LUT R2, R2, 0xfffffffe, RZ, 0xc0, !PT
0x40 @P0 LOP3.LUT R2, R2, 0x1, RZ, 0xfc, !PT
0x50 LDC.64 R6, c[0x0][0x290]
0x60 ISETP.NE.U32.AND P1, PT, R6, RZ, PT
0x70 ISETP.NE.AND.EX P1, PT, R7, RZ, PT, P1
0x80 @P1 BRA 0xc0
0x90 LOP3.LUT P2, RZ, R2, 0x1, RZ, 0xc0, !PT
0xa0 @!P2 BRA 0xd0
0xb0 EXIT
0xc0 EXIT
0xd0 EXIT
"""


@pytest.mark.parametrize(
    "params, taken",
    [
        ({**{0x290 + k: 0 for k in range(8)}, 0x2a8: 0}, [[1], [2], [], [], []]),  # dynamic scale, e4m3fn: bit set
        ({**{0x290 + k: 0 for k in range(8)}, 0x2a8: 2}, [[1], [4], [], [], []]),  # int8: the bit stays clear
        ({0x2a8: 0}, [[3, 1], [2], [], [], []]),  # the scale unknown: both ways
        ({}, [[3, 1], [4, 2], [], [], []]),
    ],
)
def test_branches_decided_by_known_parameters(params, taken):
    blocks = sass.basic_blocks(_function(BRANCHES))
    assert [b.start for b in blocks] == [0x0, 0x90, 0xB0, 0xC0, 0xD0]
    assert sass.decided_successors(blocks, params) == taken


# A loop over rows as nvcc writes it: the thread's lane (SR_TID.X) and row (SR_CTAID.X), lanes (0x280) and units
# (a 64-bit 0x250) from the arguments; a pack at lane + lanes whose square is skipped where it is absent (0xb0), the
# row's test against rows (0x260), the row advanced by 2 x lanes each iteration (the loop's induction variable).
ROW_LOOP = """
0x00 S2R R0, SR_TID.X
0x10 S2UR UR4, SR_CTAID.X
0x20 LDC R3, c[0x0][0x280]
0x30 LDC.64 R8, c[0x0][0x250]
0x40 IMAD.U32 R2, RZ, RZ, UR4
0x50 IMAD.SHL.U32 R5, R3, 0x2, RZ
0x60 IADD3 R4, R0, R3, RZ
0x70 ISETP.GE.U32.AND P0, PT, R4, R8, PT
0x80 ISETP.GE.AND.EX P0, PT, RZ, R9, PT, P0
0x90 ISETP.GE.U32.AND P1, PT, R2, c[0x0][0x260], PT
0xa0 @P1 BRA 0xd0
0xb0 @P0 BRA 0xd0
0xc0 FFMA R10, R11, R11, R10
0xd0 IADD3 R2, R2, R5, RZ
0xe0 ISETP.LT.U32.AND P2, PT, R2, c[0x0][0x260], PT
0xf0 @P2 BRA 0x60
0x100 EXIT
"""


def _arguments(lanes: int, units: int, rows: int) -> dict[int, int]:
    fields = {0x280: (lanes, 4), 0x250: (units, 8), 0x260: (rows, 4)}
    return {byte: value for offset, (number, size) in fields.items()
            for byte, value in kernel_audit.parameter_bytes(offset, number, size).items()}


@pytest.mark.parametrize(
    "units, specials, first_pass, taken",
    [
        # Lane 0 of block 0 on its first row: the row is in range, its second pack present (64 + 0 < 128).
        (128, True, True, [[1], [2], [3], [4], [1, 5], []]),
        (64, True, True, [[1], [2], [4], [], [1, 5], []]),  # a row of one pack per lane: the square skipped
        # Without the first pass the row is unknown (the back edge's value meets the entry's); the lane still decides.
        (128, True, False, [[1], [4, 2], [3], [4], [1, 5], []]),
        # Parameters alone (the audit until 2026-12-04): neither is decided, and a path could go around the square.
        (128, False, False, [[1], [4, 2], [4, 3], [4], [1, 5], []]),
    ],
)
def test_thread_branches_on_the_first_row(units, specials, first_pass, taken):
    blocks = sass.basic_blocks(_function(ROW_LOOP))
    assert [b.start for b in blocks] == [0x0, 0x60, 0xB0, 0xC0, 0xD0, 0x100]
    thread = kernel_audit.THREAD if specials else None
    edges = frozenset({(4, 1)}) if first_pass else frozenset()
    assert sass.decided_successors(blocks, _arguments(64, units, 1000), thread, edges) == taken


def test_branch_to_a_nop_lands_on_the_next_instruction():
    """basic_blocks drops NOPs: a branch to one had no edge (the absmax fold of a quantized kernel, sm_80), and once
    its predicate was decided the block had no successor at all."""
    blocks = sass.basic_blocks(_function("""
0x00 ISETP.NE.AND P0, PT, RZ, c[0x0][0x210], PT
0x10 @P0 BRA 0x30
0x20 EXIT
0x30 NOP
0x40 EXIT
"""))
    assert [(b.start, b.successors) for b in blocks] == [(0x0, [2, 1]), (0x20, []), (0x40, [])]
    assert sass.decided_successors(blocks, {0x210: 1, 0x211: 0, 0x212: 0, 0x213: 0}) == [[2], [], []]


def test_divergent_branch_falls_through():
    """A BRA.DIV (to a shuffle's out-of-line form for a diverged warp) is not taken: the audited warps run converged,
    and its block's edge back into the code (to 0x10 here) is no loop of the call's."""
    blocks = sass.basic_blocks(_function("""
0x00 MOV R0, RZ
0x10 BRA.DIV UR4, 0x50
0x20 SHFL.BFLY PT, R1, R0, 0x1, 0x1f
0x30 EXIT
0x50 MOV R2, RZ
0x60 BRA 0x10
"""))
    assert [(b.start, b.successors) for b in blocks] == [(0x0, [1]), (0x10, [3, 2]), (0x20, []), (0x50, [1])]
    assert sass.decided_successors(blocks, {}) == [[1], [2], [], []]


def test_thread_integer_arithmetic_leaves_unknown_forms_unknown():
    """P2R.B1 puts P1 at bit 9, not 1; an IMAD.WIDE with a carry-in, a wrapping shift: forms _integer does not
    follow write nothing known."""
    state = {"P1": (1, 1), "R2": (0xFFFFFFFF, 3), "R5": (0xFFFFFFFF, 1), "P0": (1, 1)}
    for line in ("P2R.B1 R2, PR, RZ, 0x2", "IMAD.WIDE.U32.X R8, R2, 0x10, R10, P0", "SHF.L.W.U32.HI R3, R2, 0x4, R5"):
        (instruction,) = _function(f"0x00 {line}").instructions
        written = sass._evaluate(instruction, state, {}, kernel_audit.THREAD)
        assert all(known[0] == 0 for known in written.values()), line


@pytest.mark.parametrize(
    "line, state, expected",
    [
        ("IADD3 R6, P2, R3, R0, RZ", {"R3": 0xFFFFFFFF, "R0": 2}, {"R6": 1, "P2": 1}),  # carry out
        ("IADD3.X R7, R2, RZ, RZ, P2, !PT", {"R2": 5, "P2": 1}, {"R7": 6}),
        ("IADD3 R1, R2, -R3, RZ", {"R2": 5, "R3": 7}, {"R1": 0xFFFFFFFE}),
        ("IADD3 R6, P2, PT, R3, R0, RZ", {"R3": 0xFFFFFFFF, "R0": 2}, {"R6": 1, "P2": 1}),  # PT: the 2nd carry-out
        ("IMAD.HI.U32 R4, R2, R5, RZ", {"R5": 0}, {"R4": 0}),  # R2 unknown (a reciprocal): times 0 is 0
        # c is the pair {R3:R2}: y + umulhi(y, e) in nvcc's division, here with e = 0.
        ("IMAD.HI.U32 R3, R3, R5, R2", {"R3": 5, "R5": 0, "R2": 0}, {"R3": 5}),
        ("IMAD.MOV R7, RZ, RZ, -R3", {"R3": 3}, {"R7": 0xFFFFFFFD}),
        ("IMAD.WIDE.U32 R8, R6, 0x10, R10", {"R6": 0x10000000, "R10": 4, "R11": 1}, {"R8": 4, "R9": 2}),
        ("IMAD.WIDE R8, R6, 0x2, RZ", {"R6": 0xFFFFFFFF}, {"R8": 0xFFFFFFFE, "R9": 0xFFFFFFFF}),
        # The carry of the add only: bits shifted out of the low word go to the high word's LEA.HI.X.
        ("LEA R2, P0, R4, R6, 0x4", {"R4": 0x10000000, "R6": 1}, {"R2": 1, "P0": 0}),
        ("LEA R2, P0, R4, R6, 0x4", {"R4": 0x08000000, "R6": 0x80000000}, {"R2": 0, "P0": 1}),
        ("LEA.HI R6, R3, R44, RZ, 0x5", {"R3": 0xFFFFFFFF, "R44": 7}, {"R6": 7 + 31}),  # rounding of x / 32
        ("LEA.HI.X R3, R8, R9, R10, 0x4, P0", {"R8": 0xF0000000, "R9": 1, "R10": 2, "P0": 1}, {"R3": 1 + 0x2F + 1}),
        ("LEA.HI.X.SX32 R7, R3, R2, 0x1, P2", {"R3": 0xFFFFFFFE, "R2": 9, "P2": 0}, {"R7": 8}),
        ("SHF.R.S32.HI R3, RZ, 0x1f, R44", {"R44": 0x80000000}, {"R3": 0xFFFFFFFF}),
        ("SHF.L.U64.HI R3, R2, 0x4, R5", {"R2": 0xF0000000, "R5": 1}, {"R3": 0x1F}),
        ("SHF.R.U64 R3, R2, 0x4, R5", {"R2": 0x10, "R5": 1}, {"R3": 0x10000001}),
        ("SHF.R.U32 R3, R2, 0x4, R5", {"R2": 0x10, "R5": 1}, {"R3": 0x10000001}),  # the funnel's low word
        ("IMNMX R3, R2, 0x2, !PT", {"R2": 1}, {"R3": 2}),
        ("ISETP.LT.AND.EX P0, PT, R7, R9, PT, P1", {"R7": 0, "R9": 0, "P1": 1}, {"P0": 1}),  # high words equal
        ("ISETP.GE.AND.EX P0, PT, R7, R9, PT, P1", {"R7": 0xFFFFFFFF, "R9": 0, "P1": 1}, {"P0": 0}),  # -1 < 0
        ("S2R R5, SR_TID.X", {}, {"R5": 0}),
        ("CS2R R8, SRZ", {}, {"R8": 0, "R9": 0}),
        ("P2R R43, PR, RZ, 0x40", {"P6": 1}, {"R43": 0x40}),
    ],
)
def test_thread_integer_arithmetic(line, state, expected):
    (instruction,) = _function(f"0x00 {line}").instructions
    known = {name: (1, value) if name.startswith("P") else (0xFFFFFFFF, value) for name, value in state.items()}
    written = sass._evaluate(instruction, known, {}, kernel_audit.THREAD)
    bits = {name: 1 if name.startswith("P") else 0xFFFFFFFF for name in expected}
    assert {name: written.get(name) for name in expected} == {name: (bits[name], v) for name, v in expected.items()}


WEIGHT_OFFSET = 0x278  # ForwardArgs.weight_offset (float) on sm_90, where the forward's store loop tests it for 0


@pytest.mark.parametrize(
    "line, offset_bits, state, expected",
    [
        ("FSETP.NEU.AND P2, PT, RZ, c[0x0][0x278], PT", 0x00000000, {}, 0),  # nn.RMSNorm's 0: no add
        ("FSETP.NEU.AND P2, PT, RZ, c[0x0][0x278], PT", 0x3F800000, {}, 1),  # Gemma's 1.0
        ("FSETP.NEU.AND P2, PT, RZ, c[0x0][0x278], PT", 0x80000000, {}, 0),  # -0 == 0
        ("FSETP.NEU.AND P2, PT, RZ, c[0x0][0x278], PT", 0x7FC00000, {}, 1),  # NaN: unordered, so not equal
        ("FSETP.NE.AND P2, PT, RZ, c[0x0][0x278], PT", 0x7FC00000, {}, 0),  # ordered: false on NaN
        ("FSETP.GTU.AND P2, PT, R6, 3.40282346638528859812e+38, PT", None, {"R6": 0x7F800000}, 1),  # inf > max
        ("FSETP.GEU.AND P2, PT, R6, RZ, PT", None, {"R6": 0xBF800000}, 0),  # -1 >= 0
        ("FSETP.NEU.AND P2, PT, -R6, RZ, PT", None, {"R6": 0}, None),  # a negated operand: not followed
    ],
)
def test_float_compares_of_known_bits(line, offset_bits, state, expected):
    """The store loop's `weight_offset == 0` (kPlain, once per row) is a float test: decided from the audited call's
    0.0 as the integer tests are, so that the path does not run both sides' stores."""
    (instruction,) = _function(f"0x00 {line}").instructions
    params = {} if offset_bits is None else kernel_audit.parameter_bytes(WEIGHT_OFFSET, offset_bits, 4)
    known = {name: (0xFFFFFFFF, value) for name, value in state.items()}
    written = sass._evaluate(instruction, known, params)
    assert written["P2"] == ((0, 0) if expected is None else (1, expected))


def test_reaching_definitions_follow_the_graph():
    """The address of the load at 0x40 comes from the weight pointer (0x220) defined before the branch; the
    nearest definition in address order (0x20, the input's: what the audit's earlier backward search in address
    order found) is on the path that exits."""
    function = _function("""
0x00 LDC.64 R4, c[0x0][0x220]
0x10 @P0 BRA 0x40
0x20 LDC.64 R4, c[0x0][0x210]
0x30 EXIT
0x40 LDG.E R6, desc[UR4][R4.64]
0x50 EXIT
""")
    blocks = sass.basic_blocks(function)
    reaching = sass.reaching_parameters(blocks, [b.successors for b in blocks])
    assert reaching(2, 0) == {0x220}


def test_reaching_definitions_follow_spills():
    """A pointer spilled to the stack (STL) and reloaded (LDL) before the store: its address is followed through
    the stack word to the pointer (0x230), as in the long backward's partial_dweight store (bf16 LayerNorm, sm_90),
    not to the stack pointer; a reload of another word finds nothing."""
    function = _function("""
0x00 LDC R1, c[0x0][0x28]
0x10 LDC.64 R4, c[0x0][0x230]
0x20 STL.64 [R1+0x8], R4
0x30 MOV R4, RZ
0x40 LDL.64 R6, [R1+0x8]
0x50 STG.E desc[UR4][R6.64], R0
0x60 LDL.64 R8, [R1+0x10]
0x70 STG.E desc[UR4][R8.64], R0
0x80 EXIT
""")
    blocks, _, by_address = sass.attributed_accesses(function)
    assert len(blocks) == 1 and by_address == {0x50: {0x230}, 0x70: set()}


def _tiny_with(old: str, new: str) -> sass.Function:
    text = FIXTURE.read_text()
    assert old in text
    (function,) = sass.parse_sass(text.replace(old, new)).values()
    return function


TINY_PLAN = {"lanes": 64, "threads": 64, "vec": 8, "cols": 64 * 8, "packs": 1, "staged": False}


def test_guard_fails_on_an_unattributed_access():
    """The out store's address from a parameter that is no pointer (0x300 instead of out's 0x230): the audit
    raises rather than leave the store out of the figures (how the long forward's normalize pass went missing on
    sm_90: its out stores got no pointer, so the path stopped after the statistics at half the DRAM bytes)."""
    function = _tiny_with("ULDC.64 UR12, c[0x0][0x230]", "ULDC.64 UR12, c[0x0][0x300]")
    with pytest.raises(kernel_audit.AttributionError, match=r"0x1e0 STG.E.128 -> no pointer"):
        kernel_audit.analyze_row_path(function, SM90, TINY_PLAN, "layer_norm", "forward")


def test_guard_fails_on_a_path_without_its_output():
    """Every access attributed, but no store of out on the path (the store here writes shared memory): the audit
    raises, naming the stream and the path. Read as a backward kernel (0x210: grad_out, 0x230: rstd), the
    fixture reads no saved and writes no partials."""
    function = _tiny_with("STG.E.128 desc[UR6][R4.64], R12", "STS.128 [R4], R12")
    with pytest.raises(kernel_audit.AttributionError, match=r"no store of out on the path \(path: B0 B1 B2"):
        kernel_audit.analyze_row_path(function, SM90, TINY_PLAN, "layer_norm", "forward")
    with pytest.raises(kernel_audit.AttributionError,
                       match=r"no load of saved on the path; no store of grad_input on the path; "
                             r"no store of partial_dbias in the kernel; no store of partial_dweight in the kernel"):
        kernel_audit.analyze_row_path(_tiny(), SM90, TINY_PLAN, "layer_norm", "backward")


@pytest.mark.parametrize(("op", "direction", "role", "loads", "stores", "kernel_stores"), [
    ("layer_norm", "forward", "rows", {"input"}, {"out"}, set()),
    ("rms_norm", "forward_quant", "rows", {"input"}, {"codes", "row_scales"}, set()),
    ("layer_norm", "backward", "rows", {"grad_out", "saved"}, {"grad_input"}, {"partial_dweight", "partial_dbias"}),
    ("rms_norm", "backward", "rows", {"grad_out", "saved"}, {"grad_input"}, {"partial_dweight"}),
    ("rms_norm", "backward", "sums", {"grad_out", "saved"}, {"row_terms"}, set()),
    ("layer_norm", "backward", "columns", {"grad_out", "saved", "row_terms"},
     {"grad_input", "partial_dweight", "partial_dbias"}, set()),
])
def test_expected_streams(op, direction, role, loads, stores, kernel_stores):
    assert kernel_audit.expected_streams(op, direction, role) == (loads, stores, kernel_stores)


@pytest.mark.parametrize(
    "registers, shared, threads, expected",
    [(128, 1216, 512, 1), (128, 9408, 128, 4), (64, 320, 128, 8), (50, 1408, 512, 2), (32, 384, 512, 4),
     (40, 131456 + 384, 512, 1), (255, 0, 32, 8), (16, 0, 32, 32)],
)
def test_blocks_per_sm(registers, shared, threads, expected):
    assert kernel_audit.blocks_per_sm(SM90, registers, shared, threads) == expected


def _row(value: float, metric_value: float = 16.0) -> kernel_audit.Row:
    plan = {"kernel": "k<float>", "lanes": 128, "rows_per_block": 1, "threads": 128, "packs": 4, "staged": False,
            "grid": 1, "persistent": False, "dynamic_shared": 0}
    return kernel_audit.Row(arch="sm_90", op="rms_norm", dtype="float32", direction="forward", n=4096, rows=1,
                            plan=plan, registers=64, spill_bytes=0, blocks=8, threads_per_sm=1024,
                            loads_before_use=16, row_loads_before_use=16, inflight_kb=value, barriers=2, fp64=4, per_element=10.0,
                            dram_per_element=8.0)


def test_quantized_targets():
    """The quantized forward reads the input once and writes a byte per element; no instruction target."""
    row = kernel_audit.Row(**{**_row(40.0).__dict__, "direction": "forward_quant", "dtype": "bfloat16",
                              "dram_per_element": 3.0, "barriers": 3})
    checks = {c.metric: c for c in kernel_audit.targets(row)}
    assert set(checks) == {"inflight_kb", "barriers_per_row", "fp64_per_row", "spill_bytes", "dram_bytes_per_element"}
    assert checks["dram_bytes_per_element"].target == "<= 3" and checks["dram_bytes_per_element"].met
    assert not checks["barriers_per_row"].met  # 128 threads per row: one barrier at most


def test_check_fails_on_new_misses_and_regressions_only(tmp_path):
    missing = _row(16.0)
    key = missing.key("inflight_kb")
    lines, checks, failures = kernel_audit.evaluate([missing], {})
    assert failures == 2 and any(line.startswith("NEW MISS") and "inflight_kb=16" in line for line in lines)
    known_file = tmp_path / "known.tsv"
    kernel_audit.write_known(known_file, checks)
    known = kernel_audit.read_known(known_file)
    assert known[key] == 16.0 and len(known) == 2  # in flight and barriers per row
    lines, _, failures = kernel_audit.evaluate([missing], known)
    assert failures == 0 and sum(line.startswith("target missed (known)") for line in lines) == 2
    lines, _, failures = kernel_audit.evaluate([_row(12.0)], known)  # fewer KB in flight than recorded
    assert failures == 1 and any(line.startswith("REGRESSION") for line in lines)
    lines, _, failures = kernel_audit.evaluate([_row(40.0)], known)  # met: the entry is to go
    assert failures == 0 and any("remove it with --update-known" in line for line in lines)


# ---- the launch plan (CUDA builds) ------------------------------------------------------------------------


def _plan_function():
    import layernorm_ext  # noqa: F401
    from layernorm_ext import _C

    if not hasattr(_C, "cuda_launch_plan"):
        pytest.skip("the library was built without its CUDA kernels")
    return _C.cuda_launch_plan


def _plan(**kwargs):
    args = {"op": "layer_norm", "direction": "forward", "input_dtype": "bfloat16", "rows": 1000, "cols": 4096,
            "sm_count": 132, "max_shared_per_block": 232448}
    args.update(kwargs)
    return _plan_function()(**args)


@pytest.mark.parametrize(
    "dtype, cols, kernel, lanes, rows_per_block, packs",
    [
        ("bfloat16", 256, "forward_rows_kernel<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, false, 8, 4, false>", 8, 16, 4),
        ("bfloat16", 4096, "forward_rows_kernel<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, false, 8, 4, false>", 128, 1, 4),
        ("bfloat16", 5125, "forward_long_kernel<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, false, 1>", 512, 1, 0),
        ("float32", 16384, "forward_rows_kernel<float, float, float, false, 4, 8, false>", 512, 1, 8),
        ("float32", 7, "forward_rows_kernel<float, float, float, false, 1, 4, false>", 4, 32, 4),  # 4 packs at least
        ("bfloat16", 65536, "forward_long_kernel<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, false, 8>", 512, 1, 0),
    ],
)
def test_plan_forward(dtype, cols, kernel, lanes, rows_per_block, packs):
    plan = _plan(input_dtype=dtype, cols=cols)
    assert (plan["kernel"], plan["lanes"], plan["rows_per_block"], plan["packs"]) == (kernel, lanes, rows_per_block,
                                                                                      packs)
    assert plan["threads"] == lanes * rows_per_block and not plan["persistent"]
    assert plan["grid"] == plan["row_groups"] == -(-1000 // rows_per_block)


def test_plan_forward_stages_a_long_row_where_it_fits():
    scratch = 2 * 16 * (32 + 4)  # the warps' states and absmax of two rows, before the stage in dynamic shared memory
    staged = _plan(cols=32768)  # staged in the rows' own dtype: 2 bytes a bfloat16 column
    assert staged["staged"] and staged["dynamic_shared"] == scratch + 32768 * 2
    assert staged["kernel"].startswith("forward_long") and staged["cluster"] == 1
    assert _plan(cols=65536)["staged"] and _plan(cols=65536)["cluster"] == 1
    unstaged = _plan(cols=65536, max_shared_per_block=100 * 1024, compute_capability=80)
    assert not unstaged["staged"] and unstaged["dynamic_shared"] == scratch and unstaged["cluster"] == 1


@pytest.mark.parametrize(("dtype", "cols", "cluster"), [("bfloat16", 131072, 2), ("bfloat16", 262144, 3),
                                                        ("float32", 65536, 2), ("float32", 262144, 5)])
def test_plan_forward_splits_a_long_row_over_a_cluster_on_sm90(dtype, cols, cluster):
    """Rows that one block cannot stage (227 KB on sm_90) go to the fewest blocks of a cluster that can, each
    staging its share: grid = rows x cluster, the row's threads (lanes) = 512 x cluster."""
    plan = _plan(input_dtype=dtype, cols=cols, rows=64)
    assert (plan["cluster"], plan["staged"], plan["lanes"], plan["threads"]) == (cluster, True, 512 * cluster, 512)
    assert plan["grid"] == 64 * cluster and plan["dynamic_shared"] <= 232448
    share = -(-cols // (512 * cluster * (16 // {"bfloat16": 2, "float32": 4}[dtype]))) * 512 * 16
    assert plan["dynamic_shared"] == 2 * 16 * (32 + 4) + share
    sm80 = _plan(input_dtype=dtype, cols=cols, rows=64, compute_capability=80, max_shared_per_block=166912)
    assert (sm80["cluster"], sm80["staged"], sm80["grid"]) == (1, False, 64)
    quantized = _plan(input_dtype=dtype, cols=cols, rows=64, quantized=True)  # the same mapping: the same statistics
    assert (quantized["cluster"], quantized["staged"]) == (cluster, True)


def test_plan_backward_is_persistent():
    uncapped = _plan(direction="backward", op="rms_norm", cols=256, rows=100000)
    assert uncapped["kernel"] == "backward_rows_kernel<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, true, 8, 2, false>"  # no grad_residual_out
    assert uncapped["persistent"] and uncapped["rows_per_block"] == 8
    assert uncapped["grid"] == uncapped["row_groups"] == 12500
    assert uncapped["dynamic_shared"] == 128 * 2 * 8 * 4  # the block's partials combine buffer
    capped = _plan(direction="backward", op="rms_norm", cols=256, rows=100000, blocks_per_sm=4)
    assert capped["grid"] == 4 * 132
    # Rows beyond one block's registers (sm_90): a cluster of 8 blocks of 512 per row of 65536, as many clusters as
    # the 2 x 132 resident blocks hold (33), each writing one row of partials.
    cluster = _plan(direction="backward", cols=65536, rows=64, blocks_per_sm=2)
    assert cluster["kernel"] == "backward_cluster_kernel<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, false, 8, 2, false>"
    assert (cluster["cluster"], cluster["threads"], cluster["lanes"], cluster["grid"]) == (8, 512, 4096, 33 * 8)
    assert cluster["persistent"] and cluster["dynamic_shared"] == 2 * 3 * 4 * 16  # the warps' sums, double-buffered
    # Beyond 16 blocks' registers: 128 column slices of 256 packs x 2 row groups (of 32 rows) fill the 2 x 132
    # resident blocks.
    long_rows = _plan(direction="backward", cols=262144, rows=64, blocks_per_sm=2)
    assert long_rows["kernel"] == "backward_long_kernel<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, false, 8, false>"
    assert (long_rows["grid"], long_rows["row_groups"], long_rows["group_rows"]) == (128 * 2, 2, 32)
    assert long_rows["sums_kernel"].startswith("backward_long_sums_kernel") and long_rows["sums_grid"] == 64


def test_plan_mixed_dtypes_and_errors():
    # Rows wider than the input come of a residual only: the variant with one (it takes the rows' layouts).
    plan = _plan(row_dtype="float32", param_dtype="float32")
    assert plan["kernel"] == ("forward_rows_kernel<__nv_bfloat16, float, float, false, 8, 4, true, "
                              "layernorm_ext::cuda::StridedRows>")  # fmt: skip
    # float64 rows of a narrower input (a float64 residual): single elements, one pack per lane, then the long kernel
    widened = _plan(row_dtype="float64", cols=512)
    assert widened["kernel"] == ("forward_rows_kernel<__nv_bfloat16, double, __nv_bfloat16, false, 1, 1, true, "
                                 "layernorm_ext::cuda::StridedRows>")  # fmt: skip
    assert _plan(row_dtype="float64")["kernel"] == "forward_long_kernel<__nv_bfloat16, double, __nv_bfloat16, false, 1>"
    with pytest.raises(ValueError, match="op must be"):
        _plan(op="batch_norm")
    with pytest.raises(ValueError, match="dtype must be"):
        _plan(input_dtype="int8")


# ---- the quantized kernels' SASS (CUDA builds with sm_90 code, and cuobjdump: the `audit` extra) ---------------


def _sm90_functions(kernels: set[str], what: str) -> dict[str, sass.Function]:
    """The library's sm_90 functions of these kernels (demangled names, as the plan gives them), disassembled at
    once; skips without cuobjdump or sm_90 code."""
    from layernorm_ext import _C

    try:
        usage = sass.resource_usage(_C.__file__, "sm_90")
    except (FileNotFoundError, OSError) as error:
        pytest.skip(f"no cuobjdump: {error}")
    except Exception as error:  # noqa: BLE001 (cuobjdump's own failure: no sm_90 code)
        pytest.skip(f"cuobjdump: {error}")
    by_kernel = {pretty.split("(", 1)[0].removeprefix("void ").removeprefix("layernorm_ext::cuda::"): name
                 for name, pretty in sass.demangle(sass.function_names(usage)).items()}
    if any(kernel not in by_kernel for kernel in kernels):
        pytest.skip(f"the library holds no sm_90 code of the {what} kernels")
    wanted = {by_kernel[kernel] for kernel in kernels}
    functions = sass.parse_sass(sass.disassemble(_C.__file__, "sm_90", sorted(wanted)), wanted)
    sass.parse_resource_usage(usage, functions)
    return {kernel: functions[by_kernel[kernel]] for kernel in kernels}


def _with_arguments(plan: dict, rows: int, cols: int) -> dict:
    """The plan as audit() hands it to analyze_row_path: with the launch's arguments (its thread's branches)."""
    return dict(plan, cols=cols, args=kernel_audit.launch_arguments(plan, rows, cols))


@pytest.fixture(scope="module")
def quantized_sm90():
    """(op, dtype, cols) -> (function, plan) of the quantized forward the sm_90 plan names."""
    cases = [("rms_norm", "bfloat16", 4096), ("rms_norm", "bfloat16", 131072), ("layer_norm", "float32", 16384)]
    plans = {case: _with_arguments(_plan(op=case[0], input_dtype=case[1], cols=case[2], rows=1024, quantized=True,
                                         compute_capability=90), 1024, case[2]) for case in cases}
    functions = _sm90_functions({plan["kernel"] for plan in plans.values()}, "quantized")
    return {case: (functions[plan["kernel"]], plan) for case, plan in plans.items()}


@pytest.fixture(scope="module")
def plain_sm90():
    """(op, dtype, direction, cols) -> (functions by kernel, plan) of the plain kernels the sm_90 plan names: the
    long forward (staged; on a cluster of 2 at fp32 65536) and the long backward (its sums and column kernels)."""
    cases = [("layer_norm", "bfloat16", "forward", 65536), ("layer_norm", "float32", "forward", 65536),
             ("rms_norm", "bfloat16", "forward", 65536), ("layer_norm", "bfloat16", "backward", 262144),
             ("rms_norm", "float32", "backward", 262144)]
    plans = {case: _with_arguments(_plan(op=case[0], input_dtype=case[1], direction=case[2], cols=case[3], rows=1024,
                                         compute_capability=90, blocks_per_sm=2), 1024, case[3]) for case in cases}
    kernels = {k for plan in plans.values() for k in (plan["kernel"], plan.get("sums_kernel")) if k}
    functions = _sm90_functions(kernels, "plain")
    return {case: (functions, plan) for case, plan in plans.items()}


@pytest.mark.parametrize("case", [("layer_norm", "bfloat16", "forward", 65536),
                                  ("layer_norm", "float32", "forward", 65536),
                                  ("rms_norm", "bfloat16", "forward", 65536)])
def test_long_forward_path_normalizes(plain_sm90, case):
    """The long forward's path runs both passes: the statistics, then out from the stage, weight and bias. Its out
    stores' address is computed once per row, far ahead of them: the earlier search back in address order (400
    instructions) found no pointer for them in the LayerNorm kernels, and the path stopped after the statistics
    (2 B/elem bf16, 4 fp32, and about half the instructions)."""
    op, dtype, _, cols = case
    functions, plan = plain_sm90[case]
    figures = kernel_audit.analyze_row_path(functions[plan["kernel"]], SM90, plan, op, "forward")
    assert plan["staged"] and figures.streams_found >= {"input", "weight", "out"} | (
        set() if op == "rms_norm" else {"bias"})
    elements = cols / plan["lanes"]
    assert figures.element_bytes / elements == pytest.approx(2 * kernel_audit.ELEMENT_BYTES[dtype])


@pytest.mark.parametrize("case", [("layer_norm", "bfloat16", "backward", 262144),
                                  ("rms_norm", "float32", "backward", 262144)])
def test_long_backward_paths(plain_sm90, case):
    """The long backward's sums pass ends with the row's coefficients (in double) and their store (row_terms, its
    second parameter); the column pass reads the rows' terms and writes dx and every partial, the bf16 LayerNorm
    kernel's partial_dweight through an address spilled to the stack; both passes take the default mode's copy of
    their code (saved_is_output false), without the memory-efficient copy's divisions by the weight (FCHK)."""
    op, dtype, _, cols = case
    functions, plan = plain_sm90[case]
    analyzed: dict = {}
    kernel_audit.long_backward_row(SM90, functions[plan["sums_kernel"]], functions[plan["kernel"]], plan, op, dtype,
                                   1024, 2, analyzed)
    ((sums, columns),) = analyzed.values()
    partials = {"partial_dweight"} | (set() if op == "rms_norm" else {"partial_dbias"})
    assert sums.streams_found >= {"grad_out", "saved", "row_terms"} and sums.fp64 > 0
    assert columns.streams_found >= {"grad_out", "saved", "row_terms", "grad_input"} | partials
    for kernel, figures in ((plan["sums_kernel"], sums), (plan["kernel"], columns)):
        assert _path_ops(functions[kernel], figures.path)["FCHK"] == 0


@pytest.fixture(scope="module")
def thread_sm90():
    """(op, dtype, direction, cols) -> (function, plan) of register-path and cluster kernels the sm_90 plan names."""
    cases = [("rms_norm", "bfloat16", "forward", 2048), ("layer_norm", "bfloat16", "backward", 4096),
             ("layer_norm", "float32", "forward", 65536)]
    plans = {case: _with_arguments(_plan(op=case[0], input_dtype=case[1], direction=case[2], cols=case[3], rows=1024,
                                         compute_capability=90, blocks_per_sm=2), 1024, case[3]) for case in cases}
    functions = _sm90_functions({plan["kernel"] for plan in plans.values()}, "plain")
    return {case: (functions[plan["kernel"]], plan) for case, plan in plans.items()}


@pytest.mark.parametrize(("case", "packs"), [
    (("rms_norm", "bfloat16", "forward", 2048), 4),  # the register path: lanes 64, 4 packs
    (("layer_norm", "bfloat16", "backward", 4096), 2),  # lanes 256, 2 packs
    (("layer_norm", "float32", "forward", 65536), 4),  # the long kernel on a cluster of 2 (lanes 1024): a chunk of 4
])
def test_thread_addresses_of_the_weight(thread_sm90, monkeypatch, case, packs):
    """The audit's thread arithmetic checked against the compiled code: with the weight pointer known, thread 0's
    weight (and bias: the same pointer) loads come out at weight + 16 x lanes x p, pack p of the thread, as the kernels
    index them. A wrong add, multiply, LEA or shift in sass._integer moves these addresses."""
    op, _, direction, _ = case
    function, plan = thread_sm90[case]
    calls: list[tuple] = []
    real = sass.attributed_accesses

    def record(function, known=None, specials=None, first_pass=frozenset()):
        if specials:
            calls.append((dict(known), specials, first_pass))
        return real(function, known, specials, first_pass)

    monkeypatch.setattr(sass, "attributed_accesses", record)
    kernel_audit.analyze_row_path(function, SM90, plan, op, direction)
    (known, specials, first_pass), *_ = calls
    addresses: set[int] = set()

    def observe(instruction: sass.Instruction, state: dict) -> None:
        if instruction.op == "LDG":
            low = min(sass._address_registers(instruction)[0])
            words = [state.get(f"R{low + k}", (0, 0)) for k in (0, 1)]
            if all(mask == 0xFFFFFFFF for mask, _ in words):  # known: only the weight's and bias' pointers are
                addresses.add(words[0][1] | words[1][1] << 32)

    sass.decided_successors(function.cache["basic_blocks"], known, specials, first_pass, observe)
    pack_bytes = 16 * plan["lanes"]
    assert sorted(addresses) == [kernel_audit.NON_NULL_POINTER + p * pack_bytes for p in range(packs)]


def _path_ops(function: sass.Function, path: list[int]) -> dict[str, int]:
    """Markers on the path, each block once: the division's FCHK, the codes' clamps (e4m3fn at 448, e5m2 at 57344),
    int8's conversion (F2I)."""
    blocks = sass.basic_blocks(function)
    ops = [i for b in path for i in blocks[b].instructions]
    return {"FCHK": sum(i.op == "FCHK" for i in ops),
            "448": sum(i.op == "FMNMX" and "448" in i.operands for i in ops),
            "57344": sum(i.op == "FMNMX" and "57344" in i.operands for i in ops),
            "F2I": sum(i.op == "F2I" for i in ops)}


@pytest.mark.parametrize(("case", "values", "barriers"), [
    (("rms_norm", "bfloat16", 4096), 32, 2),  # a thread's 4 packs of 8; the statistics' barrier, the absmax's one
    (("layer_norm", "float32", 16384), 32, 2),  # 8 packs of 4
    (("rms_norm", "bfloat16", 131072), 32, 2),  # a chunk of 4 packs of 8 per loop body; a cluster of 2
])
def test_quantized_path_is_the_dynamic_e4m3fn_one(quantized_sm90, case, values, barriers):
    """QUANT_VARIANT's branches only: every value divided by the row's dynamic scale and clamped to e4m3fn's range,
    neither int8's nor e5m2's encoding on the path; codes 1 byte and input once per element."""
    op, dtype, cols = case
    function, plan = quantized_sm90[case]
    figures = kernel_audit.analyze_row_path(function, SM90, plan, op, "forward_quant")
    assert _path_ops(function, figures.path) == {"FCHK": values + 1, "448": values, "57344": 0, "F2I": 0}
    assert figures.streams_found >= {"input", "weight", "codes", "row_scales"}
    assert figures.barriers == barriers
    elements = cols / plan["lanes"]
    assert figures.element_bytes / elements == pytest.approx(kernel_audit.ELEMENT_BYTES[dtype] + 1)


@pytest.fixture(scope="module")
def rows_sm90():
    """(op, dtype, direction, cols) -> (function, plan) of register-path kernels the sm_90 plan names (rows of
    several warps)."""
    cases = [("layer_norm", "bfloat16", "forward", 2048), ("layer_norm", "bfloat16", "forward", 8192),
             ("rms_norm", "bfloat16", "forward", 2048), ("layer_norm", "bfloat16", "backward", 4096)]
    plans = {case: _with_arguments(_plan(op=case[0], input_dtype=case[1], direction=case[2], cols=case[3], rows=1024,
                                         compute_capability=90, blocks_per_sm=2), 1024, case[3]) for case in cases}
    functions = _sm90_functions({plan["kernel"] for plan in plans.values()}, "plain")
    return {case: (functions[plan["kernel"]], plan) for case, plan in plans.items()}


def _path_op_count(function: sass.Function, path: list[int], op: str) -> int:
    blocks = sass.basic_blocks(function)
    return sum(i.op == op for b in path for i in blocks[b].instructions)


@pytest.mark.parametrize("case", [("layer_norm", "bfloat16", "forward", 2048), ("layer_norm", "bfloat16", "forward", 8192)])
def test_register_forward_path_holds_every_term(rows_sm90, case):
    """The full-row body's path: 3 fused multiply-adds per value at least (d^2, xhat, the affine). The audit took the
    general body's loop for the row loop and the full-row body's row index stayed unknown: the path went around
    the tests of it, and with them the sums of d and d^2 (67 FFMA for 32 values, 19.3 instructions per element
    where 22.3 were run)."""
    op, _, direction, cols = case
    function, plan = rows_sm90[case]
    figures = kernel_audit.analyze_row_path(function, SM90, plan, op, direction)
    assert _path_op_count(function, figures.path, "FFMA") >= 3 * cols // plan["lanes"]


@pytest.mark.parametrize(("case", "in_warp"), [(("layer_norm", "bfloat16", "forward", 2048), 15),
                                               (("layer_norm", "bfloat16", "forward", 8192), 15),
                                               (("rms_norm", "bfloat16", "forward", 2048), 5)])
def test_merge_of_warps_counts_log2_warps_steps(rows_sm90, case, in_warp):
    """Shuffles per row: the warp's butterflies (LayerNorm: the shift's sum, then sum(d) and sum(d^2); RMSNorm: the
    sum of squares), 5 steps a value, then the merge of the warps' states over pow2(warps) lanes, log2(warps) steps
    per merged value (LayerNorm merges two: the mean's rest, then M2). Until 2026-12-05 the merge counted 5 steps."""
    op, _, direction, cols = case
    function, plan = rows_sm90[case]
    figures = kernel_audit.analyze_row_path(function, SM90, plan, op, direction)
    warps = plan["lanes"] // 32
    assert warps > 1
    merged = 1 if op == "rms_norm" else 2
    assert figures.shuffles == in_warp + merged * (warps.bit_length() - 1)


def test_backward_path_adds_dweight_and_dbias(rows_sm90):
    """The backward's partial dweight / dbias buffers are given (the audited call wants both): the path takes the
    branches that add each value's dweight (a multiply and a fused multiply-add) and dbias (an add) terms in
    registers. Undecided, it went around them (3 instructions per element fewer)."""
    function, plan = rows_sm90[("layer_norm", "bfloat16", "backward", 4096)]
    figures = kernel_audit.analyze_row_path(function, SM90, plan, "layer_norm", "backward")
    values = 4096 // plan["lanes"]
    # per value: sum(g d) in the sums pass; dx's two (dy * w - mean_g, fused, and the centred term); dweight's
    assert _path_op_count(function, figures.path, "FFMA") >= 4 * values
