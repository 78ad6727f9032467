"""What goes into and comes out of the inference engine (SPEC §7): requests, sampling parameters, events.

The server and the CLI speak only these types; ``k3.inference.Engine`` implements them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: until end of sequence, a stop string or the engine's context limit
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int = 0  # how many top alternatives to report per token (0-5)
    ignore_eos: bool = False  # keep generating past the end-of-sequence token (benchmarks, tests)
    draw_offset: int = 0  # the first token's index in the sampler's noise: a continued prompt (k3.post's partial
    # rollouts) with the same seed and offset = tokens already drawn samples as if it had never stopped

    def __post_init__(self):
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:  # false for nan too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.draw_offset < 0:
            raise ValueError(f"draw_offset must be >= 0, got {self.draw_offset}")
        if not 0 <= self.logprobs <= 5:
            raise ValueError(f"logprobs must be in [0, 5], got {self.logprobs}")


@dataclass(frozen=True, eq=False)
class PromptImage:
    """An image in the prompt (SPEC §10): ``prompt_ids[start : start + length]`` are its placeholder tokens, whose
    embeddings the prefill replaces by the vision tower's features of ``pixels`` [h*w, 3, p, p] with ``grid`` (h, w)
    patches (``length`` = h*w / 4). ``digest`` names the image's content: the prefix cache hashes it with the tokens,
    so prompts that differ only in an image share no cached prefix past that image (k3.vision.preprocess makes
    all of these)."""

    start: int
    length: int
    pixels: torch.Tensor
    grid: tuple[int, int]
    digest: bytes


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    request_id: str | None = None
    images: tuple[PromptImage, ...] = ()  # in prompt order; needs a model with a vision tower


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. ``text`` is the new text it completes (may be "" while a UTF-8 sequence is
    incomplete); ``top_logprobs`` lists up to ``logprobs`` (token id, log-probability) alternatives, best first."""

    token_id: int
    text: str
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class FinishEvent:
    """The last event of a request. reason: "stop" (EOS or a stop string), "length" (max_tokens or the context
    limit), "abort" (cancelled, or the engine stopped), "error" (the engine failed: ``error`` says how)."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    text: str  # the whole completion (stop string excluded)
    error: str | None = None
