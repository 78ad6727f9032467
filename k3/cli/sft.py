"""k3 sft: supervised fine-tuning on chat data, the loss on the assistant's tokens only (SPEC §9's cold start).

The same loop, optimiser, QAT, memory and parallel options as ``k3 train`` (k3.train.loop); only the data differ
(k3.post.sft_data): a JSONL file of {"messages": [...], "effort": ...} lines rendered in the checkpoint's chat
format, packed, labels -100 outside the assistant's turns. Messages with image parts train a model with a vision
tower (k3.post.sft_images): a multimodal --init-from, or --vision PRESET for a new tower.
"""

from __future__ import annotations

import dataclasses

from ..train.loop import TrainConfig
from .common import add_model_arguments
from .train import add_train_arguments, config_from_args, report, run_training

HELP = "fine-tune on chat data (JSONL of messages), the loss on the assistant's tokens only"

SFT = TrainConfig(out=None, chat=True, steps=300, batch_size=8, seq_len=512, lr=1e-3, eval_every=50, log_every=10,
                  warmup_frac=0.05)


def add_arguments(p) -> None:
    from ..vision.config import VISION_PRESETS

    add_model_arguments(p, default_preset="tiny")
    add_train_arguments(p, SFT)
    p.add_argument("--vision", choices=list(VISION_PRESETS), default=None, metavar="PRESET",
                   help="give a model without a vision tower (a new one, or a text --init-from) a new tower and "
                   f"projector of this preset ({', '.join(VISION_PRESETS)}), trained from scratch with it: data with "
                   "images needs a vision tower (a multimodal --init-from brings its own)")
    for action in p._actions:
        if action.dest == "data":
            action.required, action.help = True, ("JSONL of chat conversations: {\"messages\": [{\"role\": ..., "
                                                  "\"content\": ...}, ...], \"effort\": low|high|max (optional)} per "
                                                  "line; content may be a list of text and image parts")
        if action.dest == "init_from":
            action.help = ("the pretrained checkpoint to fine-tune (its tokenizer decides the chat format); without "
                           "it a new model and tokenizer are trained from scratch")


def run(args) -> int:
    from ..post.sft_data import prepare

    cfg = dataclasses.replace(config_from_args(args, SFT), vision=args.vision)
    return report(*run_training(cfg, command="sft", prepare=prepare),
                  lambda r: "on assistant tokens")
