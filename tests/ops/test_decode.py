"""The Triton decode step (``nsa/ops/triton/decode.py``) against the PyTorch decode path, its
reference, on mixed positions (pos = 0, pos < l, mid-cache, capacity - 1 in one batch).

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py), in float32 and
float16 (the interpreter computes bfloat16 wrongly); on a GPU in float32 and bfloat16. The SM
count the launch plan sees is patched, so that tiny shapes take the launch shapes of a large
GPU (many compressed splits, head slices, several items per branch) or of a batch that already
fills it (several tiles per split and per item); the selection tile is cut so that a few blocks
give several candidate lists."""

import importlib.util

import pytest
import torch

import nsa.ops.triton_support
from nsa.ops import NSAParams
from nsa.ops.decode import nsa_decode
from nsa.ops.triton_support import TRITON_AVAILABLE, TRITON_INTERPRET
from tests.ops.helpers import dtype_id

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
HALF = torch.bfloat16 if CUDA else torch.float16
pytestmark = pytest.mark.skipif(not (TRITON_AVAILABLE and (CUDA or TRITON_INTERPRET)),
                                reason="needs Triton (CUDA or its interpreter)")

SMALL = dict(cmp_block=4, cmp_stride=2, sel_block=8, num_selected=3, window=5, num_init=1,
             num_local=1)
SHAPES = {  # name: (parameters, capacity S)
    "small": (SMALL, 47),
    # A compressed token spans up to three blocks (K - 1 = 3 tokens reach into a tile).
    "token-spans-blocks": (dict(cmp_block=8, cmp_stride=2, sel_block=4, num_selected=4,
                                window=6, num_init=1, num_local=2), 47),
    # l'/d = 3: tiles of 3·TB tokens; no forced initial block.
    "odd-ratio": (dict(cmp_block=6, cmp_stride=3, sel_block=9, num_selected=2, window=7,
                       num_init=0, num_local=1), 200),
    # n·l' and w past one 64-token tile: several selected and window items.
    "long": (dict(cmp_block=4, cmp_stride=2, sel_block=16, num_selected=6, window=70,
                  num_init=2, num_local=1), 200),
}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def decode_inputs(G, S, params, dtype, window, seed=0):
    """B = 4 sequences, H = 2, Dk = 16 != Dv = 8; the window K/V by ``window``: "ring" (its own
    ring of w slots), "positional" (its own, by position) or "shared" (k, v)."""
    g = torch.Generator().manual_seed(seed)
    B, H, Dk, Dv = 4, 2, 16, 8
    C = params.compressed_length(S)

    def make(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    x = dict(q=make(B, H * G, Dk), k=make(B, S, H, Dk), v=make(B, S, H, Dv),
             k_cmp=make(B, C, H, Dk), v_cmp=make(B, C, H, Dv),
             gates=torch.rand(B, H * G, 3, generator=g).to(DEVICE, dtype), k_win=None,
             v_win=None)
    if window != "shared":
        W = params.window if window == "ring" else S
        x.update(k_win=make(B, W, H, Dk), v_win=make(B, W, H, Dv))
    pos = torch.tensor([0, 2, S // 2, S - 1], device=DEVICE)
    return x, pos


def step(x, pos, params, window, backend):
    return nsa_decode(x["q"], x["k"], x["v"], x["k_cmp"], x["v_cmp"], x["gates"], pos, params,
                      k_win=x["k_win"], v_win=x["v_win"], window_ring=window == "ring",
                      backend=backend)


def launch_shapes(monkeypatch, num_sms, block_tile=None, merge_tile=None):
    """The launch plan as on a GPU of ``num_sms`` SMs, with selection tiles of ``block_tile``
    blocks and merge steps of ``merge_tile`` partial values when given."""
    import nsa.ops.triton.decode as triton_decode

    monkeypatch.setattr(triton_decode, "num_sms", lambda device: num_sms)
    if block_tile is not None:
        monkeypatch.setattr(triton_decode, "BLOCK_TILE", block_tile)
    if merge_tile is not None:
        monkeypatch.setattr(triton_decode, "MERGE_TILE", merge_tile)


def assert_step_equal(params, S, G, dtype, window):
    x, pos = decode_inputs(G, S, params, dtype, window)
    ref = step(x, pos, params, window, "torch")
    out = step(x, pos, params, window, "triton")
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, HALF], ids=dtype_id)
@pytest.mark.parametrize("window", ["ring", "shared"])
@pytest.mark.parametrize("G", [1, 2, 8], ids=lambda G: f"G{G}")
def test_triton_step_equals_the_torch_step(G, window, dtype, monkeypatch):
    """Both K/V modes of the model, G = 1, 2, 8, with a large GPU's launch shapes."""
    launch_shapes(monkeypatch, 64, block_tile=4)
    assert_step_equal(NSAParams(**SMALL), 47, G, dtype, window)


@pytest.mark.parametrize(("shape", "num_sms", "window", "G"), [
    ("small", 1, "positional", 2),
    ("small", 64, "ring", 6),  # three slices of two heads (m7c-125m's G)
    ("token-spans-blocks", 64, "ring", 2),
    ("odd-ratio", 1, "ring", 3),  # two compressed tiles for the one split
    ("odd-ratio", 64, "shared", 2),
    ("long", 1, "ring", 2),  # items of two tiles
    ("long", 64, "positional", 2),  # two selected and two window items, two head slices
])
def test_triton_step_block_shapes(shape, num_sms, window, G, monkeypatch):
    launch_shapes(monkeypatch, num_sms, block_tile=8 if num_sms > 1 else None)
    params, S = SHAPES[shape]
    assert_step_equal(NSAParams(**params), S, G, torch.float32, window)


def test_triton_step_carries_block_shares_across_tiles(monkeypatch):
    """One compressed token dominates every query's attention; it starts in the last block of
    a tile and reaches 1.5 blocks into the next tile (l = 8, d = 2, l' = 4), so the one block
    left to choose is the next tile's first, by the share kernel 1 carries across tiles. One
    program walks both tiles (one split), so the share is carried, not recomputed."""
    import nsa.ops.triton.decode as triton_decode

    launch_shapes(monkeypatch, 64, block_tile=8)
    monkeypatch.setattr(triton_decode, "MAX_SPLITS", 1)
    params = NSAParams(cmp_block=8, cmp_stride=2, sel_block=4, num_selected=4, window=6,
                       num_init=1, num_local=2)
    S = 47
    plan = triton_decode.decode_plan(4, 2, 2, S, params.window, params, 64)
    assert (plan.tile_blocks, plan.splits) == (8, 1)
    x, _ = decode_inputs(2, S, params, torch.float32, "ring", seed=2)
    x["q"] = x["q"] * 0.1
    x["q"][..., 0] = 4.0
    x["k_cmp"] = x["k_cmp"] * 0.1
    last = plan.tile_blocks * params.sel_block // params.cmp_stride - 1  # tile 0's last token
    x["k_cmp"][:, last, :, 0] = 4.0  # covers blocks 7 (1/4), 8 (1/2) and 9 (1/4)
    pos = torch.full((4,), S - 1, device=DEVICE)  # blocks 0, 10, 11 are forced
    ref = step(x, pos, params, "ring", "torch")
    torch.testing.assert_close(step(x, pos, params, "ring", "triton"), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("merge_tile", [1, 2 * 16, 3 * 2 * 16], ids=lambda m: f"merge{m}")
def test_triton_step_merges_in_steps(merge_tile, monkeypatch):
    """The merges of the compressed splits and of the selected and window items, a few
    partials at a time (Dv = 8 pads to 16 values a row: one, two or four partials of a head
    per step, a short last step): the fold across steps equals the reference, with partials of
    rows that saw no key among them (pos = 0)."""
    launch_shapes(monkeypatch, 64, block_tile=8, merge_tile=merge_tile)
    params, S = SHAPES["long"]
    assert_step_equal(NSAParams(**params), S, 4, torch.float32, "ring")


def test_triton_step_is_deterministic(monkeypatch):
    """Fixed-order merges, no float atomics: two runs are equal bit for bit."""
    launch_shapes(monkeypatch, 64, block_tile=8)
    params, S = SHAPES["long"]
    params = NSAParams(**params)
    x, pos = decode_inputs(2, S, params, HALF, "ring", seed=1)
    first = step(x, pos, params, "ring", "triton")
    assert torch.equal(step(x, pos, params, "ring", "triton"), first)


def test_decode_plan_fills_the_gpu():
    """The module docstring's launch shapes on an H200 (132 SMs), HQ = 64, H = 4, paper
    parameters: a batch of one gets ~2 programs per SM of one 64-token tile each in the
    compressed pass and ~2 an SM in the selected pass, with merges of few partials; a batch of
    16 gets long programs whose partials are a few percent of what they read."""
    from nsa.ops.triton.decode import decode_plan

    params, sms, H, G, Dv = NSAParams(), 132, 4, 16, 128
    one = decode_plan(1, H, G, 65536, 512, params, sms)
    assert one.tile_blocks * params.sel_block // params.cmp_stride == 64  # tokens per tile
    assert one.splits * one.tile_blocks == 65536 // params.sel_block  # one tile a program
    assert one.splits == 64 and H * one.splits >= 0.95 * 2 * sms
    assert (one.head_slices, one.selected_items, one.window_items) == (4, 16, 8)
    assert H * one.head_slices * one.selected_items >= 0.95 * 2 * sms
    assert one.select_tiles == 8
    sixteen = decode_plan(16, H, G, 65536, 512, params, sms)
    tokens = sixteen.tile_blocks * params.sel_block // params.cmp_stride
    assert tokens == 64 and sixteen.splits == 6 and sixteen.head_slices == 1
    # kernel 1's splits and window items in one wave of 4 programs an SM
    assert 16 * H * (sixteen.splits + sixteen.window_items) <= 4 * sms
    read_per_split = 65536 // params.cmp_stride // sixteen.splits * 2 * 128 * 2  # K, V bf16
    assert G * Dv * 4 / read_per_split < 0.04  # a partial: G·Dv float32
    assert (sixteen.selected_items, sixteen.selected_item_tokens) == (4, 256)
    assert (sixteen.window_items, sixteen.window_item_tokens) == (2, 256)


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("1", True), ("0", False)],
                         ids=["unset", "on", "off"])
def test_decode_pdl_flag_is_read_at_import(value, expected, monkeypatch):
    """NSA_DECODE_PDL=0 turns programmatic dependent launch off. It is read when
    ``nsa.ops.triton_support`` is imported (here a fresh copy of it), not by a step; off the
    GPU there is no PDL whatever it says."""
    from nsa.ops.triton.decode import use_pdl

    if value is None:
        monkeypatch.delenv("NSA_DECODE_PDL", raising=False)
    else:
        monkeypatch.setenv("NSA_DECODE_PDL", value)
    spec = importlib.util.spec_from_file_location("fresh_triton_support",
                                                  nsa.ops.triton_support.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    assert fresh.DECODE_PDL is expected
    assert not use_pdl(torch.device("cpu"))


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(("B", "T"), [(3, 16384), (1, 65536)], ids=["B3-16k", "B1-64k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_gpu_step_at_paper_sizes(B, T, dtype):
    """On the GPU, the paper's parameters, HQ = 64, H = 4, D = 128 and the device's own launch
    plan (several candidate lists, head slices at B = 1), against the PyTorch step on the same
    values in float32: bf16 products are exact in float32, so both select the same blocks and
    only the bf16 rounding of probabilities before P·V differs. Twice: bit for bit equal."""
    params = NSAParams()
    g = torch.Generator().manual_seed(7)
    HQ, H, D = 64, 4, 128
    C = params.compressed_length(T)

    def make(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    x = dict(q=make(B, HQ, D), k=make(B, T, H, D), v=make(B, T, H, D), k_cmp=make(B, C, H, D),
             v_cmp=make(B, C, H, D), gates=torch.rand(B, HQ, 3, generator=g).to(DEVICE, dtype),
             k_win=make(B, params.window, H, D), v_win=make(B, params.window, H, D))
    pos = torch.tensor([T - 1, 9000, 700][:B], device=DEVICE)
    ref = step({n: t.float() for n, t in x.items()}, pos, params, "ring", "torch")
    out = step(x, pos, params, "ring", "triton")
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tolerance, atol=tolerance)
    assert torch.equal(step(x, pos, params, "ring", "triton"), out)
