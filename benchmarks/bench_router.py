"""`k3 router` over several `k3 serve` replicas (SPEC §7 fleet routing): cache-aware affinity against round-robin and
against hashing the prompt's first block, on one workload, in one run.

    python benchmarks/bench_router.py [--replicas 3] [--policies affinity,round-robin,first-block] [--rounds 2]
        [--sessions 12] [--turns 6] [--system-tokens 256] [--turn-tokens 192] [--burst 4] [--burst-tokens 4000]
        [--max-tokens 8] [--router-args "..."] [--json out.json] [-- SERVE ARGS]

It starts ``--replicas`` replicas of ``k3 serve SERVE ARGS`` once (default: the tiny random model on the CPU with
32-token hash blocks), then for each policy a ``k3 router --policy P`` in front of them and the same workload:
``--sessions`` concurrent multi-turn sessions (header ``X-Session-Id``), each turn its session's previous prompt plus
``--turn-tokens`` new tokens, all sessions opening with the same ``--system-tokens`` (a shared system prompt), and,
one second in, a burst of ``--burst`` prompts of ``--burst-tokens`` tokens each (the long class). Every request
streams ``--max-tokens`` tokens with ``ignore_eos`` and asks for usage. Each run gets fresh random tokens (its own
seed), so no run reuses another's cache; ``--rounds`` repeats every policy, in turn, so that a shared machine's drift
falls on all of them, and each figure pools the policy's rounds. Reported per policy: the prompt tokens the replicas
served from their caches (``cached_tokens``) and their share, TTFT p50/p99 of each class (sessions, burst), requests
and output tokens per second over the windows, the router's predicted hits and spills, and how the sessions spread
over the replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_serve import pct  # noqa: E402
from benchmarks.common import header  # noqa: E402

CPU_SERVE = ["--preset", "tiny", "--random-init", "--device", "cpu", "--hash-block", "32", "--page-tokens", "64",
             "--step-tokens", "1024", "--prefill-chunk", "512", "--long-prompt", "2048"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def wait(url: str, proc: subprocess.Popen, what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if get(url + "/health").get("status") == "ok":
                return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become ready (exit code {proc.poll()})")
        time.sleep(0.3)


def start(cmd: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "k3", *cmd, "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=sys.stderr, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    return proc, f"http://127.0.0.1:{port}"


async def one(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, sid: str | None,
              cls: str, out: list) -> None:
    body = {"model": MODEL[0], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    ttft, usage, replica, ok = None, {}, None, False
    async with session.post(url + "/v1/completions", json=body,
                            headers={"x-session-id": sid} if sid else {}) as resp:
        replica = resp.headers.get("x-k3-replica")
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                ok = resp.status == 200
                break
            ev = json.loads(line[6:])
            if ev.get("choices") and ttft is None:
                ttft = time.monotonic() - t0
            usage = ev.get("usage") or usage
    out.append({"cls": cls, "ok": ok, "ttft": ttft, "end": time.monotonic(), "start": t0, "replica": replica,
                "sid": sid, "prompt": len(prompt), "cached": (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens", 0), "output": usage.get("completion_tokens", 0)})


async def workload(url: str, args, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(5, vocab) for _ in range(n)]  # noqa: E731
    system, out = tok(args.system_tokens), []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def run_session(k: int) -> None:
            prompt = list(system)
            for _ in range(args.turns):
                prompt += tok(args.turn_tokens)
                await one(session, url, prompt, args.max_tokens, f"s{seed}-{k}", "session", out)

        async def burst() -> None:
            await asyncio.sleep(1.0)
            await asyncio.gather(*(one(session, url, tok(args.burst_tokens), args.max_tokens, None, "burst", out)
                                   for _ in range(args.burst)))

        await asyncio.gather(burst(), *(run_session(k) for k in range(args.sessions)))
    return out


def summarise(policy: str, rounds: list[tuple[list[dict], dict]]) -> dict:
    """One policy's figures over its rounds: percentiles over every request, throughput over the rounds' windows."""
    rows = [r for rs, _ in rounds for r in rs]
    by = {c: [r for r in rows if r["cls"] == c and r["ok"]] for c in ("session", "burst")}
    window = sum(max(r["end"] for r in rs) - min(r["start"] for r in rs) for rs, _ in rounds)
    total = lambda k: sum(st[k] for _, st in rounds)  # noqa: E731
    prompt, cached = sum(r["prompt"] for r in rows), sum(r["cached"] for r in rows)
    spread = {}
    for r in by["session"]:
        spread.setdefault(r["sid"], set()).add(r["replica"])
    return {"policy": policy, "requests": len(rows), "errors": sum(not r["ok"] for r in rows),
            "prompt_tokens": prompt, "cached_tokens": cached, "cached_share": round(cached / max(prompt, 1), 4),
            "session_cached_tokens": sum(r["cached"] for r in by["session"]),
            **{f"ttft_{c}_p{q}_s": round(pct([r["ttft"] for r in by[c]], q), 4) for c in by for q in (50, 99)},
            "req_per_s": round(len(rows) / window, 3),
            "output_tok_per_s": round(sum(r["output"] for r in rows) / window, 1),
            "router_hits": total("hits"), "router_misses": total("misses"), "spills": total("spills"),
            "router_hit_tokens": total("hit_tokens"),
            "replicas_per_session": round(sum(len(v) for v in spread.values()) / max(len(spread), 1), 2),
            "requests_per_replica": [sorted(v["requests"] for v in st["replicas"].values()) for _, st in rounds],
            "long_class_waited": sum(st["classes"].get("long", {}).get("waited", 0) for _, st in rounds)}


MODEL = ["tiny"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--policies", default="affinity,round-robin,first-block")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; each runs every policy once, in turn")
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--turn-tokens", type=int, default=192)
    ap.add_argument("--burst", type=int, default=4)
    ap.add_argument("--burst-tokens", type=int, default=4000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--router-args", default="--classes short=0:0.75,long=2048:0.25 --max-inflight 8",
                    help="extra k3 router flags (one string)")
    ap.add_argument("--json", default=None)
    ap.add_argument("serve", nargs=argparse.REMAINDER, help="-- then k3 serve's flags (default: tiny on the CPU)")
    args = ap.parse_args()
    serve = [a for a in args.serve if a != "--"] or CPU_SERVE
    t0 = time.monotonic()
    replicas = [start(["serve", *serve]) for _ in range(args.replicas)]
    results = []
    try:
        for proc, url in replicas:
            wait(url, proc, f"k3 serve at {url}")
        print(f"{args.replicas} replicas ready in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        health = get(replicas[0][1] + "/health")
        MODEL[0] = health["model"]
        vocab = health["vocab_size"]
        policies, runs = args.policies.split(","), {}
        for k in range(args.rounds * len(policies)):
            policy = policies[k % len(policies)]
            proc, url = start(["router", "--replicas", ",".join(u for _, u in replicas), "--policy", policy,
                               *shlex.split(args.router_args)])
            try:
                wait(url, proc, "k3 router", 60)
                while get(url + "/health")["healthy_replicas"] < args.replicas:
                    time.sleep(0.1)
                rows = asyncio.run(workload(url, args, vocab, 1000 + k))  # fresh tokens: no cache from earlier runs
                runs.setdefault(policy, []).append((rows, get(url + "/router/stats")))
                print(json.dumps(summarise(policy, runs[policy][-1:])), file=sys.stderr)
            finally:
                proc.terminate()
                proc.wait(20)
        results = [summarise(p, runs[p]) for p in policies]
    finally:
        for proc, _ in replicas:
            proc.terminate()
        for proc, _ in replicas:
            proc.wait(30)
    print_table(results, args, serve)
    if args.json:
        Path(args.json).write_text(json.dumps({**header(), "args": vars(args), "results": results}, indent=1))


def print_table(results: list[dict], args, serve: list[str]) -> None:
    h = header()
    print(f"bench_router: {args.rounds} rounds, {args.replicas} replicas of k3 serve {' '.join(serve)}; "
          f"{args.sessions} sessions x "
          f"{args.turns} turns (+{args.turn_tokens} tokens each, {args.system_tokens} shared), burst of {args.burst} x "
          f"{args.burst_tokens} tokens; commit {h['commit']}, {h['machine']}, {h['date']}")
    print("| policy | cached prompt tokens (share) | session TTFT p50 / p99 | burst TTFT p50 / p99 | req/s | "
          "output tok/s | hit tokens the router predicted | spills | replicas per session | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['policy']} | {r['cached_tokens']:,} ({r['cached_share']:.1%}) | "
              f"{r['ttft_session_p50_s']:.3f} / {r['ttft_session_p99_s']:.3f} s | "
              f"{r['ttft_burst_p50_s']:.3f} / {r['ttft_burst_p99_s']:.3f} s | {r['req_per_s']:.2f} | "
              f"{r['output_tok_per_s']:.0f} | {r['router_hit_tokens']:,} | {r['spills']} | "
              f"{r['replicas_per_session']:.2f} | {r['errors']} |")


if __name__ == "__main__":
    main()
