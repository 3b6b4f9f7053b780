"""Register spills of the Triton kernels, compiled for Hopper (sm_90) on any machine: Triton's
wheel carries ptxas and cuobjdump, so no GPU is needed. A kernel that spills registers to a
per-thread stack works from local memory. The selection kernel's 3.5 KB stack (v6: products
with overlap matrices) cost it 1.5x at 64k (bench/NOTES.md v8); its launch kept 104 B with
its head loop pipelined over 3 stages (v24) and 40 B since its int32 top-n keys, and a change
that brings the large spill back must show."""

import json

import pytest

triton = pytest.importorskip("triton")

from nsa.ops.triton.compressed_window import (  # noqa: E402
    MODE_CMP,
    MODE_NAMES,
    MODE_WIN,
    _branch_fwd_kernel,
)
from nsa.ops.triton.launch import TUNING, launch_keys, launch_shape, tile_heads  # noqa: E402
from nsa.ops.triton.selection import _select_kernel, loop_stages  # noqa: E402
from tests.ops.sm90_stack import (  # noqa: E402
    HAS_TOOLS,
    cap_for_one_more,
    programs_per_sm,
    run_offline,
)

needs_cuda_tools = pytest.mark.skipif(not HAS_TOOLS, reason="this Triton build has no CUDA tools")


def sm90_stack(kernel: str, types: dict, constants: dict, num_warps: int,
               num_stages: int, aligned=None, maxnreg=None) -> int:
    """Stack bytes per thread of nsa.ops.triton.``kernel`` for sm_90 (tests/ops/sm90_stack.py,
    in a process without the interpreter); ``aligned``, ``maxnreg``: as ``compile_sm90``'s."""
    launch = dict(types=types, constants=constants, num_warps=num_warps, num_stages=num_stages,
                  aligned=aligned, maxnreg=maxnreg)
    result = run_offline(kernel, json.dumps(launch), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return int(result.stdout.split()[-1])


@needs_cuda_tools
@pytest.mark.parametrize("G", [16, 1])
def test_selection_kernel_spills_little_with_its_loop_pipelined(G):
    """D = 128, l/d/l' = 32/16/64, n = 16 with the tuned launch (64 positions, 4 warps, 128
    compressed tokens per step): G = 16 with the head loop over TUNING's stages, G = 1 with
    the step loop over its step stages (offline: 233 registers, no stack, against 216 with
    one stage)."""
    tuning = TUNING["select"]
    head_stages, step_stages = loop_stages(G, 128, 2)  # bf16
    tokens_per_block = 64 // 16
    step_blocks = tuning["tokens"] // tokens_per_block
    constants = dict(G=G, DK=128, BLOCK_DK=128, BLOCK_P=tuning["rows"], NUM_SELECTED=16,
                     BEST=16, BJ=step_blocks, TOK_PAD=step_blocks * tokens_per_block,
                     M_PAD=tokens_per_block, SPILL=1, CMP_BLOCK=32, CMP_STRIDE=16,
                     SEL_BLOCK=64, NUM_INIT=1, NUM_LOCAL=2, IEEE=False, SMALL_SCALE=True,
                     HEAD_STAGES=head_stages, STEP_STAGES=step_stages,
                     INDEX_BITS=10)  # int32 keys (64k)
    types = dict(Q="*bf16", KC="*bf16", LSE="*fp32", IDX="*i32", tile_start="*i32",
                 tile_end="*i32", tile_seq_start="*i32", tile_cmp_start="*i32",
                 scale_log2="fp32")
    # As a GPU launch specializes them: pointers to aligned data, strides divisible by 16.
    aligned = [name for name in types if types[name].startswith("*")] + [
        name for name in _select_kernel.arg_names if name.startswith("stride_")]
    assert sm90_stack("selection._select_kernel", types, constants, tuning["num_warps"],
                      num_stages=1, aligned=aligned) <= 512


@needs_cuda_tools
@pytest.mark.parametrize("kind", ["fwd", "dq"])
def test_masked_selected_kernels_spill_little_at_the_m7c_shape(kind):
    """The selected forward and dq as masked causal attention (selected_masked.py) at the
    m7c-125m shape (G = 6, D = 64, l' = 64, n = 16, bf16, TMA) with the tuned launch of the
    programs whose keys and values are finite: at 128 rows and 4 warps they spilled 520 B
    (forward) and 840 B (dq) in v14, and still ran faster on the H100 than on 8 warps, which
    spill nothing (0.37 against >= 0.49 ms, 0.40 against >= 0.46 ms: bench/NOTES.md, v14);
    v19's branch-free loop over 3 stages: 96 B and 696 B; v20 launches 64 rows; v34 the dq
    at 128 again (584 B, 8 % faster than 64 rows at 8 x 2k); the fifty-second session's dq
    at 64 rows (tiles of launch.tile_heads' heads: 0 B; 520-544 at 128). More must
    show: v15's first try, which scaled do by the gate as it loaded it, took the dq to 1016 B
    and 0.41 -> >= 0.51 ms (bench/NOTES.md, v15). The dq as the op launches it since the
    fifty-fourth session: with the compressed and window branches' loops (BRANCHES), under
    its 168-register cap (0 B; uncapped 185 registers, 0 B)."""
    rows, launch = launch_shape(f"masked_{kind}", G=6, head_dim=64)
    constants = dict(G=6, DK=64, DV=64, BLOCK_DK=64, BLOCK_DV=64, BLOCK_R=rows,
                     TILE_G=tile_heads(6), BLOCK_N=64, SEL_BLOCK=64, IEEE=False, TMA=True,
                     FINITE=True, SMALL_SCALE=True)  # the default scale's launch
    desc = "tensordesc<bf16[1, 64, 1, 64]>"
    types = dict(Q="*bf16", K="*bf16", V="*bf16", KD=desc, VD=desc, BITS="*i64", KV_FINITE="*i8",
                 O="*fp32", LSE="*fp32", DO="*bf16", GATE="*fp32", DELTA="*fp32", DQ_IN="*bf16",
                 DQ_OUT="*bf16", O_CMP="*fp32", O_WIN="*fp32", GATES="*bf16", OUT="*bf16",
                 scale_log2="fp32", scale="fp32")
    if kind == "dq":  # the op's: the three branches' dq, int32 row offsets at this shape
        constants.update(ACCUMULATE=False, WIDE_ROWS=False, BRANCHES=True, CMP_KEYS=32,
                         WIN_KEYS=64, WINDOW=512, CMP_BLOCK=32, CMP_STRIDE=16, CMP_TMA=True,
                         WIN_TMA=True)
        types.update(KC="*bf16", VC="*bf16", KW="*bf16", VW="*bf16", KWD=desc, VWD=desc,
                     KCD="tensordesc<bf16[1, 32, 1, 64]>", VCD="tensordesc<bf16[1, 32, 1, 64]>",
                     GATE_CMP="*fp32", GATE_WIN="*fp32", LSE_CMP="*fp32", LSE_WIN="*fp32",
                     DELTA_CMP="*fp32", DELTA_WIN="*fp32", tok_pos="*i32", tok_cmp_start="*i32",
                     CMP_FINITE="*i8", WIN_FINITE="*i8")
    else:
        constants["GATED"] = True  # the op's launch: the forward also writes the gated sum
    kernel = "_masked_fwd_kernel" if kind == "fwd" else "_masked_dq_kernel"
    assert sm90_stack(f"selected_masked.{kernel}", types, constants, launch["num_warps"],
                      launch["num_stages"], maxnreg=launch.get("maxnreg")
                      ) <= {"fwd": 640, "dq": 960}[kind]


@needs_cuda_tools
@pytest.mark.parametrize("mode", [MODE_CMP, MODE_WIN], ids=["compressed", "window"])
def test_compressed_and_window_forwards_fit_their_register_cap_at_the_m7c_shape(mode):
    """The compressed and window forwards at the m7c-125m shape (G = 6, D = 64, bf16, TMA, the
    programs whose keys and values are finite) as the op launches them where every stride is a
    multiple of 16 (the launches that take the cap, launch.strides_aligned): under the cap
    of 96 registers (five 4-warp programs an SM where their 128 registers fit four) they spill
    nothing, which is what made them faster (bench/NOTES.md, fifty-fifth session); a change
    that makes them spill under the cap must show."""
    family = f"{MODE_NAMES[mode]}_fwd"
    rows, launch = launch_shape(family, G=6, head_dim=64)
    keys = launch_keys(family, 64)
    constants = dict(FINITE=True, G=6, DK=64, DV=64, BLOCK_DK=64, BLOCK_DV=64, BLOCK_R=rows,
                     TILE_G=tile_heads(6), BLOCK_N=keys, MODE=mode, WINDOW=512, CMP_BLOCK=32,
                     CMP_STRIDE=16, IEEE=False, TMA=True, SMALL_SCALE=True)
    desc = f"tensordesc<bf16[1, {keys}, 1, 64]>"
    types = dict(Q="*bf16", K="*bf16", V="*bf16", KD=desc, VD=desc, O="*fp32", LSE="*fp32",
                 tok_pos="*i32", tok_cmp_start="*i32", KV_FINITE="*i8", scale_log2="fp32")
    # The launches that take the cap (launch.strides_aligned): every stride a multiple of 16.
    aligned = [name for name in types if types[name].startswith("*")] + [
        name for name in _branch_fwd_kernel.arg_names if name.startswith("stride_")]
    assert launch.get("maxnreg") == 96
    assert sm90_stack("compressed_window._branch_fwd_kernel", types, constants,
                      launch["num_warps"], launch["num_stages"], aligned=aligned,
                      maxnreg=launch["maxnreg"]) == 0


def test_programs_an_sm_and_the_cap_that_fits_one_more():
    """The census arithmetic of ``sm90_stack --launches --caps`` (sm_90: 64K registers given
    out per warp in units of 256, 228 KiB of shared memory with 1 KiB reserved per program, 64
    warps): the m7c compressed/window forward (41 KiB) at 128 registers fits four 4-warp
    programs and at 96 five; the masked dK/dV (100 KiB, 255 registers) two; where shared
    memory (the one-kernel dq's 66 KiB at 168) or warps bound a launch, no cap adds one."""
    assert programs_per_sm(128, 4, 41 * 1024) == (4, 4)
    assert programs_per_sm(96, 4, 41 * 1024) == (5, 5)
    assert programs_per_sm(255, 4, 100 * 1024) == (2, 2)
    assert programs_per_sm(168, 8, 0) == (1, 1)
    assert cap_for_one_more(128, 4, 41 * 1024) == 96
    assert cap_for_one_more(243, 4, 76288) == 168  # the compressed dK/dV: 3 by shared memory
    assert cap_for_one_more(168, 4, 66 * 1024) is None  # shared memory: three either way
    assert cap_for_one_more(30, 4, 0) is None  # 16 programs of 4 warps: every warp slot
