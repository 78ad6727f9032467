"""An OpenAI-compatible HTTP server over ``k3.inference.Engine`` (FastAPI + uvicorn).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``"stream": true`` as Server-Sent Events ending in ``data: [DONE]``), ``GET /health``. One choice per request
(``n`` = 1). Chat messages may hold ``image_url`` parts (``data:`` URLs) when the engine's model has a vision tower
(k3.serve.images). Every refused request is HTTP 400 with an OpenAI error body and the server keeps serving.

The app talks to a backend (k3.serve.backend): the engine on a thread of this process (``LocalBackend``) or in its
own process (``k3.serve.core.EngineProcess``, what ``k3 serve`` runs). Events come to each request's stream in
batches, one per engine step (or fewer when the client is slower), and each batch goes out as one SSE write.
Readiness: until the backend has warmed up (CUDA graphs captured, compilation and autotuning done) ``/health``
answers 503 with ``"ready": false`` and what it is doing, and requests get 503 with ``Retry-After``; after a failure
of the engine, ``/health`` answers 503 with the reason, waiting requests end with a 500 that says why and new ones get
a 503. ``create_app`` neither starts nor stops the backend; ``run_server`` does both, and on SIGINT / SIGTERM ends
every open stream at once (an error event, then ``[DONE]``) before it exits; a second signal exits at once.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ..chat import ChatError, chat_template_for
from ..inference.api import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from ..inference.engine import EngineFailed
from ..vision.preprocess import ImageError
from .backend import LocalBackend, RequestStream
from .fleet import add_fleet_routes
from .format import DONE, ChatFormat, CompletionFormat, Formatter, sse
from .images import NoVisionTower, chat_prompt
from .protocol import APIError, ChatRequest, CompletionRequest, error_body, validation_message
from .stream import EventStream, collect

__all__ = ["create_app", "run_server"]

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: until the context limit


RETRY_AFTER = 2  # seconds, while the backend warms up


def _check_common(engine: Any, req: CompletionRequest | ChatRequest) -> None:
    if not engine.ready:
        h = engine.health()
        if h.get("failed"):
            raise APIError(f"the engine failed and serves no more requests: {h['failed']}", None, "engine_failed",
                           status=503, type="server_error")
        raise APIError(f"the server is not ready yet ({h.get('phase')}); retry after {RETRY_AFTER} s or poll "
                       "GET /health until it says ready", None, "not_ready", status=503, type="server_error",
                       headers={"Retry-After": str(RETRY_AFTER)})
    if req.model != engine.model_name:
        raise APIError(f"the model {req.model!r} does not exist here; this server serves {engine.model_name!r} "
                       "(see GET /v1/models)", "model", "model_not_found")
    if req.n not in (None, 1):
        raise APIError(f"n={req.n} is not supported: this server returns one choice per request; send n separate "
                       "requests (with different seeds) instead", "n", "unsupported_parameter")
    req.check_supported()


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def _unparsed_body(raw: bytes) -> tuple[str, str]:
    """(message, code) for a request body FastAPI could not parse: bytes that are not UTF-8 (JSON is UTF-8 text),
    or else JSON that would not decode."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return (f"the request body is not valid UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} ({e.reason}); "
                "send JSON text encoded as UTF-8 (json.dumps escapes every non-ASCII character)", "invalid_encoding")
    return "the request body could not be parsed as JSON; send one JSON object encoded as UTF-8", "invalid_json"


def _check_ids(tokenizer: Any, ids: list[int]) -> list[int]:
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise APIError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt")
    return ids


async def _prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError(f"batched prompts are not supported: got {len(prompt)} prompts; send one prompt per "
                           "request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = await run_in_threadpool(lambda: tokenizer.encode(prompt, add_special_tokens=False).ids)
    else:
        ids = _check_ids(tokenizer, list(prompt))
    if not ids:
        raise APIError("the prompt is empty; send at least one token", "prompt")
    return ids


def _check_context(engine: Any, n_prompt: int, max_tokens: int) -> None:
    if n_prompt + max_tokens > engine.max_context:
        raise APIError(f"this model's maximum context length is {engine.max_context} tokens, but you requested "
                       f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion); "
                       "shorten the prompt or lower max_tokens", "max_tokens", "context_length_exceeded")


def _params(req: CompletionRequest | ChatRequest, max_tokens: int | None, stop: list[str], logprobs: int
            ) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                              top_k=max(req.top_k or 0, 0), top_p=1.0 if req.top_p is None else req.top_p,
                              seed=req.seed, stop=tuple(stop), logprobs=logprobs,
                              ignore_eos=req.ignore_eos)
    except ValueError as e:
        raise APIError(str(e)) from None


def _submit(engine: Any, ids: list[int], params: SamplingParams, request_id: str, images: tuple = ()
            ) -> RequestStream:
    try:
        return engine.submit(GenerationRequest(prompt_ids=tuple(ids), params=params, request_id=request_id,
                                                images=images))
    except EngineFailed as e:
        raise APIError(str(e), None, "engine_failed", status=503, type="server_error") from None
    except ValueError as e:  # the engine refuses what it cannot run; say why
        raise APIError(str(e)) from None


def _aborted() -> APIError:
    return APIError("the engine aborted this request (it may be shutting down); retry later", None,
                    "engine_aborted", status=503, type="server_error")


def _engine_error(finish) -> APIError:
    return APIError(f"generation failed: the engine failed ({finish.error}); the server must be restarted", None,
                    "engine_failed", status=500, type="server_error")


def _finish_chunks(fmt: Formatter, event: FinishEvent, streamed: str) -> list[str]:
    if event.reason == "abort":
        return [sse(_aborted().body())]
    if event.reason == "error":
        return [sse(_engine_error(event).body())]
    # text still held back (a possible stop-string prefix, an unfinished character) is sent now
    tail = event.text[len(streamed):] if event.text.startswith(streamed) else ""
    out = [sse(c) for c in fmt.chunks(tail, [], event.reason)]
    if fmt.include_usage:
        out.append(sse(fmt.usage_chunk(event)))
    return out


async def _sse(fmt: Formatter, stream: RequestStream):
    """The stream body, one write per batch of events (an engine step's tokens of this request, or all that came
    while the client was being written to): their text as one chunk, then at the end the held-back tail with
    finish_reason, usage and [DONE]."""
    streamed = ""
    first = fmt.first_chunk()
    if first is not None:
        yield sse(first)
    try:
        async for batch in stream.batches():
            tokens = [e for e in batch if isinstance(e, TokenEvent)]
            out = []
            if tokens:
                text = "".join(e.text for e in tokens)
                if text or fmt.logprobs:
                    streamed += text
                    out = [sse(c) for c in fmt.chunks(text, tokens)]
            if isinstance(batch[-1], FinishEvent):
                out += _finish_chunks(fmt, batch[-1], streamed)
            if out:
                yield "".join(out)
    except Exception as e:  # headers are gone already: report in-band, as OpenAI does
        yield sse(error_body(f"generation failed: {e}", None, "engine_error", "server_error"))
    yield DONE


async def _respond(fmt: Formatter, stream: RequestStream, request: Request, streaming: bool):
    if streaming:
        return EventStream(_sse(fmt, stream), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    tokens, finish = await collect(stream, request)
    if finish.reason == "abort":
        raise _aborted()
    if finish.reason == "error":
        raise _engine_error(finish)
    return fmt.response(tokens, finish)


def create_app(engine: Any, chat_template: Any = None) -> FastAPI:
    """The FastAPI app serving ``engine``: a backend (``k3.serve.backend``), or an engine, which is then served from
    a thread of this process (``LocalBackend``, ready at once); ``chat_template`` renders chat messages and parses
    replies (default: the tokenizer's own format, ``k3.chat.chat_template_for``)."""
    if not hasattr(engine, "health"):
        engine = LocalBackend(engine)
    tokenizer = engine.tokenizer
    template = chat_template or chat_template_for(tokenizer)
    if tokenizer is None:
        raise TypeError("create_app needs the engine's tokenizer as engine.tokenizer (the tokenizers.Tokenizer it "
                        "decodes with), to encode prompts and spell tokens in logprobs")
    app = FastAPI(title="k3", summary="OpenAI-compatible API")
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        message, param, code = validation_message(list(e.errors()))
        return JSONResponse(error_body(message, param, code), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        if e.status_code == 400 and e.detail == "There was an error parsing the body":  # FastAPI's: say why
            message, code = _unparsed_body(await request.body())
            return JSONResponse(error_body(message, None, code), status_code=400)
        return JSONResponse(error_body(str(e.detail), None, _HTTP_CODES.get(e.status_code)),
                            status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception):
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", None, None, "server_error"),
                            status_code=500)

    @app.get("/health")
    async def health():
        h = engine.health()
        if h.get("failed"):
            return JSONResponse({"status": "failed", "ready": False, "model": engine.model_name, "error": h["failed"]},
                                status_code=503)
        if not h["ready"]:
            return JSONResponse({"status": "starting", "model": engine.model_name, **h}, status_code=503,
                                headers={"Retry-After": str(RETRY_AFTER)})
        return {"status": "ok", "model": engine.model_name, **h}

    def model_card() -> dict:
        return {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "k3",
                "max_model_len": engine.max_context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != engine.model_name:
            raise APIError(f"the model {model!r} does not exist here; this server serves {engine.model_name!r}",
                           "model", "model_not_found", status=404)
        return model_card()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        _check_common(engine, req)
        ids = await _prompt_ids(tokenizer, req.prompt)
        max_tokens = req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
        _check_context(engine, len(ids), max_tokens)
        params = _params(req, max_tokens, req.stop_list(), req.logprobs or 0)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        fmt = CompletionFormat(engine.model_name, tokenizer, req.logprobs is not None, include_usage)
        return await _respond(fmt, _submit(engine, ids, params, fmt.id), request, bool(req.stream))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        _check_common(engine, req)
        if req.top_logprobs and not req.logprobs:
            raise APIError("top_logprobs needs logprobs: true", "top_logprobs")
        try:  # images are decoded and checked here, off the event loop
            ids, parser, images = await run_in_threadpool(chat_prompt, engine, template,
                                                          [m.as_dict() for m in req.messages], req.tool_specs(),
                                                          req.tool_choice_value(), req.effort())
        except ChatError as e:  # the format refused the messages or tools: say why
            raise APIError(str(e), e.param) from None
        except ImageError as e:  # corrupt, empty, zero-size or too large, or a URL k3 will not fetch
            raise APIError(str(e), e.param or "messages", "invalid_image") from None
        except NoVisionTower as e:
            raise APIError(str(e), "messages", "unsupported_content") from None
        except ValueError as e:  # e.g. images that the format left no place for
            raise APIError(str(e), "messages") from None
        ids = _check_ids(tokenizer, ids)
        if not ids:
            raise APIError("the prompt is empty; send at least one token", "messages")
        max_tokens = req.max_completion_tokens or req.max_tokens  # None: until EOS, a stop or the context limit
        _check_context(engine, len(ids), max_tokens or 1)
        stops = req.stop_list() + [s for s in template.stop if s not in req.stop_list()]
        params = _params(req, max_tokens, stops, req.top_logprobs or 0)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        fmt = ChatFormat(engine.model_name, tokenizer, bool(req.logprobs), include_usage, parser=parser)
        return await _respond(fmt, _submit(engine, ids, params, fmt.id, images), request, bool(req.stream))

    add_fleet_routes(app, engine, template, _prompt_ids)  # /v1/prefix_cache, /v1/tokenize (k3.router)
    return app


def run_server(engine: Any, host: str = "127.0.0.1", port: int = 8000, chat_template: Any = None,
               log_level: str = "info", sock=None) -> None:
    """Start ``engine`` (a backend, or an engine: then warmed up on a thread of this process), serve it over HTTP
    until SIGINT / SIGTERM, then stop it. ``sock``: an already bound listening socket (``k3 serve`` binds before it
    loads the model, so a taken port fails at once). Binds to localhost by default: pass ``host="0.0.0.0"``
    deliberately to expose an unauthenticated server to the network. Raises RuntimeError when the engine could
    not be built or warmed up (its message says why)."""
    backend = engine if hasattr(engine, "health") else LocalBackend(engine, warmup=True)
    app = create_app(backend, chat_template)
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5),
                     backend)

    def announce() -> None:  # the warm-up's outcome, once: ready, or fatal (then the server stops)
        while not server.should_exit:
            h = backend.health()
            if h["ready"]:
                print(f"k3 serve: ready (warm-up {h.get('warmup_s') or 0:.1f} s) on http://{host}:{port}/v1",
                      file=sys.stderr, flush=True)
                return
            if getattr(backend, "fatal", None):
                server.should_exit = True
                return
            server_stopped.wait(0.05)

    server_stopped = threading.Event()
    backend.start()
    threading.Thread(target=announce, name="k3-announce", daemon=True).start()
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        server_stopped.set()
        backend.stop()
    if getattr(backend, "fatal", None):
        raise RuntimeError(backend.fatal)


class _Server(uvicorn.Server):
    """uvicorn's server, whose first SIGINT / SIGTERM also ends every open stream at once (each gets an error event
    and [DONE], so the graceful shutdown has nothing left to wait for) and whose second one exits at once."""

    def __init__(self, config, backend):
        super().__init__(config)
        self.backend = backend

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:  # a second signal, whichever: leave now
            self.force_exit = True
        else:  # off the signal's frame: it may have interrupted a holder of the engine's lock
            threading.Thread(target=self.backend.abort_all, args=("shutdown",), daemon=True).start()
        super().handle_exit(sig, frame)
