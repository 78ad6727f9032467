"""The engine against full recomputation: batching, prefix hits (device and host tier), page growth and
preemption, per-class admission, failures (SPEC §7)."""

import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.data.tokenizer import train_tokenizer
from k3.inference.api import GenerationRequest, SamplingParams
from k3.inference.engine import Engine, EngineConfig, EngineFailed

TEXT = ["def f(x):\n    return x * 2\n", "import os\nprint(os.getcwd())\n", "class A:\n    pass\n"] * 20


@pytest.fixture(autouse=True, params=["sync", "async"])
def scheduling(request, monkeypatch):
    """Every test runs twice: steps read their own results, or (asynchronous scheduling, CUDA's default) the
    previous step's, with decode tokens taken from the device."""
    init = Engine.__init__

    def patched(self, *a, **k):
        init(self, *a, **k)
        self.async_scheduling = request.param == "async"

    monkeypatch.setattr(Engine, "__init__", patched)
    return request.param


@pytest.fixture(scope="module")
def tok():
    t = train_tokenizer(TEXT, 300)
    assert t.get_vocab_size() >= 200
    return t


def make_model(tok, **variant):
    torch.manual_seed(0)
    cfg = K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size(), num_nextn_predict_layers=0)
    return K3ForCausalLM(cfg.variant(**variant) if variant else cfg).eval()


def reference_greedy(model, prompt, n, eos=None):
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            t = int(model(torch.tensor([ids]))["logits"][0, -1].argmax())
            if t == eos:
                break
            ids.append(t)
            out.append(t)
    return out


def prompts(n, lengths, seed=0, vocab=200):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


# pages of 32 tokens, 8-token hash blocks, a checkpoint at every block; chunks of 7 tokens, 64 tokens a step
SMALL = EngineConfig(num_pages=256, page_tokens=32, hash_block=8, checkpoint_every=1, prefill_chunk=7, step_tokens=64,
                     max_batch=8)
GREEDY = SamplingParams(max_tokens=6, temperature=0)


def run(eng, ps, params=GREEDY):
    handles = [eng.submit(GenerationRequest(tuple(p), params)) for p in ps]
    while eng.has_work:
        eng.step()
    return [list(h) for h in handles]


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_equals_full_recomputation(tok, batch):
    model = make_model(tok)
    eng = Engine(model, tok, SMALL)
    ps = prompts(batch, [5, 23, 9, 40, 1, 17, 33, 12])
    for p, events in zip(ps, run(eng, ps)):
        ids = [e.token_id for e in events[:-1] if e.token_id != 0]
        ref = reference_greedy(model, p, 6, 0)
        assert ids == ref  # token for token
        assert events[-1].completion_tokens == len(ref) and events[-1].text == tok.decode(ref)
    assert eng.pool.pages_in_use == 0  # every request released its pages


@pytest.mark.parametrize("variant", [{"layers": "all-mla"}, {"layers": "all-kda"}, {"attn_res": "full"}])
def test_greedy_equals_recomputation_for_variants(tok, variant):
    model = make_model(tok, **variant)
    eng = Engine(model, tok, SMALL)
    ps = prompts(3, [11, 30, 4], seed=1)
    for p, fin in zip(ps, eng.generate(ps, SamplingParams(max_tokens=5, temperature=0))):
        assert fin.text == tok.decode(reference_greedy(model, p, 5, 0))


def test_prefix_hit_same_tokens_and_reports_cached(tok):
    model = make_model(tok)
    eng = Engine(model, tok, SMALL)
    (p,) = prompts(1, [45], seed=2)
    miss = eng.generate([p], GREEDY)[0]
    hit = eng.generate([p], GREEDY)[0]
    assert miss.cached_tokens == 0 and hit.cached_tokens == 40  # the last 8-token boundary before token 45
    assert hit.text == miss.text
    other = p[:27] + prompts(1, [10], seed=3)[0]  # shares 27 tokens: reuses up to the last common boundary, 24
    fin = eng.generate([other], GREEDY)[0]
    assert fin.cached_tokens == 24 and fin.text == tok.decode(reference_greedy(model, other, 6, 0))


def test_prompt_tokens_fed_through_the_decode_path_give_the_same_outputs(tok):
    """``decode_prompt_tokens``: a short prompt, a long prompt's last tokens after its chunks, and the tokens after
    a prefix hit go through the decode path a token per step (under CUDA graphs a replay costs less than an eager
    prefill): the same greedy tokens as prefilling them and as full recomputation, the same log-probabilities of
    the first token to float rounding, the same prefix hits, every page released."""
    from dataclasses import replace

    model = make_model(tok)
    ps = prompts(4, [3, 23, 45, 1], seed=6)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2)
    outs = {}
    for feed in (0, 5):
        eng = Engine(model, tok, replace(SMALL, decode_prompt_tokens=feed))
        fed, schedule = [], eng.scheduler.schedule

        def counting():
            plan = schedule()
            fed.extend(it.seq_id for it in plan.decode if it.sample is None)
            return plan

        eng.scheduler.schedule = counting
        first = run(eng, ps, params)
        again = eng.generate([ps[2]], params)[0]  # hits at 40: the 5 tokens after it are fed by decode when feed=5
        again_id = "req-4"
        outs[feed] = (first, again)
        # fed without a draw (the last known token's row draws): 2 of the 3-token prompt; the 45-token one's 4 after
        # its chunks up to its checkpoint at 40; the hit's 4 after 40; none of the 23-token one (its last chunk, 16
        # to 23, is 7 tokens) or of the 1-token one
        assert fed == ([] if feed == 0 else ["req-0"] * 2 + ["req-2"] * 4 + [again_id] * 4)
        assert again.cached_tokens == 40 and eng.pool.pages_in_use == 0
    for p, a, b in zip(ps, outs[0][0], outs[5][0]):
        assert [e.token_id for e in a[:-1]] == [e.token_id for e in b[:-1]] and a[-1].text == b[-1].text
        assert [e.token_id for e in b[:-1] if e.token_id != 0] == reference_greedy(model, p, 6, 0)
        torch.testing.assert_close(a[0].logprob, b[0].logprob, rtol=1e-4, atol=1e-5)
        assert [t for t, _ in a[0].top_logprobs] == [t for t, _ in b[0].top_logprobs]
    assert outs[0][1].text == outs[5][1].text
    with pytest.raises(ValueError, match="decode_prompt_tokens must be >= 0"):
        EngineConfig(decode_prompt_tokens=-1)


def test_a_repeated_prompt_hits_at_its_last_full_block_with_sparse_checkpoints(tok):
    """Checkpoints every 4 blocks (32 tokens) AND at each prompt's last full block: a repeat of a 45-token
    prompt hits at 40, not 32; a prompt sharing only 27 tokens falls back to the sparse checkpoints."""
    model = make_model(tok)
    eng = Engine(model, tok, EngineConfig(num_pages=256, page_tokens=32, hash_block=8, checkpoint_every=4,
                                          prefill_chunk=64, step_tokens=64, max_batch=8))
    (p,) = prompts(1, [45], seed=2)
    miss, hit = eng.generate([p], GREEDY)[0], eng.generate([p], GREEDY)[0]
    assert (miss.cached_tokens, hit.cached_tokens) == (0, 40) and hit.text == miss.text
    assert eng.prefix.num_checkpoints == 2  # at 32 (sparse) and 40 (the prompt's last full block)
    assert eng.generate([p[:27] + [7, 7, 7]], GREEDY)[0].cached_tokens == 0  # no checkpoint at 8, 16 or 24
    assert eng.generate([p[:33] + [7, 7, 7]], GREEDY)[0].cached_tokens == 32


@pytest.mark.parametrize("layers", ["all-mla", "all-kda"])
def test_prefix_hits_without_one_of_the_two_state_kinds(tok, layers):
    model = make_model(tok, layers=layers)
    eng = Engine(model, tok, SMALL)
    (p,) = prompts(1, [37], seed=4)
    miss = eng.generate([p], SamplingParams(max_tokens=4, temperature=0))[0]
    hit = eng.generate([p], SamplingParams(max_tokens=4, temperature=0))[0]
    assert hit.cached_tokens == 32 and hit.text == miss.text == tok.decode(reference_greedy(model, p, 4, 0))


def test_a_hit_restored_from_the_host_tier_equals_a_miss(tok):
    model = make_model(tok)
    cfg = EngineConfig(num_pages=12, page_tokens=32, hash_block=8, checkpoint_every=2, host_pages=32,
                       prefill_chunk=64, step_tokens=64, max_batch=4)
    eng = Engine(model, tok, cfg)
    a, b = prompts(2, [70, 90], seed=5)
    miss = eng.generate([a], GREEDY)[0]
    eng.generate([b], GREEDY)  # needs the device pages a's prefix sits in: they move to the host tier
    assert eng.prefix.host_pages_in_use > 0
    hit = eng.generate([a], GREEDY)[0]
    assert hit.cached_tokens == 64 and hit.text == miss.text == tok.decode(reference_greedy(model, a, 6, 0))
    assert eng.pool.pages_in_use == 0


def test_pages_grow_with_the_sequence_and_kda_state_is_constant(tok):
    model = make_model(tok)
    eng = Engine(model, tok, EngineConfig(num_pages=64, page_tokens=32, hash_block=8, prefix_cache=False,
                                          prefill_chunk=64, step_tokens=64))
    h = eng.submit(GenerationRequest(tuple(range(1, 31)), SamplingParams(max_tokens=20, temperature=0)))
    seq = eng.seqs[h.id]
    held = []
    while not seq.finished:
        eng.step()
        held.append((len(seq.kda_pages), len(seq.mla_pages), seq.num_computed))
    live = [x for x in held if x[0]]
    assert {k for k, _, _ in live} == {eng.layout.kda_pages}  # constant in context length
    assert all(m == eng.layout.mla_pages(n) for _, m, n in live)  # one page more each time a page fills
    assert live[0][1] == 1 and live[-1][1] == 2 and eng.pool.pages_in_use == 0


@pytest.mark.slow
def test_preemption_when_the_pool_is_full_keeps_every_output_exact(tok):
    model = make_model(tok)
    kda = Engine(model, tok, SMALL).layout.kda_pages
    # three sequences of up to 70 tokens (3 pages each) in a pool with room for two of them at their start:
    # when the first one needs its third page, the latest admitted is preempted and later recomputed
    eng = Engine(model, tok, EngineConfig(num_pages=2 * kda + 4, page_tokens=32, hash_block=8, checkpoint_every=1,
                                          prefill_chunk=16, step_tokens=64, max_batch=8))
    ps = prompts(3, [20], seed=6)
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    handles = [eng.submit(GenerationRequest(tuple(p), params)) for p in ps]
    while eng.has_work:
        eng.step()
    assert eng.stats()["preemptions"] > 0
    for p, h in zip(ps, handles):
        assert [e.token_id for e in list(h)[:-1]] == reference_greedy(model, p, 50)
    assert eng.pool.pages_in_use == 0


def test_a_short_request_is_not_held_back_by_a_long_prompt(tok):
    """Per-class admission: while a long prompt prefills, a short request sent later finishes within a few steps
    of what it takes alone (counted in engine steps: deterministic)."""
    model = make_model(tok)
    cfg = EngineConfig(num_pages=128, page_tokens=32, hash_block=8, checkpoint_every=64, prefill_chunk=64,
                       step_tokens=64, long_prompt=256, max_batch=8)
    short = prompts(1, [20], seed=7)[0]
    alone = Engine(model, tok, cfg)
    h = alone.submit(GenerationRequest(tuple(short), SamplingParams(max_tokens=4, temperature=0)))
    idle_steps = 0
    while alone.has_work:
        alone.step()
        idle_steps += 1
    eng = Engine(model, tok, cfg)
    long_h = eng.submit(GenerationRequest(tuple(prompts(1, [1024], seed=8)[0]), SamplingParams(max_tokens=2)))
    eng.step()  # the long prompt has started
    h2 = eng.submit(GenerationRequest(tuple(short), SamplingParams(max_tokens=4, temperature=0)))
    steps = 0
    while not eng.seqs.get(h2.id) is None:
        eng.step()
        steps += 1
    assert steps <= idle_steps + 2 and eng.seqs.get(long_h.id) is not None  # done while the long one still runs
    assert list(h2)[-1].text == list(h)[-1].text


def test_seeded_sampling_is_independent_of_the_batch(tok):
    model = make_model(tok)
    p = prompts(1, [12], seed=9)[0]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=123)
    alone = Engine(model, tok, SMALL).generate([p], params)[0].text
    crowd = Engine(model, tok, SMALL).generate([p] + prompts(3, [5, 30, 9], seed=10),
                                               [params] + [SamplingParams(max_tokens=8)] * 3)[0].text
    assert alone == crowd


def test_requests_that_cannot_fit_are_refused(tok):
    eng = Engine(make_model(tok), tok, EngineConfig(num_pages=8, page_tokens=32, hash_block=8, max_context=64,
                                                    step_tokens=64))
    with pytest.raises(ValueError, match="context limit"):
        eng.submit(GenerationRequest(tuple(range(1, 60)), SamplingParams(max_tokens=10)))
    with pytest.raises(ValueError, match="empty"):
        eng.submit(GenerationRequest((), SamplingParams()))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        eng.submit(GenerationRequest((1, 10**6), SamplingParams()))
    small = Engine(make_model(tok), tok, EngineConfig(num_pages=6, page_tokens=32, hash_block=8, step_tokens=64))
    assert small.max_context == (5 - small.layout.kda_pages) * 32  # the pool's limit is the advertised one


def test_no_max_tokens_means_until_the_context_limit(tok):
    eng = Engine(make_model(tok), tok, EngineConfig(num_pages=64, page_tokens=32, hash_block=8, max_context=40,
                                                    step_tokens=64))
    fin = eng.generate([prompts(1, [30], seed=11)[0]], SamplingParams(max_tokens=None, temperature=0))[0]
    assert fin.reason == "stop" or (fin.reason == "length" and fin.completion_tokens == 10)


def test_abort_frees_pages_and_threaded_submit(tok):
    eng = Engine(make_model(tok), tok, SMALL)
    eng.start()
    try:
        h1 = eng.submit(GenerationRequest(tuple(prompts(1, [20])[0]), SamplingParams(max_tokens=50, temperature=0)))
        first = next(iter(h1))
        assert first.token_id >= 0
        h1.cancel()
        assert list(h1)[-1].reason == "abort"
        h2 = eng.submit(GenerationRequest(tuple(prompts(1, [8])[0]), SamplingParams(max_tokens=4, temperature=0)))
        fin = list(h2)[-1]
        assert fin.reason in ("length", "stop") and fin.prompt_tokens == 8
    finally:
        eng.stop()
    assert eng.pool.pages_in_use == 0


def test_an_engine_failure_ends_every_request_with_its_reason(tok, monkeypatch):
    eng = Engine(make_model(tok), tok, SMALL)

    def broken(plan):
        raise IndexError("index 4096 is out of bounds for dimension 0 with size 300")

    monkeypatch.setattr(eng.runner, "launch", broken)
    handles = [eng.submit(GenerationRequest((1, 2, 3), SamplingParams(max_tokens=4))) for _ in range(3)]
    eng.start()  # after the submissions: the loop fails at its first step, and would refuse later ones
    try:
        for h in handles:
            fin = list(h)[-1]  # never a hang
            assert fin.reason == "error" and "IndexError: index 4096" in fin.error
        assert eng.failed.startswith("IndexError")
        with pytest.raises(EngineFailed, match="index 4096"):
            eng.submit(GenerationRequest((1, 2, 3), SamplingParams()))
    finally:
        eng.stop()


def test_a_tokenizer_larger_than_the_model_is_refused(tok):
    cfg = K3Config.preset("tiny").replace(vocab_size=100, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match=r"tokenizer has \d+ tokens but the model's vocabulary has 100"):
        Engine(K3ForCausalLM(cfg), tok, SMALL)



def test_cuda_graphs_asked_for_where_they_cannot_run_are_refused_by_name(tok):
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device.*cuda_graphs=False"):
        Engine(make_model(tok), tok, EngineConfig(num_pages=16, page_tokens=64, hash_block=32, cuda_graphs=True))
