"""The engine in its own process (SPEC §7), as vLLM's engine core and SGLang's scheduler process: the HTTP server's
event loop and the engine's step loop then never share an interpreter lock.

    server process                                  engine process (spawned)
    EngineProcess.submit ── ("submit", request) ──> receiver thread: Engine.submit(request, sink)
    RequestStream  <── dispatch ── reader thread <── ("events", [(id, event), ...]) ── after each step
                                                 <── ("hello", info) ("phase", text) ("ready", s) ("stats", dict)
                                                     ("failed", reason) ("fatal", message)

The engine process builds its engine with ``build()`` (a picklable callable, e.g. ``functools.partial`` of
``k3.cli.serve.build_engine`` over the command's arguments), says hello (model name, context limit, vocabulary,
vision tower), warms up (``Engine.warmup``: CUDA graphs, compilation, autotuning; reported as phases), then runs the
engine's loop on a thread while its main thread takes requests. Events go back once per engine step, in one message:
detokenisation and stop strings stay in the engine process (the same code as in-process), the server process only
formats and sends. Messages travel over ``multiprocessing`` pipes (pickled); a request id is the server's. When the
server process dies, the engine process sees its pipe close and exits; when the engine process dies, every open
request ends with an error and ``health()`` says why.
"""

from __future__ import annotations

import gc
import hashlib
import multiprocessing as mp
import threading
import time
from collections import deque
from typing import Any, Callable

from ..inference.api import FinishEvent, GenerationRequest
from ..inference.engine import EngineFailed
from .backend import RequestStream, dispatch
from .fleet import PUBLISH_EVERY, PrefixMirror, PrefixTracker
from .images import vision_of

__all__ = ["EngineProcess", "tokenizer_digest"]

STATS_EVERY = 0.25  # seconds between the engine process's stats messages


def tokenizer_digest(tok: Any) -> str:
    """A fingerprint of a tokenizer's vocabulary, to check both processes loaded the same one."""
    n = tok.get_vocab_size(with_added_tokens=True)
    probe = [tok.decode([i]) for i in range(0, n, max(1, n // 257))]
    return hashlib.sha256(repr((n, probe)).encode()).hexdigest()[:16]


# ---- the engine process ---------------------------------------------------------------------------------------------
class _Sink:
    __slots__ = ("rid", "outbox")

    def __init__(self, rid: str, outbox: deque):
        self.rid, self.outbox = rid, outbox

    def put(self, event: Any) -> None:
        self.outbox.append((self.rid, event))


def _core_main(build: Callable, requests, replies) -> None:
    lock = threading.Lock()
    gone = threading.Event()  # the server process closed its end: nothing more to tell it

    def send(msg) -> None:
        if gone.is_set():
            return
        with lock:
            try:
                replies.send(msg)
            except (BrokenPipeError, EOFError, ConnectionResetError):
                gone.set()

    try:
        engine = build()
    except Exception as e:  # noqa: BLE001 - the server prints it and exits
        send(("fatal", f"{type(e).__name__}: {e}"))
        return
    send(("hello", {"model_name": engine.model_name, "max_context": engine.max_context,
                    "vocab_size": engine.tokenizer.get_vocab_size(with_added_tokens=True),
                    "model_vocab": engine.model.config.vocab_size, "vision": vision_of(engine),
                    "digest": tokenizer_digest(engine.tokenizer), "stats": engine.stats(),
                    "hash_block": engine.cfg.hash_block, "prefix_cache": engine.prefix is not None}))
    try:
        seconds = engine.warmup(progress=lambda text: send(("phase", f"warming up: {text}")))
    except Exception as e:  # noqa: BLE001
        send(("fatal", f"warm-up failed: {type(e).__name__}: {e}"))
        return
    gc.collect()
    gc.freeze()  # the model, pool and graphs live for the whole run: no collection walks them again
    outbox: deque = deque()
    state = {"stats_at": 0.0, "failed_sent": False, "prefix_at": 0.0}
    tracker = PrefixTracker(engine.prefix)

    def flush() -> None:
        items = []
        while outbox:
            items.append(outbox.popleft())
        if items:
            send(("events", items))
        now = time.monotonic()
        if now - state["stats_at"] > STATS_EVERY:
            state["stats_at"] = now
            send(("stats", engine.stats()))
        if now - state["prefix_at"] > PUBLISH_EVERY:  # what a fleet router mirrors (k3.serve.fleet)
            state["prefix_at"] = now
            delta = tracker.poll()
            if delta is not None:
                send(("prefix", *delta))
        if engine.failed and not state["failed_sent"]:
            state["failed_sent"] = True
            send(("failed", engine.failed))

    engine.after_step = flush
    engine.start()
    send(("ready", seconds))
    last_stats = None
    try:
        while True:
            try:
                if not requests.poll(STATS_EVERY):  # idle: the last step's stats may be stale (an abort, a finish)
                    stats = engine.stats()
                    if stats != last_stats:
                        last_stats = stats
                        send(("stats", stats))
                    delta = tracker.poll()
                    if delta is not None:
                        send(("prefix", *delta))
                    continue
                msg = requests.recv()
            except (EOFError, OSError):  # the server process is gone
                gone.set()
                break
            kind = msg[0]
            if kind == "submit":
                req: GenerationRequest = msg[1]
                try:
                    engine.submit(req, _Sink(req.request_id, outbox))
                except Exception as e:  # noqa: BLE001 - the server checked it already; say why anyway
                    outbox.append((req.request_id, FinishEvent("error", len(req.prompt_ids), 0, 0, "", str(e))))
                    flush()
            elif kind == "abort":
                engine.abort(msg[1])
            elif kind == "abort_all":
                for rid in list(engine.seqs):
                    engine.abort(rid)
            elif kind == "stop":
                break
    finally:
        engine.stop()
        flush()


# ---- the server process ----------------------------------------------------------------------------------------------
class EngineProcess:
    """The engine in a child process, behind the backend interface of ``k3.serve.backend``. ``tokenizer``: the
    same tokenizer the engine process loads (checked by fingerprint), for prompts and logprobs."""

    def __init__(self, build: Callable, tokenizer: Any):
        self.build, self.tokenizer = build, tokenizer
        self.model_name, self.max_context, self.vocab_size, self.vision = "", 0, 0, None
        self.ready, self.phase, self.failed, self.fatal, self.warmup_s = False, "loading the model", None, None, None
        self._stats: dict = {}
        self.prefix_mirror: PrefixMirror | None = None  # set by the hello
        self._streams: dict[str, RequestStream] = {}
        self._hello = threading.Event()
        self._send_lock = threading.Lock()
        self.proc = None

    def start(self) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA state or threads inherited from this one
        req_r, self._req_w = ctx.Pipe(duplex=False)
        self._rep_r, rep_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_core_main, args=(self.build, req_r, rep_w), name="k3-engine", daemon=True)
        self.proc.start()
        req_r.close()
        rep_w.close()
        threading.Thread(target=self._read, name="k3-engine-reader", daemon=True).start()

    def wait_hello(self, timeout: float | None = None) -> None:
        """Block until the engine process has built its engine (or failed to: RuntimeError with its message)."""
        self._hello.wait(timeout)
        if self.fatal:
            raise RuntimeError(self.fatal)

    def _read(self) -> None:
        while True:
            try:
                msg = self._rep_r.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "events":
                self._deliver(msg[1])
            elif kind == "stats":
                self._stats = msg[1]
            elif kind == "prefix":
                self.prefix_mirror.apply(msg[1], msg[2])
            elif kind == "phase":
                self.phase = msg[1]
            elif kind == "hello":
                self._take_hello(msg[1])
            elif kind == "ready":
                self.warmup_s, self.phase, self.ready = msg[1], "ready", True
            elif kind == "failed":
                self.failed = msg[1]
            elif kind == "fatal":
                self.fatal = self.failed = msg[1]
                self._hello.set()
        if not self.failed:
            code = self.proc.exitcode if self.proc is not None else None
            self.failed = f"the engine process exited{f' with code {code}' if code is not None else ''}"
        self.ready = False
        self._hello.set()
        self._fail_open()

    def _take_hello(self, info: dict) -> None:
        self.model_name, self.max_context, self.vision = info["model_name"], info["max_context"], info["vision"]
        self.vocab_size, self._stats = info["vocab_size"], info["stats"]
        self.prefix_mirror = PrefixMirror(info["hash_block"], info["prefix_cache"])
        if info["digest"] != tokenizer_digest(self.tokenizer):
            self.fatal = self.failed = ("the engine process loaded a different tokenizer than the server process; "
                                        "restart k3 serve (is the checkpoint being rewritten?)")
        self._hello.set()

    def _deliver(self, items: list) -> None:
        by_loop: dict = {}
        for rid, event in items:
            stream = self._streams.get(rid)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((rid, event))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(dispatch, self._streams, batch)
            except RuntimeError:
                for rid, _ in batch:
                    self._streams.pop(rid, None)

    def _fail_open(self) -> None:
        items = [(rid, FinishEvent("error", 0, 0, 0, "", self.failed)) for rid in list(self._streams)]
        self._deliver(items)

    def _send(self, msg) -> None:
        with self._send_lock:
            self._req_w.send(msg)

    def submit(self, req: GenerationRequest) -> RequestStream:
        if self.failed:
            raise EngineFailed(f"the engine failed and serves no more requests: {self.failed}")
        stream = RequestStream(req.request_id, self.abort)
        self._streams[req.request_id] = stream
        try:
            self._send(("submit", req))
        except (OSError, ValueError) as e:
            self._streams.pop(req.request_id, None)
            raise EngineFailed(f"the engine process is unreachable: {e}") from None
        return stream

    def abort(self, rid: str) -> None:
        try:
            self._send(("abort", rid))
        except (OSError, ValueError):
            pass

    def abort_all(self, reason: str = "shutdown") -> None:
        try:
            self._send(("abort_all", reason))
        except (OSError, ValueError):
            pass

    def health(self) -> dict:
        return {"ready": self.ready and not self.failed, "phase": self.phase, "failed": self.failed,
                "warmup_s": self.warmup_s, "vocab_size": self.vocab_size, **self._stats}

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        try:
            self._send(("stop",))
        except (OSError, ValueError):
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self._req_w.close()
