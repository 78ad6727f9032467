"""How long a running text request waits while one large image goes through the engine (SPEC §7, §10,
``k3.inference.images``), on the CPU.

    python benchmarks/bench_vision_blocking.py [--size 2000] [--json out.json]

The tiny text model with the tiny tower (what a CPU ``k3 serve`` of a tiny multimodal checkpoint runs), on the
engine's own thread. A text request decodes; once it has written ``--warm`` tokens, a request with one ``--size``
x ``--size`` image (random pixels, preprocessed as ``k3 serve`` does: 2000 x 2000 becomes 16384 patches, 4096
image tokens) arrives. Reported: the text request's median gap between tokens before the image came, its longest
gap from then until the image request's first token (and the tokens it wrote meanwhile), and the image request's
time to first token; then the same
with a text prompt of as many tokens instead of the image (the step budget's own cost: its prefill chunks). An
engine that runs the whole tower inside one step holds the text request for the tower's whole time; one that
encodes images in bounded pieces between steps (``EngineConfig.image_step_flops``) holds it no longer than a text
prompt of the same length does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import header  # noqa: E402


def measure(size: int, warm: int, with_image: bool = True) -> dict:
    import torch
    from PIL import Image

    from k3 import K3Config
    from k3.data.tokenizer import train_tokenizer
    from k3.inference.api import GenerationRequest, PromptImage, SamplingParams
    from k3.inference.engine import Engine, EngineConfig
    from k3.vision import K3ForConditionalGeneration, VisionConfig
    from k3.vision.preprocess import preprocess

    tok = train_tokenizer(["a red circle", "the number 42", "what shape is it?"] * 20, 300,
                          special_tokens=("<|endoftext|>", "<|media_pad|>"))
    torch.manual_seed(0)
    cfg = K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size(), num_nextn_predict_layers=0)
    vision = VisionConfig.preset("tiny")
    model = K3ForConditionalGeneration(cfg, vision, media_placeholder_token_id=1).eval()
    eng = Engine(model, tok, EngineConfig(num_pages=64, page_tokens=1024, hash_block=512, max_batch=4))
    pixels = torch.randint(0, 256, (size * size * 3,), dtype=torch.uint8).numpy().tobytes()
    im = preprocess(Image.frombytes("RGB", (size, size), pixels), vision)
    n = im.tokens(vision)
    ids = (30,) + (1,) * n + (31,)
    eng.start()
    try:
        text = eng.submit(GenerationRequest((20, 21, 22), SamplingParams(max_tokens=20000, ignore_eos=True)))
        times: list[float] = []
        reader = threading.Thread(target=lambda: [times.append(time.perf_counter()) for _ in text], daemon=True)
        reader.start()
        while len(times) < warm:
            time.sleep(0.01)
        t_image = time.perf_counter()
        images = (PromptImage(1, n, im.pixels, im.grid, im.digest),) if with_image else ()
        prompt = ids if with_image else (30,) + (40,) * n + (31,)
        image = eng.submit(GenerationRequest(prompt, SamplingParams(max_tokens=1, ignore_eos=True), images=images))
        next(iter(image))
        t_first = time.perf_counter()
        text.cancel()
        reader.join(timeout=60)
    finally:
        eng.stop()
    before = [b - a for a, b in zip(times, times[1:]) if b <= t_image]
    during = [b - max(a, t_image) for a, b in zip(times, times[1:]) if b > t_image and a < t_first]
    return {"grid": list(im.grid), "prompt_tokens": len(prompt),
            "text_gap_before_ms": round(1e3 * statistics.median(before), 1),
            "text_longest_gap_s": round(max(during, default=t_first - t_image), 3),
            "text_tokens_meanwhile": len(during), "prompt_ttft_s": round(t_first - t_image, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=2000, help="the image's side in pixels")
    ap.add_argument("--warm", type=int, default=20, help="text tokens written before the image arrives")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    result = {**header(), "size": a.size, "image_prompt": measure(a.size, a.warm),
              "text_prompt": measure(a.size, a.warm, with_image=False)}
    print(json.dumps(result, indent=1))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
