"""Pacing prompt chunks so decoding streams keep a steady rhythm (issue: a 20K-token prefill starved short requests).

A step that mixes decodes with a prompt chunk costs about ``t = a + b * n`` for ``n`` prompt tokens: ``a`` the decode
rows' and the step's fixed cost, ``b`` the cost per prompt token at the current context (attention over the cached
context makes ``b`` grow as a long prompt advances, so both are running averages, not constants). Every decoding
stream waits for the whole step, so the engine keeps ``t`` near ``target_s`` while anything decodes:

    cap = (target_s - a) / b      prompt tokens per step, clamped to [min_tokens, prefill_chunk]

When no sequence decodes there is no cap (a lone prompt prefills at full chunks: nobody waits on it). On an H200 a
2,048-token chunk of ``small`` costs well under the default target, so the cap does not bind there; on a CPU, where
the same chunk takes seconds, it does.
"""

from __future__ import annotations


class StepPacer:
    def __init__(self, target_s: float, max_tokens: int, min_tokens: int = 32, decay: float = 0.7):
        self.target_s, self.max_tokens, self.min_tokens, self.decay = target_s, max_tokens, min(min_tokens,
                                                                                                  max_tokens), decay
        self.fixed_s: float | None = None  # a: a step with no prompt tokens
        self.per_token_s: float | None = None  # b: each prompt token on top of it

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        """One finished step: its prompt tokens and its wall time."""
        if prompt_tokens == 0:
            self.fixed_s = self._avg(self.fixed_s, seconds)
        else:
            per = max(0.0, seconds - (self.fixed_s or 0.0)) / prompt_tokens
            self.per_token_s = self._avg(self.per_token_s, per)

    def cap(self) -> int | None:
        """Prompt tokens for the next step while something decodes; None until a prompt step has been timed."""
        if self.per_token_s is None or self.per_token_s <= 0:
            return None
        room = self.target_s - (self.fixed_s or 0.0)
        return max(self.min_tokens, min(self.max_tokens, int(room / self.per_token_s)))

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new
