"""What a replica tells a fleet router (k3.router, SPEC §7 fleet routing): its prefix-cache state and its prompts.

- ``GET /v1/prefix_cache?since=V&epoch=E``: the prefix cache's fine blocks, each chain hash (hex) with whether a hit
  may end there (``True``: a KDA checkpoint is kept after the block, so both halves of the hybrid state exist).
  With the ``epoch`` and ``version`` of an earlier answer it is a delta (``added``, ``removed``) while the replica
  still holds the log since then, else the whole state (``full: true``, ``blocks``). A restarted replica has a new
  epoch, so a router never mixes two lives of one replica.
- ``POST /v1/tokenize``: the body of a completion or chat request -> the prompt's ids and its images' (start, end,
  digest), exactly what the engine hashes (``k3.inference.prefix.extend_hashes``), and the replica's ``hash_block``.

The engine's process publishes the state: ``PrefixTracker.poll`` diffs ``PrefixCache.reusable_blocks()`` against the
last published one (O(cached blocks), at most every ``PUBLISH_EVERY`` seconds, on the engine's thread after a step);
the server's process keeps a ``PrefixMirror`` of it. (No ``from __future__ import annotations`` here: FastAPI reads
the routes' annotations, and ``Request`` is imported inside ``add_fleet_routes``.)
"""

import os
import threading
from collections import deque
from typing import Any

PUBLISH_EVERY = 0.25  # seconds between two diffs of the prefix cache
LOG_LEN = 256  # deltas the mirror keeps for routers that poll with `since`

__all__ = ["PrefixTracker", "PrefixMirror", "add_fleet_routes", "PUBLISH_EVERY"]


class PrefixTracker:
    """On the engine's side: what changed in the prefix cache since the last ``poll``."""

    def __init__(self, prefix: Any):
        self.prefix, self.last = prefix, {}

    def poll(self) -> tuple[dict, list] | None:
        if self.prefix is None:
            return None
        cur = self.prefix.reusable_blocks()
        added = {h: v for h, v in cur.items() if self.last.get(h) != v}
        removed = [h for h in self.last if h not in cur]
        self.last = cur
        return (added, removed) if added or removed else None


class PrefixMirror:
    """On the server's side: the published state, a version counter and the last ``LOG_LEN`` deltas."""

    def __init__(self, hash_block: int, enabled: bool = True):
        self.hash_block, self.enabled = hash_block, enabled
        self.epoch = os.urandom(6).hex()
        self.version, self.blocks = 0, {}
        self.log: deque = deque(maxlen=LOG_LEN)  # (version after, added, removed)
        self.lock = threading.Lock()  # applied from the engine's or the reader's thread, read on the event loop

    def apply(self, added: dict, removed: list) -> None:
        with self.lock:
            self._apply(added, removed)

    def _apply(self, added: dict, removed: list) -> None:
        for h in removed:
            self.blocks.pop(h, None)
        self.blocks.update(added)
        self.version += 1
        self.log.append((self.version, added, removed))

    def since(self, version: int | None, epoch: str | None) -> dict:
        with self.lock:
            return self._since(version, epoch)

    def _since(self, version: int | None, epoch: str | None) -> dict:
        head = {"epoch": self.epoch, "version": self.version, "hash_block": self.hash_block,
                "prefix_cache": self.enabled}
        oldest = self.log[0][0] - 1 if self.log else self.version
        if epoch == self.epoch and version is not None and oldest <= version <= self.version:
            added, removed = {}, []
            for v, a, r in self.log:
                if v > version:
                    for h in r:
                        added.pop(h, None)
                    removed += r
                    added.update(a)
            return {**head, "full": False, "added": {h.hex(): c for h, c in added.items()},
                    "removed": [h.hex() for h in removed]}
        return {**head, "full": True, "blocks": {h.hex(): c for h, c in self.blocks.items()}}


def add_fleet_routes(app: Any, engine: Any, template: Any, prompt_ids: Any) -> None:
    """Add the two routes above to ``create_app``'s app; ``prompt_ids``: its completion prompt encoder."""
    from fastapi import Request
    from pydantic import ValidationError
    from starlette.concurrency import run_in_threadpool

    from ..chat import ChatError
    from .images import chat_prompt
    from .protocol import APIError, ChatRequest, CompletionRequest

    @app.get("/v1/prefix_cache")
    async def prefix_cache(since: int | None = None, epoch: str | None = None):
        mirror = getattr(engine, "prefix_mirror", None)
        if mirror is None:
            raise APIError("this backend publishes no prefix-cache state", None, "unsupported", status=404)
        return mirror.since(since, epoch)

    @app.post("/v1/tokenize")
    async def tokenize(request: Request):
        body = await request.json()
        if not isinstance(body, dict):
            raise APIError("the body must be a JSON object: a completion or chat request", None)
        mirror = getattr(engine, "prefix_mirror", None)
        hash_block = mirror.hash_block if mirror is not None else 0
        try:
            if "messages" in body:
                req = ChatRequest.model_validate(body)
                ids, _, images = await run_in_threadpool(chat_prompt, engine, template,
                                                         [m.as_dict() for m in req.messages], req.tool_specs(),
                                                         req.tool_choice_value(), req.effort())
                media = [[im.start, im.start + im.length, im.digest.hex()] for im in images]
            else:
                req = CompletionRequest.model_validate(body)
                ids, media = await prompt_ids(engine.tokenizer, req.prompt), []
        except ValidationError as e:
            raise APIError(f"not a completion or chat request: {e.errors()[0].get('msg')}",
                           ".".join(str(x) for x in e.errors()[0].get("loc", ())) or None) from None
        except ChatError as e:
            raise APIError(str(e), e.param) from None
        except ValueError as e:
            raise APIError(str(e), "messages") from None
        return {"ids": list(ids), "media": media, "hash_block": hash_block}
