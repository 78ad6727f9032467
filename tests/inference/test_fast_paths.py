"""Which kernels each phase dispatches to (the GPU's choice, checked on the CPU): inference's fast paths
(k3.inference.fast) run through the mixer hook and nowhere else, under the conditions the layers used to test
themselves. The device checks of the predicates are taken out (each stand-in below is the op's own predicate without
``x.is_cuda`` / ``triton_available()``) and the kernels are replaced by recorders returning the general path's
shapes, so prefill and decode steps at batch 1 and 32 and a training step report their kernels, compared with what
main reported before the move (``BEFORE``):

- decode, batch 1: the router kernel, the expert kernels and the fused MoE output (rows <= MOE_ROWS) in every MoE
  layer, KDA's fused output (rows <= KDA_ROWS) in every KDA layer, the AttnRes add inside the mix;
- decode, batch 32: the router and expert kernels (32 x k rows <= DECODE_ROWS), neither fused output projection;
- a training forward and backward: none of them (the layers' own forward is the only path)."""

import pytest
import torch

import k3.inference.fast as fast
from k3 import K3Config, K3ForCausalLM
from k3.data.tokenizer import train_tokenizer
from k3.inference.api import GenerationRequest, SamplingParams
from k3.inference.engine import Engine, EngineConfig
from k3.ops.attn_res import _fits, attn_res_mix_norm_reference
from k3.ops.moe_decode import DECODE_ROWS
from k3.ops.proj_decode import KDA_ROWS, MOE_ROWS, TILE
from k3.ops.routing import router_scores, select_experts


def _recording(monkeypatch) -> dict:
    calls = {"router": 0, "experts": 0, "moe_out": 0, "kda_out": 0, "add_mix": 0}

    def no_grad():
        return not torch.is_grad_enabled()

    # the ops' predicates (k3.ops.proj_decode, moe_decode, router_decode, attn_res) as on a CUDA device with Triton
    monkeypatch.setattr(fast, "proj_decode_applies", lambda x, rows, max_rows, weight, width: (
        no_grad() and rows <= max_rows and width <= TILE and weight.is_contiguous()))
    monkeypatch.setattr(fast, "decode_applies", lambda z, idx: no_grad() and idx.numel() <= DECODE_ROWS)
    monkeypatch.setattr(fast, "router_decode_applies", lambda x, k, score_func: (
        no_grad() and score_func == "sigmoid" and x.shape[0] * k <= DECODE_ROWS))
    monkeypatch.setattr(fast, "kernel_applies", _fits)

    def router(x, weight, bias, k, renorm, scaling):
        calls["router"] += 1
        scores = router_scores(x.float() @ weight.float().T, "sigmoid")
        return (*select_experts(scores, bias, k, renorm, scaling), scores)

    def experts(z, weights, idx, *_):
        calls["experts"] += 1
        return torch.zeros(*idx.shape, z.shape[-1])

    def moe_out(rows, fused, gate_off, up_off, shared, norm_w, eps, weight, act, b1, b2):
        calls["moe_out"] += 1
        return torch.zeros(rows.shape[0], weight.shape[0])  # [N, D]

    def kda_out(o, gate, norm_w, eps, w):
        calls["kda_out"] += 1
        return torch.zeros(o.shape[0], w.shape[0])

    def add_mix(sources, delta, query, key_norm, eps, norm_w, norm_eps):
        calls["add_mix"] += 1
        last = sources[-1] + delta
        return attn_res_mix_norm_reference(sources[:-1] + [last], query, key_norm, eps, norm_w, norm_eps), last

    for name, fn in (("router_decode", router), ("expert_decode", experts), ("moe_output_decode", moe_out),
                     ("kda_output_decode", kda_out), ("attn_res_add_mix_norm", add_mix)):
        monkeypatch.setattr(fast, name, fn)
    return calls


def _step_calls(batch: int, monkeypatch) -> tuple[dict, dict, K3Config]:
    """The kernels of a prefill step of ``batch`` 3-token prompts, then of their first decode step."""
    tok = train_tokenizer(["def f(x):\n    return x\n", "import os\n"] * 30, 300)
    torch.manual_seed(0)
    cfg = K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size(), num_nextn_predict_layers=0)
    eng = Engine(K3ForCausalLM(cfg).eval(), tok, EngineConfig(num_pages=8 * batch + 16, page_tokens=32, hash_block=8,
                                                            prefill_chunk=16, step_tokens=256, max_batch=batch,
                                                            prefix_cache=False))
    for i in range(batch):
        eng.submit(GenerationRequest((5 + i, 6, 7), SamplingParams(max_tokens=8, ignore_eos=True)))
    calls = _recording(monkeypatch)
    plan = eng.scheduler.schedule()  # the prompts' prefill, packed in one row
    assert len(plan.prefill) == batch and not plan.decode
    eng.runner.execute(plan)
    prefill = dict(calls)
    eng.scheduler.update(plan, eng.seqs)
    for it in plan.prefill:
        eng.seqs[it.seq_id].tokens.append(9)
    for k in calls:
        calls[k] = 0
    plan = eng.scheduler.schedule()
    assert len(plan.decode) == batch and not plan.prefill
    eng.runner.execute(plan)
    eng.stop()
    return prefill, dict(calls), cfg


# main at 705ecee, before the fast paths moved out of the layers, with the same stand-ins: the tiny model (5 MoE
# layers, 4 KDA layers, 9 AttnRes reads after a write with blocks to mix with) gave exactly these
BEFORE = {
    1: ({"router": 5, "experts": 5, "moe_out": 0, "kda_out": 4, "add_mix": 9},  # prefill: 3 rows
        {"router": 5, "experts": 5, "moe_out": 5, "kda_out": 4, "add_mix": 9}),  # decode: 1 row
    32: ({"router": 5, "experts": 5, "moe_out": 0, "kda_out": 0, "add_mix": 9},  # prefill: 96 rows
         {"router": 5, "experts": 5, "moe_out": 0, "kda_out": 0, "add_mix": 9}),  # decode: 32 rows
}


@pytest.mark.parametrize("batch", [1, 32], ids=["B1", "B32"])
def test_prefill_and_decode_take_the_kernels_they_took_inside_the_layers(batch, monkeypatch):
    prefill, decode, cfg = _step_calls(batch, monkeypatch)
    assert (prefill, decode) == BEFORE[batch]
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    kda = sum(cfg.layer_kind(i) == "kda" for i in range(cfg.num_hidden_layers))
    assert decode["router"] == decode["experts"] == moe  # batch x k <= DECODE_ROWS
    assert decode["moe_out"] == (moe if batch <= MOE_ROWS else 0) and decode["kda_out"] == (kda if batch <= KDA_ROWS
                                                                                             else 0)


def test_training_takes_none_of_them(monkeypatch):
    calls = _recording(monkeypatch)
    torch.manual_seed(0)
    cfg = K3Config.preset("tiny")
    model = K3ForCausalLM(cfg).train()
    model.fuse_projections()  # even fused: training never reads the fused tensors
    ids = torch.randint(0, cfg.vocab_size, (1, 1))  # one token: the fewest rows
    model(ids, labels=ids, record=("max_logit", "routing"))["loss"].backward()
    with torch.no_grad():  # nor does a plain forward without a mixer (before: it took them, as inference did)
        model(torch.randint(0, cfg.vocab_size, (1, 4)))
    assert not any(calls.values()), calls
