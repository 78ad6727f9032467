"""k3 eval: perplexity and bits per byte of a text file, or lm-evaluation-harness tasks (with lm-eval installed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

HELP = "evaluate a checkpoint: perplexity / bits per byte of a text file, or lm-eval tasks (--tasks)"


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True, help="a checkpoint directory (or a run directory holding checkpoint/)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", metavar="FILE", help="a UTF-8 text file: perplexity and bits per byte")
    what.add_argument("--tasks", help="lm-eval task names, comma-separated (needs pip install 'k3[eval]')")
    p.add_argument("--include-path", help="a directory of lm-eval task YAMLs (your own, local tasks)")
    p.add_argument("--limit", type=float, default=None, help="lm-eval: at most this many documents per task")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--max-length", type=int, default=2048, help="tokens scored at once (longer texts: rolling windows)")
    p.add_argument("--output", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--device", default="auto")


def _tasks(args, model, tok) -> dict:
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise RuntimeError("--tasks runs lm-evaluation-harness, which is not installed: pip install 'k3[eval]'") from None
    from ..eval.harness import K3LM

    lm = K3LM(model=model, tokenizer=tok, max_length=args.max_length)
    manager = TaskManager(include_path=args.include_path) if args.include_path else TaskManager()
    out = lm_eval.simple_evaluate(model=lm, tasks=[t for t in args.tasks.split(",") if t], task_manager=manager,
                                  limit=args.limit, num_fewshot=args.num_fewshot, log_samples=False)
    return {"results": out["results"]}


def _read_text(path: Path) -> str:
    """--text's file: one UTF-8 text file; a directory, a missing path, a binary or non-UTF-8 file is refused
    naming it and what to give instead."""
    from ..data.corpus import read_text_file

    if path.is_dir():
        raise IsADirectoryError(f"--text {path} is a directory; give one UTF-8 text file (run k3 eval once per file, "
                                "or concatenate them: cat DIR/*.txt > all.txt)")
    if not path.exists():
        raise FileNotFoundError(f"--text {path}: no such file")
    return read_text_file(path, name=f"--text {path}", want="--text takes one UTF-8 text file")


def run(args) -> int:
    from ..eval.scoring import score_text
    from ..inference.load import load_for_inference
    from ..train.loop import resolve_device

    text = _read_text(Path(args.text)) if args.text else None  # before the model loads: a bad file fails fast
    model, tok = load_for_inference(args.checkpoint, resolve_device(args.device))
    if args.text:
        path = Path(args.text)
        s = score_text(model, tok, text, max_length=args.max_length)
        result = {"text": str(path), **s.as_dict()}
        print(f"{path}: {s.tokens} tokens, {s.bytes} bytes | loss {s.loss:.4f} nats/token | perplexity "
              f"{s.perplexity:.3f} | {s.bits_per_byte:.4f} bits/byte")
    else:
        result = _tasks(args, model, tok)
        json.dump(result, sys.stdout, indent=2, default=str)
        print()
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0
