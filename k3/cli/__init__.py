"""The ``k3`` command (= ``python -m k3``): one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys

from . import chat, demo, evaluate, generate, params, plot, serve, train

COMMANDS = {"demo": demo, "train": train, "generate": generate, "chat": chat, "serve": serve, "eval": evaluate,
            "plot": plot, "params": params}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3", description="Kimi K3 in pure PyTorch: train, study and serve K3 models.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, mod in COMMANDS.items():
        mod.add_arguments(sub.add_parser(name, help=mod.HELP, description=mod.HELP))
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return COMMANDS[args.command].run(args) or 0
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"k3 {args.command}: error: {e}", file=sys.stderr)
        return 1
