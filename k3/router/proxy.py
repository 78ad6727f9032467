"""The router's HTTP app (FastAPI, as k3 serve): an OpenAI-compatible proxy in front of several ``k3 serve`` replicas.

One request: (1) a replica tokenises the body (``POST /v1/tokenize``: the exact ids and image digests its engine would
hash; a refused body comes back from it as it is); (2) the router hashes the ids into the engine's fine blocks and
takes a slot of the prompt's length class (k3.router.admission); (3) the policy picks the replica (k3.router.policy);
(4) the body goes there unchanged, and the replica's bytes come back unchanged with ``X-K3-Replica`` naming it.
Failover: a request whose replica cannot be reached, drops the connection or answers 503 before sending a byte of its
body is retried once on the backup, and the replica leaves the healthy set until its health checks pass again. A
stream that had started is never replayed: it ends with an error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..serve.format import DONE, sse
from ..serve.protocol import error_body
from .admission import Admission, RequestClass
from .fleet import Fleet, Replica
from .index import prompt_hashes
from .policy import Choice, Ring, _RoundRobin, choose

__all__ = ["Router", "create_router_app", "REPLICA_HEADER"]

REPLICA_HEADER = "X-K3-Replica"
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


class _NothingSent(Exception):
    """The replica failed before sending a byte of the response body: safe to retry elsewhere."""


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           type: str = "server_error") -> JSONResponse:
    return JSONResponse(error_body(message, param, code, type), status_code=status)


class Router:
    def __init__(self, urls: list[str], policy: str, classes: list[RequestClass], max_inflight: int = 16,
                 spill: float = 4.0, **fleet_args):
        self.policy, self.spill = policy, spill
        self.admission = Admission(classes, max_inflight)
        self.fleet = Fleet(urls, on_change=self.admission.set_replicas, **fleet_args)
        self.ring, self.rr = Ring(urls), _RoundRobin()
        self.counts = {"requests": 0, "hits": 0, "misses": 0, "hit_tokens": 0, "prompt_tokens": 0, "spills": 0,
                       "retries": 0, "failed": 0, "stream_errors": 0}

    # ---- one request ----------------------------------------------------------------------------------------------
    async def handle(self, path: str, raw: bytes, session: str | None) -> Response:
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "the request body is not JSON; send one JSON object encoded as UTF-8", None,
                          "invalid_json", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", None, "invalid_json", "invalid_request_error")
        session = session or (body.get("user") if isinstance(body.get("user"), str) else None)
        tok = await self._tokenize(raw, session)
        if isinstance(tok, Response):
            return tok
        ids, hashes = tok["ids"], prompt_hashes(tok["ids"], tok["media"], tok["hash_block"])
        cls = self.admission.class_of(len(ids))
        await self.admission.acquire(cls)
        released = False
        try:
            try:
                choice = self._choose(session, hashes)
            except LookupError:
                return _error(503, "no replica is healthy; see GET /router/stats for each replica's last error", None,
                              "no_replica")
            self._count(choice, hashes, len(ids))
            resp = await self._forward(path, raw, choice, len(ids), hashes, bool(body.get("stream")),
                                       lambda: self.admission.release(cls))
            released = isinstance(resp, StreamingResponse)  # the stream releases its slot when it ends
            return resp
        finally:
            if not released:
                self.admission.release(cls)

    def _choose(self, session: str | None, hashes: list[bytes]) -> Choice:
        first = hashes[0].hex() if hashes else None
        key = first if self.policy == "first-block" else (session or first)
        return choose(self.policy, self.ring, self.fleet.replicas, key, hashes, self.spill, self.rr)

    def _count(self, choice: Choice, hashes: list[bytes], n: int) -> None:
        c = self.counts
        hit = choice.replica.index.reusable(hashes)
        c["requests"] += 1
        c["hits" if hit else "misses"] += 1
        c["hit_tokens"] += hit * choice.replica.index.hash_block
        c["prompt_tokens"] += n
        c["spills"] += choice.spilled

    async def _tokenize(self, raw: bytes, session: str | None) -> dict | Response:
        """The prompt's ids and media, from the session's primary (or the least loaded replica)."""
        tried: set[str] = set()
        for _ in range(2):
            try:
                choice = choose("affinity", self.ring, {u: r for u, r in self.fleet.replicas.items()
                                                        if u not in tried}, session, [], 1e9, self.rr)
            except LookupError:
                break
            r = choice.replica
            tried.add(r.url)
            try:
                async with self.fleet.session.post(r.url + "/v1/tokenize", data=raw,
                                                   headers={"content-type": "application/json"}) as resp:
                    data = await resp.read()
                    if resp.status == 200:
                        return json.loads(data)
                    if resp.status != 503:  # the replica refused the body: so would any other
                        return Response(data, resp.status, media_type=resp.content_type,
                                        headers={REPLICA_HEADER: r.url})
            except _UPSTREAM_ERRORS as e:
                self.fleet.mark_down(r, f"tokenize failed: {type(e).__name__}: {e}")
        return _error(503, "no replica could tokenize the request (none is healthy); retry later or see GET "
                      "/router/stats", None, "no_replica")

    async def _forward(self, path: str, raw: bytes, choice: Choice, n: int, hashes: list[bytes], stream: bool,
                       release) -> Response:
        targets = [choice.replica] + ([choice.backup] if choice.backup is not None else [])
        last = "no replica"
        for attempt, r in enumerate(targets):
            if attempt and not r.healthy:
                alive = [x for x in self.fleet.healthy if x is not targets[0]]
                if not alive:
                    break
                r = min(alive, key=lambda x: x.inflight)
            if attempt:
                self.counts["retries"] += 1
            try:
                return await self._send(path, raw, r, n, hashes, stream, release)
            except _NothingSent as e:
                last = str(e)
                self.fleet.mark_down(r, last)
        self.counts["failed"] += 1
        return _error(502, f"the request failed on its replica and its backup ({last}); retry it", None,
                      "replica_failed")

    async def _send(self, path: str, raw: bytes, r: Replica, n: int, hashes: list[bytes], stream: bool,
                    release) -> Response:
        r.inflight += 1
        r.queued_tokens += n
        r.requests += 1
        waiting, relayed, resp = True, False, None
        try:
            try:
                resp = await self.fleet.session.post(r.url + path, data=raw,
                                                     headers={"content-type": "application/json"})
                if resp.status == 503:
                    raise _NothingSent(f"{r.url} answered 503: {(await resp.read())[:200]!r}")
                first = await resp.content.readany()
                if not first and resp.status == 200:
                    raise _NothingSent(f"{r.url} closed the connection before answering")
            except _UPSTREAM_ERRORS as e:
                raise _NothingSent(f"{r.url}: {type(e).__name__}: {e}") from None
            r.queued_tokens -= n
            waiting = False
            r.index.expect(hashes)
            headers = {REPLICA_HEADER: r.url}
            if not stream or resp.status != 200:
                rest = await resp.read()
                return Response(first + rest, resp.status, media_type=resp.content_type, headers=headers)
            out = StreamingResponse(self._relay(resp, first, r, release), resp.status,
                                    headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                    media_type="text/event-stream")
            relayed = True  # the relay owns the response and the replica's count now
            return out
        except _UPSTREAM_ERRORS as e:  # after the first byte of a non-streaming body: the client sees a 502
            raise _NothingSent(f"{r.url}: {type(e).__name__}: {e}") from None
        finally:
            if waiting:
                r.queued_tokens -= n
            if not relayed:
                if resp is not None:
                    resp.release()
                r.inflight -= 1

    async def _relay(self, resp, first: bytes, r: Replica, release):
        try:
            yield first
            try:
                async for chunk in resp.content.iter_any():
                    yield chunk
            except _UPSTREAM_ERRORS as e:
                self.counts["stream_errors"] += 1
                self.fleet.mark_down(r, f"stream broke: {type(e).__name__}: {e}")
                yield sse(error_body(f"the replica {r.url} failed mid-stream ({type(e).__name__}); the reply so far "
                                     "is incomplete, send the request again", None, "replica_failed", "server_error"))
                yield DONE
        finally:
            resp.release()
            r.inflight -= 1
            release()

    # ---- the rest -------------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        c = self.counts
        return {"policy": self.policy, **c,
                "hit_rate": round(c["hits"] / c["requests"], 4) if c["requests"] else 0.0,
                "classes": self.admission.stats(),
                "replicas": {u: r.stats() for u, r in self.fleet.replicas.items()}}

    async def any_replica(self, path: str) -> Response:
        for r in sorted(self.fleet.healthy, key=lambda x: x.inflight):
            try:
                async with self.fleet.session.get(r.url + path) as resp:
                    return Response(await resp.read(), resp.status, media_type=resp.content_type,
                                    headers={REPLICA_HEADER: r.url})
            except _UPSTREAM_ERRORS as e:
                self.fleet.mark_down(r, f"{path} failed: {type(e).__name__}: {e}")
        return _error(503, "no replica is healthy; see GET /router/stats", None, "no_replica")


def create_router_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        await router.fleet.start()
        yield
        await router.fleet.stop()

    app = FastAPI(title="k3 router", summary="OpenAI-compatible proxy over k3 serve replicas", lifespan=lifespan)
    app.state.router = router

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.handle("/v1/completions", await request.body(), request.headers.get("x-session-id"))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await router.handle("/v1/chat/completions", await request.body(), request.headers.get("x-session-id"))

    @app.get("/v1/models")
    async def models():
        return await router.any_replica("/v1/models")

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        return await router.any_replica(f"/v1/models/{model}")

    @app.get("/health")
    async def health():
        n = len(router.fleet.healthy)
        body = {"status": "ok" if n else "no_replica", "healthy_replicas": n, "replicas": len(router.fleet.replicas)}
        return JSONResponse(body, status_code=200 if n else 503)

    @app.get("/router/stats")
    async def stats() -> dict[str, Any]:
        return router.stats()

    return app

