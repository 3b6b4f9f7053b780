"""Per-thread stack (spilled registers) of nsa Triton kernels compiled for Hopper (sm_90),
printed in bytes. Run in its own process, without TRITON_INTERPRET (under the interpreter
``triton.jit`` gives functions that cannot be compiled):

    python -m tests.ops.sm90_stack MODULE.KERNEL '{"types": {...}, "constants": {...},
                                                   "num_warps": 4, "num_stages": 1}'
    python -m tests.ops.sm90_stack --launches FILE   # a JSON list of {"kernel": ..., launch}

With ``--launches`` every launch is compiled; one line per launch (its stack, registers, shared
memory and programs an SM, a digest of its machine code, ``copy_races`` and ptxas'
performance-loss notes), then the exit status 1 if any failed to compile (each failure's
error is printed). With ``--caps`` as well, a launch whose registers (not its shared memory)
bound its programs an SM is compiled again under the register cap (``maxnreg``) that fits one
more, and its stack there is printed: a census of where a cap might pay (bench/NOTES.md,
fifty-fourth and fifty-fifth sessions; a cap that spills inside a loop lost each time it was
timed). Two such listings of one launches
file, before and after a change, show which launches compile differently: a refactor whose
listing is unchanged needs no GPU run to re-measure (the launches of the test suite's
interpreter run: ``TRITON_INTERPRET=1 python -m tests.ops.test_compile_for_hopper FILE``
writes them; with ``--m7c``, those of the op at m7c-125m's shape).
"""

import hashlib
import importlib
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nsa.ops.triton.jit import triton_function

TOOLS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
HAS_TOOLS = (TOOLS / "cuobjdump").exists()  # this Triton build carries ptxas and cuobjdump
REPO = pathlib.Path(__file__).parents[2]


def run_offline(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """This module with ``args`` in its own process, from the repository root, without
    TRITON_INTERPRET (a test process under the interpreter cannot compile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "tests.ops.sm90_stack", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def compile_sm90(fn, types: dict, constants: dict, num_warps: int, num_stages: int,
                 aligned=None, maxnreg=None):
    """The kernel compiled for sm_90. Argument types by name (int32 where not given), constexpr
    values by name; ``aligned``: the names of the arguments a launch specializes as multiples
    of 16 (pointers to 16-byte aligned data, integers divisible by 16), default every pointer
    argument. A GPU launch specializes them so (its cache key holds each argument's
    alignment), and the code differs: without it no load is vectorized or asynchronous
    (cp.async), and registers and spills are not those of the launches that run. ``maxnreg``:
    the launch's register cap, where it has one."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    if aligned is None:
        aligned = [n for n in names if signature[n].startswith("*")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = ASTSource(fn, signature,
                       constexprs={(names.index(n),): v for n, v in constants.items()},
                       attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg is not None:  # a launch's register cap (launch.launch_shape)
        options["maxnreg"] = maxnreg
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _cuobjdump(kernel, option: str) -> str:
    """What cuobjdump ``option`` prints of the kernel's cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = pathlib.Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        return subprocess.run([str(TOOLS / "cuobjdump"), option, str(cubin)],
                              capture_output=True, text=True, check=True).stdout


def _usage(kernel) -> tuple[int, int]:
    """(registers, stack bytes) a thread of the compiled kernel, from one cuobjdump run."""
    usage = _cuobjdump(kernel, "-res-usage")
    return int(usage.split("REG:")[1].split()[0]), int(usage.split("STACK:")[1].split()[0])


# An sm_90 SM: 64K 32-bit registers, given out per warp in units of 256; 228 KiB of shared
# memory, 1 KiB of it reserved per resident program; at most 64 warps and 32 programs.
SM_REGISTERS, REGISTER_UNIT, SM_SHARED, PROGRAM_SHARED, SM_WARPS, SM_PROGRAMS = (
    65536, 256, 228 * 1024, 1024, 64, 32)


def programs_per_sm(registers: int, num_warps: int, shared: int) -> tuple[int, int]:
    """(programs of ``num_warps`` warps an SM can hold at ``registers`` a thread and
    ``shared`` bytes of shared memory a program, those its registers alone allow)."""
    warp_registers = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = SM_REGISTERS // warp_registers // num_warps
    by_shared = SM_SHARED // (shared + PROGRAM_SHARED)
    return min(by_registers, by_shared, SM_WARPS // num_warps, SM_PROGRAMS), by_registers


def cap_for_one_more(registers: int, num_warps: int, shared: int) -> int | None:
    """The most registers a thread (a multiple of 8) at which one more program of this launch
    fits an SM, or None where its shared memory or warps, not its registers, bound it."""
    programs, by_registers = programs_per_sm(registers, num_warps, shared)
    if by_registers > programs:
        return None
    cap = SM_REGISTERS // ((programs + 1) * num_warps) // REGISTER_UNIT * REGISTER_UNIT // 32
    if cap < 24 or programs_per_sm(cap, num_warps, shared)[0] <= programs:
        return None
    return cap


def ptxas_losses(kernel) -> list[str]:
    """The codes of ptxas' "Potential Performance Loss" notes on the kernel (``-v``, sm_90a),
    e.g. C7515: its wgmma instructions serialized, each waiting for the one before. ptxas runs
    on the PTX afresh: a compile that Triton's cache served ran none."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = pathlib.Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        notes = subprocess.run([str(TOOLS / "ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o",
                                str(ptx.with_suffix(".cubin"))],
                               capture_output=True, text=True, check=True).stderr
    return [re.search(r"\((C\d+)\)", line).group(1) for line in notes.splitlines()
            if "Potential Performance Loss" in line]


def sass_digest(kernel) -> str:
    """A digest of the kernel's machine code (SASS instructions, without their addresses and
    encodings). The PTX is not enough: its debug line numbers move whenever code above a
    kernel moves, and ptxas's output can move with them."""
    lines = []
    for line in _cuobjdump(kernel, "-sass").splitlines():
        code = re.sub(r"/\*[0-9a-f]{4,}\*/", "", line.split(";")[0]).strip()
        if code and not code.startswith(("/*", "Function", ".")):
            lines.append(code)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


_RING = re.compile(r"(%[\w#-]+) = ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x")
_CONSTANT = re.compile(r"(%[\w#-]+) = arith\.constant (-?\d+) : i32")
_VIEW = re.compile(r"(%[\w#-]+) = ttg\.memdesc_(?:index (%[\w#-]+)\[(%[\w#-]+)\]|reshape (%[\w#-]+)"
                   r"|trans (%[\w#-]+))")
_WRAP = re.compile(r"(%[\w#-]+) = arith\.select %[\w#-]+, %c0_i32, (%[\w#-]+) ")
_STEP = re.compile(r"(%[\w#-]+) = arith\.addi (%[\w#-]+), %c1_i32 ")
_COPY = re.compile(r"(?:ttng\.async_tma_copy_global_to_local %[\w#-]+\[[^\]]*\] (%[\w#-]+)"
                   r"|ttg\.async_copy_global_to_local %[\w#-]+, (%[\w#-]+)"
                   r"|ttg\.local_store %[\w#-]+, (%[\w#-]+))")
_WGMMA = re.compile(r"ttng\.warp_group_dot (%[\w#-]+), (%[\w#-]+), .*isAsync = true")
_WAIT = re.compile(r"ttng\.warp_group_dot_wait .*pendings = (\d+)")


def _loops(ttgir: str):
    """(iter_args header, body lines) of every scf.for in the TTGIR, nested ones included."""
    lines = ttgir.splitlines()
    for i, line in enumerate(lines):
        if " scf.for " not in line:
            continue
        depth, body = line.count("{") - line.count("}"), []
        for inner in lines[i + 1:]:
            depth += inner.count("{") - inner.count("}")
            if depth <= 0:
                break
            body.append(inner)
        yield line, body


def copy_races(ttgir: str) -> int:
    """How many copies into shared memory (TMA, cp.async or a store) in the loops of a
    compiled kernel (its TTGIR) may overwrite a buffer that an asynchronous wgmma, issued
    before and not yet waited for, still reads. Triton 3.6's pipeliner puts each loaded
    operand in a ring of buffers, slot (i + 1 + j) mod n in iteration j (i: the slot
    counter's initial value); a copy's slot equal to that of an outstanding wgmma's operand is
    the race of upstream triton-lang/triton#8139 (v27's compressed/window dK/dV: its TMA ring
    had as many buffers as tiles loaded ahead; bench/NOTES.md, twenty-eighth session). Each
    loop is followed over n + 1 iterations, the wgmmas left outstanding at its end carried into
    the next; an operand slot that is not such a counter or a constant counts as any slot."""
    rings = {name: int(n) for name, n in _RING.findall(ttgir)}
    constants = {name: int(value) for name, value in _CONSTANT.findall(ttgir)}
    turns = max(rings.values(), default=1) + 1  # iterations followed per loop
    races = set()
    for header, body in _loops(ttgir):
        initial = dict(re.findall(r"(%[\w#-]+) = (%[\w#-]+)", header.split("iter_args(")[-1]))
        steps = dict(_STEP.findall("\n".join(body)))
        counters = {}  # slot counter -> its value before the first iteration
        for wrapped, stepped in _WRAP.findall("\n".join(body)):
            start = constants.get(initial.get(steps.get(stepped, ""), ""))
            if start is not None:
                counters[wrapped] = start + 1
        outstanding = []  # per unwaited wgmma: its operands' (ring, slot)
        for j in range(turns):
            buffers = {}  # value -> (ring, slot in this iteration, or None: any)
            for number, line in enumerate(body):
                if view := _VIEW.search(line):
                    name, ring, index, reshaped, transposed = view.groups()
                    if ring is not None and ring in rings:
                        n = rings[ring]
                        slot = (counters[index] + j) % n if index in counters else (
                            constants[index] % n if index in constants else None)
                        buffers[name] = (ring, slot)
                    elif (reshaped or transposed) in buffers:
                        buffers[name] = buffers[reshaped or transposed]
                elif wgmma := _WGMMA.search(line):
                    outstanding.append([buffers[v] for v in wgmma.groups() if v in buffers])
                elif wait := _WAIT.search(line):
                    pending = int(wait.group(1))
                    outstanding = outstanding[len(outstanding) - pending:] if pending else []
                elif copy := _COPY.search(line):
                    target = buffers.get(next(v for v in copy.groups() if v))
                    if target and any(ring == target[0] and None in (slot, target[1])
                                      or (ring, slot) == target
                                      for reads in outstanding for ring, slot in reads):
                        races.add((header, number))
    return len(races)


def compile_launch(kernel: str, launch: dict):
    """nsa.ops.triton.``kernel`` ("module.name") compiled for ``launch``."""
    module_name, kernel_name = kernel.rsplit(".", 1)
    fn = triton_function(getattr(importlib.import_module(f"nsa.ops.triton.{module_name}"),
                                 kernel_name))
    return compile_sm90(fn, launch["types"], launch["constants"], launch["num_warps"],
                        launch["num_stages"], launch.get("aligned"), launch.get("maxnreg"))


def _cap_line(launch: dict, registers: int, shared: int) -> str:
    """The launch compiled again under the cap that fits one more program an SM: its stack."""
    cap = cap_for_one_more(registers, launch["num_warps"], shared)
    if cap is None:
        return ""
    registers, stack = _usage(compile_launch(launch["kernel"], dict(launch, maxnreg=cap)))
    more = programs_per_sm(registers, launch["num_warps"], shared)[0]
    return f"\n    cap {cap}: stack {stack} B, {more} programs an SM"


if __name__ == "__main__":
    if sys.argv[1] != "--launches":
        print(_usage(compile_launch(sys.argv[1], json.loads(sys.argv[2])))[1])
        sys.exit(0)
    failed = 0
    for launch in json.loads(pathlib.Path(sys.argv[2]).read_text()):
        try:
            compiled = compile_launch(launch["kernel"], launch)
            losses = ",".join(ptxas_losses(compiled)) or "none"
            (registers, stack), shared = _usage(compiled), compiled.metadata.shared
            programs = programs_per_sm(registers, launch["num_warps"], shared)[0]
            caps = _cap_line(launch, registers, shared) if "--caps" in sys.argv[3:] else ""
            print(f"{launch['kernel']}: stack {stack} B, registers {registers}, "
                  f"shared {shared / 1024:.0f} KiB, {programs} programs an SM, "
                  f"sass {sass_digest(compiled)}, "
                  f"copy races {copy_races(compiled.asm['ttgir'])}, ptxas losses {losses}{caps}")
        except Exception as error:  # noqa: BLE001  (every failure is reported, then exit 1)
            failed += 1
            print(f"{launch['kernel']} FAILED with {json.dumps(launch['constants'])}:\n{error}")
    sys.exit(1 if failed else 0)
