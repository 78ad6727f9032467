"""The engine on a GPU (fla-core's kernels, our Triton decode kernels): the CUDA-graph runner (compiled) equals the
eager runner and the model's own forward over the whole sequence, step by step with the same tokens fed to both
(teacher forcing), at mixed context lengths; a whole graph-captured generation runs to the end; asynchronous
scheduling gives the synchronous tokens.

The exactness test runs in float32 with IEEE matmuls (test_engine_parts_gpu.py says why not bf16: a random MoE
routes on near-ties): relative RMS of the logits within 1e-3 against the full forward (chunked vs recurrent KDA,
paged vs dense MLA), 1e-4 between the graph and the eager runner. Even fp32 has near-ties over a long prompt: the
2,100-token one routes a token with a top-k margin of 5e-7, under the ~1e-6 by which the two computations' scores
differ, and one token routed to another expert moves the last logits by ~4e-3 (the full forward with AttnRes's row
kernel did, the same forward with the reference mix did not; the engine matched the latter to 7e-6). A sequence whose
full forward routes any token with a margin under ``NEAR_TIE`` is held to ``TIE_BOUND`` instead (routing_ties.py),
and most sequences must be tie-free. What it tests is the decode path (our Triton
decode kernels, the graphs); the prompts and the full forward run KDA's chunk and short-conv references on the
GPU (fla-core's kernels have their own tests in test_fla.py, and their autotuning afresh for fp32 outlasted
every device step this test was given). The other two run in bf16, the serving dtype, with fla-core."""

import copy
import os

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # Triton's fp32 tl.dot as IEEE fp32, not TF32

import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.data.tokenizer import train_tokenizer
from k3.inference.api import GenerationRequest, SamplingParams
from k3.inference.engine import Engine, EngineConfig

from .routing_ties import TIE_BOUND, last_logits

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return float((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt())


@pytest.fixture(scope="module")
def setup():
    tok = train_tokenizer(["def f(x):\n    return x\n", "import os\n"] * 30, 300)
    torch.manual_seed(0)
    cfg = K3Config.preset("small").replace(vocab_size=4096, num_nextn_predict_layers=0)
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    model = K3ForCausalLM(cfg).to("cuda").eval()
    yield tok, model, copy.deepcopy(model).to(torch.bfloat16)  # (tokenizer, fp32 model, bf16 model)
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


def _engines(tok, model):
    # decode_prompt_tokens=0: both engines prefill every prompt (by default a graph engine feeds a short prompt
    # through its decode graphs, a token per step: its sequences would then take a different number of steps, and
    # with the test's fixed next token, different tokens than the eager engine's)
    cfg = dict(num_pages=256, page_tokens=256, hash_block=256, prefill_chunk=1024, step_tokens=2048, max_batch=8,
               prefix_cache=False, decode_prompt_tokens=0)
    return (Engine(model, tok, EngineConfig(**cfg, cuda_graphs=True, compile=True)),
            Engine(model, tok, EngineConfig(**cfg, cuda_graphs=False, compile=False)))


@pytest.fixture
def reference_prefill_kernels(monkeypatch):
    """KDA's chunked kernel and short convs as the references (prefill and the full forward); decode untouched."""
    import k3.layers.sequence.kda as kda_layer
    import k3.ops.kda as kda_ops

    chunk, conv = kda_ops.chunk_kda, kda_layer.short_conv
    monkeypatch.setattr(kda_ops, "chunk_kda", lambda *a, **kw: chunk(*a, **{**kw, "backend": "torch"}))
    monkeypatch.setattr(kda_layer, "short_conv", lambda *a, **kw: conv(*a, **{**kw, "backend": "torch"}))


@pytest.mark.usefixtures("reference_prefill_kernels")
@torch.no_grad()
def test_graph_runner_equals_eager_runner_and_the_full_forward(setup):
    tok, model, _ = setup
    graph, eager = _engines(tok, model)
    assert graph.runner.use_graphs and not eager.runner.use_graphs
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (3, 70, 600, 1500, 2100)]
    for eng in (graph, eager):
        for p in prompts:
            eng.submit(GenerationRequest(tuple(p), SamplingParams(max_tokens=64, ignore_eos=True)))
        while any(s.pending > 1 for s in eng.running) or eng.waiting:  # until every prompt is in
            plan = eng.scheduler.schedule()
            eng.runner.execute(plan)
            eng.scheduler.update(plan, eng.seqs)
            for it in plan.prefill + plan.decode:  # the next token: the same for both engines
                if it.sample is not None:
                    eng.seqs[it.seq_id].tokens.append(7)
    agree, total = 0, 0
    for step in range(6):
        plans = [eng.scheduler.schedule() for eng in (graph, eager)]
        assert [it.seq_id for it in plans[0].decode] == [it.seq_id for it in plans[1].decode] and not plans[0].prefill
        assert len(plans[0].decode) == len(prompts)
        assert all(graph.seqs[a.seq_id].tokens == eager.seqs[b.seq_id].tokens
                   for a, b in zip(plans[0].decode, plans[1].decode))  # the same tokens fed to both
        lg = graph.runner.decode_logits(plans[0].decode).clone()
        le = eager.runner.decode_logits(plans[1].decode)
        refs, ties = [], []
        for it in plans[0].decode:
            ref, tie = last_logits(model, graph.seqs[it.seq_id].tokens)
            refs.append(ref)
            ties.append(tie)
        print(f"step {step}: near-ties {ties}, graph/eager {_rel(lg, le):.2e}, graph/full "
              f"{max(_rel(lg[b], r) for b, r in enumerate(refs)):.2e}, eager/full "
              f"{max(_rel(le[b], r) for b, r in enumerate(refs)):.2e}", flush=True)
        assert _rel(lg, le) < 1e-4
        assert sum(ties) <= 2, ties  # the tight bound holds for most rows
        for b, ref in enumerate(refs):
            assert _rel(lg[b], ref) < (TIE_BOUND if ties[b] else 1e-3), (step, b, ties[b])
            agree += int(lg[b].argmax() == ref.argmax())
            total += 1
        nxt = lg.argmax(-1).tolist()
        for eng, plan in zip((graph, eager), plans):
            eng.scheduler.update(plan, eng.seqs)
            for it, t in zip(plan.decode, nxt):
                eng.seqs[it.seq_id].tokens.append(t)
    assert agree >= 0.95 * total  # argmax: a near-tie of two logits may still go either way
    for eng in (graph, eager):
        eng.stop()


def test_a_graph_captured_generation_runs_to_the_end_and_frees_its_pages(setup):
    tok, _, model = setup
    eng = Engine(model, tok, EngineConfig(num_pages=256, page_tokens=256, hash_block=256, step_tokens=2048,
                                          max_batch=8))
    assert eng.runner.use_graphs
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (10, 300, 1200)]
    fins = eng.generate(ps, [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                             SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
                             SamplingParams(max_tokens=40, temperature=1.0, top_k=20, seed=4, ignore_eos=True)])
    assert [f.completion_tokens for f in fins] == [40, 40, 40] and eng.pool.pages_in_use == 0
    eng.stop()


def test_asynchronous_scheduling_on_the_gpu_gives_the_synchronous_tokens(setup):
    """Under CUDA graphs, planning step n+1 while step n runs (decode tokens read from the device, results through
    pinned memory) gives the same greedy and seeded tokens as reading every step's results first."""
    tok, _, model = setup
    g = torch.Generator().manual_seed(2)
    ps = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (7, 260, 900, 33)]
    # one length for all: both modes then run the same batch shapes (async adds only a last step of finished
    # rows), so the same kernels give bitwise the same logits
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)]
    out = {}
    for mode in (False, True):
        eng = Engine(model, tok, EngineConfig(num_pages=256, page_tokens=256, hash_block=256, step_tokens=2048,
                                              max_batch=8, async_scheduling=mode))
        assert eng.runner.use_graphs and eng.async_scheduling == mode
        handles = [eng.submit(GenerationRequest(tuple(p), q)) for p, q in zip(ps, params)]
        while eng.has_work:
            eng.step()
        out[mode] = [[e.token_id for e in list(h)[:-1]] for h in handles]
        assert eng.pool.pages_in_use == 0
        eng.stop()
    assert out[True] == out[False]
