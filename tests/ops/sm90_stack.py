"""Per-thread stack (spilled registers) of one nsa Triton kernel compiled for Hopper (sm_90),
printed in bytes. Run in its own process, without TRITON_INTERPRET (under the interpreter
``triton.jit`` gives functions that cannot be compiled):

    python -m tests.ops.sm90_stack MODULE.KERNEL '{"types": {...}, "constants": {...},
                                                   "num_warps": 4, "num_stages": 1}'
"""

import importlib
import json
import pathlib
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TOOLS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def stack_bytes(fn, types: dict, constants: dict, num_warps: int, num_stages: int) -> int:
    """Argument types by name (int32 where not given), constexpr values by name."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    source = ASTSource(fn, signature,
                       constexprs={(names.index(n),): v for n, v in constants.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.TemporaryDirectory() as tmp:
        cubin = pathlib.Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(TOOLS / "cuobjdump"), "-res-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout
    return int(usage.split("STACK:")[1].split()[0])


if __name__ == "__main__":
    module_name, kernel_name = sys.argv[1].rsplit(".", 1)
    launch = json.loads(sys.argv[2])
    kernel = getattr(importlib.import_module(f"nsa.ops.triton.{module_name}"), kernel_name)
    print(stack_bytes(kernel, launch["types"], launch["constants"], launch["num_warps"],
                      launch["num_stages"]))
