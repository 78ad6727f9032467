"""k3 as an lm-evaluation-harness model: ``lm_eval --model k3 --model_args checkpoint=DIR[,device=cpu,max_length=2048]``.

Registered under the ``lm_eval.models`` entry point (pyproject.toml), which lm-eval reads from the release after
0.4.13 on; ``k3 eval --tasks ...`` registers it itself and runs with any lm-eval 0.4. Log-likelihoods come from the
model's forward over packed requests (``k3.eval.scoring``); generation runs on k3's inference engine
(``Engine.generate``, greedy or sampled as the task asks, stopping at the task's ``until`` strings).
"""

from __future__ import annotations

from pathlib import Path

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from ..data.tokenizer import encode, eos_id
from ..inference.api import SamplingParams
from .scoring import prefix_id, rolling_windows, score_sequences

__all__ = ["K3LM"]


@register_model("k3")
class K3LM(TemplateLM):
    """``checkpoint``: a checkpoint directory (or a run directory holding ``checkpoint/``); ``max_length``: the
    longest sequence scored at once (longer contexts keep their last tokens); ``batch_size``: requests per forward
    (lm-eval's ``--batch_size``; "auto" = as many as fit ``max_length`` tokens)."""

    def __init__(self, checkpoint: str | None = None, device: str = "auto", max_length: int = 2048,
                 batch_size: int | str = "auto", max_gen_toks: int = 256, model=None, tokenizer=None, **unused):
        super().__init__()
        from ..inference.load import load_for_inference
        from ..train.loop import resolve_device

        if model is None:
            if checkpoint is None:
                raise ValueError("k3 needs --model_args checkpoint=DIR (a k3 checkpoint or a Kimi release directory)")
            if not Path(checkpoint).exists():
                raise FileNotFoundError(f"checkpoint={checkpoint!r} does not exist")
            model, tokenizer = load_for_inference(checkpoint, resolve_device(device))
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_length, self.max_gen_toks = int(max_length), int(max_gen_toks)
        auto = batch_size in (None, "auto") or str(batch_size).startswith("auto")
        self.batch_tokens = self.max_length * (1 if auto else max(int(batch_size), 1))
        self._engine = None

    # ---- what TemplateLM needs -------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return eos_id(self.tokenizer)

    @property
    def prefix_token_id(self) -> int:
        return prefix_id(self.tokenizer)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return encode(self.tokenizer, string)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        items = []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens is longer than max_length = "
                                 f"{self.max_length}; raise max_length in --model_args")
            items.append(((list(context) + list(continuation))[-(self.max_length + 1):], len(continuation)))
        scored = score_sequences(self.model, items, self.batch_tokens)
        return [(sum(lp), all(greedy)) for lp, greedy in scored]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (text,) in (r.args for r in requests):
            windows = rolling_windows(self.tok_encode(text), self.prefix_token_id, self.max_length)
            out.append(sum(sum(lp) for lp, _ in score_sequences(self.model, windows, self.batch_tokens)))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params = [], []
        for context, kwargs in (r.args for r in requests):
            kwargs = dict(kwargs)
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            if max_new >= self.max_length:
                raise ValueError(f"max_gen_toks = {max_new} leaves no room for the context in max_length = "
                                 f"{self.max_length}; raise max_length in --model_args")
            sample = kwargs.pop("do_sample", False)
            temperature = float(kwargs.pop("temperature", 0.0)) if sample else 0.0
            ids = self.tok_encode(context)[-(self.max_length - max_new):] or [self.prefix_token_id]
            prompts.append(ids)
            params.append(SamplingParams(max_tokens=max_new, temperature=temperature,
                                         top_p=float(kwargs.pop("top_p", 1.0)), seed=kwargs.pop("seed", 0),
                                         stop=tuple(u for u in until if u)))
        return [f.text for f in self.engine.generate(prompts, params)]

    @property
    def engine(self):
        if self._engine is None:
            from ..inference.engine import Engine, EngineConfig

            self._engine = Engine(self.model, self.tokenizer, EngineConfig(max_context=self.max_length))
        return self._engine
