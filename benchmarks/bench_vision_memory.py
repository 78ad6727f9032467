"""Peak extra memory and time of one large image through the vision tower on the CPU (SPEC §10,
``k3.vision.attention``).

    python benchmarks/bench_vision_memory.py [--size 2000] [--preset tiny] [--layers N] [--json out.json]

A ``--size`` x ``--size`` image (random pixels) is preprocessed as ``k3 serve`` does (``k3.vision.preprocess``: a
2000 x 2000 image is shrunk to 1792 x 1792, the 16384-patch budget) and sent through ``MoonViT`` of ``--preset``
(``--layers``: fewer layers of that width, for the release's sizes on a CPU) under ``no_grad``, in a fresh process.
Reported: the grid, the seconds of the forward, and its peak extra resident memory (``ru_maxrss`` after it, less the
resident memory just before it: what the forward added, whatever held it). Attention that materialises the
[H, L, L] scores of one 16384-patch image needs H x 1 GiB for them alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import header  # noqa: E402


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def one(size: int, preset: str, layers: int | None) -> dict:
    import torch
    from PIL import Image

    from k3.vision import MoonViT, VisionConfig
    from k3.vision.preprocess import preprocess

    cfg = VisionConfig.preset(preset)
    if layers:
        cfg = cfg.replace(vt_num_hidden_layers=layers)
    torch.manual_seed(0)
    tower = MoonViT(cfg).eval()
    image = Image.frombytes("RGB", (size, size), torch.randint(0, 256, (size * size * 3,), dtype=torch.uint8)
                            .numpy().tobytes())
    im = preprocess(image, cfg)
    del image
    before = _rss_gib()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = tower(im.pixels, [im.grid])
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return {"size": size, "preset": preset, "layers": cfg.vt_num_hidden_layers, "grid": list(im.grid),
            "patches": im.grid[0] * im.grid[1], "heads": cfg.vt_num_attention_heads, "seconds": round(seconds, 2),
            "rss_before_gib": round(before, 3), "peak_extra_rss_gib": round(peak - before, 3),
            "finite": bool(torch.isfinite(out).all())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=2000, help="the image's side in pixels")
    ap.add_argument("--preset", default="tiny", help="a VisionConfig preset (tiny, moonvit-v2, k25-moonvit)")
    ap.add_argument("--layers", type=int, default=None, help="this many layers of the preset's width")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one(a.size, a.preset, a.layers)))
        return
    args = [sys.executable, __file__, "--child", "--size", str(a.size), "--preset", a.preset]
    if a.layers:
        args += ["--layers", str(a.layers)]
    run = subprocess.run(args, capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"the measurement failed:\n{run.stderr}")
    result = {**header(), **json.loads(run.stdout.strip().splitlines()[-1])}
    print(json.dumps(result, indent=1))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
