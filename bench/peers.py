"""Public NSA implementations on our benchmark's inputs (``bench/attention.py --peers DIR``).

Their sources are not part of this repository: ``DIR/mdy`` and ``DIR/fla`` hold unmodified,
trimmed work trees of the two projects (see ``bench/NOTES.md``, "Peers"). This module only
calls their public functions; it copies none of their code.

Both peers get the tensors of ``bench/attention.py``'s ``nsa_inputs``: q [B, T, HQ, D],
k, v [B, T, H, D] and gates [B, T, HQ, 3], with the paper parameters (l=32, d=16, l'=64,
n=16, w=512, 1 initial + 2 local forced blocks), scale D ** -0.5. Neither takes compressed
K/V from outside: both compress k and v inside their op by mean pooling (no parameters), so
``k_cmp``/``v_cmp`` are not used and get no gradient. What one ``run(x)`` does and what it
differs in from ours (``nsa.nsa_attention``):

mdy (mdy666/Scalable-Flash-Native-Sparse-Attention, package ``flash_nsa``): its Megatron-level
    op ``NSACore(config)(q, k, v, combine_weight, cu_seqlens)``, one ``torch.autograd.Function``
    (``flash_nsa_varlen_func``) with a hand-written backward: mean-pooled compression with
    l=32, d=16 (as the paper's sizes; ours takes k_cmp/v_cmp as inputs), compressed attention,
    top-n selection (forced block 0 and the two most recent blocks, like ours; block scores
    summed over a group's heads, cubed and stored in float16 before the arg-max, so near-ties
    can resolve differently from ours), selected attention, sliding window and a fused
    gate: ``sigmoid(w) * o`` for each branch (gates are logits; ours takes activated gates).
    Inputs are packed varlen ([T, heads, D], ``cu_seqlens`` = [0, T]: B = 1 only); its
    forward compares ``cu_seqlens`` with the cached one on the host (a device sync per
    call, part of its API's cost). Any G (G < 16 pads the head tile to 16); head dims must
    be powers of two; bfloat16 or float16 only. Its window branch calls
    flash-attn, which is not installed here: ``swa_fwd``/``swa_bwd`` of the module are
    replaced by fla's Triton ``parallel_attn_fwd``/``parallel_attn_bwd`` with the same
    window (flash-attn's ``window_size=(w, -1)``, i.e. w + 1 keys), returning what flash-attn
    returns (output, log-sum-exp; dq, dk, dv in the input dtype). The rest of their
    forward and backward (including the order of gradient accumulation) is theirs.
fla (fla-org/flash-linear-attention, ``fla.ops.nsa.parallel_nsa``): compressed and selected
    branches with gates ``g_cmp * o_cmp + g_slc * o_slc`` (gates used as given, like ours);
    its window branch calls flash-attn, so it is called with ``window_size=0`` and the window
    is added as fla itself does it, ``o + g_win * attn_w`` with fla's Triton
    ``parallel_attn(q, k, v, window_size=w)`` (w keys, like ours) in place of flash-attn.
    Differences: it compresses with non-overlapping 64-token means (l = d = l' = 64; the
    paper's l=32, d=16 are not supported), so its compressed branch sees T/64 tokens where
    ours and mdy's see T/16; forced blocks are block 0 and the two most recent blocks, order
    among equal scores unspecified (bitonic sort); an integer n is rounded up to a power of
    two (n = 16: exact; other n are refused). It needs G = HQ/H a power of two >= 16 (the
    group is a matrix tile): other G are refused.

``build(name, x, params)`` returns ``(run, inputs)``: ``run(x)`` is one forward, ``inputs``
the tensors its backward differentiates; a shape a peer cannot take raises :class:`Refused`.

    python bench/peers.py --peers DIR        # CPU self-check: import, print signatures
    TRITON_INTERPRET=1 python bench/peers.py --peers DIR --run   # and run a tiny shape
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import os
import sys
import types

import torch

PEERS = ("mdy", "fla")
NUM_INIT, NUM_LOCAL = 1, 2  # forced blocks of our defaults (nsa_attention's num_init/num_local)
_ROOT: list[str] = []  # the --peers directory, once set


class Refused(Exception):
    """A peer cannot run this shape or configuration (the message says why)."""


def set_root(root: str) -> None:
    """Where the peers' work trees are (``root/mdy``, ``root/fla``); nothing is imported yet."""
    root = os.path.abspath(root)
    for name in PEERS:
        if not os.path.isdir(os.path.join(root, name)):
            raise FileNotFoundError(f"--peers {root}: no {name}/ in it")
    _ROOT[:] = [root]


def _path(name: str) -> str:
    if not _ROOT:
        raise RuntimeError("peer implementations need --peers DIR")
    path = os.path.join(_ROOT[0], name)
    if path not in sys.path:
        sys.path.insert(0, path)
    return path


def _stub_package(name: str, path: str, **attrs) -> None:
    """Register package ``name`` at ``path`` without running its ``__init__``.

    Both peers' top-level ``__init__`` import far more than the NSA ops (fla: every layer and
    model, hence transformers; flash_nsa: inference and flash-attn wrappers, pandas).
    Submodules still import normally, with their own ``__init__``.
    """
    if name in sys.modules:
        return
    module = types.ModuleType(name)
    module.__path__ = [path]
    module.__dict__.update(attrs)
    sys.modules[name] = module


def _version_of(init_file: str) -> str:
    with open(init_file) as f:
        for line in f:
            if line.startswith("__version__"):
                return line.split("=", 1)[1].strip().strip("\"'")
    return "0"


def load_fla() -> types.SimpleNamespace:
    """fla's NSA op and its Triton softmax attention (``fla.ops.{nsa,attn}.parallel``)."""
    root = os.path.join(_path("fla"), "fla")
    # fla dispatches parallel_attn to TileLang kernels where tilelang is installed (by default
    # on Hopper): keep its Triton kernels, the ones named here.
    os.environ.setdefault("FLA_TILELANG", "0")
    _stub_package("fla", root, __version__=_version_of(os.path.join(root, "__init__.py")))
    _stub_package("fla.ops", os.path.join(root, "ops"))
    nsa = importlib.import_module("fla.ops.nsa.parallel")
    attn = importlib.import_module("fla.ops.attn.parallel")
    return types.SimpleNamespace(parallel_nsa=nsa.parallel_nsa, parallel_attn=attn.parallel_attn,
                                 parallel_attn_fwd=attn.parallel_attn_fwd,
                                 parallel_attn_bwd=attn.parallel_attn_bwd)


def _ensure_pkg_resources() -> None:
    """flash_nsa's utils import ``pkg_resources`` (setuptools) for one version comparison."""
    try:
        import pkg_resources  # noqa: F401
    except ImportError:
        from packaging.version import parse

        sys.modules["pkg_resources"] = types.SimpleNamespace(parse_version=parse)


def load_mdy() -> types.SimpleNamespace:
    """flash_nsa's Megatron-level op with its window branch on fla's Triton attention."""
    root = os.path.join(_path("mdy"), "flash_nsa")
    _ensure_pkg_resources()
    _stub_package("flash_nsa", root)
    _stub_package("flash_nsa.modules", os.path.join(root, "modules"))
    # flash_nsa.utils reads the device's compute capability at import. Without CUDA (the CPU
    # self-check) say Ampere, so that its non-TMA kernels (which the interpreter can run) are used.
    capability = torch.cuda.get_device_capability
    if not torch.cuda.is_available():
        torch.cuda.get_device_capability = lambda *args, **kwargs: (8, 0)
    try:
        module = importlib.import_module("flash_nsa.modules.megatron_level_nsa")
        config = importlib.import_module("flash_nsa.config")
    finally:
        torch.cuda.get_device_capability = capability
    if not getattr(module, "_nsa_bench_window", False):
        module.swa_fwd, module.swa_bwd = _mdy_window(module.NSAHelper, load_fla())
        module._nsa_bench_window = True
    return types.SimpleNamespace(module=module, NSAConfig=config.NSAConfig,
                                 NSACore=module.NSACore, NSAHelper=module.NSAHelper)


def _mdy_window(helper, fla):
    """``swa_fwd``/``swa_bwd``: flash_nsa's signatures, flash-attn's results, fla's Triton kernels.

    flash_nsa calls flash-attn with ``window_size=(w, -1)`` and ``causal=True``: query t sees
    keys t-w .. t, which is fla's ``window_size=w + 1``. Tensors are packed [T, heads, D]
    (one sequence: the benchmark's B = 1 inputs); fla takes [1, T, heads, D].
    """

    def window(helper):
        return helper.window_size + 1

    def swa_fwd(q, k, v, sm_scale=None, out=None, helper=helper):
        o, lse = fla.parallel_attn_fwd(q=q[None], k=k[None], v=v[None], g_cumsum=None,
                                       sink_bias=None, scale=sm_scale, window_size=window(helper))
        if out is not None:
            out.copy_(o[0])
            return out, lse
        return o[0], lse

    def swa_bwd(q, k, v, out, lse, dout, sm_scale=None, helper=helper):
        dq, dk, dv, _, _ = fla.parallel_attn_bwd(q=q[None], k=k[None], v=v[None], o=out[None],
                                                 g_cumsum=None, lse=lse, do=dout[None],
                                                 scale=sm_scale, window_size=window(helper))
        # flash-attn returns gradients in the input dtype; flash_nsa casts dk, dv to float
        # itself and frees the originals, so these must be new tensors, not fla's buffers.
        return dq[0].to(q.dtype), dk[0].to(k.dtype), dv[0].to(v.dtype)

    return swa_fwd, swa_bwd


def _shape(x):
    B, T, HQ, D = x["q"].shape
    H, Dv = x["k"].shape[2], x["v"].shape[-1]
    return B, T, HQ, H, D, Dv


def build_mdy(x, params):
    B, T, HQ, H, D, Dv = _shape(x)
    if B != 1:
        raise Refused("B = 1 only (window branch on fla's attention)")
    if D != Dv or D & (D - 1):
        raise Refused(f"head dims must be equal powers of two (D={D}, Dv={Dv})")
    if HQ % H:
        raise Refused(f"HQ={HQ} not a multiple of H={H}")
    if x["q"].dtype not in (torch.bfloat16, torch.float16):
        # Its backward casts the window's dk, dv to float32 and frees the originals.
        raise Refused(f"{x['q'].dtype}: bfloat16 or float16 only")
    if T * HQ * D >= 2**31:
        raise Refused("int32 offsets: T * HQ * D >= 2^31 (its README: 256k on one GPU)")
    mdy = load_mdy()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints advice for G < 16
            config = mdy.NSAConfig(head_dim=D, num_heads=HQ, num_kv_heads=H,
                                   kernel_size=params["cmp_block"], stride=params["cmp_stride"],
                                   block_size=params["sel_block"], top_n=params["num_selected"],
                                   window_size=params["window"], num_init_blocks=NUM_INIT,
                                   num_local_blocks=NUM_LOCAL, cmp_k_method="mean",
                                   cmp_v_method="mean")
            core = mdy.NSACore(config)
    except AssertionError as error:
        raise Refused(f"config rejected: {error}") from error
    cu_seqlens = torch.tensor([0, T], dtype=torch.int32, device=x["q"].device)

    def run(x):
        o = core(x["q"][0], x["k"][0], x["v"][0], x["gates"][0], cu_seqlens)
        return o.unsqueeze(0)

    return run, [x["q"], x["k"], x["v"], x["gates"]]


def build_fla(x, params):
    B, T, HQ, H, D, Dv = _shape(x)
    G = HQ // H
    if HQ % H or G < 16 or G & (G - 1):
        raise Refused(f"G = HQ/H = {HQ / H:g}: parallel_nsa needs a power of two >= 16")
    if max(D, Dv) > 256:
        raise Refused(f"head dim {max(D, Dv)} > 256")
    n = params["num_selected"]
    if n & (n - 1):
        raise Refused(f"n = {n}: parallel_nsa selects the next power of two of blocks")
    fla = load_fla()
    block, window = params["sel_block"], params["window"]

    def run(x):
        q, k, v, gates = x["q"], x["k"], x["v"], x["gates"]
        o = fla.parallel_nsa(q, k, v, g_cmp=gates[..., 0], g_slc=gates[..., 1], g_swa=None,
                             block_counts=n, block_size=block, window_size=0)
        o_win = fla.parallel_attn(q, k, v, window_size=window)
        return torch.addcmul(o, o_win, gates[..., 2].unsqueeze(-1))

    return run, [x["q"], x["k"], x["v"], x["gates"]]


BUILDERS = {"mdy": build_mdy, "fla": build_fla}


def build(name, x, params):
    """``(run, inputs)`` of peer ``name`` on the benchmark inputs ``x``; raises :class:`Refused`."""
    return BUILDERS[name](x, params)


# ---------------------------------------------------------------- CPU self-check

# The peer functions the adapters call, with the keyword arguments they pass.
CALLS = {
    "mdy NSAConfig": (lambda: load_mdy().NSAConfig,
                      ["head_dim", "num_heads", "num_kv_heads", "kernel_size", "stride",
                       "block_size", "top_n", "window_size", "num_init_blocks",
                       "num_local_blocks", "cmp_k_method", "cmp_v_method"]),
    "mdy NSACore": (lambda: load_mdy().NSACore, ["config"]),
    "mdy NSACore.forward": (lambda: load_mdy().NSACore.forward,
                            ["q", "k", "v", "combine_weight", "cu_seqlens"]),
    "mdy swa_fwd (replaced)": (lambda: importlib.import_module(
        "flash_nsa.ops.sliding_window_attention").swa_fwd, ["q", "k", "v", "sm_scale", "helper"]),
    "mdy swa_bwd (replaced)": (lambda: importlib.import_module(
        "flash_nsa.ops.sliding_window_attention").swa_bwd,
        ["q", "k", "v", "out", "lse", "dout", "sm_scale", "helper"]),
    "fla parallel_nsa": (lambda: load_fla().parallel_nsa,
                         ["q", "k", "v", "g_cmp", "g_slc", "g_swa", "block_counts",
                          "block_size", "window_size"]),
    "fla parallel_attn": (lambda: load_fla().parallel_attn, ["q", "k", "v", "window_size"]),
    "fla parallel_attn_fwd": (lambda: load_fla().parallel_attn_fwd,
                              ["q", "k", "v", "g_cumsum", "sink_bias", "scale", "window_size"]),
    "fla parallel_attn_bwd": (lambda: load_fla().parallel_attn_bwd,
                              ["q", "k", "v", "o", "g_cumsum", "lse", "do", "scale",
                               "window_size"]),
}


def self_check() -> None:
    """Import both peers and check that every function we call takes the arguments we pass."""
    load_mdy()  # before the look-ups: flash_nsa.ops.* need its package stubs
    for what, (get, names) in CALLS.items():
        fn = get()
        signature = inspect.signature(fn)
        missing = [n for n in names if n not in signature.parameters]
        print(f"{what}{signature}")
        if missing:
            raise SystemExit(f"{what}: no parameter(s) {missing}")
    mdy = load_mdy()
    assert mdy.module.swa_fwd.__module__ == __name__, "window branch not replaced"
    function = mdy.module.NSAFunction
    for method, name in ((function.forward, "swa_fwd"), (function.backward, "swa_bwd")):
        # NSAFunction must look the window functions up in its module's globals.
        assert name in method.__code__.co_names, f"NSAFunction.{method.__name__} calls no {name}"
    print("mdy: is_triton34", mdy.NSAHelper.is_triton34(), "hopper", mdy.NSAHelper.is_hopper)


def _one_config_each() -> None:
    """Keep the first config of every autotuned kernel the peers have loaded (CPU check only)."""
    from triton.runtime.autotuner import Autotuner

    for name, module in list(sys.modules.items()):
        if name.startswith(("fla.", "flash_nsa.")):
            for value in vars(module).values():
                while hasattr(value, "fn"):  # through @triton.heuristics to @triton.autotune
                    if isinstance(value, Autotuner):
                        value.configs = value.configs[:1]
                    value = value.fn


def _mean_pool(x, size, stride):
    """[B, T, H, D] -> [B, (T - size) // stride + 1, H, D]: means of windows of ``size`` tokens."""
    return x.unfold(1, size, stride).mean(-1)


def _reference(name, x, params):
    """Ours (PyTorch backend) set up to compute what peer ``name`` computes, where it can.

    The same function but for the order of near-equal block scores (exactly the same while
    every block is selected, T <= n * l'): checks layouts, head grouping, scale, compression,
    selection rules, window and gating.
    """
    import nsa

    q, k, v, gates = x["q"], x["k"], x["v"], x["gates"]
    if name == "mdy":  # mean pooling with l, d; gates are logits; flash-attn's w + 1 keys
        l, d = params["cmp_block"], params["cmp_stride"]
        cfg = dict(params, window=params["window"] + 1)
        gates = torch.sigmoid(gates.float()).to(gates.dtype)
    else:  # fla: means of l' tokens, l = d = l'
        l = d = params["sel_block"]
        cfg = dict(params, cmp_block=l, cmp_stride=d)
    return nsa.nsa_attention(q, k, v, _mean_pool(k, l, d), _mean_pool(v, l, d), gates,
                             num_init=NUM_INIT, num_local=NUM_LOCAL, backend="torch", **cfg)


def run_tiny(T=256, HQ=16, H=1, D=64, num_selected=None, window=None,
             dtype=torch.float16) -> None:
    """Forward + backward of each peer at a tiny shape against ours computing the same function.

    On the CPU this needs ``TRITON_INTERPRET=1`` (float16: the interpreter has no bfloat16
    atomics); it then runs mdy's non-TMA (Ampere) kernels and one config of each autotuned
    fla kernel.
    """
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from attention import PAPER, nsa_inputs

    params = dict(PAPER, num_selected=num_selected or PAPER["num_selected"],
                  window=window or PAPER["window"])
    torch.manual_seed(0)
    x = nsa_inputs(T, HQ, H, D, dtype, "cuda" if torch.cuda.is_available() else "cpu")
    with torch.no_grad():
        x["gates"].uniform_(0.2, 0.8)
    if not torch.cuda.is_available():
        load_mdy().NSAHelper.use_tma = False  # the interpreter has no TMA allocator
        _one_config_each()  # the interpreter cannot benchmark autotune configs
    exact = T <= params["num_selected"] * params["sel_block"]
    print(f"T={T}, HQ={HQ}, H={H}, D={D}, {dtype}, {params}")
    for name in PEERS:
        run, inputs = build(name, x, params)
        out = run(x)
        grad = torch.randn_like(out)
        grads = torch.autograd.grad(out, inputs, grad)
        ref = _reference(name, x, params)
        ref_grads = torch.autograd.grad(ref, inputs, grad)
        print(f"{name}: out {tuple(out.shape)} {out.dtype}, finite "
              f"{all(bool(t.isfinite().all()) for t in (out, *grads))}; relative difference "
              f"to ours{' (same function)' if exact else ' (selection may differ)'}: "
              + ", ".join(f"{what} {_rel(a, b):.1e}" for what, a, b in
                          zip(("out", "dq", "dk", "dv", "dgates"), (out, *grads),
                              (ref, *ref_grads), strict=True)))


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", required=True, help="directory with mdy/ and fla/")
    parser.add_argument("--run", action="store_true",
                        help="also run each peer at a tiny shape (on CPU: TRITON_INTERPRET=1)")
    parser.add_argument("--seq", type=int, default=256, help="T of --run")
    parser.add_argument("--num-selected", type=int, default=None, help="n of --run")
    parser.add_argument("--window", type=int, default=None, help="w of --run")
    args = parser.parse_args(argv)
    set_root(args.peers)
    self_check()
    if args.run:
        run_tiny(T=args.seq, num_selected=args.num_selected, window=args.window)


if __name__ == "__main__":
    main()
