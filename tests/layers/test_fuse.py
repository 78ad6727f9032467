"""Fused projections (inference): the same outputs as the separate Linears, the same parameters and checkpoint,
and training after fusing still trains the parameters (the fused tensor follows them: it is their storage)."""

import copy

import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.inference.fast import InferenceMixer


class FusedFFN(InferenceMixer):
    """The layers' own token mixers; the FFNs through the fused projections (k3.inference.fast)."""

    def attend(self, layer, x):
        return layer.attend(x)

VARIANTS = {
    "k3": K3Config.preset("tiny"),
    "kimi-linear-like": K3Config.preset("tiny").replace(gate="softplus", use_full_rank_gate=False,
                                                        mla_use_output_gate=False, q_lora_rank=None,
                                                        routed_expert_hidden_size=None),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_fused_model_equals_the_unfused_one_and_keeps_its_parameters(name):
    torch.manual_seed(0)
    model = K3ForCausalLM(VARIANTS[name]).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 19))
    ref = copy.deepcopy(model)
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    model.fuse_projections()
    assert model.model.layers[0].self_attn.in_proj is not None
    assert {k: v for k, v in model.state_dict().items()}.keys() == keys.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in keys.items())
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(ids, mixer=FusedFFN())["logits"], ref(ids)["logits"], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_training_after_fusing_updates_what_the_fused_path_reads():
    torch.manual_seed(1)
    model = K3ForCausalLM(VARIANTS["k3"])
    ref = copy.deepcopy(model)
    model.fuse_projections()
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    for m in (model, ref):
        m.train()
        m(ids, labels=ids)["loss"].backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=n)
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            if p.grad is not None:  # an SGD step on every parameter that has a gradient
                p.add_(p.grad, alpha=-0.1)
                q.add_(q.grad, alpha=-0.1)
        model.eval(), ref.eval()
        torch.testing.assert_close(model(ids)["logits"], ref(ids)["logits"], atol=1e-5, rtol=1e-5)
