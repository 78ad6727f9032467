"""What the HTTP app talks to: an engine in this process (``LocalBackend``) or in its own (``k3.serve.core``).

Both hand the engine's events to the event loop in batches, never one cross-thread call per token:
- the engine puts each request's TokenEvents / FinishEvent on a sink that only appends to a list;
- after each engine step (``Engine.after_step``) the list is handed to the loop in one call per loop, which
  appends every event to its request's ``RequestStream`` and wakes the stream's task once;
- a stream task takes everything queued since it last ran as one batch, so a stream sends one SSE chunk per engine
  step, or fewer, larger chunks when the client or the loop is slower than the engine.

The app needs from a backend: ``tokenizer``, ``model_name``, ``max_context``, ``vocab_size``, ``vision`` (None or
``(vision_config, media_placeholder_token_id)``), ``submit(GenerationRequest) -> RequestStream``, ``health() ->
dict`` (``ready``, ``phase``, ``failed`` and the engine's stats), ``abort_all(reason)`` (server shutdown), ``start()``
and ``stop()``.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections import deque
from typing import Any

from ..inference.api import FinishEvent, GenerationRequest
from .fleet import PUBLISH_EVERY, PrefixMirror, PrefixTracker
from .images import vision_of

__all__ = ["RequestStream", "LocalBackend", "dispatch"]


class RequestStream:
    """One request's events on the event loop: ``push`` (loop thread only) and ``batches()``."""

    def __init__(self, rid: str, cancel):
        self.id, self._cancel = rid, cancel
        self.loop = asyncio.get_running_loop()
        self._items: deque = deque()
        self._ready = asyncio.Event()
        self.finished = False

    def push(self, event: Any) -> None:
        self._items.append(event)
        self._ready.set()

    async def batches(self):
        """Lists of events, each everything that arrived since the last; the last list ends with the FinishEvent.
        Closing the generator early (the client left, shutdown) cancels the request."""
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                batch = list(self._items)
                self._items.clear()
                if isinstance(batch[-1], FinishEvent):
                    self.finished = True
                yield batch
                if self.finished:
                    return
        finally:
            if not self.finished:
                self.cancel()

    def cancel(self) -> None:
        self._cancel(self.id)


def dispatch(streams: dict[str, RequestStream], items: list[tuple[str, Any]]) -> None:
    """On the loop: each (request id, event) to its stream; a finished request's stream is forgotten."""
    for rid, event in items:
        stream = streams.get(rid)
        if stream is None:
            continue  # its client left and the stream was dropped
        stream.push(event)
        if isinstance(event, FinishEvent):
            streams.pop(rid, None)


class _Sink:
    """Where the engine puts one request's events: appended, with the request id, to the backend's pending list."""

    __slots__ = ("rid", "pending")

    def __init__(self, rid: str, pending: deque):
        self.rid, self.pending = rid, pending

    def put(self, event: Any) -> None:
        self.pending.append((self.rid, event))


class LocalBackend:
    """The engine on a thread of this process. ``warmup``: ``start()`` first runs ``Engine.warmup`` on a thread
    (``health()`` says not ready and what it is doing meanwhile); otherwise the backend is ready at once (a test's
    engine, or one already warm)."""

    def __init__(self, engine: Any, warmup: bool = False):
        self.engine = engine
        self.tokenizer, self.model_name, self.max_context = engine.tokenizer, engine.model_name, engine.max_context
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.vision = vision_of(engine)
        self.ready, self.phase, self.warmup_s = not warmup, "starting" if warmup else "ready", None
        self._warmup = warmup
        self._pending: deque = deque()  # appended by the engine's thread, drained by flush (both atomic)
        self._streams: dict[str, RequestStream] = {}
        prefix, cfg = getattr(engine, "prefix", None), getattr(engine, "cfg", None)
        self.prefix_mirror = PrefixMirror(getattr(cfg, "hash_block", 0), prefix is not None)
        self._tracker, self._published_at = PrefixTracker(prefix), 0.0
        engine.after_step = self.flush

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        if not self._warmup:
            self.engine.start()
            return

        def warm() -> None:
            try:
                self.warmup_s = self.engine.warmup(progress=self._progress)
            except Exception as e:  # noqa: BLE001 - reported on /health and to every request, never a hang
                self.phase = f"warm-up failed: {type(e).__name__}: {e}"
                self.engine.failed = self.phase
                return
            gc.collect()
            gc.freeze()  # what exists now lives for the whole run: no collection walks it again
            self.engine.start()
            self.phase, self.ready = "ready", True

        threading.Thread(target=warm, name="k3-warmup", daemon=True).start()

    def _progress(self, text: str) -> None:
        self.phase = f"warming up: {text}"

    def stop(self) -> None:
        self.engine.stop()
        self.flush()

    def abort_all(self, reason: str = "shutdown") -> None:
        for rid in list(self._streams):
            self.engine.abort(rid)

    # ---- requests -----------------------------------------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> RequestStream:
        stream = RequestStream(req.request_id, self.engine.abort)
        self._streams[req.request_id] = stream
        try:
            self.engine.submit(req, _Sink(req.request_id, self._pending))
        except BaseException:
            self._streams.pop(req.request_id, None)
            raise
        return stream

    def flush(self) -> None:
        """Hand the events the engine produced since the last flush to their loops (one call per loop)."""
        by_loop: dict = {}
        while self._pending:
            rid, event = self._pending.popleft()
            stream = self._streams.get(rid)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((rid, event))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(dispatch, self._streams, batch)
            except RuntimeError:  # that loop is closed (its client's test portal, or shutdown)
                for rid, _ in batch:
                    self._streams.pop(rid, None)
        if time.monotonic() - self._published_at > PUBLISH_EVERY:  # what a fleet router mirrors (k3.serve.fleet)
            self._published_at = time.monotonic()
            delta = self._tracker.poll()
            if delta is not None:
                self.prefix_mirror.apply(*delta)

    def health(self) -> dict:
        failed = getattr(self.engine, "failed", None)
        stats = self.engine.stats() if hasattr(self.engine, "stats") else {}
        return {"ready": self.ready and not failed, "phase": self.phase, "failed": failed,
                "warmup_s": self.warmup_s, "vocab_size": self.vocab_size, **stats}
