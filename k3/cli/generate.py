"""k3 generate: sample text from a trained checkpoint (a plain full-recompute loop)."""

from __future__ import annotations

from pathlib import Path

import torch

HELP = "sample a continuation of --prompt from a checkpoint"


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True, help="a checkpoint directory (e.g. RUN/checkpoint) or a run directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")


@torch.no_grad()
def generate(model, tok, prompt: str, max_tokens: int, temperature: float = 0.8, top_k: int = 50,
             seed: int = 0, device="cpu") -> str:
    from ..data import decode, encode, eos_id

    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1; got {max_tokens}")
    ids = encode(tok, prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give some text")
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.tensor([ids], device=device)
    eos = eos_id(tok)
    out = []
    for _ in range(max_tokens):
        logits = model(x)["logits"][0, -1].float().cpu()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = logits.topk(min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(logits.softmax(-1), 1, generator=g))
        if nxt == eos:
            break
        out.append(nxt)
        x = torch.cat([x, torch.tensor([[nxt]], device=device)], dim=1)
    return decode(tok, out)


def load_for_inference(path: str | Path, device):
    from ..checkpoint import load_pretrained
    from ..data import load_tokenizer

    p = Path(path)
    if (p / "checkpoint").is_dir():
        p = p / "checkpoint"
    if not (p / "tokenizer.json").exists():
        raise FileNotFoundError(f"no tokenizer.json in {p}: point --checkpoint at a k3 checkpoint directory")
    model = load_pretrained(p, dtype=torch.float32).to(device).eval()
    return model, load_tokenizer(p / "tokenizer.json")


def run(args) -> int:
    from ..train.loop import resolve_device

    device = resolve_device(args.device)
    model, tok = load_for_inference(args.checkpoint, device)
    text = generate(model, tok, args.prompt, args.max_tokens, args.temperature, args.top_k, args.seed, device)
    print(args.prompt + text)
    return 0
