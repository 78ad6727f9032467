"""The router's parts without servers: the hashes match the engine's, the index needs a KDA checkpoint, the mirror's
deltas rebuild the state, the ring moves only a dead replica's keys, and each class keeps its share."""

import asyncio

import pytest

from k3.inference.prefix import chain_hashes
from k3.router.admission import Admission, parse_classes
from k3.router.index import PrefixIndex, prompt_hashes
from k3.router.policy import Ring
from k3.serve.fleet import PrefixMirror, PrefixTracker


def test_router_hashes_are_the_engines():
    ids = list(range(100))
    assert prompt_hashes(ids, [], 16) == chain_hashes(ids, 16)


def test_a_hit_needs_the_blocks_and_a_kda_checkpoint():
    hs = chain_hashes(list(range(64)), 16)  # four blocks
    index = PrefixIndex()
    index.apply({"epoch": "e", "version": 1, "hash_block": 16, "full": True,
                 "blocks": {hs[0].hex(): False, hs[1].hex(): True, hs[2].hex(): False}})
    assert index.reusable(hs) == 2  # block 2 is held but no checkpoint follows it; block 3 is not held
    index.apply({"epoch": "e", "version": 2, "hash_block": 16, "full": False, "added": {hs[2].hex(): True},
                 "removed": [hs[0].hex()]})
    assert index.reusable(hs) == 0  # the first block is gone: nothing after it can be reused
    index.expect(hs)
    assert index.reusable(hs) == 4  # what the router sent there is expected until the replica says otherwise


class _FakeCache:
    def __init__(self):
        self.state = {}

    def reusable_blocks(self):
        return dict(self.state)


def test_the_mirrors_deltas_rebuild_the_cache_state():
    cache, mirror, index = _FakeCache(), PrefixMirror(16), PrefixIndex()
    tracker = PrefixTracker(cache)
    for step in range(5):
        cache.state = {bytes([i]) * 16: i % 2 == 0 for i in range(step, step + 3)}
        delta = tracker.poll()
        mirror.apply(*delta)
        index.apply(mirror.since(index.version, index.epoch))
        assert index.blocks == cache.state
    assert tracker.poll() is None
    assert mirror.since(0, "another epoch")["full"] is True


def test_the_ring_moves_only_a_dead_replicas_keys():
    names = ["http://a", "http://b", "http://c"]
    ring = Ring(names)
    before = {k: ring.order(k)[0] for k in map(str, range(300))}
    assert len(set(before.values())) == 3
    alive = lambda k: [n for n in ring.order(k) if n != "http://b"][0]  # noqa: E731 - b is down
    for k, primary in before.items():
        assert alive(k) == primary if primary != "http://b" else alive(k) == ring.order(k)[1]


def test_each_class_keeps_its_share():
    classes = parse_classes("short=0:0.5,long=100:0.5")
    adm = Admission(classes, max_inflight=2)  # one replica: a budget of 1 per class
    short, long = adm.class_of(5), adm.class_of(500)

    async def go():
        await adm.acquire(long)
        waiter = asyncio.ensure_future(adm.acquire(long))
        await asyncio.sleep(0)
        assert not waiter.done()  # the long class is at its share
        await asyncio.wait_for(adm.acquire(short), 1)  # the short class is not
        adm.release(long)
        await asyncio.wait_for(waiter, 1)
        return adm.stats()

    stats = asyncio.run(go())
    assert stats["long"]["waited"] == 1 and stats["short"]["waited"] == 0


@pytest.mark.parametrize("text", ["short=0", "long=10:0.5", "a=0:0.7,b=5:0.7", "a=0:0.5,a=5:0.5"])
def test_bad_classes_name_the_flag(text):
    with pytest.raises(ValueError, match="--classes"):
        parse_classes(text)
