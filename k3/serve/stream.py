"""Streams of a request's events on the event loop, and the SSE response that always notices a client leaving.

``collect`` gathers a non-streaming request's events and cancels the request if the client disconnects meanwhile;
``EventStream`` sends Server-Sent Events and closes the body generator on a disconnect, whose ``finally`` (in
``RequestStream.batches``) cancels the request and frees its cache in the engine.
"""

from __future__ import annotations

import asyncio

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..inference.api import FinishEvent, TokenEvent
from .backend import RequestStream

__all__ = ["collect", "EventStream"]


async def collect(stream: RequestStream, request: Request) -> tuple[list[TokenEvent], FinishEvent]:
    """All events of a non-streaming request; a client that disconnects meanwhile cancels the request."""
    async def watch_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        stream.cancel()

    watcher = asyncio.create_task(watch_disconnect())
    tokens: list[TokenEvent] = []
    try:
        async for batch in stream.batches():
            for event in batch:
                if isinstance(event, TokenEvent):
                    tokens.append(event)
                else:
                    return tokens, event
    finally:
        watcher.cancel()
    raise AssertionError("unreachable: a stream's batches end with a FinishEvent")


class EventStream(StreamingResponse):
    """Server-Sent Events that always watch for the client leaving, whatever ASGI version the server speaks,
    and always close the body generator, so an early disconnect reaches the request's cancellation at once."""

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
