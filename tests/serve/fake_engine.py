"""A deterministic stand-in for ``k3.inference.Engine`` with its public API, for testing the server alone.

Whatever the prompt, the "model" writes ``script`` (default ``SCRIPT``; ``repeat`` times) then EOS, one token per request per engine
step, from a background thread, like continuous batching. It honours max_tokens ("length"), stop strings (via
the real IncrementalDetokenizer + StopMatcher, so TokenEvent texts are stop-safe and FinishEvent.text is the
whole completion), cancel ("abort"), reports cached_tokens as the longest prefix shared with an earlier prompt
(in blocks of 4 tokens) and invents logprobs. EOS counts as a completion token but has no TokenEvent.
Test hooks: ``submitted`` (requests), ``cancelled`` (request ids cancelled before they finished),
``step_delay`` (seconds per step), ``repeat``, ``abort_after`` (abort every request after that many tokens,
as an engine shutting down would).
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache

import uvicorn

from k3.data.tokenizer import train_tokenizer
from k3.inference.api import FinishEvent, GenerationRequest, TokenEvent
from k3.inference.detok import IncrementalDetokenizer, StopMatcher
from k3.inference.engine import RequestHandle

SCRIPT = "Hello, wörld! 漢字 and 🙂.<|im_end|> after ☃ the end"
CORPUS = ["Hello, wörld! Hello world, café é è 漢字 漢字 and 🙂 emoji 🙂", "the end and the start",
          "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"] * 4
BLOCK = 4


@lru_cache(maxsize=1)
def tiny_tokenizer():
    return train_tokenizer(CORPUS, vocab_size=300, min_frequency=1)


class FakeHandle(RequestHandle):
    """The real handle's event queue and iteration; cancel() only flags the request for the fake engine."""

    def __init__(self, engine: FakeEngine, request: GenerationRequest, events=None):
        super().__init__(engine, request.request_id, events)
        self.request = request
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()
        with self.engine._wake:
            self.engine._wake.notify()


@dataclass
class _State:
    handle: FakeHandle
    detok: IncrementalDetokenizer
    stop: StopMatcher
    cached: int
    n: int = 0
    text: list[str] = field(default_factory=list)


class FakeEngine:
    def __init__(self, tokenizer=None, max_context: int = 256, model_name: str = "k3-fake", step_delay: float = 0.0,
                 repeat: int = 1, script: str = SCRIPT):
        self.tokenizer = tokenizer or tiny_tokenizer()
        self.max_context, self.model_name = max_context, model_name
        self.step_delay, self.repeat, self.abort_after = step_delay, repeat, None
        self.script = self.tokenizer.encode(script, add_special_tokens=False).ids
        self.submitted: list[GenerationRequest] = []
        self.cancelled: list[str] = []
        self._prompts: list[tuple[int, ...]] = []
        self._active: list[_State] = []
        self._wake = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self.after_step = None  # as Engine's: called after every step (a server's backend sets it)

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._loop, daemon=True, name="fake-engine")
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._running = False
            self._wake.notify()
        self._thread.join()
        for s in self._active:
            self._finish(s, "abort")
        if self.after_step is not None:
            self.after_step()

    def expected_text(self, max_tokens: int | None = None, stop: tuple[str, ...] = ()) -> str:
        """The completion this engine writes for these settings, computed without the engine."""
        ids = (self.script * self.repeat)[:max_tokens]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        cuts = [text.find(s) for s in stop if s in text]
        return text[:min(cuts)] if cuts else text

    def abort(self, rid: str) -> None:
        for s in list(self._active):
            if s.handle.id == rid:
                s.handle.cancel()

    def submit(self, request: GenerationRequest, events=None) -> FakeHandle:
        n = len(request.prompt_ids)
        if n + (request.params.max_tokens or 1) > self.max_context:
            raise ValueError(f"prompt ({n}) + max_tokens ({request.params.max_tokens}) > {self.max_context}")
        handle = FakeHandle(self, request, events)
        prompt = tuple(request.prompt_ids)
        shared = max((_common(prompt, p) for p in self._prompts), default=0)
        cached = min(shared, n - 1) // BLOCK * BLOCK
        state = _State(handle, IncrementalDetokenizer(self.tokenizer), StopMatcher(request.params.stop), cached)
        with self._wake:
            self.submitted.append(request)
            self._prompts.append(prompt)
            self._active.append(state)
            self._wake.notify()
        return handle

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._running and not self._active:
                    self._wake.wait()
                if not self._running:
                    return
                batch = list(self._active)
            for state in batch:
                if self._step(state):
                    with self._wake:
                        self._active.remove(state)
            if self.after_step is not None:
                self.after_step()
            if self.step_delay:
                time.sleep(self.step_delay)

    def _step(self, s: _State) -> bool:
        """One token for one request; True when the request is finished."""
        params = s.handle.request.params
        if s.handle.cancelled.is_set():
            self.cancelled.append(s.handle.request.request_id)
            return self._finish(s, "abort")
        if self.abort_after is not None and s.n >= self.abort_after:
            return self._finish(s, "abort")
        stream = self.script * self.repeat
        s.n += 1
        if s.n > len(stream):
            return self._finish(s, "stop")  # EOS
        token = stream[s.n - 1]
        text, stopped = s.stop.feed(s.detok.push(token))
        s.text.append(text)
        V = self.tokenizer.get_vocab_size()
        top = tuple(((token + j) % V, -0.5 * (j + 1)) for j in range(params.logprobs))
        s.handle.events.put(TokenEvent(token, text, -0.25 * (token % 4 + 1), top))
        if stopped:
            return self._finish(s, "stop", flush=False)
        if s.n >= (params.max_tokens or self.max_context - len(s.handle.request.prompt_ids)):
            return self._finish(s, "length")
        return False

    def _finish(self, s: _State, reason: str, flush: bool = True) -> bool:
        if flush and reason != "abort":
            text, stopped = s.stop.feed(s.detok.flush())
            s.text.append(text if stopped else text + s.stop.flush())
            reason = "stop" if stopped else reason
        s.handle.events.put(FinishEvent(reason, len(s.handle.request.prompt_ids), s.n, s.cached, "".join(s.text)))
        return True


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@contextmanager
def live_server(app):
    """A real uvicorn server for ``app`` on 127.0.0.1 (a free port, a background thread); yields its /v1 URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # the OS picks a free port; loopback only
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
