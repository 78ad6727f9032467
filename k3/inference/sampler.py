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
SLICE = 1024  # tokens per slice of the two-stage reductions over the vocabulary
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


def _chunks(V: int) -> int:
    """How many slices of ~1024 tokens a row's reductions are split into (1 for small vocabularies)."""
    return max(1, V // SLICE)


def _argmax(x_BCL: torch.Tensor) -> torch.Tensor:
    """argmax over the flattened (C, L) of each row, the first maximal index as ``argmax``: the first slice holding
    the maximum, then the first index inside it."""
    val_BC, idx_BC = x_BCL.max(-1)
    c_B = val_BC.argmax(-1)
    return c_B * x_BCL.shape[-1] + idx_BC.gather(-1, c_B[:, None]).squeeze(-1)


def sample(logits: torch.Tensor, temperature_B: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor,
           seed_B: torch.Tensor, step_B: torch.Tensor, filtered: bool = True, top_logprobs: bool = True):
    """Pick the next token of each row of ``logits`` [B,V].

    ``filtered=False`` skips top-k / top-p (valid when every row has top_k 0 and top_p 1: no sort).
    ``top_logprobs=False`` skips the K best alternatives (valid when no row asks for logprobs: two top-k passes
    over the vocabulary, ~4% of a `small` decode step at batch 1); their columns are then zeros. Returns
    (tokens long [B], logprob fp32 [B] of the chosen token, top_logprob fp32 [B,K], top_id long [B,K]).

    Every reduction over the vocabulary runs in two stages, over C slices of L ~ 1024 tokens and then over the
    slices (the row padded with -inf to C x L): with few rows a one-stage reduction is one program per row walking
    the whole vocabulary (25 us for 164K tokens on an H200), the split spreads it over C programs. The same
    results: argmaxes pick the first maximal index either way, the top-K of the slices' top-Ks is the row's,
    log-sum-exp = m + log sum_c exp(m_c - m) s_c."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    B, V = logits.shape
    C = _chunks(V)
    L = -(-V // C)
    logits_BV = logits.float()
    padded_BCL = torch.nn.functional.pad(logits_BV, (0, C * L - V), value=float("-inf")).view(B, C, L)
    m_BC = padded_BCL.amax(-1)
    m_B = m_BC.amax(-1)
    s_BC = (padded_BCL - m_BC[..., None]).exp().sum(-1)
    lse_B = m_B + ((m_BC - m_B[:, None]).exp() * s_BC).sum(-1).log()
    greedy_B = _argmax(padded_BCL)
    temp_B = temperature_B.float().clamp(min=MIN_TEMPERATURE)
    scaled_BV = logits_BV / temp_B[:, None]
    if filtered:
        scaled_BV = _filter(scaled_BV, top_k_B, top_p_B.float())
    noise_BV = -torch.log(hash_uniform(seed_B, step_B, V))  # Exp(1)
    race_BV = torch.nn.functional.pad(scaled_BV - torch.log(noise_BV), (0, C * L - V), value=float("-inf"))
    drawn_B = _argmax(race_BV.view(B, C, L))
    tokens_B = torch.where(temperature_B < MIN_TEMPERATURE, greedy_B, drawn_B)
    chosen_B = logits_BV.gather(-1, tokens_B[:, None]).squeeze(-1) - lse_B
    K = min(TOP_LOGPROBS, V)
    if not top_logprobs:
        return tokens_B, chosen_B, logits_BV.new_zeros(B, K), torch.zeros(B, K, dtype=torch.long, device=logits.device)
    top_BCK, at_BCK = padded_BCL.topk(min(K, L), dim=-1)  # each slice's top K, then theirs
    top_lp, pick = top_BCK.flatten(1).topk(K, dim=-1)
    top_id = (at_BCK + torch.arange(C, device=logits.device)[:, None] * L).flatten(1).gather(-1, pick)
    return tokens_B, chosen_B, top_lp - lse_B[:, None], top_id
