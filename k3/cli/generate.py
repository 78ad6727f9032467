"""k3 generate: sample a continuation from a checkpoint through the inference engine."""

from __future__ import annotations

import sys
from pathlib import Path

from ..inference.load import load_for_inference
from .common import (add_device_argument, add_verify_argument, int_at_least, number, positive_int, seed,
                     utf8_error)

HELP = "sample a continuation of --prompt from a checkpoint (streams to stdout)"


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True, help="a checkpoint directory (e.g. RUN/checkpoint) or a run directory")
    p.add_argument("--prompt", required=True, help="the text to continue")
    add_sampling_arguments(p)
    add_device_argument(p)
    add_verify_argument(p)
    add_packed_argument(p)


def add_packed_argument(p) -> None:
    p.add_argument("--packed-experts", action="store_true", help="keep the routed experts packed in memory (MXFP4, "
                   "4.25 bits per weight; MXFP8 activations); a checkpoint with float experts is quantised on load")


def add_sampling_arguments(p, max_tokens: int = 64) -> None:
    p.add_argument("--max-tokens", type=positive_int, default=max_tokens, help="tokens to generate at most")
    p.add_argument("--temperature", type=number(0), default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int_at_least(0), default=50, help="0 = off")
    p.add_argument("--top-p", type=number(0, 1, lo_open=True), default=1.0, help="nucleus sampling; 1 = off")
    p.add_argument("--seed", type=seed, default=0, help="the same seed gives the same text")


def sampling_from_args(args, stop=()):
    from ..inference.api import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, stop=tuple(stop))


def make_engine(model, tok, name: str = "k3", **overrides):
    from ..inference.engine import Engine, EngineConfig

    return Engine(model, tok, EngineConfig(**overrides), model_name=name)


class ReplyInterrupted(KeyboardInterrupt):
    """Ctrl-C while a reply streamed: the request was cancelled; ``text`` is what had been printed of it."""

    def __init__(self, text: str):
        super().__init__("reply interrupted")
        self.text = text


def submit_prompt(engine, prompt: str, params):
    """The engine's handle for ``prompt``; refuses an empty prompt before anything is printed."""
    from ..data import encode
    from ..inference.api import GenerationRequest

    ids = encode(engine.tokenizer, prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give some text")
    return engine.submit(GenerationRequest(tuple(ids), params))


def stream_completion(handle, out=None) -> str:
    """Print the text of ``handle``'s tokens as they come (to ``out``, default: the current sys.stdout) and return
    it. Ctrl-C cancels the request (through the handle), waits for the engine to end it, and raises
    ReplyInterrupted with the text so far."""
    from ..inference.api import FinishEvent, TokenEvent

    out = out or sys.stdout
    text = ""
    try:
        for ev in handle:
            if isinstance(ev, TokenEvent):
                out.write(ev.text)
                out.flush()
                text += ev.text
    except KeyboardInterrupt:
        handle.cancel()
        for ev in handle:  # the engine ends the request with FinishEvent("abort") at its next step
            if isinstance(ev, FinishEvent):
                break
        raise ReplyInterrupted(text) from None
    return text


def generate_text(model, tok, prompt: str, max_tokens: int, temperature: float = 0.8, top_k: int = 50,
                  seed: int = 0) -> str:
    """One completion, synchronously (no engine thread)."""
    from ..data import encode
    from ..inference.api import SamplingParams

    engine = make_engine(model, tok)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, seed=seed)
    return engine.generate([encode(tok, prompt)], params)[0].text


def run(args) -> int:
    from ..train.loop import resolve_device

    if (why := utf8_error(args.prompt)) is not None:
        raise ValueError(f"--prompt is not UTF-8 text ({why}, as the shell passed it); give UTF-8 text: check the "
                         "terminal's or the file's encoding (e.g. iconv -t utf-8), or LANG=C.UTF-8")
    params = sampling_from_args(args)
    model, tok = load_for_inference(args.checkpoint, resolve_device(args.device), verify=args.verify,
                                    packed_experts=args.packed_experts)
    engine = make_engine(model, tok, Path(args.checkpoint).name)
    engine.start()
    try:
        handle = submit_prompt(engine, args.prompt, params)  # errors come before the prompt is echoed
        sys.stdout.write(args.prompt)
        try:
            stream_completion(handle)
        finally:
            sys.stdout.write("\n")  # a message after Ctrl-C starts a line of its own
            sys.stdout.flush()
    finally:
        engine.stop()
    return 0
