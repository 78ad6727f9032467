"""What subcommands share: the parser class (one-line errors, defaults in --help), argument types that refuse
meaningless values at parse time, and the model arguments."""

from __future__ import annotations

import argparse
import math

from ..config import PRESETS, K3Config


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, except where there is none to show (None, required, on/off flags)."""

    def _get_help_string(self, action):
        if action.default is None or action.required or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error: what was wrong and where to look, without the usage block."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def int_at_least(lo: int, why: str = ""):
    """An argparse type: an integer >= ``lo``."""

    def parse(text: str) -> int:
        value = _integer(text)
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}{why}; got {value}")
        return value

    return parse


def int_in(lo: int, hi: int):
    """An argparse type: an integer in [lo, hi]."""

    def parse(text: str) -> int:
        value = _integer(text)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}]; got {value}")
        return value

    return parse


def number(lo: float = -math.inf, hi: float = math.inf, lo_open: bool = False):
    """An argparse type: a finite float in [lo, hi] (or (lo, hi] with ``lo_open``); nan and inf are refused."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number; got {text}")
        if value < lo or (lo_open and value == lo) or value > hi:
            low = f"> {lo:g}" if lo_open else f">= {lo:g}"
            raise argparse.ArgumentTypeError(f"must be {low}" + (f" and <= {hi:g}" if hi < math.inf else "")
                                             + f"; got {text}")
        return value

    return parse


positive_int = int_at_least(1)
seed = int_in(-2**63, 2**64 - 1)  # what torch.Generator.manual_seed takes


def add_model_arguments(p, default_preset: str | None = None) -> None:
    g = p.add_mutually_exclusive_group(required=default_preset is None)
    g.add_argument("--preset", choices=list(PRESETS), default=default_preset, help="a named configuration")
    g.add_argument("--config", metavar="PATH", help="an HF config.json (or a directory holding one)")


def add_device_argument(p, default: str = "auto") -> None:
    p.add_argument("--device", default=default, help="auto (CUDA when available, else CPU) | cpu | cuda | cuda:N")


def add_threads_argument(p, default: int | None) -> None:
    p.add_argument("--threads", type=positive_int, default=default,
                   help="CPU threads per operation (torch.set_num_threads); default: "
                   + ("PyTorch's, one per core" if default is None else str(default))
                   + ". At tiny sizes one thread is fastest: an op of ~0.1 ms costs less than the threads' hand-off")


def apply_threads(args) -> None:
    """``--threads``: at the tiny preset's sizes most ops take 20-200 us, and splitting each over cores costs more
    in synchronisation than it saves; on a loaded machine a thread waiting for a busy core stalls every op (one
    tiny training step on a shared 2-core CPU: 1.0 s with one thread, 13 s with two)."""
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)


def add_verify_argument(p) -> None:
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip checking the checkpoint's files against its SHA256SUMS (faster for huge checkpoints)")


def config_from_args(args) -> K3Config:
    return K3Config.from_hf(args.config) if args.config else K3Config.preset(args.preset)


def utf8_error(line: bytes | str) -> str | None:
    """Why ``line`` is not UTF-8 text (the first bad byte and its position), or None. A str holds the bytes Python
    could not decode as lone surrogates (its ``surrogateescape`` reading of stdin and argv)."""
    if isinstance(line, str):
        try:
            line.encode("utf-8")
            return None
        except UnicodeEncodeError as e:
            c = ord(line[e.start])
            byte = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"a lone surrogate \\u{c:04x}"
            return f"{byte} at character {e.start + 1}"
    try:
        line.decode("utf-8")
        return None
    except UnicodeDecodeError as e:
        return f"byte 0x{line[e.start]:02x} at byte {e.start + 1}"
