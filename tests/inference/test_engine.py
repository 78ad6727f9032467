"""The engine against full recomputation, the prefix cache, and the pool's accounting (SPEC §7)."""

import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.data.tokenizer import train_tokenizer
from k3.inference.api import GenerationRequest, SamplingParams
from k3.inference.cache import CacheLayout
from k3.inference.engine import Engine, EngineConfig

TEXT = ["def f(x):\n    return x * 2\n", "import os\nprint(os.getcwd())\n", "class A:\n    pass\n"] * 20


@pytest.fixture(scope="module")
def tok():
    t = train_tokenizer(TEXT, 300)
    assert t.get_vocab_size() >= 200
    return t


def make_model(tok, **variant):
    torch.manual_seed(0)
    cfg = K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size(), num_nextn_predict_layers=0)
    return K3ForCausalLM(cfg.variant(**variant) if variant else cfg).eval()


def reference_greedy(model, prompt, n, eos):
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


SMALL = EngineConfig(num_pages=256, page_tokens=16, hash_block=8, checkpoint_every=1, prefill_chunk=7)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_equals_full_recomputation(tok, batch):
    model = make_model(tok)
    eng = Engine(model, tok, SMALL)
    ps = prompts(batch, [5, 23, 9, 40, 1, 17, 33, 12])
    handles = [eng.submit(GenerationRequest(tuple(p), SamplingParams(max_tokens=6, temperature=0))) for p in ps]
    while eng.has_work:
        eng.step()
    for p, h in zip(ps, handles):
        events = list(h)
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
    miss = eng.generate([p], SamplingParams(max_tokens=6, temperature=0))[0]
    hit = eng.generate([p], SamplingParams(max_tokens=6, temperature=0))[0]
    assert miss.cached_tokens == 0 and hit.cached_tokens == 40  # the last 8-token boundary before token 45
    assert hit.text == miss.text
    # a prompt sharing 27 tokens reuses up to the last common boundary, 24
    other = p[:27] + prompts(1, [10], seed=3)[0]
    fin = eng.generate([other], SamplingParams(max_tokens=6, temperature=0))[0]
    assert fin.cached_tokens == 24
    assert fin.text == tok.decode(reference_greedy(model, other, 6, 0))


@pytest.mark.parametrize("layers", ["all-mla", "all-kda"])
def test_prefix_hits_without_one_of_the_two_cache_kinds(tok, layers):
    model = make_model(tok, layers=layers)
    eng = Engine(model, tok, SMALL)
    (p,) = prompts(1, [37], seed=4)
    miss = eng.generate([p], SamplingParams(max_tokens=4, temperature=0))[0]
    hit = eng.generate([p], SamplingParams(max_tokens=4, temperature=0))[0]
    assert hit.cached_tokens == 32 and hit.text == miss.text == tok.decode(reference_greedy(model, p, 4, 0))


def test_sparse_checkpoints_limit_reuse_to_checkpointed_boundaries(tok):
    model = make_model(tok)
    eng = Engine(model, tok, EngineConfig(num_pages=256, page_tokens=16, hash_block=8, checkpoint_every=2,
                                          prefill_chunk=64))
    (p,) = prompts(1, [45], seed=2)
    eng.generate([p], SamplingParams(max_tokens=2, temperature=0))
    assert eng.prefix.num_checkpoints == 2  # at tokens 16 and 32 (and decode did not reach 48)
    assert eng.generate([p[:30] + [7, 7, 7]], SamplingParams(max_tokens=2, temperature=0))[0].cached_tokens == 16


def test_kda_state_bytes_constant_mla_bytes_linear():
    cfg = K3Config.preset("kimi-k3")
    lay = CacheLayout.from_config(cfg, page_tokens=1024, dtype=torch.bfloat16)
    assert lay.mla_bytes_per_token == 24 * 576 * 2  # 27 KB per token, as the report's serving numbers say
    assert lay.kda_state_bytes == 69 * (96 * 128 * 128 * 4 + 3 * 96 * 128 * 3 * 2)
    tiny = K3Config.preset("tiny")
    eng = Engine(make_model(train_tokenizer(TEXT, 300)), train_tokenizer(TEXT, 300),
                 EngineConfig(num_pages=512, page_tokens=16, hash_block=8, prefix_cache=False))
    L = eng.layout
    used = []
    for n in (16, 64, 256):
        before = eng.pool.pages_in_use
        h = eng.submit(GenerationRequest(tuple(range(1, n + 1)), SamplingParams(max_tokens=1, temperature=0)))
        eng._admit()
        seq = eng.running[-1]
        used.append((len(seq.kda_pages), len(seq.mla_pages)))
        assert eng.pool.pages_in_use - before == len(seq.kda_pages) + len(seq.mla_pages)
        h.cancel()
        eng.step()
    assert len({k for k, _ in used}) == 1 and used[0][0] == L.kda_pages  # constant in context length
    assert [m for _, m in used] == [L.mla_pages(n + 1) for n in (16, 64, 256)]  # linear
    assert tiny.kv_lora_rank + tiny.qk_rope_head_dim == L.latent


def test_abort_frees_pages_and_threaded_submit(tok):
    model = make_model(tok)
    eng = Engine(model, tok, SMALL)
    eng.start()
    try:
        h1 = eng.submit(GenerationRequest(tuple(prompts(1, [20])[0]), SamplingParams(max_tokens=50, temperature=0)))
        first = next(iter(h1))
        assert first.token_id >= 0
        h1.cancel()
        events = list(h1)
        assert events[-1].reason == "abort"
        h2 = eng.submit(GenerationRequest(tuple(prompts(1, [8])[0]), SamplingParams(max_tokens=4, temperature=0)))
        fin = list(h2)[-1]
        assert fin.reason in ("length", "stop") and fin.prompt_tokens == 8
    finally:
        eng.stop()
    assert eng.pool.pages_in_use == 0


def test_requests_that_cannot_fit_are_refused(tok):
    eng = Engine(make_model(tok), tok, EngineConfig(num_pages=8, page_tokens=16, hash_block=8, max_context=64))
    with pytest.raises(ValueError, match="context limit"):
        eng.submit(GenerationRequest(tuple(range(1, 60)), SamplingParams(max_tokens=10)))
    with pytest.raises(ValueError, match="empty"):
        eng.submit(GenerationRequest((), SamplingParams()))
