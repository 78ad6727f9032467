"""k3 chat: an interactive multi-turn chat in the terminal, in the tokenizer's chat format (k3.chat).

Ctrl-C while a reply streams stops that reply (the request is cancelled in the engine) and keeps what was
printed of it in the conversation; Ctrl-D or an empty line at the prompt ends the chat (status 0), Ctrl-C there
ends it with status 130, as every k3 command interrupted. A line that is not UTF-8 text is refused with the byte
named, and the prompt comes back: the conversation goes on.

Input is read from the file descriptor with ``select`` and a short timeout, not one blocking ``read``: a Ctrl-C
that the kernel hands to another thread (the engine's, or a torch worker) is then still seen at the prompt.

``--image PATH`` (repeatable) puts images before the first message's text (a checkpoint with a vision tower:
k3.vision); they stay in the conversation, and the prefix cache keeps them encoded across turns.
"""

from __future__ import annotations

import os
import select
import sys
from pathlib import Path

from ..inference.load import load_for_inference
from .common import add_device_argument, add_verify_argument, utf8_error
from .generate import ReplyInterrupted, add_sampling_arguments, make_engine, sampling_from_args

HELP = "chat with a checkpoint in the terminal (multi-turn; earlier turns hit the prefix cache)"


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True, help="a checkpoint directory or a run directory")
    p.add_argument("--system", default=None, help="an optional system message")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image (PNG, JPEG, GIF, WebP, BMP) shown with the first message; repeat for several "
                   "(needs a checkpoint with a vision tower)")
    add_sampling_arguments(p, max_tokens=256)
    add_device_argument(p)
    add_verify_argument(p)


class LineReader:
    """Lines of ``stdin`` as bytes, read from its file descriptor in select-timed waits (the Python signal handler
    runs between them); a stream without one (a test's StringIO) is read with its own ``readline``."""

    POLL_S = 0.2

    def __init__(self, stdin):
        self.stdin, self.pending, self.eof = stdin, b"", False
        try:
            self.fd = stdin.fileno()
        except (AttributeError, OSError, ValueError):
            self.fd = None

    def readline(self) -> bytes | str:
        if self.fd is None:  # the bytes under a text stream, when it has them: decoding is ours to report
            return self.stdin.buffer.readline() if hasattr(self.stdin, "buffer") else self.stdin.readline()
        while b"\n" not in self.pending and not self.eof:
            if select.select([self.fd], [], [], self.POLL_S)[0]:
                chunk = os.read(self.fd, 65536)
                self.eof = not chunk
                self.pending += chunk
        cut = self.pending.find(b"\n") + 1 or len(self.pending)
        line, self.pending = self.pending[:cut], self.pending[cut:]
        return line


def _read_line(stdin, stdout) -> str | None:
    """The user's next message, or None to quit (an empty line, Ctrl-D). Ctrl-C here raises KeyboardInterrupt
    (the chat ends with status 130). A line that is not UTF-8 is refused and asked for again."""
    while True:
        stdout.write("> ")
        stdout.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            stdout.write("\n")
            stdout.flush()
            raise
        why = utf8_error(line)
        if why is None:
            break
        stdout.write(f"(not sent: that line is not UTF-8 text ({why}); check the terminal's encoding, e.g. "
                     "LANG=C.UTF-8, and type it again)\n")
    if isinstance(line, bytes):
        line = line.decode("utf-8")
    return line.rstrip("\n") if line.strip() else None


def reply(engine, template, messages, params, out) -> str:
    """One assistant turn: prompt in the chat format, stream the reply's content to ``out``, return it. Ctrl-C
    cancels the request, waits for the engine to end it, and raises ReplyInterrupted with the text so far."""
    from ..inference.api import FinishEvent, GenerationRequest, TokenEvent
    from ..serve.images import chat_prompt

    ids, parser, images = chat_prompt(engine, template, messages)
    content = []

    def show(events):
        for ev in events:
            if ev.kind in ("content", "error"):
                out.write(ev.text)
                out.flush()
                content.append(ev.text)  # after the write: an interrupted write was not shown

    handle = engine.submit(GenerationRequest(tuple(ids), params, images=images))
    try:
        for ev in handle:
            if isinstance(ev, TokenEvent):
                show(parser.feed(ev.text))
    except KeyboardInterrupt:
        handle.cancel()
        for ev in handle:  # the engine ends the request with FinishEvent("abort") at its next step
            if isinstance(ev, FinishEvent):
                break
        raise ReplyInterrupted("".join(content)) from None
    show(parser.finish())
    return "".join(content)


def _image_parts(model, paths: list[str]) -> list[dict]:
    """The first message's image parts, each image read and checked now (an error names the file)."""
    if not paths:
        return []
    vision = getattr(model, "vision_config", None)
    if vision is None:
        raise ValueError("--image: this checkpoint has no vision tower (its config.json has no vision_config), so it "
                         "cannot read images; chat without --image, or use a multimodal checkpoint")
    from ..vision.preprocess import load_image

    for path in paths:
        load_image(path, vision, name=f"--image {path}")
    return [{"type": "image", "path": str(Path(path).resolve())} for path in paths]


def run(args, stdin=sys.stdin, stdout=sys.stdout) -> int:
    from ..chat import chat_template_for
    from ..train.loop import resolve_device

    model, tok = load_for_inference(args.checkpoint, resolve_device(args.device), verify=args.verify)
    images = _image_parts(model, getattr(args, "image", None) or [])
    template = chat_template_for(tok)
    params = sampling_from_args(args, template.stop)
    engine = make_engine(model, tok)
    engine.start()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    stdout.write("k3 chat: type a message; Ctrl-C stops a reply; an empty line, Ctrl-D or Ctrl-C here quits\n")
    reader = LineReader(stdin)
    try:
        while (line := _read_line(reader, stdout)) is not None:
            messages.append({"role": "user", "content": [*images, {"type": "text", "text": line}] if images else line})
            images = []
            try:
                text = reply(engine, template, messages, params, stdout)
            except ReplyInterrupted as e:
                text = e.text
                stdout.write(" [stopped]")
            stdout.write("\n")
            messages.append({"role": "assistant", "content": text})
    finally:
        engine.stop()
    return 0
