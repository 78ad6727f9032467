"""Prompt chunks paced against decoding streams: the step-cost model, the CPU prefill attention, and the engine's
short requests while a long prompt prefills (k3.inference.pacing, k3.inference.mixers)."""

import pytest
import torch

from k3.inference.mixers import _causal_attention
from k3.inference.pacing import StepPacer


def test_pacer_caps_prompt_tokens_to_the_step_target():
    p = StepPacer(target_s=0.25, max_tokens=2048, min_tokens=32)
    assert p.cap() is None  # no prompt step timed yet
    p.observe(0, 0.05)  # a decode-only step: a = 50 ms
    p.observe(1000, 1.05)  # 1 ms per prompt token on top
    assert p.cap() == 200  # (0.25 - 0.05) / 0.001
    for _ in range(20):
        p.observe(100, 0.05 + 100 * 1e-5)  # the device got fast: the cap opens to the chunk
    assert p.cap() == 2048
    slow = StepPacer(target_s=0.25, max_tokens=2048, min_tokens=32)
    slow.observe(10, 10.0)  # slower than the target even for 10 tokens: still progress, min_tokens a step
    assert slow.cap() == 32


@pytest.mark.parametrize("s", [0, 1, 37], ids=lambda s: f"cached{s}")
def test_cpu_prefill_attention_equals_written_out_causal_softmax(s):
    """softmax(q k^T * scale, query i sees keys <= s + i) v, with v's head size below q's (MLA: 24 vs 16)."""
    g = torch.Generator().manual_seed(0)
    H, n, D, Dv, scale = 3, 9, 24, 16, 0.3
    q, k = torch.randn(1, H, n, D, generator=g), torch.randn(1, H, s + n, D, generator=g)
    v = torch.randn(1, H, s + n, Dv, generator=g)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    visible = torch.arange(s + n)[None, :] <= (s + torch.arange(n))[:, None]
    ref = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(_causal_attention(q, k, v, s, scale), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_short_request_streams_while_a_long_prompt_prefills():
    """The engine end to end: a short request that arrives while a 1,000-token prompt prefills gets its first token
    in the next step and all its tokens before that prompt is through; while it decodes no step carries more
    prompt tokens than the pacer's cap; and both outputs equal each request's output alone."""
    from k3 import K3Config, K3ForCausalLM
    from k3.data.tokenizer import train_tokenizer
    from k3.inference.api import FinishEvent, GenerationRequest, SamplingParams
    from k3.inference.engine import Engine, EngineConfig

    tok = train_tokenizer(["def f(x):\n    return x * 2\n", "import os\nprint(os.getcwd())\n"] * 20, 300)
    torch.manual_seed(0)
    cfg = K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size(), num_nextn_predict_layers=0)
    model = K3ForCausalLM(cfg).eval()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    long_ids, short_ids = [(13 * i) % 250 + 5 for i in range(1000)], [7, 8, 9, 10, 11]
    ecfg = dict(num_pages=64, page_tokens=64, hash_block=64, prefill_chunk=256)

    def alone(ids):
        return Engine(model, tok, EngineConfig(**ecfg)).generate([ids], params)[0].text

    class Sink(list):
        put = list.append

    eng = Engine(model, tok, EngineConfig(**ecfg, decode_step_target_s=1e-9))  # every step is over the target
    eng.async_scheduling = False
    long_events, short_events = Sink(), Sink()
    eng.submit(GenerationRequest(tuple(long_ids), params, request_id="L"), long_events)
    eng.step()  # L's first chunk (nothing decodes: no cap)
    assert eng.seqs["L"].num_computed == 256
    eng.submit(GenerationRequest(tuple(short_ids), params, request_id="S"), short_events)
    steps = 0
    while not (short_events and isinstance(short_events[-1], FinishEvent)):
        before = eng.seqs["L"].num_computed
        cap = eng.pacer.cap()
        eng.step()
        steps += 1
        if steps == 1:
            assert len(short_events) == 1  # S's prompt went first, whole: its first token after one step
        else:
            assert eng.seqs["L"].num_computed - before <= cap == eng.pacer.min_tokens  # S decodes: L is paced
    assert steps == 4 and eng.seqs["L"].num_computed < len(long_ids)  # S is done; L still prefills
    while not (long_events and isinstance(long_events[-1], FinishEvent)):
        eng.step()
    assert short_events[-1].text == alone(short_ids) and long_events[-1].text == alone(long_ids)
