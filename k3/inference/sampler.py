"""Next-token sampling for a batch of rows, each with its own parameters, all on the device (SPEC §7).

Legend: B rows, V vocabulary, K reported alternatives (``TOP_LOGPROBS``).

Per row: temperature 0 is greedy (argmax of the raw logits); otherwise divide by the temperature, keep the top-k
logits (``top_k`` 0 = off), then the nucleus (the smallest set of most likely tokens whose probability sums to at
least ``top_p``, never fewer than one), and draw by the exponential race: argmax_v p_v / E_v with E_v ~ Exp(1)
(as gpt-fast does), i.e. argmax_v (logit_v / T - log E_v).

The noise is a counter-based hash of (the request's seed, the index of the token being drawn, v): no random
generator state, so a request's tokens depend only on its own logits, seed and position (the same seed gives the
same tokens whatever else shares the batch, after a preemption too), and the whole function is static-shaped
tensor code a CUDA graph can replay. Every parameter is a [B] tensor. Reported log-probabilities are those of
the UNMODIFIED logits (temperature 1, no filtering), as the OpenAI API reports them.
"""

from __future__ import annotations

import torch

__all__ = ["sample", "hash_uniform", "MIN_TEMPERATURE", "TOP_LOGPROBS"]

MIN_TEMPERATURE = 1e-5  # below this, logits / T overflows float32: such rows are greedy
TOP_LOGPROBS = 5  # alternatives computed for every row (the API allows 0-5)
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) held in int64, without int64 overflow (16-bit halves)."""
    return (((x & 0xFFFF) * c) + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser: a bijection of [0, 2^32) with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def hash_uniform(seed_B: torch.Tensor, step_B: torch.Tensor, V: int) -> torch.Tensor:
    """[B,V] float32 in (0, 1): a fixed function of (seed, step, v), the same on every device."""
    v = torch.arange(V, device=seed_B.device, dtype=torch.int64)
    s = seed_B.to(torch.int64)
    h = _fmix32((s & _M32)[:, None] ^ _fmix32(((s >> 32) & _M32) ^ _fmix32(step_B.to(torch.int64) & _M32))[:, None])
    h = _fmix32(h ^ _fmix32(v)[None, :])
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # 24 bits: exact in fp32, never 0 or 1


def _filter(scaled_BV: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor) -> torch.Tensor:
    """-inf outside each row's top-k and nucleus (ties with the k-th value kept; top_p = 1 keeps every token)."""
    V = scaled_BV.shape[-1]
    sorted_BV, idx_BV = scaled_BV.sort(dim=-1, descending=True)
    k_B = torch.where((top_k_B > 0) & (top_k_B < V), top_k_B, torch.full_like(top_k_B, V))
    kth_B1 = sorted_BV.gather(-1, (k_B - 1)[:, None])
    probs_BV = sorted_BV.masked_fill(sorted_BV < kth_B1, float("-inf")).softmax(-1)
    before_BV = probs_BV.cumsum(-1) - probs_BV  # mass of the strictly more likely tokens
    drop_sorted = (sorted_BV < kth_B1) | ((before_BV >= top_p_B[:, None]) & (top_p_B < 1.0)[:, None])
    drop_BV = torch.zeros_like(drop_sorted).scatter(-1, idx_BV, drop_sorted)
    return scaled_BV.masked_fill(drop_BV, float("-inf"))


def sample(logits: torch.Tensor, temperature_B: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor,
           seed_B: torch.Tensor, step_B: torch.Tensor, filtered: bool = True):
    """Pick the next token of each row of ``logits`` [B,V].

    ``filtered=False`` skips top-k / top-p (valid when every row has top_k 0 and top_p 1: no sort). Returns
    (tokens long [B], logprob fp32 [B] of the chosen token, top_logprob fp32 [B,K], top_id long [B,K])."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    logits_BV = logits.float()
    logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
    greedy_B = logits_BV.argmax(dim=-1)
    temp_B = temperature_B.float().clamp(min=MIN_TEMPERATURE)
    scaled_BV = logits_BV / temp_B[:, None]
    if filtered:
        scaled_BV = _filter(scaled_BV, top_k_B, top_p_B.float())
    noise_BV = -torch.log(hash_uniform(seed_B, step_B, logits_BV.shape[-1]))  # Exp(1)
    drawn_B = (scaled_BV - torch.log(noise_BV)).argmax(dim=-1)
    tokens_B = torch.where(temperature_B < MIN_TEMPERATURE, greedy_B, drawn_B)
    chosen_B = logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
    top_lp, top_id = logprobs_BV.topk(min(TOP_LOGPROBS, logits_BV.shape[-1]), dim=-1)
    return tokens_B, chosen_B, top_lp, top_id
