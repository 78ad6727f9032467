"""Rollouts through the engine: recorded log-probs are the policy's; partial rollout over several steps gives the
same trajectories and the same gradient as finishing them in one go (frozen policy)."""

import copy

import pytest
import torch

from k3.config import K3Config
from k3.model.transformer import K3ForCausalLM
from k3.post.batch import pack, score, token_logprobs
from k3.post.format import ChatFormat
from k3.post.objective import policy_loss
from k3.post.rollout import Rollout, Trajectory


def tiny(tok, seed=0):
    torch.manual_seed(seed)
    return K3ForCausalLM(K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size())).eval()


def prompts(tok):
    fmt = ChatFormat(tok)
    return fmt, [fmt.prompt_ids([{"role": "user", "content": f"What is {a} + {b}?"}], e)
                 for a, b, e in ((1, 2, "low"), (3, 4, "max"), (5, 6, "high"))]


def trajectories(ps, G=2):
    return [Trajectory(g, p, seed=100 * g + i) for g, p in enumerate(ps) for i in range(G)]


def grads(model, trajs):
    model.zero_grad()
    adv = [[1.0 - 0.5 * i] * len(t.tokens) for i, t in enumerate(trajs)]
    batches = pack(trajs, adv, 64, 1.0)
    n = sum(len(t.tokens) for t in trajs)
    for b in batches:
        loss, _ = policy_loss(token_logprobs(model, b), b["sampled_logp"], b["adv"], 0.2, 0.28, n)
        loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.parametrize("between", ["live", "load", "keep", "new"])
def test_partial_rollout_equals_finishing_first(chat_tokenizer, between):
    """Rounds of 3 tokens with the frozen policy at versions 0, 1, ...: the requests stay live in the engine
    between rounds ("live"), are re-encoded after ``load`` (a new step's weights, here the same), stay live on
    their cache across ``load(reencode=False)`` ("keep"), or are resubmitted to a new engine (a resumed run): each
    gives the trajectories and gradient of one go."""
    tok = chat_tokenizer
    model = tiny(tok)
    fmt, ps = prompts(tok)
    whole = trajectories(ps)
    Rollout(model, tok, fmt.stop, 14, version=0).round(whole)
    parts = trajectories(ps)
    rollout = Rollout(model, tok, fmt.stop, 14, version=0)
    rounds = 0
    while not all(t.done for t in parts):
        if between in ("load", "keep"):
            rollout.load(model, rounds, reencode=between == "load")
        elif between == "new":
            rollout = Rollout(model, tok, fmt.stop, 14, version=rounds)
        else:
            rollout.version = rounds
        rollout.round(parts, chunk=3)
        rounds += 1
    assert rounds == 5  # 14 tokens in chunks of 3
    assert [t.versions for t in parts][0] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4]
    for a, b in zip(whole, parts):
        assert a.tokens == b.tokens and a.finish == b.finish and a.text == b.text
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    ga, gb = grads(model, whole), grads(model, parts)
    assert ga.keys() == gb.keys() and len(ga) > 10
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], atol=1e-6, rtol=1e-4)


def test_load_puts_new_weights_in_the_engine(chat_tokenizer):
    """One engine for a run: after ``load(policy_b)`` it samples what a new engine built from policy_b samples,
    and live requests are re-encoded (their tokens after the load are policy_b's)."""
    tok = chat_tokenizer
    a, b = tiny(tok, seed=2), tiny(tok, seed=3)
    fmt, ps = prompts(tok)
    rollout = Rollout(a, tok, fmt.stop, 8, version=0)
    carried = trajectories(ps)
    rollout.round(carried, chunk=2)  # live requests with policy a's cache
    resumed = copy.deepcopy(carried)
    rollout.load(b, 1)
    rollout.round(carried)
    Rollout(b, tok, fmt.stop, 8, version=1).round(resumed)  # the same trajectories continued by a new engine
    fresh, loaded = trajectories(ps), trajectories(ps)
    Rollout(b, tok, fmt.stop, 8, version=1).round(fresh)
    rollout.round(loaded)
    for x, y in [*zip(resumed, carried), *zip(fresh, loaded)]:
        assert x.tokens == y.tokens and x.versions == y.versions and x.finish == y.finish
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
    assert carried[0].versions[:3] == [0, 0, 1] and loaded[0].versions == [1] * len(loaded[0].tokens)


def test_load_without_reencoding_continues_on_the_kept_cache(chat_tokenizer):
    """``load(b, reencode=False)``: the carried replies continue on the cache policy a wrote. A policy b that
    differs from a only in the LM head writes the same cache (no layer reads the head), so there the kept cache is
    exactly b's and the continuation equals re-encoding; a b that differs in a layer's weights writes another
    cache, so the kept one gives other log-probs than re-encoding. Either way no request is resubmitted and the
    tokens drawn before the load keep version 0."""
    tok = chat_tokenizer
    a = tiny(tok, seed=2)
    fmt, ps = prompts(tok)
    head, layer = copy.deepcopy(a), copy.deepcopy(a)
    with torch.no_grad():
        head.lm_head.weight.mul_(1.5)
        layer.model.layers[0].self_attn.v_proj.weight.mul_(3.0)  # the first KDA layer's values: its state

    def continued(b, reencode):
        rollout = Rollout(a, tok, fmt.stop, 8, version=0)
        trajs = trajectories(ps)
        rollout.round(trajs, chunk=2)
        submitted = rollout.engine.submit
        calls = []
        rollout.engine.submit = lambda req: calls.append(req) or submitted(req)
        rollout.load(b, 1, reencode=reencode)
        rollout.round(trajs)
        assert [t.versions[:2] for t in trajs] == [[0, 0]] * len(trajs)
        assert len(calls) == (len(trajs) if reencode else 0)
        return trajs

    for b, same in ((head, True), (layer, False)):
        kept, again = continued(b, False), continued(b, True)
        for x, y in zip(kept, again):
            assert x.tokens[:2] == y.tokens[:2] and x.logprobs[:2] == y.logprobs[:2]
        lp = lambda ts: torch.tensor([t.logprobs[2] for t in ts])  # noqa: E731  the first token after the load
        if same:
            for x, y in zip(kept, again):
                assert x.tokens == y.tokens
                torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
        else:
            assert (lp(kept) - lp(again)).abs().max() > 1e-3


def test_recorded_logprobs_are_the_training_forwards(chat_tokenizer):
    tok = chat_tokenizer
    model = tiny(tok, seed=1)
    fmt, ps = prompts(tok)
    trajs = trajectories(ps, G=3)
    Rollout(model, tok, fmt.stop, 10, version=0).round(trajs)
    scored = score(model, trajs, 40)  # micro-batches of several documents: the packing keeps them apart
    for t, s in zip(trajs, scored):
        assert len(s) == len(t.tokens) == 10
        torch.testing.assert_close(torch.tensor(s), torch.tensor(t.logprobs), atol=1e-4, rtol=0)


def test_a_stop_string_split_over_chunks_ends_the_reply_after_it(chat_tokenizer):
    """The stop string is looked for in the whole reply: one completed by a later chunk cuts the reply right
    after the token that completes it, as the engine does for a reply written in one go."""
    tok = chat_tokenizer
    fmt, _ = prompts(tok)
    reply = tok.encode("4<|im_end|>").ids
    extra = tok.encode("xyz").ids
    r = Rollout.__new__(Rollout)
    r.tokenizer, r.stop, r.max_tokens, r._live = tok, fmt.stop, 50, {}
    for before in range(len(reply)):  # the chunk boundary anywhere inside the reply
        t = Trajectory(0, [1], 0, tokens=reply + extra, logprobs=[-1.0] * (len(reply) + len(extra)),
                       versions=[0] * (len(reply) + len(extra)))
        r._settle(t, before, "length")
        assert t.tokens == reply and len(t.logprobs) == len(t.versions) == len(reply)
        assert (t.finish, t.text) == ("stop", "4")
    t = Trajectory(0, [1], 0, tokens=extra, logprobs=[-1.0] * len(extra), versions=[0] * len(extra))
    r._settle(t, 0, "length")
    assert not t.done  # a chunk limit without a stop string: carried over


def test_rollout_refuses_an_engine_that_would_outlive_a_load(chat_tokenizer):
    """load() changes the weights in place: a prefix cache (keyed by tokens) or asynchronous scheduling would give
    a trajectory tokens or a cache of another policy version; both are refused, naming the field."""
    from k3.inference.engine import EngineConfig

    model, fmt = tiny(chat_tokenizer), ChatFormat(chat_tokenizer)
    for field in ("prefix_cache", "async_scheduling"):
        cfg = EngineConfig(page_tokens=512, num_pages=520, prefix_cache=field == "prefix_cache",
                           async_scheduling=field == "async_scheduling")
        with pytest.raises(ValueError, match=f"{field}=False"):
            Rollout(model, chat_tokenizer, fmt.stop, 8, version=0, engine_config=cfg)


def test_a_bf16_rollout_samples_from_the_policy_rounded_to_bf16(chat_tokenizer):
    """``dtype=torch.bfloat16`` (the default on CUDA, where it lets the engine use CUDA graphs): the engine holds
    the policy's weights rounded to bf16, also after ``load``, and the recorded log-probs are that bf16 copy's own
    (its full forward's, within 0.02: two bf16 computations; measured 0.004), not the fp32 policy's (0.007
    apart here); the default on CPU keeps the policy's dtype."""
    from k3.post.rollout import rollout_dtype

    tok = chat_tokenizer
    a, b = tiny(tok, seed=2), tiny(tok, seed=3)
    assert rollout_dtype(a) == torch.float32 and rollout_dtype(a, "bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown rollout dtype 'fp8'"):
        rollout_dtype(a, "fp8")
    fmt, ps = prompts(tok)
    rollout = Rollout(a, tok, fmt.stop, 10, version=0, dtype=torch.bfloat16)
    rollout.load(b, 1)
    engine_weights = dict(rollout.engine.model.named_parameters())
    for name, p in b.named_parameters():
        assert torch.equal(engine_weights[name], p.detach().to(torch.bfloat16)), name
    trajs = trajectories(ps, G=2)
    rollout.round(trajs)
    b16 = copy.deepcopy(b).to(torch.bfloat16)
    sampler, policy = score(b16, trajs, 40), score(b, trajs, 40)
    gap = 0.0
    for t, s16, s32 in zip(trajs, sampler, policy):
        torch.testing.assert_close(torch.tensor(t.logprobs), torch.tensor(s16).float(), atol=0.02, rtol=0)
        gap = max(gap, (torch.tensor(t.logprobs) - torch.tensor(s32)).abs().max().item())
    assert gap > 1e-4, "a bf16 sampler's log-probs should differ from the fp32 policy's by rounding"
