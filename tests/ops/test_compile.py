"""The Triton op is a registered torch.library op: opcheck passes and torch.compile traces a
whole model with it as one graph (fullgraph=True: a graph break would raise).

On a machine without CUDA the kernels run in Triton's interpreter and the compiler is
``aot_eager`` (traces forward and backward, no code generation); with CUDA it is Inductor.
"""

import contextlib

import pytest
import torch

import nsa
from nsa.config_tree import replace_fields
from nsa.models import LanguageModel, ModelConfig

pytest.importorskip("triton")

from nsa.ops.triton.attention import attention_bwd_op, attention_fwd_op, select_op  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
COMPILER = "inductor" if CUDA else "aot_eager"
SMALL = dict(cmp_block=4, cmp_stride=2, sel_block=8, num_selected=3, window=5, num_init=1,
             num_local=2)


# Blocks of 16 tokens, at most 2n of them in T = 40: the selected branch's masked kernels.
MASKED = dict(SMALL, cmp_block=8, cmp_stride=4, sel_block=16, num_selected=3)


def op_inputs(T=19, HQ=4, H=2, Dk=16, Dv=8, seed=0, params=SMALL):
    g = torch.Generator().manual_seed(seed)
    Tc = nsa.compressed_length(T, params["cmp_block"], params["cmp_stride"])
    shapes = [(1, T, HQ, Dk), (1, T, H, Dk), (1, T, H, Dv), (1, Tc, H, Dk), (1, Tc, H, Dv),
              (1, T, HQ, 3), (1, T, H, Dk), (1, T, H, Dv)]
    tensors = [torch.randn(s, generator=g).to(DEVICE).requires_grad_() for s in shapes]
    tensors[5] = torch.rand(shapes[5], generator=g).to(DEVICE).requires_grad_()  # gates
    return tensors


@pytest.mark.parametrize("T, params, packed", [(19, SMALL, False), (40, MASKED, False),
                                               (40, MASKED, True)],
                         ids=["per-block", "masked", "masked-but-packed"])
def test_attention_ops_pass_opcheck(T, params, packed):
    """Schema, fake (meta) implementations and dispatch of the forward and backward ops are
    consistent (their autograd is an autograd.Function, whose gradients the backend tests
    compare with the reference), with the selection saved as the masked kernels' row masks
    (fixed length, blocks of 16) or as block indices (otherwise)."""
    inputs = [t.detach() for t in op_inputs(T, params=params)]
    cu_seqlens = torch.tensor([0, 7, T], dtype=torch.int32, device=DEVICE) if packed else None
    args = (*inputs, cu_seqlens, *params.values(), 0.25)
    torch.library.opcheck(attention_fwd_op, args)
    out, selection, *saved = attention_fwd_op(*args)
    masked = params is MASKED and not packed
    assert selection.dtype == (torch.int64 if masked else torch.int32)
    torch.library.opcheck(attention_bwd_op, (torch.randn_like(out), *inputs, selection, *saved,
                                             cu_seqlens, *params.values(), 0.25))


def test_select_op_passes_opcheck():
    q, _, _, k_cmp, *_ = op_inputs()
    params = {k: v for k, v in SMALL.items() if k != "window"}
    torch.library.opcheck(select_op, (q.detach(), k_cmp.detach(), None, *params.values(), 0.25))


def test_compiled_model_has_no_graph_break_and_matches_eager():
    config = replace_fields(
        ModelConfig(), vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim_k=8, head_dim_v=8, max_seq_len=40, backend="triton", **SMALL)
    torch.manual_seed(0)
    model = LanguageModel(config).to(DEVICE)
    tokens = torch.randint(0, 64, (2, 37), device=DEVICE)
    targets = torch.randint(0, 64, (2, 37), device=DEVICE)

    eager_loss = model(tokens, targets)
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))

    compiled = torch.compile(model, fullgraph=True, backend=COMPILER)
    loss = compiled(tokens, targets)
    grads = torch.autograd.grad(loss, list(model.parameters()))

    torch.testing.assert_close(loss, eager_loss, rtol=1e-4, atol=1e-5)
    for (name, _), g, e in zip(model.named_parameters(), grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-5, msg=name)


def test_compiled_model_runs_the_registered_ops():
    """Eager calls go around the dispatcher (launch.call_op); a trace must keep the registered
    forward and backward ops as nodes of its graphs (not trace into their kernels)."""
    from torch._dynamo.backends.common import aot_autograd

    targets = {"forward": set(), "backward": set()}

    def recorder(kind):
        def compile_graph(graph_module, example_inputs):
            targets[kind].update(node.target for node in graph_module.graph.nodes)
            return graph_module
        return compile_graph

    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    config = replace_fields(
        ModelConfig(), vocab_size=64, dim=32, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim_k=8, head_dim_v=8, max_seq_len=40, backend="triton", **SMALL)
    model = LanguageModel(config).to(DEVICE)
    tokens = torch.randint(0, 64, (1, 37), device=DEVICE)
    torch._dynamo.reset()
    torch.compile(model, fullgraph=True, backend=backend)(tokens, tokens).backward()
    assert torch.ops.nsa.attention_fwd.default in targets["forward"]
    assert torch.ops.nsa.attention_bwd.default in targets["backward"]
    if CUDA:  # the model's own kernels take CUDA tensors only (transformer.triton_takes)
        assert torch.ops.nsa.rms_norm.default in targets["forward"]
        assert torch.ops.nsa.rms_norm_backward.default in targets["backward"]


@pytest.mark.parametrize("kind", ["meta", "fake"])
def test_tensors_without_data_take_the_registered_ops_fake_implementation(kind):
    """Meta tensors, and fake ones under FakeTensorMode, go through the registered ops
    (launch.call_op), whose fake implementations give the shapes: no kernel runs on them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    inputs = [t.detach() for t in op_inputs()]
    mode = FakeTensorMode() if kind == "fake" else None
    if mode is None:
        inputs = [t.to("meta") for t in inputs]
    else:
        inputs = [mode.from_tensor(t) for t in inputs]
    q, k, v, k_cmp, v_cmp, gates, k_win, v_win = inputs
    with mode if mode is not None else contextlib.nullcontext():
        out = nsa.nsa_attention(q, k, v, k_cmp, v_cmp, gates, k_win=k_win, v_win=v_win,
                                backend="triton", **SMALL)
        idx = nsa.nsa_select(q, k_cmp, backend="triton",
                             **{n: x for n, x in SMALL.items() if n != "window"})
    assert out.shape == (1, 19, 4, 8) and out.device == q.device
    assert idx.shape == (1, 19, 2, SMALL["num_selected"])
