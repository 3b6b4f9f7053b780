"""Every Triton kernel launch that the op (forward and backward), the selection op, the fused
decode step, the cache append, RoPE, the compressors, the layer's branch gates, the model's
norms, MLP activation and loss make in a CPU run compiles for Hopper (sm_90), with its
arguments specialized as a GPU launch specializes them (alignment, integers of 1), keeps its
tensor-core instructions pipelined (no ptxas note that it serialized them) but on the rare
non-finite paths and in the masked dK/dV (measured faster so), and copies nothing into a
shared buffer that an unfinished asynchronous tensor-core product still reads
(``sm90_stack.copy_races``).

CI has no GPU: there the kernels run in Triton's interpreter, which executes Python that the
compiler refuses (a tuple of two dtypes assigned in one line did that: the GPU found it, after
the interpreter tests had passed). Here the interpreter's launches are recorded (argument
types, constexpr values, warps, stages) and each distinct one is compiled offline for sm_90 in
a process without the interpreter, with the ptxas that Triton's wheel carries
(tests/ops/sm90_stack.py). On a CUDA machine the other tests compile every launch for real.

    TRITON_INTERPRET=1 python -m tests.ops.test_compile_for_hopper FILE   # write the launches
    TRITON_INTERPRET=1 python -m tests.ops.test_compile_for_hopper FILE --m7c  # the op's at m7c
"""

import inspect
import json
from unittest import mock

import pytest
import torch

import nsa
from nsa.ops.params import NSAParams
from nsa.ops.triton_support import TRITON_INTERPRET
from tests.ops.helpers import make_inputs

triton = pytest.importorskip("triton")

from tests.ops.sm90_stack import HAS_TOOLS, run_offline  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not TRITON_INTERPRET, reason="launches are recorded from the interpreter"),
    pytest.mark.skipif(not HAS_TOOLS, reason="this Triton build has no CUDA tools"),
]
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
         torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8",
         torch.bool: "i1"}
# Kernels the recorded work must launch (the recording itself is checked by this).
EXPECTED = {
    "compressed_window._branch_fwd_kernel", "compressed_window._branches_dq_kernel",
    "compressed_window._branch_bwd_dkdv_kernel", "selection._select_kernel",
    "selected._selected_fwd_kernel", "selected._selected_bwd_dq_kernel",
    "selected_blocks._block_fwd_kernel", "selected_blocks._merge_partials_kernel",
    "selected_blocks._block_bwd_kernel", "selected_blocks._sum_dq_kernel",
    "selected_masked._masked_fwd_kernel",
    "selected_masked._masked_dq_kernel", "selected_masked._masked_dkdv_kernel",
    "selected_masked._selection_bits_kernel", "selected_masked._block_positions_kernel",
    "gating._gate_backward_kernel",
    "finite._kv_finite_kernel",
    "decode._compressed_kernel", "decode._select_kernel", "decode._selected_kernel",
    "cache_append._append_kernel", "cache_compress._first_product_kernel",
    "cache_compress._finish_kernel", "rope._rope_kernel",
    "compressor._compress_fwd_kernel", "compressor._hidden_grad_kernel",
    "compressor._input_grad_kernel", "compressor._weight_grads_kernel",
    "swiglu._swiglu_fwd_kernel", "swiglu._swiglu_bwd_kernel",
    "branch_gates._branch_gates_fwd_kernel", "branch_gates._branch_gates_bwd_kernel",
    "rms_norm._rms_norm_fwd_kernel", "rms_norm._rms_norm_bwd_kernel",
    "cross_entropy._cross_entropy_fwd_kernel", "cross_entropy._cross_entropy_bwd_kernel",
}


def is_constexpr(annotation) -> bool:
    """A kernel parameter annotated tl.constexpr (a string under postponed annotations)."""
    return annotation is triton.language.constexpr or annotation in ("tl.constexpr",
                                                                     "triton.language.constexpr")


def argument_type(value) -> str:
    """The compiler's signature type of a runtime kernel argument."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, TensorDescriptor):
        block = ", ".join(map(str, value.block_shape))
        return f"tensordesc<{TYPES[value.base.dtype]}[{block}]>"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no signature type for {type(value).__name__}")


def launch_record(fn, args, kwargs) -> dict:
    """{"kernel", "types", "constants", "aligned", "num_warps", "num_stages", "maxnreg"} of one
    interpreted launch, its arguments specialized as a GPU launch specializes them (Triton's
    own rule: pointers to 16-byte aligned data and integers divisible by 16 are "aligned",
    an integer 1 is a constant)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.tools.tensor_descriptor import TensorDescriptor

    parameters = inspect.signature(fn).parameters
    bound = dict(zip(parameters, args)) | {k: v for k, v in kwargs.items() if k in parameters}
    types, constants, aligned = {}, {}, []
    for name, value in bound.items():
        if is_constexpr(parameters[name].annotation) or value is None:
            constants[name] = value
            continue
        if not isinstance(value, TensorDescriptor | bool | float):
            kind, attribute = native_specialize_impl(BaseBackend, value, False, True, True)
            if kind == "constexpr":
                constants[name] = attribute
                continue
            if attribute == "D":
                aligned.append(name)
        types[name] = argument_type(value)
    return dict(kernel=f"{fn.__module__.removeprefix('nsa.ops.triton.')}.{fn.__name__}",
                types=types, constants=constants, aligned=aligned,
                num_warps=kwargs.get("num_warps", 4), num_stages=kwargs.get("num_stages", 3),
                maxnreg=kwargs.get("maxnreg"))


def recorded_launches(work) -> list[dict]:
    """The distinct launches ``work()`` makes, recorded from the interpreter; a launch with
    programmatic dependent launch off (the CPU's) is also recorded with it on (the GPU's)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches = {}
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        record = launch_record(self.fn, args, kwargs)
        variants = [record]
        if record["constants"].get("PDL") is False:
            variants.append(dict(record, constants=dict(record["constants"], PDL=True)))
        for variant in variants:
            launches.setdefault(json.dumps(variant, sort_keys=True), variant)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        work()
    finally:
        InterpretedFunction.run = run
    return list(launches.values())


def attention_forward_backward(dtype, T, window, heads=(4, 2), dim=16):
    """nsa_attention and nsa_select on tiny shapes: HQ / H = ``heads`` (default G = 2), head
    dim ``dim``, l' = 16 (whole blocks and, from T = 300, full 64-key tiles through tensor
    descriptors)."""
    p = dict(cmp_block=8, cmp_stride=4, sel_block=16, num_selected=3, window=window)
    x = make_inputs(1, T, *heads, dim, dim, dtype=dtype, **p)
    x = {name: t.requires_grad_() for name, t in x.items()}
    out = nsa.nsa_attention(x["q"], x["k"], x["v"], x["k_cmp"], x["v_cmp"], x["gates"],
                            k_win=x["k_win"], v_win=x["v_win"], backend="triton", **p)
    out.float().square().sum().backward()
    nsa.nsa_select(x["q"].detach(), x["k_cmp"].detach(), backend="triton",
                   **{k: v for k, v in p.items() if k != "window"})


def decode_step(dtype, ring):
    from nsa.ops.decode import nsa_decode

    params = NSAParams(cmp_block=8, cmp_stride=4, sel_block=16, num_selected=3, window=9)
    g = torch.Generator().manual_seed(0)
    B, S, H, G, D = 2, 70, 2, 2, 16
    C = params.compressed_length(S)
    make = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    windows = dict(k_win=make(B, params.window, H, D), v_win=make(B, params.window, H, D))
    nsa_decode(make(B, H * G, D), make(B, S, H, D), make(B, S, H, D), make(B, C, H, D),
               make(B, C, H, D), torch.rand(B, H * G, 3, generator=g).to(dtype),
               torch.tensor([3, S - 1]), params, window_ring=ring, backend="triton",
               **(windows if ring else {}))


def decode_step_in_chunks(dtype):
    """The decode step with a large GPU's launch plan (two compressed splits) and merge steps of
    one partial, so that the merges' loops run more than one step (a loop that reshapes a
    variable fails to compile for the GPU only)."""
    import nsa.ops.triton.decode as triton_decode

    with mock.patch.object(triton_decode, "MERGE_TILE", 16), \
            mock.patch.object(triton_decode, "num_sms", lambda device: 64):
        decode_step(dtype, ring=True)


def append_and_rope(dtype, sets):
    from nsa.layers.rope import rope_angles, rope_frequencies
    from nsa.ops.triton.cache_append import append_kv_triton
    from nsa.ops.triton.rope import rope_triton_many

    B, H, D, capacity = 2, 2, 16, 40
    pos = torch.tensor([3, 17])
    cos, sin = rope_angles(pos[:, None], rope_frequencies(D, 10000.0, "cpu"))
    caches = [torch.zeros(B, n, H, D, dtype=dtype) for n in (capacity, capacity, 8, 8, 4, 4)]
    if sets == 1:
        caches[2:4] = [None, None]
    append_kv_triton(torch.randn(B, 1, sets, H, 2 * D).to(dtype), cos, sin, pos, *caches)
    x = torch.randn(B, 1, H, D, dtype=dtype, requires_grad=True)
    rope_triton_many([x], cos, sin)[0].float().sum().backward()


def compressed_update(dtype, compressor, D=16, block=4):
    from nsa.layers.attention import compressed_rope_table
    from nsa.layers.compressor import Compressor
    from nsa.ops.triton.cache_compress import compress_step_triton

    B, H, num_cmp = 2, 2, 10
    ring = torch.randn(B, block, H, D).to(dtype)
    out = torch.zeros(B, num_cmp, H, D, dtype=dtype)
    rope = compressed_rope_table(num_cmp, block, 2, D, 10000.0, torch.device("cpu"))
    with torch.no_grad():
        compress_step_triton(ring, torch.tensor([3, 8]), Compressor(D, block, 2, compressor),
                             out, dtype, rope)


def compressor_forward_backward(dtype, D=16, hidden=32, block=8, stride=4):
    """The training compressors (nsa/ops/triton/compressor.py) forward and backward, a layer's
    two in one launch; computed in ``dtype`` from float32 weights, as under autocast."""
    from nsa.layers.compressor import Compressor
    from nsa.ops.triton.compressor import compress_triton

    modules = [Compressor(D, block, stride, "mlp", hidden) for _ in range(2)]
    xs = [torch.randn(2, 40, 2, D).to(dtype).requires_grad_() for _ in modules]
    outs = compress_triton(xs, [m.weights() for m in modules], block, stride, dtype)
    sum(out.float().sum() for out in outs).backward()


def swiglu_forward_backward(dtype, hidden=40):
    """The model MLP's activation (nsa/ops/triton/swiglu.py) forward and backward."""
    from nsa.ops.triton.swiglu import swiglu_triton

    gate_up = torch.randn(2, 5, 2 * hidden).to(dtype).requires_grad_()
    swiglu_triton(gate_up).float().sum().backward()


def gates_forward_backward(dtype, heads=12):
    """The NSA layer's branch gates (nsa/ops/triton/branch_gates.py) forward and backward, of
    logits viewed in a wider projection's rows as the layer's, with a float32 bias as under
    autocast; m7c-125m's 12 heads."""
    from nsa.ops.triton.branch_gates import branch_gates_triton

    y = torch.randn(2, 5, 8 + heads * 3).to(dtype).requires_grad_()
    bias = torch.zeros(heads * 3, requires_grad=True)
    branch_gates_triton(y[..., 8:].unflatten(-1, (heads, 3)), bias).float().sum().backward()


def norm_forward_backward(dtype, width=40):
    """The model's RMSNorm (nsa/ops/triton/rms_norm.py), alone and after a residual add, forward
    and backward, with a float32 weight and a 16-bit output as under autocast; and rows of
    m7c-125m's width."""
    from nsa.ops.triton.rms_norm import add_rms_norm_triton, rms_norm_triton

    for w in (width, 768):
        x, update = (torch.randn(3, w).to(dtype).requires_grad_() for _ in range(2))
        weight = torch.ones(w, requires_grad=True)
        h, y = add_rms_norm_triton(x, update, weight, 1e-5, torch.bfloat16)
        z = rms_norm_triton(h, weight, 1e-5, torch.bfloat16)
        (h.float().sum() + y.float().sum() + z.float().sum()).backward()


def loss_forward_backward(dtype, vocab=5000):
    """The model's loss (nsa/ops/triton/cross_entropy.py) forward and backward: two steps of
    classes, an ignored target."""
    from nsa.ops.triton.cross_entropy import cross_entropy_triton

    logits = torch.randn(3, vocab).to(dtype).requires_grad_()
    cross_entropy_triton(logits, torch.tensor([1, -100, vocab - 1])).backward()


def in_chunks(work):
    """``work`` with the per-block selected kernels run over chunks of positions (their
    partials' budget made small), so that dK/dV are added up over the chunks in the kernels."""
    from nsa.ops.triton import selected_blocks

    with mock.patch.object(selected_blocks, "PARTIALS_BYTES", 50_000):
        work()


def everything():
    for compressor in ("mlp", "mean"):
        compressed_update(torch.bfloat16, compressor)
    compressed_update(torch.bfloat16, "mlp", D=64, block=32)  # m7c-125m's: 32 slices
    compressor_forward_backward(torch.float32)
    compressor_forward_backward(torch.bfloat16, D=64, hidden=128, block=32, stride=16)  # m7c
    compressor_forward_backward(torch.bfloat16, D=128, hidden=256, block=32, stride=16)  # 8 warps
    for dtype in (torch.float32, torch.bfloat16):
        attention_forward_backward(dtype, 40, window=9)
        decode_step(dtype, ring=True)
        decode_step(dtype, ring=False)
        decode_step_in_chunks(dtype)
        append_and_rope(dtype, sets=3)
        append_and_rope(dtype, sets=1)
        swiglu_forward_backward(dtype)
        gates_forward_backward(dtype)
        norm_forward_backward(dtype)
        loss_forward_backward(dtype)
    attention_forward_backward(torch.float32, 300, window=130)
    attention_forward_backward(torch.bfloat16, 40, window=9, heads=(2, 2))  # G = 1: step stages
    # G = 4 at the paper's head dim (the window dK/dV's transposed tiles, descriptor loads of
    # 128-wide rows), and G = 16 (the selection's pipelined head loop), in bf16.
    attention_forward_backward(torch.bfloat16, 300, window=130, heads=(8, 2), dim=128)
    attention_forward_backward(torch.bfloat16, 300, window=130, heads=(32, 2))
    in_chunks(lambda: attention_forward_backward(torch.bfloat16, 300, window=130))


def test_every_recorded_launch_compiles_for_hopper(tmp_path):
    launches = recorded_launches(everything)
    assert {launch["kernel"] for launch in launches} >= EXPECTED
    assert any(t.startswith("tensordesc") for launch in launches
               for t in launch["types"].values())  # the TMA paths are among them
    assert any(launch["constants"].get("TRANSPOSED") for launch in launches)
    assert any(launch["constants"].get("HEAD_STAGES", 1) > 1 for launch in launches)
    assert any(launch["constants"].get("STEP_STAGES", 1) > 1 for launch in launches)
    assert any(launch["kernel"] == "selected_blocks._block_bwd_kernel"
               and launch["constants"].get("ACCUMULATE") for launch in launches)  # in chunks
    # Compiled as the GPU specializes them: every launch has aligned pointers.
    assert all(any(launch["types"][n].startswith("*") for n in launch["aligned"])
               for launch in launches)
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(launches))
    result = run_offline("--launches", str(path), timeout=1200)
    failures = [line for line in result.stdout.splitlines() if "FAILED" in line]
    assert result.returncode == 0, (failures, result.stdout[-4000:], result.stderr[-2000:])
    compiled = [line for line in result.stdout.splitlines() if ": stack " in line]
    assert len(compiled) == len(launches)
    # No copy over a buffer that an unwaited asynchronous wgmma reads: v27's compressed/window
    # dK/dV had two per launch (q's and do's TMA rings), and its gradients differed from run
    # to run on an H200 (bench/NOTES.md, twenty-eighth session).
    racing = [line for line in compiled if "copy races 0," not in line]
    assert not racing, racing
    # ptxas serializes every wgmma of a kernel (C7515: each waits for the one before) where
    # code between a wgmma and its wait defines its accumulator registers; the kernels that
    # branched between their finite and non-finite paths at run time were all so (bench/NOTES.md,
    # twenty-fifth session). Only the non-finite launches (FINITE off: rare, kept exact) may be.
    slowed = [(launch["kernel"], launch["constants"].get("FINITE"), line.rsplit(" ", 1)[1])
              for launch, line in zip(launches, compiled, strict=True)
              if not line.endswith("ptxas losses none")]
    assert all(kernel.startswith("compressed_window.") and finite is False
               for kernel, finite, _ in slowed), slowed


def m7c_attention_forward_backward():
    """The op forward and backward at m7c-125m's layer shape (12 query heads on 2 KV heads of
    64, bf16, the paper's blocks) at 1 x 256 tokens: the launches of its 8 x 2k training step
    (the same constants: the selected branch as masked attention, int32 row offsets), for a
    register census (``python -m tests.ops.sm90_stack --launches FILE --caps``)."""
    p = dict(cmp_block=32, cmp_stride=16, sel_block=64, num_selected=16, window=512)
    x = make_inputs(1, 256, 12, 2, 64, 64, dtype=torch.bfloat16, **p)
    x = {name: t.requires_grad_() for name, t in x.items()}
    out = nsa.nsa_attention(x["q"], x["k"], x["v"], x["k_cmp"], x["v_cmp"], x["gates"],
                            k_win=x["k_win"], v_win=x["v_win"], backend="triton", **p)
    out.float().square().sum().backward()


if __name__ == "__main__":  # the launches, for `python -m tests.ops.sm90_stack --launches`
    import sys

    work = m7c_attention_forward_backward if "--m7c" in sys.argv[2:] else everything
    with open(sys.argv[1], "w") as f:
        json.dump(recorded_launches(work), f)
