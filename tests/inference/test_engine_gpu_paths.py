"""The engine with the code paths it takes on a GPU, on CPU tensors: our fused Triton KDA decode kernel (short
convs, norms, gate and recurrence in one launch, tails and state updated in place), our Triton kernels for the MLA
latent write and flash-decoding over the pages, AttnRes's row kernel (the residual add inside the mix) and KDA's
fused gated norm + o_proj (k3.ops.proj_decode), all under Triton's interpreter
(``TRITON_INTERPRET=1``, set by tests/conftest.py without CUDA), with fused projections (the engine's default,
whose outputs are column slices of one matmul). Teacher-forced decode logits of a batch of sequences at mixed
context lengths equal the model's full forward over each whole sequence (fp32: relative RMS 1e-4), step by step.

On CUDA these paths are chosen by device; here they are selected by replacing the engine's dispatchers with the
CUDA branch of each (what ``tests/gpu/test_engine_parts_gpu.py`` checks on the GPU itself). The fused MoE decode
kernels stay on the grouped path here: under the interpreter they cost minutes per step; tests/ops/
test_decode_kernels.py compares them with the grouped path, and their wrapper makes every input contiguous."""

import importlib.util

import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.data.tokenizer import train_tokenizer
from k3.inference.api import GenerationRequest, SamplingParams
from k3.inference.engine import Engine, EngineConfig

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs triton (the test extra installs it)")


def _rel(a, b):
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


@pytest.fixture
def gpu_paths(monkeypatch):
    """Route the engine's decode through the CUDA branches of its dispatchers."""
    import k3.inference.mixers as mixers
    from k3.ops._mla_decode_triton import write_latents
    from k3.ops.kda.decode import kda_decode_fused
    from k3.ops.mla_decode import mla_decode_triton

    calls = {"kda": 0, "mla": 0}

    def kda_decode(q, k, v, f, b, conv_weights, A_log, dt_bias, state, conv, index, gate_kind, lower_bound, backend,
                   f_b_weight):
        calls["kda"] += 1
        return kda_decode_fused(q, k, v, f, b, conv_weights, A_log, dt_bias, state, conv, index, gate_kind,
                                lower_bound, f_b_weight=f_b_weight)

    def mla_decode_append(q_lat, q_pe, latent, cache, page_table, positions, scale):
        calls["mla"] += 1
        write_latents(latent, cache, page_table, positions)
        return mla_decode_triton(q_lat, q_pe, cache, page_table, positions, scale, length_offset=1, splits=3,
                                 block_n=16)

    monkeypatch.setattr(mixers, "kda_decode", kda_decode)
    monkeypatch.setattr(mixers, "mla_decode_append", mla_decode_append)

    # AttnRes's row kernel (with the residual add inside) and KDA's fused gated norm + o_proj, at a decode step's
    # rows only (at most 4: the reference forwards below have more, so they stay on the plain path)
    import k3.inference.fast as fast
    import k3.ops.attn_res as attn_res
    from k3.ops.proj_decode import TILE

    def few_rows(sources):
        return not torch.is_grad_enabled() and sources[0].numel() <= 4 * sources[0].shape[-1]

    def proj_applies(x, rows, max_rows, weight, width):
        return not torch.is_grad_enabled() and rows <= min(4, max_rows) and width <= TILE

    real_kda_out = fast.kda_output_decode

    def kda_out(*a):
        calls["kda_out"] += 1
        return real_kda_out(*a)

    real_rows = attn_res._rows

    def rows(*a):
        calls["attn_res"] += 1
        return real_rows(*a)

    calls.update(attn_res=0, kda_out=0)
    monkeypatch.setattr(fast, "kernel_applies", few_rows)
    monkeypatch.setattr(attn_res, "kernel_applies", few_rows)
    monkeypatch.setattr(attn_res, "_rows", rows)
    monkeypatch.setattr(fast, "proj_decode_applies", proj_applies)
    monkeypatch.setattr(fast, "kda_output_decode", kda_out)
    return calls


@pytest.mark.slow
@torch.no_grad()
def test_decode_on_the_gpu_paths_equals_the_full_forward(gpu_paths):
    tok = train_tokenizer(["def f(x):\n    return x\n", "import os\n"] * 30, 300)
    torch.manual_seed(0)
    cfg = K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size(), num_nextn_predict_layers=0)
    model = K3ForCausalLM(cfg).eval()
    eng = Engine(model, tok, EngineConfig(num_pages=64, page_tokens=32, hash_block=8, prefill_chunk=24,
                                          step_tokens=64, max_batch=4, prefix_cache=False))
    assert model.model.layers[0].self_attn.in_proj is not None  # fused projections: f and b are strided slices
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 250, (n,), generator=g).tolist() for n in (5, 21, 40)]
    for p in prompts:
        eng.submit(GenerationRequest(tuple(p), SamplingParams(max_tokens=16, ignore_eos=True)))
    while any(s.pending > 1 for s in eng.running) or eng.waiting:  # prefill every prompt (chunked, several steps)
        plan = eng.scheduler.schedule()
        eng.runner.execute(plan)
        eng.scheduler.update(plan, eng.seqs)
        for it in plan.prefill + plan.decode:
            if it.sample is not None:
                eng.seqs[it.seq_id].tokens.append(7)
    gpu_paths.update(kda=0, mla=0, attn_res=0, kda_out=0)
    for step in range(2):
        plan = eng.scheduler.schedule()
        assert len(plan.decode) == len(prompts) and not plan.prefill
        logits = eng.runner.decode_logits(plan.decode)
        for b, it in enumerate(plan.decode):
            ref = model(torch.tensor([eng.seqs[it.seq_id].tokens]))["logits"][0, -1]
            assert _rel(logits[b], ref) < 1e-4, (step, b, _rel(logits[b], ref))
        eng.scheduler.update(plan, eng.seqs)
        for it, t in zip(plan.decode, logits.argmax(-1).tolist()):
            eng.seqs[it.seq_id].tokens.append(t)
    n_kda = sum(1 for i in range(cfg.num_hidden_layers) if cfg.layer_kind(i) == "kda")
    assert gpu_paths["kda"] == 2 * n_kda and gpu_paths["mla"] == 2 * (cfg.num_hidden_layers - n_kda)
    assert gpu_paths["kda_out"] == 2 * n_kda and gpu_paths["attn_res"] >= 2 * (2 * cfg.num_hidden_layers - 1)
    eng.stop()
