"""One engine step's view of the hybrid cache, handed to ``K3ForCausalLM.forward(..., cache=...)``.

Legend: B sequences in the step, T new tokens each, S cached tokens (padded to the longest), R kv_lora_rank,
Dr rope dim. KDA layers continue each sequence's fixed-size state (chunked form for a prefill chunk, the
recurrence for one decode token); MLA layers append the new tokens' latents and attend over cache + new
tokens with weight absorption, in the 576-dim latent space.
"""

from __future__ import annotations

import torch

from ..layers.sequence.kda import KDAState


class StepCache:
    def __init__(self, kda_in: dict[int, KDAState], mla_in: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 ctx_lens: torch.Tensor, num_new: int):
        self.kda_in, self.mla_in = kda_in, mla_in  # keyed by decoder-layer index
        self.ctx_lens = ctx_lens  # [B] cached tokens per sequence
        self.kda_out: dict[int, KDAState] = {}
        self.mla_new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # latents of the new tokens
        B, S, T = ctx_lens.numel(), max(int(ctx_lens.max()), 0) if ctx_lens.numel() else 0, num_new
        dev = ctx_lens.device
        self.positions = ctx_lens[:, None] + torch.arange(T, device=dev)[None]  # [B,T] absolute positions
        cached = torch.arange(S, device=dev)[None, None, :] < ctx_lens[:, None, None]  # [B,1,S]
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None]  # [1,T,T]
        self.mask = torch.cat([cached.expand(B, T, S), causal.expand(B, T, T)], dim=-1)  # [B,T,S+T]

    def attend(self, layer, x: torch.Tensor) -> torch.Tensor:
        i = layer.layer_idx
        if layer.kind == "kda":
            y, state = layer.self_attn(x, state=self.kda_in[i], output_state=True)
            self.kda_out[i] = state
            return y
        mla = layer.self_attn
        c_new, pe_new = mla.latent(x, self.positions)  # [B,T,R], [B,T,Dr]
        self.mla_new[i] = (c_new, pe_new)
        c_old, pe_old = self.mla_in[i]
        c_all = torch.cat([c_old.to(c_new.dtype), c_new], dim=1)
        pe_all = torch.cat([pe_old.to(pe_new.dtype), pe_new], dim=1)
        return mla.attend_absorbed(x, c_all, pe_all, self.mask, self.positions)
