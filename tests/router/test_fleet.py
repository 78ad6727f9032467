"""k3 router over three tiny replicas (SPEC §7 fleet routing, issue 49's acceptance): affinity keeps a session's
turns on the replica that holds its prefix, responses match a direct replica's byte for byte, a burst of long prompts
leaves short requests' TTFT near idle, and a killed primary's sessions move to their backup without failing a request
that had not started. Module order matters: the failover test kills a replica, so it runs last."""

import json
import random
import re
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import get, post, start_router, stop

pytestmark = pytest.mark.slow  # three replicas start once for the module (tens of seconds on a shared CPU)
VOCAB = 1024  # the --random-init tokenizer's


@pytest.fixture(scope="module")
def router(fleet):
    url, proc = start_router(fleet.urls, "--classes", "short=0:0.75,long=1024:0.25", "--max-inflight", "4")
    yield url
    stop(proc)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, VOCAB) for _ in range(n)]


def complete(url, prompt, session=None, max_tokens=4, **kw):
    status, headers, raw = post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                          "temperature": 0, **kw},
                                {"x-session-id": session} if session else None)
    assert status == 200, raw
    return headers.get("x-k3-replica"), json.loads(raw)


def test_a_sessions_turns_stay_on_one_replica_and_hit_its_cache(router):
    rng = random.Random(1)
    placed = {}
    for s in range(4):
        prompt, name = [], f"sess-{s}"
        for turn in range(4):
            prompt = prompt + ids(rng, 40)
            replica, body = complete(router, prompt, name)
            placed.setdefault(name, set()).add(replica)
            if turn:
                assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= (len(prompt) - 40) // 16 * 16
    assert all(len(v) == 1 for v in placed.values()), placed
    stats = get(router + "/router/stats")
    assert stats["hits"] >= 12 and stats["spills"] == 0, stats


def test_the_same_prompt_without_a_session_goes_where_its_prefix_is(router):
    prompt = ids(random.Random(2), 100)
    first, _ = complete(router, prompt)
    time.sleep(0.3)  # the replica's next publication says it holds the blocks
    again, body = complete(router, prompt + ids(random.Random(3), 20))
    assert again == first and body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96


def _masked(raw: bytes) -> bytes:
    """The response without what differs per request by design (the id and the creation second)."""
    raw = re.sub(rb'"id": ?"[a-z]+-[0-9a-f]+"', b'"id":"X"', raw)
    return re.sub(rb'"created": ?\d+', b'"created":0', raw)


def _stream(raw: bytes) -> tuple:
    """(text, finish reasons, usage, each event's bytes with its text and ids masked) of an SSE body."""
    text, finish, usage, shapes = "", [], None, []
    for line in raw.split(b"\n\n"):
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        for c in event.get("choices", []):
            text += c.get("text") or (c.get("delta") or {}).get("content") or ""
            finish.append(c.get("finish_reason"))
        usage = event.get("usage") or usage
        shapes.append(re.sub(rb'"(text|content)": "(\\.|[^"\\])*"', b'"T"', _masked(line)))
    assert raw.endswith(b"data: [DONE]\n\n")
    return text, [f for f in finish if f], usage, sorted(set(shapes))


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "import os\n", "max_tokens": 12}),
    ("/v1/completions", {"prompt": "def main():", "max_tokens": 8, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Yo"}], "max_tokens": 8, "stream": True,
                              "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": [10**6], "max_tokens": 4}),  # refused by the replica: the same 400 comes back
], ids=["completion", "completion-stream", "chat", "chat-stream-usage", "bad-token"])
def test_router_responses_are_byte_identical_to_a_direct_replicas(fleet, router, path, body):
    body = {"model": "tiny", "temperature": 0, **body}
    post(router + path, body)  # once first, so that both compared requests find the prompt cached (cached_tokens)
    status, headers, via = post(router + path, body)
    direct = post(headers.get("x-k3-replica", fleet.urls[0]) + path, body)
    assert status == direct[0]
    if body.get("stream"):  # a replica groups tokens into SSE writes by timing, so compare what the events carry
        assert _stream(via) == _stream(direct[2])
    else:
        assert _masked(via) == _masked(direct[2])
    if status == 200:
        assert headers["x-k3-replica"] in fleet.urls


def test_models_health_and_stats(router, fleet):
    assert get(router + "/v1/models")["data"][0]["id"] == "tiny"
    assert get(router + "/health")["healthy_replicas"] == 3
    stats = get(router + "/router/stats")
    assert set(stats["replicas"]) == set(fleet.urls) and set(stats["classes"]) == {"short", "long"}


def _ttft(url: str, prompt, session=None) -> float:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(
        {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}).encode(),
        {"content-type": "application/json", **({"x-session-id": session} if session else {})})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:
        r.readline()  # the first SSE line: the first token
        t = time.monotonic() - t0
        r.read()
    return t


def test_a_burst_of_long_prompts_leaves_short_ttft_near_idle(router):
    rng = random.Random(4)
    idle = statistics.median(_ttft(router, ids(rng, 12)) for _ in range(6))
    longs = [ids(rng, 3000) for _ in range(6)]
    with ThreadPoolExecutor(6) as pool:
        burst = [pool.submit(_ttft, router, p) for p in longs]
        time.sleep(0.5)
        during = []
        while not all(f.done() for f in burst) and len(during) < 12:
            during.append(_ttft(router, ids(rng, 12)))
        [f.result() for f in burst]
    stats = get(router + "/router/stats")["classes"]
    assert stats["long"]["waited"] >= 1  # the long class went over its share and queued
    assert statistics.median(during) <= max(6 * idle, idle + 0.5), (idle, during)


def test_killing_the_primary_moves_its_sessions_to_the_backup(fleet, router):
    rng = random.Random(5)
    sessions = {f"fo-{s}": [] for s in range(6)}
    home = {}
    for name in sessions:  # turn 1 of each session: where it lives
        sessions[name] = ids(rng, 40)
        home[name], _ = complete(router, sessions[name], name)
    victim = home["fo-0"]
    failures, results, stop_at = [], [], time.monotonic() + 4
    killer = threading.Timer(1.0, fleet.kill, args=(victim,))
    killer.start()

    def run(name):  # turns until the deadline, each a non-streaming request: it sends nothing before it is done
        while time.monotonic() < stop_at:
            sessions[name] = sessions[name] + ids(random.Random(name), 20)
            status, headers, raw = post(router + "/v1/completions", {"model": "tiny", "prompt": sessions[name],
                                        "max_tokens": 4, "temperature": 0}, {"x-session-id": name})
            (results if status == 200 else failures).append((name, headers.get("x-k3-replica"), status, raw[:200]))

    with ThreadPoolExecutor(len(sessions)) as pool:
        list(pool.map(run, sessions))
    killer.join()
    assert not failures, failures
    moved = [n for n in sessions if home[n] == victim]
    last = {n: r for n, r, *_ in results}
    assert all(last[n] != victim for n in moved), (victim, last)
    assert get(router + "/router/stats")["replicas"][victim]["healthy"] is False
    fleet.restart(victim)  # re-entry: the health checks bring it back, its keys return
    deadline = time.monotonic() + 20
    while not get(router + "/router/stats")["replicas"][victim]["healthy"] and time.monotonic() < deadline:
        time.sleep(0.2)
    stats = get(router + "/router/stats")["replicas"][victim]
    assert stats["healthy"] and stats["reentries"] == 1
    replica, _ = complete(router, ids(rng, 8), "fo-0")
    assert replica == victim
