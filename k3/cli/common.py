"""Arguments shared by subcommands."""

from __future__ import annotations

from ..config import PRESETS, K3Config


def add_model_arguments(p, default_preset: str | None = None) -> None:
    g = p.add_mutually_exclusive_group(required=default_preset is None)
    g.add_argument("--preset", choices=list(PRESETS), default=default_preset, help="a named configuration")
    g.add_argument("--config", metavar="PATH", help="an HF config.json (or a directory holding one)")


def config_from_args(args) -> K3Config:
    return K3Config.from_hf(args.config) if args.config else K3Config.preset(args.preset)
