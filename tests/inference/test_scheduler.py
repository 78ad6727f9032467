"""The Scheduler's plans as plain data (vLLM's scheduler tests' style): requests in, ``SchedulerOutput`` out, no
model. A step is simulated as the engine runs it: schedule, count the sampled rows in flight, ``update``, then
deliver one token per sampled row (k3.inference.engine.Engine.step, synchronous)."""

import pytest

from k3.inference.api import GenerationRequest, SamplingParams
from k3.inference.pool import PageLayout, PagePool
from k3.inference.prefix import PrefixCache
from k3.inference.scheduler import DecodeItem, PrefillItem, Scheduler, SchedulerConfig, Sequence

PAGE = 4  # tokens per MLA page (and per hash block)
MLA_ONLY = PageLayout(n_mla=1, latent=4, n_kda=0, kda_heads=1, kda_dim=4, conv_width=4, page_tokens=PAGE)
HYBRID = PageLayout(n_mla=1, latent=64, n_kda=1, kda_heads=1, kda_dim=4, conv_width=4, page_tokens=PAGE)


def make(pages: int = 64, layout: PageLayout = MLA_ONLY, prefix: bool = False, **cfg):
    pool = PagePool(layout, pages + 1)  # + the scratch page
    cache = PrefixCache(pool, hash_block=PAGE, checkpoint_every=2) if prefix else None
    return Scheduler(pool, cache, SchedulerConfig(**cfg), hash_block=PAGE), {}


def add(sched, seqs, sid: str, prompt, max_tokens: int = 8, long: bool = False) -> Sequence:
    req = GenerationRequest(tuple(prompt), SamplingParams(max_tokens=max_tokens))
    seq = Sequence(sid, req, seed=0, max_tokens=max_tokens, arrival=sched.next_arrival(), long=long)
    sched.add(seq)
    seqs[sid] = seq
    return seq


def step(sched, seqs, token: int = 7):
    """One synchronous engine step; every sampled row draws ``token``. -> the plan."""
    plan = sched.schedule()
    sampled = [it.seq_id for it in [*plan.prefill, *plan.decode] if it.sample is not None]
    for sid in sampled:
        seqs[sid].in_flight += 1
    sched.update(plan, seqs)
    for sid in sampled:
        seqs[sid].in_flight -= 1
        seqs[sid].tokens.append(token)
    return plan


def shape(plan):
    """The plan as (kind, seq, start, n tokens, samples?) rows."""
    return ([("P", it.seq_id, it.start, len(it.tokens), it.sample is not None) for it in plan.prefill]
            + [("D", it.seq_id, it.position, 1, it.sample is not None) for it in plan.decode])


def test_prompts_prefill_whole_then_decode_one_token_each():
    sched, seqs = make()
    add(sched, seqs, "a", range(10))
    add(sched, seqs, "b", range(100, 106))
    plan = step(sched, seqs, token=42)
    assert shape(plan) == [("P", "a", 0, 10, True), ("P", "b", 0, 6, True)]
    assert plan.prefill[0].tokens == list(range(10)) and len(plan.prefill[0].mla_pages) == 3  # ceil(10 / 4)
    assert plan.prefill[1].mla_pages == [p for p in plan.prefill[1].mla_pages if p not in plan.prefill[0].mla_pages]
    plan = step(sched, seqs)
    assert shape(plan) == [("D", "a", 10, 1, True), ("D", "b", 6, 1, True)]
    assert [it.token for it in plan.decode] == [42, 42]  # the token the previous step sampled
    assert isinstance(plan.decode[0], DecodeItem) and len(plan.decode[1].mla_pages) == 2  # 7 tokens: 2 pages
    assert [len(seqs[s].tokens) for s in "ab"] == [12, 8]


def test_decode_rows_come_first_and_prompts_are_chunked_within_the_token_budget():
    sched, seqs = make(step_tokens=8, prefill_chunk=8)
    add(sched, seqs, "a", range(3))
    step(sched, seqs)  # a's prompt; a decodes from now on
    add(sched, seqs, "b", range(20))
    plans = [shape(step(sched, seqs)) for _ in range(3)]
    assert plans == [[("P", "b", 0, 7, False), ("D", "a", 3, 1, True)],  # 1 decode + 7 prompt tokens = 8
                     [("P", "b", 7, 7, False), ("D", "a", 4, 1, True)],
                     [("P", "b", 14, 6, True), ("D", "a", 5, 1, True)]]  # the last chunk samples b's first token


def test_prefill_chunk_caps_a_prompt_below_the_budget():
    sched, seqs = make(step_tokens=64, prefill_chunk=5)
    add(sched, seqs, "a", range(12))
    add(sched, seqs, "b", range(3))
    # b fits the step whole: admitted before a's first chunk (shortest prompt first)
    assert shape(step(sched, seqs)) == [("P", "b", 0, 3, True), ("P", "a", 0, 5, False)]
    assert shape(step(sched, seqs)) == [("P", "a", 5, 5, False), ("D", "b", 3, 1, True)]


def test_a_short_prompt_starts_in_the_step_it_arrives_while_a_long_one_prefills():
    """SRPT for prompts: a running 40-token prompt does not push a 3-token arrival past the step's budget."""
    sched, seqs = make(step_tokens=8, prefill_chunk=8)
    add(sched, seqs, "big", range(40))
    assert shape(step(sched, seqs)) == [("P", "big", 0, 8, False)]
    add(sched, seqs, "short", range(100, 103))
    assert shape(step(sched, seqs)) == [("P", "short", 0, 3, True), ("P", "big", 8, 5, False)]
    assert shape(step(sched, seqs)) == [("P", "big", 13, 7, False), ("D", "short", 3, 1, True)]


def test_prefill_cap_bounds_prompt_tokens_while_a_sequence_decodes():
    sched, seqs = make(step_tokens=64, prefill_chunk=32)
    sched.prefill_cap = 6
    add(sched, seqs, "a", range(4))
    assert shape(step(sched, seqs)) == [("P", "a", 0, 4, True)]  # nothing decodes yet: no cap
    add(sched, seqs, "b", range(100, 130))
    assert shape(step(sched, seqs)) == [("P", "b", 0, 6, False), ("D", "a", 4, 1, True)]
    assert shape(step(sched, seqs)) == [("P", "b", 6, 6, False), ("D", "a", 5, 1, True)]
    sched.prefill_cap = None
    assert shape(step(sched, seqs)) == [("P", "b", 12, 18, True), ("D", "a", 6, 1, True)]


def test_max_batch_holds_requests_in_the_queue():
    sched, seqs = make(max_batch=2)
    for s in "abc":
        add(sched, seqs, s, range(4))
    assert [it.seq_id for it in step(sched, seqs).prefill] == ["a", "b"]
    assert [s.id for s in sched.waiting] == ["c"]
    sched.finish(seqs["a"])
    assert shape(step(sched, seqs)) == [("P", "c", 0, 4, True), ("D", "b", 4, 1, True)]


def test_a_full_pool_preempts_the_latest_arrival_which_is_recomputed_later():
    sched, seqs = make(pages=4)
    add(sched, seqs, "a", range(8))  # 2 pages
    add(sched, seqs, "b", range(100, 108))  # 2 pages: the pool is full
    step(sched, seqs)
    assert sched.pool.available == 0
    plan = step(sched, seqs)  # a's 9th token needs a third page: b, the later arrival, gives its two back
    assert shape(plan) == [("D", "a", 8, 1, True)]  # b's decode row was dropped from this plan
    assert sched.preemptions == 1
    b = seqs["b"]  # re-admitted in the same step, but no pages fit it yet: nothing of it is planned
    assert b.num_computed == 0 and b.mla_pages == [] and b.tokens == list(range(100, 108)) + [7]
    sched.finish(seqs["a"])
    plan = step(sched, seqs)  # b comes back and recomputes its prompt and the token it had drawn
    assert shape(plan) == [("P", "b", 0, 9, True)]
    assert plan.prefill[0].tokens == list(range(100, 108)) + [7]


def test_a_request_that_cannot_get_pages_preempts_no_earlier_arrival():
    sched, seqs = make(pages=3)
    add(sched, seqs, "a", range(8))
    step(sched, seqs)
    add(sched, seqs, "b", range(100, 108))  # needs 2 pages, 1 is free, and a arrived first
    plan = step(sched, seqs)
    assert shape(plan) == [("D", "a", 8, 1, True)]
    assert sched.preemptions == 0 and seqs["b"].mla_pages == [] and seqs["b"].num_computed == 0
    sched.finish(seqs["a"])
    assert shape(step(sched, seqs)) == [("P", "b", 0, 8, True)]


def test_a_prefix_hit_skips_the_cached_blocks_and_shares_their_pages():
    sched, seqs = make(prefix=True)
    a = add(sched, seqs, "a", range(10), max_tokens=1)
    step(sched, seqs)
    cached = a.mla_pages[:2]  # tokens 0-7: two full blocks, published to the cache
    sched.finish(a)
    b = add(sched, seqs, "b", [*range(8), 50, 51, 52])
    plan = step(sched, seqs)
    assert shape(plan) == [("P", "b", 8, 3, True)]
    assert plan.prefill[0].tokens == [50, 51, 52] and b.cached_tokens == 8
    assert plan.prefill[0].mla_pages[:2] == cached and len(plan.prefill[0].mla_pages) == 3
    c = add(sched, seqs, "c", range(8))  # the whole prompt is cached: its last block is recomputed (a logit)
    assert shape(step(sched, seqs)) == [("P", "c", 4, 4, True), ("D", "b", 11, 1, True)] and c.cached_tokens == 4


def test_a_prefix_miss_after_a_different_first_block():
    sched, seqs = make(prefix=True)
    a = add(sched, seqs, "a", range(10), max_tokens=1)
    step(sched, seqs)
    sched.finish(a)
    add(sched, seqs, "b", [99, *range(1, 10)])
    assert shape(step(sched, seqs)) == [("P", "b", 0, 10, True)]


def test_with_kda_layers_chunks_end_at_checkpoints_and_hits_restore_one():
    sched, seqs = make(layout=HYBRID, prefix=True)
    a = add(sched, seqs, "a", range(18), max_tokens=1)
    # checkpoints every 2 blocks (8 tokens) and at the prompt's last full block (16): chunks end there
    assert [shape(step(sched, seqs)) for _ in range(3)] == [[("P", "a", 0, 8, False)], [("P", "a", 8, 8, False)],
                                                           [("P", "a", 16, 2, True)]]
    assert sched.prefix.num_checkpoints == 2
    sched.finish(a)
    b = add(sched, seqs, "b", [*range(12), 60])
    # the hit is the checkpoint at 8 (block 12 is cached, but no KDA state after it); b's chunk ends at its own
    # last full block, 12, for a checkpoint there
    assert shape(step(sched, seqs)) == [("P", "b", 8, 4, False)]
    assert b.cached_tokens == 8 and len(b.kda_pages) == HYBRID.kda_pages
    # one known token left: a decode row (a prompt token fed like a generated one)
    assert shape(step(sched, seqs)) == [("D", "b", 12, 1, True)] and sched.prefix.num_checkpoints == 3


def test_long_prompts_get_a_share_of_the_budget_while_short_ones_wait():
    sched, seqs = make(step_tokens=16, prefill_chunk=16, long_prompt=12, long_share=0.5)
    add(sched, seqs, "long", range(40), long=True)
    add(sched, seqs, "short", range(100, 104))
    # short requests first; the long one gets half of what is left while a short one is waiting or prefilling
    assert shape(step(sched, seqs)) == [("P", "short", 0, 4, True), ("P", "long", 0, 8, False)]
    # nothing short is waiting or prefilling now: the long prompt takes the rest of the budget
    assert shape(step(sched, seqs)) == [("P", "long", 8, 15, False), ("D", "short", 4, 1, True)]


def test_decode_prompt_tokens_feeds_a_short_remainder_through_the_decode_path():
    sched, seqs = make(prefix=True, decode_prompt_tokens=2)
    a = add(sched, seqs, "a", range(8), max_tokens=1)
    step(sched, seqs)
    sched.finish(a)
    add(sched, seqs, "b", [*range(4), 70, 71])  # 4 cached, 2 to feed: one decode row a step, sampling at the last
    assert shape(step(sched, seqs)) == [("D", "b", 4, 1, False)]
    assert shape(step(sched, seqs)) == [("D", "b", 5, 1, True)]


def test_plans_are_plain_data():
    sched, seqs = make()
    add(sched, seqs, "a", range(5))
    plan = step(sched, seqs)
    (item,) = plan.prefill
    assert isinstance(item, PrefillItem) and item.images == ()
    with pytest.raises(AttributeError):  # frozen: the runner cannot change what the scheduler decided
        item.start = 3
    assert item.sample.step == 0 and step(sched, seqs).decode[0].sample.step == 1  # the noise index of each draw
