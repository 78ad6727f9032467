"""The engine's parts on a GPU, each against the model's own forward over the whole sequence, with fla-core's
kernels and with the reference kernels on the same GPU, so that a disagreement names its part: the packed prefill
of several prompts, then eager decode steps.

In float32 with IEEE matmuls (no TF32), relative RMS of the logits within 1e-3 (5e-3 with fla's kernels, whose
dot products are TF32: BOUND). Not in bf16: a randomly
initialised MoE routes on near-ties (the 4th and 5th expert scores differ by ~0.01), so bf16 rounding alone picks
other experts for 7% of the tokens of the first MoE layer and ~40% by the fourth, and two bf16 computations of the
same forward (full vs packed) differ by 0.3-0.8 relative RMS: the test could not tell a bug from rounding. Float32
has near-ties too, rarely (routing_ties.py): a sequence whose full forward routes a token on one is held to the
looser bound, and most sequences must be tie-free."""

import os

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # Triton's fp32 tl.dot as IEEE fp32, not TF32

import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.data.tokenizer import train_tokenizer
from k3.inference.api import GenerationRequest, SamplingParams
from k3.inference.engine import Engine, EngineConfig

from .routing_ties import TIE_BOUND, last_logits

# relative RMS of the logits off a near-tie. fla's Triton KDA kernels take their fp32 dot products in TF32 whatever
# torch's matmul flags say (`tl.dot` without `input_precision`), and the engine runs other fla kernels than the full
# forward (the fused recurrent step against the chunked form), so their bound is TF32's: the H200 measured up to
# 2.0e-3 on a 600-token prompt with no near-tie (the torch backend: <= 1.2e-5)
BOUND = {"torch": 1e-3, "fla": 5e-3}

pytestmark = pytest.mark.gpu
LENGTHS = (3, 70, 600, 1500, 2100)


def _rel(a, b):
    return float((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt())


@pytest.fixture
def ieee_matmuls():
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.mark.usefixtures("ieee_matmuls")
@pytest.mark.parametrize("backend", ["torch", "fla"])  # torch first: fla autotunes afresh in fp32
@torch.no_grad()
def test_prefill_then_eager_decode_match_the_full_forward(backend):
    tok = train_tokenizer(["def f(x):\n    return x\n", "import os\n"] * 30, 300)
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("small").replace(vocab_size=4096, num_nextn_predict_layers=0))
    model = model.to("cuda", torch.float32).eval()  # TF32 off: the ieee_matmuls fixture
    model.set_kda_backend(backend)
    eng = Engine(model, tok, EngineConfig(num_pages=256, page_tokens=256, hash_block=256, prefill_chunk=4096,
                                          step_tokens=8192, max_batch=8, prefix_cache=False, cuda_graphs=False))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in LENGTHS]
    for p in prompts:
        eng.submit(GenerationRequest(tuple(p), SamplingParams(max_tokens=16, ignore_eos=True)))
    plan = eng.scheduler.schedule()
    assert len(plan.prefill) == len(prompts) and all(it.sample is not None for it in plan.prefill)
    logits = eng.runner.prefill_logits(plan.prefill)  # every prompt in one packed forward
    eng.scheduler.update(plan, eng.seqs)
    errs, ties = [], []
    for i, p in enumerate(prompts):
        ref, tie = last_logits(model, p)
        errs.append(_rel(logits[i], ref))
        ties.append(tie)
    print(f"{backend} prefill: " + ", ".join(f"{n}: {e:.1e}{' (near-tie)' if t else ''}"
                                             for n, e, t in zip(LENGTHS, errs, ties)), flush=True)
    assert sum(ties) <= 2, ties  # the tight bound holds for most prompts
    for it in plan.prefill:
        eng.seqs[it.seq_id].tokens.append(7)
    for step in range(4):
        plan = eng.scheduler.schedule()
        lg = eng.runner.decode_logits(plan.decode)
        eng.scheduler.update(plan, eng.seqs)
        row, tie = [], []
        for b, it in enumerate(plan.decode):
            seq = eng.seqs[it.seq_id]
            ref, t = last_logits(model, seq.tokens)
            row.append(_rel(lg[b], ref))
            tie.append(t)
            seq.tokens.append(int(lg[b].argmax()))
        print(f"{backend} decode step {step}: " + ", ".join(f"{e:.1e}{' (near-tie)' if t else ''}"
                                                            for e, t in zip(row, tie)), flush=True)
        errs += row
        ties += tie
    eng.stop()
    for e, t in zip(errs, ties):
        assert e < (TIE_BOUND if t else BOUND[backend]), (errs, ties)


@pytest.mark.parametrize("compiled", [False, True])
@torch.no_grad()
def test_bf16_absorbed_mla_weights_equal_the_widened_fp32_products(compiled):
    """A bf16 GatedMLA's absorb / unabsorb on CUDA (one bmm with fp32 accumulation and output, W read as stored)
    against the fp32 einsums of the widened operands: the same products (bf16 x bf16 is exact in fp32), summed in
    another order. unabsorb first rounds o_lat to bf16 (as the naive path's bf16 attention output is): against
    the rounded input it is exact up to summation order, against the unrounded within bf16's rounding. Compiled as
    the decode graphs compile it, too."""
    from k3.layers.sequence.mla import GatedMLA

    torch.manual_seed(0)
    cfg = K3Config.preset("small")
    layer = GatedMLA(cfg).cuda().to(torch.bfloat16).eval()
    H, R = cfg.num_attention_heads, cfg.kv_lora_rank
    w_uk, w_uv = (w.float() for w in layer.absorbed_weights())
    absorb = torch.compile(layer.absorb, fullgraph=True) if compiled else layer.absorb
    unabsorb = torch.compile(layer.unabsorb, fullgraph=True) if compiled else layer.unabsorb
    for B, T in ((1, 1), (8, 1), (2, 5)):
        q = torch.randn(B, T, H, cfg.qk_nope_head_dim, device="cuda", dtype=torch.bfloat16)
        q_lat = absorb(q)
        assert q_lat.dtype == torch.float32 and q_lat.shape == (B, T, H, R)
        assert _rel(q_lat, torch.einsum("bthn,hnr->bthr", q.float(), w_uk)) < 1e-6
        o_lat = torch.randn(B, T, H, R, device="cuda")
        o = unabsorb(o_lat)
        assert o.dtype == torch.float32 and o.shape == (B, T, H * cfg.v_head_dim)
        rounded = torch.einsum("bthr,hvr->bthv", o_lat.bfloat16().float(), w_uv).reshape(B, T, -1)
        assert _rel(o, rounded) < 1e-6
        assert _rel(o, torch.einsum("bthr,hvr->bthv", o_lat, w_uv).reshape(B, T, -1)) < 2**-8
