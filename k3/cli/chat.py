"""k3 chat: an interactive multi-turn chat in the terminal (the ChatML template of k3.serve.chat)."""

from __future__ import annotations

import sys

from .generate import add_sampling_arguments, load_for_inference, make_engine, sampling_from_args, stream_completion

HELP = "chat with a checkpoint in the terminal (multi-turn; earlier turns hit the prefix cache)"


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--system", default=None, help="an optional system message")
    add_sampling_arguments(p, max_tokens=256)
    p.add_argument("--device", default="auto")


def run(args, stdin=sys.stdin, stdout=sys.stdout) -> int:
    from ..serve.chat import ChatTemplate
    from ..train.loop import resolve_device

    model, tok = load_for_inference(args.checkpoint, resolve_device(args.device))
    template = ChatTemplate()
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
            reply = stream_completion(engine, template.render(messages), sampling_from_args(args, template.stop),
                                      out=stdout)
            stdout.write("\n")
            messages.append({"role": "assistant", "content": reply})
    finally:
        engine.stop()
    return 0
