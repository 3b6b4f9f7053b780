"""On a GPU the language model runs its norms (each with the residual add before it, in the same
pass), its MLP activation and its loss through the Triton kernels (nsa/ops/triton/rms_norm.py,
swiglu.py, cross_entropy.py), with the loss and gradients of their PyTorch forms under bf16
autocast, and less peak memory."""

from unittest import mock

import pytest
import torch

import nsa.models.transformer as transformer
from nsa.ops.triton_support import TRITON_AVAILABLE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not TRITON_AVAILABLE,
                                reason="needs a GPU and Triton")


def test_the_model_trains_the_same_through_its_kernels():
    import nsa.ops.triton.cross_entropy as ce_module
    import nsa.ops.triton.rms_norm as rms_module
    import nsa.ops.triton.swiglu as swiglu_module
    from nsa.models import LanguageModel
    from nsa.train import build_config

    config = build_config("tiny", ["attention=dense"]).model
    torch.manual_seed(0)
    model = LanguageModel(config).cuda()
    tokens = torch.randint(0, config.vocab_size, (2, 65), device="cuda")
    targets = tokens[:, 1:].clone()
    targets[0, :5] = -100  # not counted

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], targets)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return loss.detach(), grads, torch.cuda.max_memory_allocated()

    with mock.patch.object(swiglu_module, "swiglu_triton",
                           wraps=swiglu_module.swiglu_triton) as swiglu, \
            mock.patch.object(ce_module, "cross_entropy_triton",
                              wraps=ce_module.cross_entropy_triton) as loss_kernel, \
            mock.patch.object(rms_module, "rms_norm_triton",
                              wraps=rms_module.rms_norm_triton) as norm, \
            mock.patch.object(rms_module, "add_rms_norm_triton",
                              wraps=rms_module.add_rms_norm_triton) as add_norm:
        loss, grads, peak = loss_and_grads()
    assert swiglu.call_count == config.num_layers and loss_kernel.call_count == 1
    # The first block's first norm alone; every other norm adds the residual update before it.
    assert norm.call_count == 1 and add_norm.call_count == 2 * config.num_layers
    with mock.patch.object(transformer, "triton_takes", lambda x: False):  # PyTorch's forms
        ref_loss, ref_grads, ref_peak = loss_and_grads()
    torch.testing.assert_close(loss, ref_loss, rtol=2e-3, atol=2e-3)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=5e-2, atol=5e-3, msg=name)
    assert peak < ref_peak
