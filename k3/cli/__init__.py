"""The ``k3`` command (= ``python -m k3``): one entry point, one subcommand per job.

A bad invocation ends with one line on stderr naming the argument or file and what to do, and a non-zero exit:
2 for arguments argparse refuses, 1 for errors found while running, 130 after Ctrl-C. ``K3_DEBUG=1`` shows the
full traceback instead.
"""

from __future__ import annotations

import os
import signal
import sys

from .. import __version__
from . import agent, chat, demo, demo_vision, distill, evaluate, generate, params, plot, rl, router, serve, sft, train
from .common import Parser

COMMANDS = {"demo": demo, "demo-vision": demo_vision, "train": train, "sft": sft, "rl": rl, "distill": distill,
            "generate": generate, "chat": chat, "serve": serve, "router": router, "eval": evaluate,
            "plot": plot, "params": params, "agent": agent}
# what a user can cause (a bad file, value or device); anything else is a bug and keeps its traceback
USER_ERRORS = (ValueError, OSError, RuntimeError)


def build_parser() -> Parser:
    p = Parser(prog="k3", description="Kimi K3 in pure PyTorch: train, study and serve K3 models.")
    p.add_argument("--version", action="version", version=f"k3 {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, mod in COMMANDS.items():
        mod.add_arguments(sub.add_parser(name, help=mod.HELP, description=mod.HELP))
    return p


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error(f"choose a command: {', '.join(COMMANDS)}")
    debug = os.environ.get("K3_DEBUG") == "1"
    try:
        code = COMMANDS[args.command].run(args) or 0
        sys.stdout.flush()  # a closed pipe shows here rather than at exit
        return code
    except BrokenPipeError:  # `k3 ... | head`: the reader left; say nothing (the Python docs' recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a program stopped by a closed pipe
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"k3 {args.command}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        if debug:
            raise
        print(f"k3 {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 1


def entry() -> int:
    """The ``k3`` command's entry point: ``main``, then SIGINT ignored while the interpreter exits (atexit callbacks
    and finalizers run then: a Ctrl-C arriving there would print a traceback, with nothing left to stop)."""
    try:
        code = main()
    except KeyboardInterrupt:  # one that came outside the command's own handling (e.g. while parsing arguments)
        print("k3: interrupted", file=sys.stderr)
        code = 130
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code
