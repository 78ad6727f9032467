"""The load generator of ``bench_serve.py``: streaming OpenAI clients over HTTP, one asyncio loop per process.

Two independent clients: ``aiohttp`` (a well-kept HTTP client, the default) and ``raw`` (HTTP/1.1 written and
chunked SSE parsed by hand on asyncio streams, about 60 lines), so a figure can be checked against a client that
shares no code with the first. Each request records, on this process's ``time.perf_counter`` clock rebased to the
wall clock: its start, the arrival of each stream chunk that carries text (a chunk may carry several tokens: the
server sends what one engine step produced, or more when the client reads slower than that), the usage chunk's
counts and any error.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

__all__ = ["Job", "Record", "run_jobs"]


@dataclass(frozen=True)
class Job:
    """One request: ``prompt`` is token ids (completions) or text (chat); ``at``: seconds after the start at which
    it is sent (Poisson arrivals), or None to send it as soon as a client slot is free (fixed concurrency)."""

    endpoint: str  # "completions" | "chat"
    prompt: list[int] | str
    max_tokens: int
    at: float | None = None


@dataclass
class Record:
    start: float = 0.0  # wall-clock seconds
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk that carries text
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    end: float = 0.0


def _body(job: Job, model: str) -> dict:
    common = {"model": model, "max_tokens": job.max_tokens, "stream": True, "temperature": 0.0,
              "ignore_eos": True, "stream_options": {"include_usage": True}}
    if job.endpoint == "chat":
        return {**common, "messages": [{"role": "user", "content": job.prompt}]}
    return {**common, "prompt": job.prompt}


def _take(rec: Record, payload: str, now: float) -> bool:
    """One SSE data payload; True at [DONE]."""
    if payload == "[DONE]":
        return True
    obj = json.loads(payload)
    if "error" in obj:
        rec.error = obj["error"].get("message", "error")
        return False
    if obj.get("usage"):
        u = obj["usage"]
        rec.prompt_tokens, rec.completion_tokens = u["prompt_tokens"], u["completion_tokens"]
        rec.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    for ch in obj.get("choices", []):
        delta = ch.get("delta", ch)
        text = delta.get("text") or delta.get("content") or delta.get("reasoning_content") or ""
        if text:
            rec.chunks.append(now)
    return False


class Clock:
    """perf_counter, rebased once to the wall clock: monotonic within a process, comparable across processes."""

    def __init__(self):
        self.offset = time.time() - time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() + self.offset


async def _aiohttp_one(session, url: str, job: Job, model: str, clock: Clock) -> Record:
    rec = Record(start=clock())
    path = "/v1/chat/completions" if job.endpoint == "chat" else "/v1/completions"
    try:
        async with session.post(url + path, json=_body(job, model)) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return rec
            async for line in r.content:
                if line.startswith(b"data: ") and _take(rec, line[6:].strip().decode(), clock()):
                    break
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash of the benchmark
        rec.error = f"{type(e).__name__}: {e}"
    rec.end = clock()
    return rec


async def _raw_one(url: str, job: Job, model: str, clock: Clock) -> Record:
    """HTTP/1.1 by hand: one connection per request, chunked transfer decoding, SSE lines."""
    rec = Record(start=clock())
    u = urlsplit(url)
    path = "/v1/chat/completions" if job.endpoint == "chat" else "/v1/completions"
    body = json.dumps(_body(job, model)).encode()
    try:
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        status = (await reader.readline()).split()[1]
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # headers
        if status != b"200":
            rec.error = f"HTTP {status.decode()}"
        buf, done = b"", False
        while not done and not rec.error:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            buf += await reader.readexactly(size)
            await reader.readexactly(2)
            now = clock()
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.startswith(b"data: ") and _take(rec, line[6:].strip().decode(), now):
                    done = True
        writer.close()
    except Exception as e:  # noqa: BLE001
        rec.error = f"{type(e).__name__}: {e}"
    rec.end = clock()
    return rec


async def _run(url: str, model: str, jobs: list[Job], concurrency: int, client: str, t0: float) -> list[Record]:
    clock = Clock()
    sem = asyncio.Semaphore(concurrency)
    session = None
    if client == "aiohttp":
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                        timeout=aiohttp.ClientTimeout(total=None, sock_read=600))

    async def one(job: Job) -> Record:
        if job.at is not None:
            await asyncio.sleep(max(0.0, t0 + job.at - clock()))
        async with sem:
            if session is not None:
                return await _aiohttp_one(session, url, job, model, clock)
            return await _raw_one(url, job, model, clock)

    try:
        await asyncio.sleep(max(0.0, t0 - clock()))
        return list(await asyncio.gather(*(one(j) for j in jobs)))
    finally:
        if session is not None:
            await session.close()


def run_jobs(url: str, model: str, jobs: list[Job], concurrency: int, client: str, t0: float) -> list[dict]:
    """Run ``jobs`` with at most ``concurrency`` in flight, starting at wall-clock ``t0``; the records as dicts
    (a process pool's workers return them)."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return [asdict(r) for r in asyncio.run(_run(url, model, jobs, concurrency, client, t0))]


def make_jobs(endpoint: str, n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
              shared_prefix: int, rate: float | None, seed: int) -> list[Job]:
    """``n`` jobs with prompt/output lengths uniform in the given [lo, hi] ranges, a common random prefix of
    ``shared_prefix`` tokens, and Poisson arrival times at ``rate`` requests/s (None: fixed concurrency)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    words = "the of and to in is for on with as by at from that this it be are".split()
    jobs, t = [], 0.0
    for _ in range(n):
        length = rng.randint(*prompt_len)
        if endpoint == "chat":  # text of about `length` tokens (k3's BPE: about one token per short word)
            prompt: list[int] | str = " ".join(rng.choice(words) for _ in range(length))
        else:
            prompt = prefix + [rng.randrange(3, vocab) for _ in range(max(1, length - shared_prefix))]
        if rate:
            t += rng.expovariate(rate)
        jobs.append(Job(endpoint, prompt, rng.randint(*output_len), t if rate else None))
    return jobs
