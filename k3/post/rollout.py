"""Rollouts through k3's inference engine, with partial rollout (SPEC §9).

Legend: P prompt groups, G samples per prompt, N response tokens of a step.

A ``Trajectory`` is one sampled reply: its tokens, the log-probability each had under the policy that SAMPLED
it (the engine's ``TokenEvent.logprob``, recorded at sampling time) and that policy's version (the trainer step
it was sampled at). ``Rollout(policy, tokenizer, stop, ...)`` samples at temperature 1 with no top-k/top-p, so
the engine's log-probability (of the unmodified logits) is exactly the sampling distribution's.

Partial rollout: ``round(trajectories, chunk)`` steps the engine until every unfinished trajectory has written
``chunk`` more tokens (sequences decoding together write one token per engine step each) or finished;
one that has neither stopped nor reached ``max_tokens`` stays unfinished and is continued in a later round. One
``Rollout`` (one engine) serves a whole run: a trajectory's request stays live in the engine between rounds (its
cache kept, nothing re-encoded) as long as the weights do not change; ``load(policy, version)`` copies a new
policy's weights into the engine's model in place and, by default, ends the live requests, so each carried
trajectory is resubmitted once (its prompt + tokens so far re-encoded by the new policy: the cache a token is
sampled from is always the policy that drew it, and a run resumed from a checkpoint continues exactly).
``load(..., reencode=False)`` keeps them live instead: their cache (written by the versions that drew their
earlier tokens) is kept and their next tokens are drawn by the new weights from it, as the report's rollout
reuses a carried trajectory's cached prefix (seed 000 §8.5; PipelineRL's in-flight weight updates): no
re-encoding, at the price of a stale cache. The recorded log-probability is still that of the computation that
drew the token, so the objective's ratio stays against the true sampling distribution. The continuation uses the
trajectory's seed with ``SamplingParams.draw_offset`` = tokens already drawn, so with an unchanged policy a
trajectory continued over several rounds or steps is token for token the one written in one go (stop strings are
looked for in the whole reply, not only in the last chunk).

Precision: the engine holds its own copy of the weights, by default in bf16 on CUDA (where the engine then
decodes under CUDA graphs instead of paying the eager step's host work) and in the policy's dtype elsewhere. A
bf16 sampler is not the fp32 policy: the recorded log-probabilities are the bf16 copy's, so the objective's ratio
pi_theta / pi_sampler also carries the rounding gap between the two (clipped like any other off-policy ratio), as
in RL systems that sample with a bf16 server and train fp32 master weights. ``dtype=torch.float32`` samples from
the policy exactly.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

import torch

from ..inference.api import FinishEvent, GenerationRequest, SamplingParams
from ..inference.engine import Engine, EngineConfig
from ..model.transformer import K3ForCausalLM

__all__ = ["Trajectory", "Rollout", "policy_copy", "rollout_dtype", "ROLLOUT_DTYPES"]


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


ROLLOUT_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def rollout_dtype(policy: torch.nn.Module, dtype: torch.dtype | str | None = None) -> torch.dtype:
    """The engine's dtype for ``policy``: ``dtype`` (a torch dtype or a ROLLOUT_DTYPES name), or for None /
    "auto" bf16 on CUDA (CUDA graphs) and the policy's own dtype elsewhere."""
    if isinstance(dtype, str):
        if dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"unknown rollout dtype {dtype!r}; expected one of {sorted(ROLLOUT_DTYPES)}")
        dtype = ROLLOUT_DTYPES[dtype]
    p = next(policy.parameters())
    if dtype is None:
        return torch.bfloat16 if p.is_cuda else p.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"rollout dtype must be float32 or bfloat16; got {dtype}")
    return dtype


def policy_copy(policy: torch.nn.Module, dtype: torch.dtype | str | None = None) -> K3ForCausalLM:
    """A detached copy of ``policy``'s weights for the engine (which fuses projections and runs in eval mode), in
    ``rollout_dtype(policy, dtype)``: the training model, its hooks and its optimiser never see the engine."""
    model = K3ForCausalLM(policy.config).to(next(policy.parameters()).device, rollout_dtype(policy, dtype))
    model.load_state_dict(policy.state_dict())  # (cast to the copy's dtype, as load() does)
    return model.eval()


class Rollout:
    """Sampling from a policy through one engine. ``stop``: the chat format's stop strings; ``max_tokens``: the
    longest reply (a trajectory reaching it finishes with "length"); ``temperature`` other than 1 is for
    evaluation only (the recorded log-probabilities are then not the sampling distribution's); ``dtype``: the
    engine's copy of the weights (``rollout_dtype``: default bf16 on CUDA, see the module docstring). The engine runs
    synchronously (no asynchronous scheduling), so every token is delivered before ``load`` changes the weights:
    a token's recorded version is the policy that drew it."""

    def __init__(self, policy, tokenizer, stop: tuple[str, ...], max_tokens: int, version: int,
                 engine_config: EngineConfig | None = None, temperature: float = 1.0,
                 dtype: torch.dtype | str | None = None):
        from ..data.tokenizer import eos_id

        self.tokenizer, self.stop, self.max_tokens, self.version = tokenizer, tuple(stop), max_tokens, version
        self.eos, self.temperature = eos_id(tokenizer), temperature  # training rollouts: 1 (see the docstring)
        # compile=False: CUDA graphs (with a bf16 copy on CUDA) of the eager decode step; a run builds several
        # engines (budget calibration, the run's own, each evaluation), and compiling each would cost more than
        # it saves over the few thousand decode steps of an RL run
        self.engine = Engine(policy_copy(policy, dtype), tokenizer, engine_config or EngineConfig(
            page_tokens=512, num_pages=520, max_batch=256, step_tokens=8192, async_scheduling=False,
            prefix_cache=False, compile=False))
        if self.engine.async_scheduling:
            raise ValueError("Rollout needs EngineConfig(async_scheduling=False): a token sampled by one policy "
                             "version must be delivered before the weights change")
        if self.engine.prefix is not None:  # its pages are keyed by tokens alone: they would outlive a load
            raise ValueError("Rollout needs EngineConfig(prefix_cache=False): load() changes the weights in place, "
                             "and a cached prefix would give a resubmitted trajectory the old policy's cache")
        self._live: dict[int, tuple[Trajectory, object]] = {}  # id(trajectory) -> (it, its request's handle)

    @torch.no_grad()
    def load(self, policy, version: int, reencode: bool = True) -> None:
        """``policy``'s weights into the engine's model, in place (its fused projections are views of them), as
        policy ``version``. ``reencode``: live requests end, so their trajectories are re-encoded by this policy
        next round; False: they stay live on their cache (see the module docstring), after the tokens the engine
        drew for them past the last round's chunk are taken in under the old version."""
        if reencode:
            for _, handle in self._live.values():
                handle.cancel()
            self._live.clear()
        else:
            for t, _ in list(self._live.values()):
                before = len(t.tokens)
                self._settle(t, before, self._drain(t, {id(t): 0}))
        self.engine.model.load_state_dict(policy.state_dict())
        self.version = version

    def round(self, trajectories: list[Trajectory], chunk: int | None = None) -> int:
        """Advance every unfinished trajectory by up to ``chunk`` tokens (None: to its end). -> tokens drawn."""
        todo = [t for t in trajectories if not t.done]
        for t in todo:
            if id(t) not in self._live:
                left = self.max_tokens - len(t.tokens)
                params = SamplingParams(max_tokens=left, temperature=self.temperature, seed=t.seed, stop=self.stop,
                                        draw_offset=len(t.tokens))
                self._live[id(t)] = (t, self.engine.submit(GenerationRequest(tuple(t.prompt_ids + t.tokens),
                                                                             params)))
        before = {id(t): len(t.tokens) for t in todo}
        drawn = {id(t): 0 for t in todo}  # events (EOS included) this round
        ended: dict[int, str] = {}  # id -> its request's finish reason
        running = list(todo)
        while running:
            self.engine.step()
            still = []
            for t in running:
                reason = self._drain(t, drawn)
                if reason is not None:
                    ended[id(t)] = reason
                elif chunk is None or drawn[id(t)] < chunk:
                    still.append(t)
            running = still
        for t in todo:
            self._settle(t, before[id(t)], ended.get(id(t)))
        return sum(len(t.tokens) - before[id(t)] for t in todo)

    def _drain(self, t: Trajectory, drawn: dict) -> str | None:
        """Take ``t``'s delivered events; -> its request's finish reason once it has one (the request is then no
        longer live), else None."""
        _, handle = self._live[id(t)]
        while True:
            try:
                ev = handle.events.get_nowait()
            except queue.Empty:
                return None
            if isinstance(ev, FinishEvent):
                if ev.reason == "error":
                    raise RuntimeError(f"rollout failed in the engine: {ev.error}")
                del self._live[id(t)]
                return ev.reason
            drawn[id(t)] += 1
            if ev.token_id != self.eos:  # EOS ends the reply; it is no token of it (as at inference)
                t.tokens.append(ev.token_id)
                t.logprobs.append(ev.logprob)
                t.versions.append(self.version)

    def _settle(self, t: Trajectory, before: int, reason: str | None) -> None:
        """Finish ``t`` if its reply holds a stop string (cut right after the token completing the first one),
        ended with EOS, or is ``max_tokens`` long; else it stays unfinished. ``reason``: its request's finish
        reason, None while it is live."""
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
        if t.done and id(t) in self._live:  # a stop string the engine could not see (it straddles a resubmission)
            self._live.pop(id(t))[1].cancel()
