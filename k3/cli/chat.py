"""k3 chat: an interactive multi-turn chat in the terminal, in the tokenizer's chat format (k3.serve.chat)."""

from __future__ import annotations

import sys

from .generate import add_sampling_arguments, load_for_inference, make_engine, sampling_from_args

HELP = "chat with a checkpoint in the terminal (multi-turn; earlier turns hit the prefix cache)"


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--system", default=None, help="an optional system message")
    add_sampling_arguments(p, max_tokens=256)
    p.add_argument("--device", default="auto")


def reply(engine, template, messages, params, out) -> str:
    """One assistant turn: prompt in the chat format, stream the reply's content to ``out``, return it."""
    from ..inference.api import GenerationRequest, TokenEvent

    prompt = template.prompt(engine.tokenizer, messages)
    content = []

    def show(events):
        for ev in events:
            if ev.kind in ("content", "error"):
                content.append(ev.text)
                out.write(ev.text)
                out.flush()

    for ev in engine.submit(GenerationRequest(tuple(prompt.ids), params)):
        if isinstance(ev, TokenEvent):
            show(prompt.parser.feed(ev.text))
    show(prompt.parser.finish())
    return "".join(content)


def run(args, stdin=sys.stdin, stdout=sys.stdout) -> int:
    from ..serve.chat import chat_template_for
    from ..train.loop import resolve_device

    model, tok = load_for_inference(args.checkpoint, resolve_device(args.device))
    template = chat_template_for(tok)
    engine = make_engine(model, tok)
    engine.start()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    stdout.write("k3 chat: type a message, an empty line or Ctrl-D to quit\n")
    try:
        while True:
            stdout.write("> ")
            stdout.flush()
            line = stdin.readline()
            if not line.strip():
                break
            messages.append({"role": "user", "content": line.rstrip("\n")})
            text = reply(engine, template, messages, sampling_from_args(args, template.stop), stdout)
            stdout.write("\n")
            messages.append({"role": "assistant", "content": text})
    finally:
        engine.stop()
    return 0
