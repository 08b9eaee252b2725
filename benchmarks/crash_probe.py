#!/usr/bin/env python
"""Where a refused call kills the process: each bad call of the H200 crashes alone, in a child process.

    python benchmarks/crash_probe.py                 # cuda and cpu; a C++ backtrace of the first crash per device (gdb)

On an H200 machine (2026-12-04, torch 2.11) every refused call whose message printed integers died with SIGSEGV,
on CUDA and CPU tensors alike; messages of text alone, and ATen's own integer messages, raised. This probe's
backtrace found why: that machine's compiler (/opt/gcc/bin/g++ 13.3) linked a private, static copy of libstdc++ into
our library (no libstdc++.so.6 among its NEEDED entries), and Python's -Wl,-Bsymbolic-functions bound our calls to that
copy, so our `ostream << int64_t` ran the copy's num_put against a locale built by the process's libstdc++.so.6: a
facet looked up by another copy's index, a virtual call into codecvt<char16_t>::do_unshift, a fault. Our messages are
now written without a stream (csrc/message.h); the probe stays to catch any return of it. The cases run in one child
per device; where that child does not see every case raise, each runs in its own child (with faulthandler's Python
stack), and the first one per device killed by a signal is run again under gdb (or cuda-gdb, which debugs host code
too) in batch mode for the native backtrace, the faulting instructions and the registers. Exit status 0 when every
case raised its RuntimeError, 1 otherwise.
"""

from __future__ import annotations

import argparse
import glob
import shutil
import signal
import subprocess
import sys
import textwrap

# (name, code run after `import torch, layernorm_ext as L` with `dev` set): each must raise RuntimeError.
CASES = {
    "dtype_message": "L.layer_norm(torch.ones(4, 8, device=dev), [8], torch.ones(8, device=dev, dtype=torch.int64))",
    "shape_message": "L.layer_norm(torch.ones(4, 8, device=dev), [7])",
    "shape_message_op": "torch.ops.layernorm_ext.layer_norm_fwd(torch.ones(4, 8, device=dev), [7], None, None, 1e-5)",
    "weight_shape_message": "L.rms_norm(torch.ones(4, 8, device=dev), [8], torch.ones(7, device=dev))",
    "int_only_message": "L.rms_norm_quant(torch.ones(2, 64, device=dev), [64], torch.ones(64, device=dev), "
                        "quant_dtype=torch.float8_e4m3fn, group_size=128)",
    "c10_message_of_aten": "torch.ones(4, 8, device=dev).view(5, 7)",
    # ATen's integer message (an allocation of 2 PiB, past any address space: 32 TiB got the CPU child OOM-killed on a
    # machine that overcommits), thrown inside our op and unwound through our frames.
    "aten_message_through_ours": "L.layer_norm(torch.ones(1, 8, device=dev).expand(2**46, 8), [8])",
}

CHILD = """
import sys, torch, layernorm_ext as L
dev = {dev!r}
if {maps}:  # which C++ runtimes this process loaded: a mismatch between builder and loader is one suspect
    libs = {{line.split()[-1] for line in open("/proc/self/maps") if "libstdc++" in line or "libgcc_s" in line}}
    print("loaded:", " ".join(sorted(libs)), flush=True)
try:
    {code}
except RuntimeError as e:
    print("raised:", str(e).splitlines()[0][:160])
    sys.exit(0)
print("no error")
sys.exit(3)
"""


# Every case in one process first (one import of torch: about 5 s a child on the H200 machine, 14 children did not fit
# gpu_check's minute); the cases run one child each only where that process did not see every case raise.
ALL_CHILD = """
import sys, torch, layernorm_ext as L
dev = {dev!r}
libs = {{line.split()[-1] for line in open("/proc/self/maps") if "libstdc++" in line or "libgcc_s" in line}}
print("loaded:", " ".join(sorted(libs)), flush=True)
for name, code in {cases!r}.items():
    try:
        exec(code)
    except RuntimeError as e:
        print(name, "raised:", str(e).splitlines()[0][:160], flush=True)
    else:
        print(name, "no error", flush=True)
"""


def run_all(dev: str, timeout: float) -> dict[str, str] | None:
    """Each case's line when one process saw every case raise, else None."""
    child = textwrap.dedent(ALL_CHILD).format(dev=dev, cases=CASES)
    try:
        run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    lines = run.stdout.splitlines()
    raised = {name: line for line in lines for name in CASES if line.startswith(f"{name} raised:")}
    if run.returncode != 0 or len(raised) != len(CASES):
        return None
    print(f"{dev:5s} {lines[0]}", flush=True)  # the child's first line: the C++ runtimes it loaded
    return {name: line[len(name) + 1:] for name, line in raised.items()}


def run_case(dev: str, code: str, timeout: float, maps: bool = False) -> tuple[int, str]:
    child = textwrap.dedent(CHILD).format(dev=dev, code=code, maps=maps)
    run = subprocess.run([sys.executable, "-X", "faulthandler", "-c", child], capture_output=True, text=True,
                         timeout=timeout)
    return run.returncode, (run.stdout + run.stderr).strip()


def backtrace(dev: str, code: str, timeout: float) -> str:
    found = sorted(glob.glob("/usr/local/cuda*/bin/cuda-gdb"))
    gdb = shutil.which("gdb") or shutil.which("cuda-gdb") or (found[0] if found else None)
    if gdb is None:
        return "(no gdb or cuda-gdb found)"
    child = textwrap.dedent(CHILD).format(dev=dev, code=code, maps=False)
    cmd = [gdb, "-batch", "-ex", "run", "-ex", "bt 30", "-ex", "x/8i $pc", "-ex", "info registers rip rsp rdi rsi rax",
           "-ex", "info sharedlibrary", "--args", sys.executable, "-c", child]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"({gdb} timed out)"
    # The innermost frames, the faulting instructions and registers first; of the library list (hundreds of lines,
    # which on 2026-12-04 pushed the top frames out of a tail) only the C++ runtimes and our library.
    out = (run.stdout + run.stderr).splitlines()
    frames = [line for line in out if line.startswith(("#", "=>", "Program", "rip", "rsp", "rdi", "rsi", "rax"))
              or line.startswith("   0x")]
    libs = [line for line in out if line.startswith("0x") and ("libstdc++" in line or "libgcc" in line or "_C." in line
                                                               or "libc10" in line)]
    return "\n".join(frames[:60] + libs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", default="cuda,cpu")
    p.add_argument("--timeout", type=float, default=120.0)
    opts = p.parse_args(argv)
    bad = 0
    traced: set[str] = set()
    for dev in opts.devices.split(","):
        together = run_all(dev, opts.timeout)
        if together is not None:
            for name, text in together.items():
                print(f"{dev:5s} {name:22s} exit 0  {text[:140]}", flush=True)
            continue
        for name, code in CASES.items():
            rc, text = run_case(dev, code, opts.timeout, maps=name == next(iter(CASES)))
            signame = signal.Signals(-rc).name if rc < 0 else ""
            print(f"{dev:5s} {name:22s} exit {rc} {signame} {text.splitlines()[-1][:140] if text else ''}", flush=True)
            if text.startswith("loaded:"):
                print("    " + text.splitlines()[0], flush=True)
            if rc != 0:
                bad += 1
                if rc < 0 and dev not in traced:  # one native backtrace per device: gdb takes ~10 s a run
                    traced.add(dev)
                    print(textwrap.indent(text[-3000:], "    "), flush=True)  # faulthandler's Python stack
                    print(textwrap.indent(backtrace(dev, code, opts.timeout), "    "), flush=True)
    print(f"crash_probe: {bad} of {len(CASES) * len(opts.devices.split(','))} cases did not raise cleanly")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
