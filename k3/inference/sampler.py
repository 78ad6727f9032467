"""Next-token sampling for a batch of requests, each with its own SamplingParams and random generator (SPEC §7).

Per row: temperature 0 is greedy (argmax of the raw logits); otherwise divide by the temperature, keep the top-k
logits (``top_k`` 0 = off), then the nucleus (the smallest set of most likely tokens whose probability sums to at
least ``top_p``, never fewer than one token), and draw from what is left with the row's own ``torch.Generator``.
Drawing uses the exponential race (argmax of p / E with E ~ Exp(1), as gpt-fast does), so a seeded request's
tokens depend only on its own logits and its own generator: the same seed gives the same tokens whatever else
shares the batch. Reported log-probabilities are those of the UNMODIFIED logits (temperature 1, no filtering),
as the OpenAI API reports them.

Shapes: B = rows (requests), V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .api import SamplingParams

__all__ = ["sample", "make_generator"]

MIN_TEMPERATURE = 1e-5  # below this, logits / T overflows float32: such rows are treated as greedy


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The generator a request samples with: seeded from ``params.seed`` when given, else None (the global RNG).
    Create it once per request and pass it to every ``sample`` call for that request; it must live on the
    device of the logits."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def _filter_top_k(scaled_BV: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    V = scaled_BV.size(-1)
    k_B = torch.tensor([k if 0 < k < V else V for k in top_k], device=scaled_BV.device)
    if bool((k_B == V).all()):
        return scaled_BV
    sorted_BV = scaled_BV.sort(dim=-1, descending=True).values
    kth_B1 = sorted_BV.gather(-1, (k_B - 1)[:, None])  # ties with the k-th value are kept too
    return scaled_BV.masked_fill(scaled_BV < kth_B1, float("-inf"))


def _filter_top_p(scaled_BV: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    p_B = torch.tensor(top_p, device=scaled_BV.device, dtype=scaled_BV.dtype)
    use_B = p_B < 1.0  # at top_p = 1 rounding in the cumsum could drop tail tokens: leave those rows alone
    if not bool(use_B.any()):
        return scaled_BV
    probs_BV = scaled_BV.softmax(dim=-1)
    sorted_BV, idx_BV = probs_BV.sort(dim=-1, descending=True)
    before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV  # mass of the strictly more likely tokens
    drop_sorted_BV = (before_BV >= p_B[:, None]) & use_B[:, None]  # the first token always has before = 0 < p
    drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, idx_BV, drop_sorted_BV)
    return scaled_BV.masked_fill(drop_BV, float("-inf"))


def _draw(probs_BV: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row by the exponential race; each seeded row draws its noise from its own generator."""
    noise_BV = torch.empty_like(probs_BV)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        noise_BV[shared] = torch.empty_like(probs_BV[shared]).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise_BV[i].exponential_(generator=g)
    noise_BV.clamp_(min=torch.finfo(noise_BV.dtype).tiny)  # a draw of exactly 0 would make 0/0 = NaN win argmax
    return (probs_BV / noise_BV).argmax(dim=-1)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
           ) -> tuple[torch.Tensor, torch.Tensor, list[list[tuple[int, float]]]]:
    """Pick the next token of each row of ``logits`` [B, V].

    Returns ``tokens`` (long [B]), ``logprobs`` (float [B], log-softmax of the raw logits at the chosen token)
    and ``top``: per row, the ``params[i].logprobs`` most likely (token id, logprob) pairs, most likely first
    (an empty list when 0)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    B, V = logits.shape
    if len(params) != B or len(generators) != B:
        raise ValueError(f"need one SamplingParams and one generator (or None) per row: logits has {B} rows, "
                         f"got {len(params)} params and {len(generators)} generators")
    logits_BV = logits.float()
    logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
    tokens_B = logits_BV.argmax(dim=-1)

    rows = [i for i, p in enumerate(params) if p.temperature >= MIN_TEMPERATURE]
    if rows:
        temp_R1 = torch.tensor([params[i].temperature for i in rows], device=logits.device)[:, None]
        scaled_RV = logits_BV[rows] / temp_R1
        scaled_RV = _filter_top_k(scaled_RV, [params[i].top_k for i in rows])
        scaled_RV = _filter_top_p(scaled_RV, [params[i].top_p for i in rows])
        tokens_B[rows] = _draw(scaled_RV.softmax(dim=-1), [generators[i] for i in rows])

    chosen_B = logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
    top: list[list[tuple[int, float]]] = [[] for _ in range(B)]
    k_max = min(max(p.logprobs for p in params), V)
    if k_max > 0:
        top_lp_BK, top_id_BK = logprobs_BV.topk(k_max, dim=-1)
        ids, lps = top_id_BK.tolist(), top_lp_BK.tolist()
        for i, p in enumerate(params):
            top[i] = list(zip(ids[i][:p.logprobs], lps[i][:p.logprobs]))
    return tokens_B, chosen_B, top
