"""QK-clip, the weight clipping of Kimi K2's MuonClip (SPEC §5), per MLA head.

Legend: H heads, Dn nope dim, Dr rope/pe dim, Dv value dim. Head h's logit is
    s_h = (q_nope . k_nope + q_pe . k_pe) * scale,  q from q_b_proj (or q_proj) rows, k_nope from kv_b_proj rows.
When the recorded max logit m_h exceeds tau, with gamma = tau / m_h:
    q_nope rows *= sqrt(gamma),  k_nope rows *= sqrt(gamma),  q_pe rows *= gamma
so every logit of head h scales by exactly gamma and its max returns to tau. k_pe is one projection shared by
all heads (kv_a_proj_with_mqa), so it is left alone; other heads and the value rows are untouched.

Use: ask the forward for them (``model(..., record=("max_logit",))``: ``out.max_logit`` {layer: [H]}), take their
maximum over the step's micro-batches (``k3.layers.stats.merge_max_logits``), then after ``optimizer.step()`` call
``qk_clip_(model, max_logit, tau)``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.sequence.mla import GatedMLA


@torch.no_grad()
def scale_head_logits_(layer: GatedMLA, gamma: torch.Tensor) -> None:
    """Scale head h's logits by ``gamma[h]`` [H] in place (see the module docstring); gamma 1 leaves a head
    bit-for-bit unchanged. Works on plain and on FSDP2-sharded (DTensor) weights alike: the per-row factors
    are built for the whole matrix and each rank applies its own rows."""
    from .optim.muon import _like

    H, Dn, Dr, Dv = layer.num_heads, layer.nope, layer.pe, layer.dv
    g = gamma.to(torch.float32)  # stays on its device: no wait for it per layer
    q_rows = torch.cat([g.sqrt()[:, None].expand(H, Dn), g[:, None].expand(H, Dr)], 1).reshape(-1)  # [H*(Dn+Dr)]
    kv_rows = torch.cat([g.sqrt()[:, None].expand(H, Dn), g.new_ones(H, Dv)], 1).reshape(-1)  # [H*(Dn+Dv)]
    for w, rows in (((layer.q_b_proj if layer.q_lora else layer.q_proj).weight, q_rows),
                    (layer.kv_b_proj.weight, kv_rows)):
        factor = rows.to(w.device)[:, None].expand(w.shape)
        w.copy_((w.float() * _like(w, factor)).to(w.dtype) if not hasattr(w, "device_mesh")
                else w * _like(w, factor.to(w.dtype)))


@torch.no_grad()
def qk_clip_(model: nn.Module, max_logit: dict | None, tau: float = 100.0) -> torch.Tensor:
    """Clip every MLA head of ``model`` whose max logit in ``max_logit`` ({layer index: [H] fp32}, the forwards'
    ``CausalLMOutput.max_logit``) exceeds ``tau``; return the number of heads clipped, a 0-d int64 tensor on the
    layers' device (not read back here: the caller reads it with the step's other figures).

    Layers absent from ``max_logit`` are skipped. Under data parallelism all-reduce each max logit with MAX first
    (``TrainingPlan.sync_max_logits``), so that every replica clips the same heads.
    """
    if tau <= 0:
        raise ValueError(f"qk_clip_: tau must be positive, got {tau}")
    counts = []
    for layer in model.modules():
        if not isinstance(layer, GatedMLA) or not max_logit or layer.layer_idx not in max_logit:
            continue
        m = max_logit[layer.layer_idx].float()
        if m.shape != (layer.num_heads,):
            raise ValueError(f"GatedMLA layer {layer.layer_idx}: max_logit has shape {tuple(m.shape)}, "
                             f"expected ({layer.num_heads},)")
        over = m > tau
        scale_head_logits_(layer, torch.where(over, tau / m, torch.ones_like(m)))
        counts.append(over.sum())
    return torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.int64)
