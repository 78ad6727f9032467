"""The replicas behind the router: their health, load and prefix-cache mirrors, kept fresh by two background loops.

- Health: ``GET /health`` every ``health_every`` seconds. A replica that fails ``fail_after`` checks in a row (or
  whose connection fails under a request) leaves the ring's healthy set; one that answers 200 ``rejoin_after`` times
  in a row re-enters. A replica that comes back as a new process (a new prefix epoch) starts with an empty index.
- Prefix state: ``GET /v1/prefix_cache?since=V&epoch=E`` every ``poll_every`` seconds (deltas, k3.serve.fleet).

HTTP client: aiohttp (one ``ClientSession`` with a connection pool per replica), as benchmarks/bench_serve.py uses:
its streaming reads (``content.readany``) hand SSE bytes through as they arrive, and it is already installed.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp

from .index import PrefixIndex

__all__ = ["Replica", "Fleet"]


@dataclass
class Replica:
    url: str  # http://host:port, no trailing slash
    healthy: bool = False
    inflight: int = 0  # requests the router has open there
    queued_tokens: int = 0  # prompt tokens of those that have not sent their first byte yet
    index: PrefixIndex = field(default_factory=PrefixIndex)
    fails: int = 0  # health checks failed in a row
    oks: int = 0  # health checks passed in a row while unhealthy
    model: str | None = None
    last_error: str | None = None
    requests: int = 0
    removals: int = 0
    reentries: int = 0

    def stats(self) -> dict:
        return {"healthy": self.healthy, "inflight": self.inflight, "queued_tokens": self.queued_tokens,
                "requests": self.requests, "indexed_blocks": len(self.index.blocks),
                "removals": self.removals, "reentries": self.reentries, "last_error": self.last_error}


class Fleet:
    def __init__(self, urls: list[str], health_every: float = 1.0, poll_every: float = 0.25, fail_after: int = 2,
                 rejoin_after: int = 1, on_change=None):
        self.replicas = {u: Replica(u) for u in urls}
        self.health_every, self.poll_every = health_every, poll_every
        self.fail_after, self.rejoin_after = fail_after, rejoin_after
        self.on_change = on_change  # called with the number of healthy replicas when it changes
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                             connector=aiohttp.TCPConnector(limit=0, limit_per_host=0))
        await asyncio.gather(*(self.check(r) for r in self.replicas.values()))
        self._tasks = [asyncio.create_task(self._loop(self.check, self.health_every)),
                       asyncio.create_task(self._loop(self.poll, self.poll_every))]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    async def _loop(self, fn, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            await asyncio.gather(*(fn(r) for r in self.replicas.values()), return_exceptions=True)

    @property
    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    async def check(self, r: Replica) -> None:
        try:
            async with self.session.get(r.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                body = await resp.json(content_type=None)
                ok = resp.status == 200
                error = None if ok else f"/health answered {resp.status}: {body.get('status')} {body.get('phase')}"
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            ok, body, error = False, {}, f"/health failed: {type(e).__name__}: {e}"
        if ok:
            r.fails, r.model = 0, body.get("model", r.model)
            r.oks += 1
            if not r.healthy and r.oks >= self.rejoin_after:
                self._set(r, True)
        else:
            r.oks, r.last_error = 0, error
            r.fails += 1
            if r.healthy and r.fails >= self.fail_after:
                self._set(r, False)

    def mark_down(self, r: Replica, error: str) -> None:
        """A request could not reach ``r``: out of the healthy set at once (the health loop brings it back)."""
        r.last_error, r.oks, r.fails = error, 0, self.fail_after
        if r.healthy:
            self._set(r, False)

    def _set(self, r: Replica, healthy: bool) -> None:
        r.healthy = healthy
        if healthy:
            r.reentries += 1 if r.removals else 0
        else:
            r.removals += 1
        if self.on_change is not None:
            self.on_change(len(self.healthy))

    async def poll(self, r: Replica) -> None:
        if not r.healthy:
            return
        q = f"?since={r.index.version}&epoch={r.index.epoch}" if r.index.epoch else ""
        try:
            async with self.session.get(r.url + "/v1/prefix_cache" + q,
                                        timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status != 200:
                    return
                msg = await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return
        if msg["epoch"] != r.index.epoch and r.index.epoch is not None:
            r.index.reset()  # a new process: nothing of the old one's cache survives
        r.index.apply(msg)
        r.index.expire(time.monotonic())
