"""k3 demo-vision: the vision path trained end to end on a CPU with no download (SPEC §10).

A tiny MoonViT-V2 tower (2 layers, width 64) and projector with the ``tiny`` K3 language model learn to answer
questions about rendered scenes (k3.vision.shapes: a coloured shape and a digit): each example is a ChatML chat, the
user's message an image part then a question (as ``k3 chat --image`` sends them), built by ``k3.vision.encode_chat``
(what SFT data with images goes through), the target the answer then ``<|im_end|>``; the loss is on the answer's
tokens only. Fresh scenes every step; the validation scenes are never trained on. The language model trains from
the first step; the tower and projector join at ``--vision-after`` (default: half way) at a thirtieth of its
learning rate (``train`` says why).

The evidence that the model uses the image: on the held-out scenes, the answer loss with each example's own image
against the same examples with the images shuffled (each question shown another scene's image), and the exact-match
accuracy of the greedy answer, both ways. A model that ignored the image would score the same on both. The
checkpoint (config.json with its vision_config, safetensors in the multimodal layout, tokenizer) and a sample scene
are saved, so ``k3 chat --checkpoint OUT --image OUT/sample.png`` asks it more. ``--sft`` trains on the same
scenes through ``k3 sft``'s chat data with images instead (k3.cli.demo_vision_sft).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .common import int_at_least, number, positive_int, seed

CHANCE = {"shape": 1 / 3, "colour": 1 / 4, "digit": 1 / 10}  # the answers' prior: what ignoring the image scores
HELP = "train a tiny vision tower + LM on rendered shapes and digits (CPU, no download); image vs shuffled-image gap"


def add_arguments(p) -> None:
    p.add_argument("--steps", type=positive_int, default=400, help="optimizer steps")
    p.add_argument("--batch-size", type=positive_int, default=16, help="examples per step (fresh scenes)")
    p.add_argument("--lr", type=number(0, lo_open=True), default=3e-3,
                   help="the language model's peak AdamW learning rate (cosine decay to a tenth)")
    p.add_argument("--vision-lr", type=number(0), default=1e-4, help="the tower's and projector's, once they train")
    p.add_argument("--vision-after", type=int_at_least(0), default=None, metavar="STEPS",
                   help="the tower and projector are held until this step (default: half the steps), then warm up "
                   "over 50 steps")
    p.add_argument("--val-scenes", type=positive_int, default=100, help="held-out scenes (3 questions each)")
    p.add_argument("--questions", default="shape,colour,digit",
                   help="which questions to train and ask, comma-separated (shape, colour, digit)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--out", default="runs/demo-vision", help="where the checkpoint and a sample scene go")
    p.add_argument("--sft", action="store_true",
                   help="write the scenes as chat JSONL with image parts and train with `k3 sft --vision tiny` (its "
                   "defaults: --lr, --vision-lr and --vision-after are the demo's own loop's) instead")


@dataclass
class Examples:
    """A batch: ids [B,T] (right-padded), labels [B,T] (-100 but on the answers), pixels [B*h*w,3,p,p], grids."""

    ids: torch.Tensor
    labels: torch.Tensor
    pixels: torch.Tensor
    grids: list[tuple[int, int]]


class SceneTask:
    """Tokenizer, prompts and batches of the demo (ChatML prompts built once per question by encode_chat)."""

    def __init__(self, vision):
        from ..data.tokenizer import EOS, train_tokenizer
        from ..chat import ChatTemplate
        from ..vision.chat import data_url, encode_chat
        from ..vision.prompt import MEDIA_PAD
        from ..vision.shapes import COLOURS, QUESTIONS, SHAPES, random_scene, render

        self.template, self.vision = ChatTemplate(), vision
        answers = [*SHAPES, *COLOURS, *map(str, range(10))]
        corpus = [self.template.render([{"role": "user", "content": q}]) + a + self.template.stop[0]
                  for q in QUESTIONS.values() for a in answers]
        self.tok = train_tokenizer(corpus * 4, 400, special_tokens=(EOS, MEDIA_PAD))
        self.placeholder, self.eos = self.tok.token_to_id(MEDIA_PAD), self.tok.token_to_id(EOS)
        import io

        buf = io.BytesIO()
        render(random_scene(random.Random(0))).save(buf, "PNG")
        part = {"type": "image_url", "image_url": {"url": data_url(buf.getvalue())}}
        self.prompts = {}  # question kind -> prompt ids with the image's placeholder run
        for kind, q in QUESTIONS.items():
            parts = [part, {"type": "text", "text": q}]  # as `k3 chat --image` sends it: the image, then the text
            out = encode_chat(self.template, self.tok, [{"role": "user", "content": parts}], vision, self.placeholder)
            self.prompts[kind] = out.ids
        self.kinds = list(QUESTIONS)
        self._scene, self._render = random_scene, render

    def target(self, answer: str) -> list[int]:
        return self.tok.encode(answer + self.template.stop[0], add_special_tokens=False).ids

    def batch(self, scenes, kinds) -> Examples:
        from ..vision.preprocess import preprocess

        rows, labels, images = [], [], []
        for scene, kind in zip(scenes, kinds):
            prompt, target = self.prompts[kind], self.target(scene.answer(kind))
            rows.append(prompt + target)
            labels.append([-100] * len(prompt) + target)
            images.append(preprocess(self._render(scene), self.vision))
        T = max(map(len, rows))
        ids = torch.tensor([r + [self.eos] * (T - len(r)) for r in rows])
        lab = torch.tensor([r + [-100] * (T - len(r)) for r in labels])
        return Examples(ids, lab, torch.cat([im.pixels for im in images]), [im.grid for im in images])

    def sample(self, rng: random.Random, n: int):
        scenes = [self._scene(rng) for _ in range(n)]
        return self.batch(scenes, [rng.choice(self.kinds) for _ in range(n)])


def answer_stats(model, ex: Examples, shuffle: int = 0) -> tuple[float, torch.Tensor]:
    """(mean answer-token loss, per-example exact match of the greedy answer): teacher-forced argmax at every answer
    position equals greedy decoding up to a first mistake, so all-correct == the greedy answer is right. ``shuffle``
    = k: example i gets example i-k's image (a rotation: with k the questions per scene, each question is shown
    another scene)."""
    pixels, grids = ex.pixels, ex.grids
    if shuffle:
        per = pixels.shape[0] // len(grids)  # every scene has the same grid
        pixels = pixels.view(len(grids), per, *pixels.shape[1:]).roll(shuffle, 0).flatten(0, 1)
    with torch.no_grad():
        logits = model(ex.ids, pixels, grids).logits[:, :-1].float()
    tgt = ex.labels[:, 1:]
    loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-100)
    mask = tgt != -100
    right = ((logits.argmax(-1) == tgt) | ~mask).all(1)
    return float(loss), right


def train(task: SceneTask, steps: int, batch_size: int, lr: float, vision_lr: float, vision_after: int, seed_: int,
          val: Examples, log=print, log_every: int = 50):
    """The model after ``steps`` AdamW steps on fresh scenes. The tower and projector stay at their initialisation
    for ``vision_after`` steps while the language model learns to read their (random but image-dependent)
    features, then train at ``vision_lr``: trained with a random language model from the first step, the tower's
    output collapses to one constant within ~15 steps (the random model's gradient treats image features as
    noise) and the model never uses the image."""
    from .. import K3Config
    from ..vision import K3ForConditionalGeneration

    torch.manual_seed(seed_)
    cfg = K3Config.preset("tiny").replace(vocab_size=task.tok.get_vocab_size(), num_nextn_predict_layers=0)
    model = K3ForConditionalGeneration(cfg, task.vision, media_placeholder_token_id=task.placeholder)
    vision = [*model.vision_tower.parameters(), *model.mm_projector.parameters()]
    opt = torch.optim.AdamW([{"params": model.language_model.parameters()}, {"params": vision}], lr=lr,
                            betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(seed_ + 1)
    for step in range(1, steps + 1):
        decay = 0.1 + 0.45 * (1 + math.cos(math.pi * step / steps))  # cosine to a tenth
        opt.param_groups[0]["lr"] = lr * min(1.0, step / 20) * decay  # after a 20-step warm-up
        opt.param_groups[1]["lr"] = vision_lr * min(1.0, max(0, step - vision_after) / 50) * decay
        ex = task.sample(rng, batch_size)
        model.train()
        loss = model(ex.ids, ex.pixels, ex.grids, labels=ex.labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % log_every == 0 or step == steps:
            model.eval()
            v, right = answer_stats(model, val)
            log(f"step {step:4d}  train answer loss {loss.item():.3f}  val {v:.3f}  val accuracy "
                f"{right.float().mean():.1%}")
    return model.eval()


def evaluate(model, val: Examples, asked: list[str], kinds: list[str]) -> dict:
    """The evidence on ``val``, each held-out scene asked every one of ``kinds`` in turn (``asked``: per example)."""
    real, right = answer_stats(model, val)
    shuffled, right_s = answer_stats(model, val, shuffle=len(kinds))
    by_kind = {k: float(right[[i for i, x in enumerate(asked) if x == k]].float().mean()) for k in kinds}
    return {"val_loss_image": real, "val_loss_shuffled": shuffled, "accuracy_image": float(right.float().mean()),
            "accuracy_shuffled": float(right_s.float().mean()), "accuracy_by_question": by_kind}


def report(r: dict, kinds: list[str]) -> None:
    print(f"validation answer loss: {r['val_loss_image']:.3f} with the image, {r['val_loss_shuffled']:.3f} with a "
          f"shuffled image ({r['val_loss_shuffled'] / max(r['val_loss_image'], 1e-9):.1f}x)")
    print(f"held-out accuracy: {r['accuracy_image']:.1%} with the image, {r['accuracy_shuffled']:.1%} with a shuffled "
          "image; by question: " + ", ".join(f"{k} {v:.1%}" for k, v in r["accuracy_by_question"].items())
          + f" (chance: {', '.join(f'{k} {CHANCE[k]:.0%}' for k in kinds)})")


def run(args) -> int:
    from ..pretrained import save_pretrained
    from ..data.tokenizer import save_tokenizer
    from ..vision import VisionConfig

    t0 = time.time()
    task = SceneTask(VisionConfig.preset("tiny"))
    kinds = [k.strip() for k in args.questions.split(",") if k.strip()]
    if not kinds or any(k not in task.kinds for k in kinds):
        raise ValueError(f"--questions {args.questions!r}: give some of {','.join(task.kinds)}, comma-separated")
    task.kinds = kinds
    if args.sft:
        from .demo_vision_sft import run as run_sft

        return run_sft(args, kinds)
    vrng = random.Random(10_000 + args.seed)  # the held-out scenes: a stream the training never draws from
    scenes = [task._scene(vrng) for _ in range(args.val_scenes)]
    asked = [k for _ in scenes for k in task.kinds]  # each held-out scene with every question
    val = task.batch([s for s in scenes for _ in task.kinds], asked)
    print(f"k3 demo-vision: tiny MoonViT-V2 (2 layers, width 64) + tiny K3 on rendered shapes and digits, "
          f"{args.steps} steps x {args.batch_size} scenes; {len(asked)} held-out questions")
    after = args.steps // 2 if args.vision_after is None else args.vision_after
    model = train(task, args.steps, args.batch_size, args.lr, args.vision_lr, after, args.seed, val)
    r = evaluate(model, val, asked, task.kinds)
    report(r, kinds)
    out = Path(args.out)
    save_pretrained(model, out)
    (out / "results.json").write_text(json.dumps({**r, "steps": args.steps, "batch_size": args.batch_size,
                                                  "questions": kinds, "val_questions": len(asked)}, indent=2))
    save_tokenizer(task.tok, out / "tokenizer.json")
    task._render(scenes[0]).save(out / "sample.png")
    print(f"checkpoint in {out} ({time.time() - t0:.0f} s); ask it about a scene (e.g. 'What colour is the shape?'):\n"
          f"  k3 chat --checkpoint {out} --image {out / 'sample.png'} --temperature 0")
    return 0
