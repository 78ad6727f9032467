"""k3 demo-vision --sft: the demo's scenes and questions as SFT data with images, trained by ``k3 sft`` (SPEC §9,
§10).

The training scenes (``--steps`` x ``--batch-size``, one question each) and the held-out ones (every question) are
written as chat JSONL, each user message an ``image_url`` part (the scene as a ``data:`` URL, what an OpenAI client
sends) then the question, the assistant message the answer. ``k3 sft --vision tiny`` trains the tiny K3 model and a
new tiny MoonViT-V2 tower on the training file with its own defaults (Muon/AdamW at one learning rate, packed
sequences of 128 tokens, --batch-size / 4 of them a step: about as many scenes as the demo's own loop sees); the
held-out file is then read through the same SFT data path and scored as the demo scores its own model: the answer
loss and greedy accuracy with each question's own image against another scene's.
"""

from __future__ import annotations

import io
import json
import random
import time
from pathlib import Path

import torch

from .demo_vision import Examples, evaluate, report

SEQ_LEN = 128  # about four scene conversations a sequence


def scene_chat(scene, kind: str) -> dict:
    """One SFT line: the rendered scene and the question ``kind`` -> its answer."""
    from ..vision.chat import data_url
    from ..vision.shapes import QUESTIONS, render

    buf = io.BytesIO()
    render(scene).save(buf, "PNG")
    image = {"type": "image_url", "image_url": {"url": data_url(buf.getvalue())}}
    return {"messages": [{"role": "user", "content": [image, {"type": "text", "text": QUESTIONS[kind]}]},
                         {"role": "assistant", "content": scene.answer(kind)}]}


def held_out(checkpoint: Path, path: Path):
    """(the trained model, the held-out conversations of ``path`` as one right-padded Examples batch)."""
    from ..data import eos_id, load_tokenizer
    from ..post.format import ChatFormat
    from ..post.sft_data import encode_conversation, load_conversations
    from ..post.sft_images import ImagePrompt
    from ..pretrained import load_pretrained

    model = load_pretrained(checkpoint, dtype=torch.float32, vision=True).eval()
    tok = load_tokenizer(checkpoint / "tokenizer.json")
    fmt, prompt = ChatFormat(tok), ImagePrompt(model.vision_config, model.media_placeholder_token_id)
    docs = [d for c in load_conversations(path) for d in encode_conversation(fmt, c.messages, c.effort, prompt,
                                                                               c.where)]
    T, eos = max(len(d.ids) for d in docs), eos_id(tok)
    ids = torch.tensor([d.ids + [eos] * (T - len(d.ids)) for d in docs])
    labels = torch.tensor([d.labels + [-100] * (T - len(d.ids)) for d in docs])
    pixels = torch.cat([im.pixels(model.vision_config) for d in docs for im in d.images])
    return model, Examples(ids, labels, pixels, [im.grid for d in docs for im in d.images])


def run(args, kinds: list[str]) -> int:
    from ..vision.shapes import random_scene, render
    from . import main

    t0 = time.time()
    out = Path(args.out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    rng, vrng = random.Random(args.seed + 1), random.Random(10_000 + args.seed)  # as the demo's own streams
    train = [scene_chat(random_scene(rng), rng.choice(kinds)) for _ in range(args.steps * args.batch_size)]
    scenes = [random_scene(vrng) for _ in range(args.val_scenes)]
    asked = [k for _ in scenes for k in kinds]
    val = [scene_chat(s, k) for s in scenes for k in kinds]
    for name, lines in (("train", train), ("val", val)):
        (out / "data" / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    print(f"k3 demo-vision --sft: {len(train)} training scenes and {len(val)} held-out questions as chat JSONL in "
          f"{out / 'data'}; k3 sft --vision tiny on them")
    code = main(["sft", "--data", str(out / "data" / "train.jsonl"), "--out", str(out / "sft"), "--vision", "tiny",
                 "--steps", str(args.steps), "--batch-size", str(max(1, args.batch_size // 4)), "--seq-len",
                 str(SEQ_LEN), "--vocab-size", "400", "--seed", str(args.seed), "--eval-every", "100",
                 "--log-every", "50"])
    if code:
        return code
    model, examples = held_out(out / "sft" / "checkpoint", out / "data" / "val.jsonl")
    r = evaluate(model, examples, asked, kinds)
    report(r, kinds)
    (out / "results.json").write_text(json.dumps({**r, "via": "k3 sft", "steps": args.steps, "seq_len": SEQ_LEN,
                                                  "sft_batch_size": max(1, args.batch_size // 4),
                                                  "train_scenes": len(train), "questions": kinds,
                                                  "val_questions": len(asked)}, indent=2))
    render(scenes[0]).save(out / "sample.png")
    print(f"checkpoint in {out / 'sft' / 'checkpoint'} ({time.time() - t0:.0f} s); ask it about a held-out scene:\n"
          f"  k3 chat --checkpoint {out / 'sft' / 'checkpoint'} --image {out / 'sample.png'} --temperature 0")
    return 0
