"""Regional torch.compile (k3.train.compile, `k3 train --compile`) against eager on CPU: the same loss and gradients.

Inductor on CPU generates C++: the test skips, saying so, where no C compiler is installed. A two-layer model
(KDA with the dense FFN, then MLA with the LatentMoE) with AttnRes blocks of one layer keeps the number of graphs
(and the compile time) small while covering every compiled region kind.
"""

import shutil

import pytest
import torch

from k3.config import K3Config, hybrid_layers
from k3.ops.regions import set_region_compiler
from k3.model.transformer import K3ForCausalLM
from k3.train.compile import compile_model, compiled_regions
from tests.conftest import assert_close

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="torch.compile's inductor needs a C compiler on CPU (apt-get install gcc)")


def two_layer_model():
    mla, kda = hybrid_layers(2)
    cfg = K3Config.preset("tiny").replace(vocab_size=128, num_hidden_layers=2, full_attn_layers=mla, kda_layers=kda,
                                          attn_res_block_size=1, num_nextn_predict_layers=0)
    torch.manual_seed(0)
    return K3ForCausalLM(cfg).train()


def loss_and_grads(model, ids, cu):
    model.zero_grad(set_to_none=True)
    loss = model(ids, cu_seqlens=cu, labels=ids, return_logits=False)["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
def test_compiled_regions_give_the_eager_loss_and_gradients():
    model = two_layer_model()
    names = list(model.state_dict())
    ids, cu = torch.randint(0, 128, (1, 48)), torch.tensor([0, 17, 18, 48])
    ref_loss, ref_grads = loss_and_grads(model, ids, cu)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    previous = set_region_compiler(None)
    try:
        compile_model(model)
        kinds = sorted(set(type(m).__name__ for m in compiled_regions(model)))
        assert kinds == ["GatedMLP", "LatentMoE", "RMSNorm", "_HeadNorm"]
        norms = {n for n, m in model.named_modules() if m in compiled_regions(model) and type(m).__name__ == "RMSNorm"}
        assert {"model.norm", "model.layers.1.self_attn.kv_a_layernorm"} <= norms  # the final norm, MLA's latent
        assert not any(".block_sparse_moe." in n for n in norms)  # inside a compiled FFN: compiled with it
        compiler, seen = set_region_compiler(None), set()
        set_region_compiler(lambda name, fn: (seen.add(name), compiler(name, fn))[1])
        for _ in range(2):  # the compiling call, then the compiled graphs themselves
            loss, grads = loss_and_grads(model, ids, cu)
            # inductor may reorder fp32 sums: float rounding (measured 2e-7 absolute on the gradients)
            assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
            assert set(grads) == set(ref_grads)
            for name, g in ref_grads.items():
                assert_close(name, g, grads[name], 1e-5)
        assert seen == {"attn_res", "kda_activations", "moe_experts", "mla_output", "lm_loss"}  # every region
    finally:
        set_region_compiler(previous)
        torch.set_num_threads(threads)
    assert list(model.state_dict()) == names  # compiled in place: the official names are unchanged


def test_attn_res_region_runs_eagerly_where_it_is_one_kernel(monkeypatch):
    """The "attn_res" region's compiled form is bypassed where the mix is a Triton kernel (compiling it there would
    add only guards and a graph break), and used elsewhere."""
    import k3.ops.attn_res as ops
    from k3.train.compile import _unless_kernel

    ran = []
    eager = lambda *a: ran.append("eager")  # noqa: E731
    compiled = lambda *a: ran.append("compiled")  # noqa: E731
    run = _unless_kernel(eager, compiled)
    x = torch.zeros(2, 4)
    for kernel in (True, False):
        monkeypatch.setattr(ops, "uses_kernel", lambda sources, k=kernel: k)
        run(1e-5, torch.zeros(1, 4), torch.ones(4), None, x, x)
    assert ran == ["eager", "compiled"]
