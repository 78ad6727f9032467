"""Bridge the engine's blocking event iterator into asyncio, and cancel the request when the client leaves.

Each request gets one daemon thread that runs ``for event in handle`` and hands the events to the event loop
through an ``asyncio.Queue`` (so no thread pool is held by idle streams and a slow engine never blocks the
loop). Whenever the consumer stops before the FinishEvent (client disconnect, server shutdown, an error), the
bridge calls ``handle.cancel()``, which frees the request's cache in the engine.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..inference.api import FinishEvent, TokenEvent

__all__ = ["events", "collect", "EventStream"]

_END = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def _pump(handle: Any, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
    """Thread body: move events from the blocking iterator to the loop; give up if the loop is gone."""
    try:
        try:
            for event in handle:
                loop.call_soon_threadsafe(queue.put_nowait, event)
        except Exception as e:  # surfaced to the request as an error, never silently dropped
            loop.call_soon_threadsafe(queue.put_nowait, _Failed(e))
        loop.call_soon_threadsafe(queue.put_nowait, _END)
    except RuntimeError:  # the event loop was closed under us (server shutdown)
        handle.cancel()


async def events(handle: Any) -> AsyncIterator[TokenEvent | FinishEvent]:
    """The handle's events, awaited without blocking the loop; cancels the request if closed early."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    threading.Thread(target=_pump, args=(handle, loop, queue), daemon=True, name="k3-serve-pump").start()
    finished = False
    try:
        while True:
            item = await queue.get()
            if item is _END:
                raise RuntimeError("the engine's event stream ended without a FinishEvent")
            if isinstance(item, _Failed):
                raise item.error
            finished = isinstance(item, FinishEvent)
            yield item
            if finished:
                return
    finally:
        if not finished:
            handle.cancel()  # synchronous: safe even while the task is being cancelled


async def collect(handle: Any, request: Request) -> tuple[list[TokenEvent], FinishEvent]:
    """All events of a non-streaming request; a client that disconnects meanwhile cancels the request."""
    async def watch_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        handle.cancel()

    watcher = asyncio.create_task(watch_disconnect())
    tokens: list[TokenEvent] = []
    try:
        async for event in events(handle):
            if isinstance(event, TokenEvent):
                tokens.append(event)
            else:
                return tokens, event
    finally:
        watcher.cancel()
    raise AssertionError("unreachable: events() ends with a FinishEvent or raises")


class EventStream(StreamingResponse):
    """Server-Sent Events that always watch for the client leaving, whatever ASGI version the server speaks,
    and always close the body generator, so an early disconnect reaches ``handle.cancel()`` at once."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
