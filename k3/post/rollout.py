"""Rollouts through k3's inference engine, with partial rollout (SPEC §9).

Legend: P prompt groups, G samples per prompt, N response tokens of a step.

A ``Trajectory`` is one sampled reply: its tokens, the log-probability each had under the policy that SAMPLED
it (the engine's ``TokenEvent.logprob``, recorded at sampling time) and that policy's version (the trainer step
it was sampled at). ``Rollout(policy, tokenizer, stop, ...)`` samples at temperature 1 with no top-k/top-p, so
the engine's log-probability (of the unmodified logits) is exactly the sampling distribution's.

Partial rollout: ``round(trajectories, chunk)`` lets every unfinished trajectory write at most ``chunk`` more tokens;
one that has neither stopped nor reached ``max_tokens`` stays unfinished and is continued in a later round,
typically by a newer policy (its prompt + tokens so far resubmitted). The continuation uses the trajectory's
seed with ``SamplingParams.draw_offset`` = tokens already drawn, so with an unchanged policy a trajectory
continued over several rounds is token for token the one written in one go (stop strings are looked for in the
whole reply, not only in the last chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..inference.api import GenerationRequest, SamplingParams
from ..inference.engine import Engine, EngineConfig
from ..model.transformer import K3ForCausalLM

__all__ = ["Trajectory", "Rollout", "policy_copy"]


@dataclass
class Trajectory:
    group: int  # the prompt group (one prompt, G trajectories)
    prompt_ids: list[int]
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # log mu(y_t): the sampling policy's, recorded when drawn
    versions: list[int] = field(default_factory=list)  # the policy version that drew each token
    finish: str | None = None  # "stop" (a stop string or EOS) or "length" (max_tokens); None while unfinished
    text: str = ""  # the reply, stop string excluded (set when finished)

    @property
    def done(self) -> bool:
        return self.finish is not None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def policy_copy(policy: torch.nn.Module) -> K3ForCausalLM:
    """A detached copy of ``policy``'s weights for the engine (which fuses projections and runs in eval mode):
    the training model, its hooks and its optimiser never see the engine."""
    model = K3ForCausalLM(policy.config).to(next(policy.parameters()).device)
    model.load_state_dict(policy.state_dict())
    return model.eval()


class Rollout:
    """Sampling from one policy version. ``stop``: the chat format's stop strings; ``max_tokens``: the longest
    reply (a trajectory reaching it finishes with "length"); ``temperature`` other than 1 is for evaluation
    only (the recorded log-probabilities are then not the sampling distribution's)."""

    def __init__(self, policy, tokenizer, stop: tuple[str, ...], max_tokens: int, version: int,
                 engine_config: EngineConfig | None = None, temperature: float = 1.0):
        from ..data.tokenizer import eos_id

        self.tokenizer, self.stop, self.max_tokens, self.version = tokenizer, tuple(stop), max_tokens, version
        self.eos, self.temperature = eos_id(tokenizer), temperature  # training rollouts: 1 (see the docstring)
        self.engine = Engine(policy_copy(policy), tokenizer, engine_config or EngineConfig(page_tokens=512,
                                                                                         num_pages=64))

    def round(self, trajectories: list[Trajectory], chunk: int | None = None) -> int:
        """Advance every unfinished trajectory by up to ``chunk`` tokens (None: to its end). -> tokens drawn."""
        todo = [t for t in trajectories if not t.done]
        handles = []
        for t in todo:
            left = self.max_tokens - len(t.tokens)
            params = SamplingParams(max_tokens=left if chunk is None else min(chunk, left), temperature=self.temperature,
                                    seed=t.seed, stop=self.stop, draw_offset=len(t.tokens))
            handles.append(self.engine.submit(GenerationRequest(tuple(t.prompt_ids + t.tokens), params)))
        seqs = [self.engine.seqs[h.id] for h in handles]
        while any(not s.finished for s in seqs):
            self.engine.step()
        drawn = 0
        for t, h in zip(todo, handles):
            *events, fin = list(h)
            if fin.reason == "error":
                raise RuntimeError(f"rollout failed in the engine: {fin.error}")
            before = len(t.tokens)
            for ev in events:
                if ev.token_id == self.eos:  # EOS ends the reply; it is no token of it (as at inference)
                    continue
                t.tokens.append(ev.token_id)
                t.logprobs.append(ev.logprob)
                t.versions.append(self.version)
            drawn += len(t.tokens) - before
            self._settle(t, before, fin.reason)
        return drawn

    def _settle(self, t: Trajectory, before: int, reason: str) -> None:
        """Finish ``t`` if its reply holds a stop string (cut right after the token completing the first one),
        ended with EOS, or is ``max_tokens`` long; else it stays unfinished."""
        text = self.tokenizer.decode(t.tokens)
        hit = [text.index(s) for s in self.stop if s in text]
        if hit:
            k = before
            while not any(s in self.tokenizer.decode(t.tokens[:k]) for s in self.stop):
                k += 1
            del t.tokens[k:], t.logprobs[k:], t.versions[k:]
            t.finish, t.text = "stop", text[:min(hit)]
        elif reason == "stop":  # EOS
            t.finish, t.text = "stop", text
        elif len(t.tokens) >= self.max_tokens:
            t.finish, t.text = "length", text
