"""Context parallelism for the whole K3 model (SPEC §8), applied from outside the single-device model.

Legend: B batch, T this rank's tokens, S keys seen by this rank (= end), D hidden, H heads, K head dim,
R kv_lora_rank, Dr rope dim, V vocab, W conv width.

Rank r of the CP group holds the r-th contiguous segment [start, end) of every sequence (for packed documents:
of the one packed row [1, T_global]; segments may differ in length but must tile [0, T_global) in rank order).
Only the token mixers see across tokens; AttnRes, norms, MoE and the head are per token and need nothing. So a
``ContextParallel`` object is handed to the model as its token ``mixer=`` (``DecoderLayer.forward`` then calls
``cp.attend(layer, x)`` instead of the layer's own token mixer):

  - KDA (``_attend_kda``): the layer's own projections, activations and output; the q/k/v short convolutions
    take their W-1 halo from the previous rank (``kcp_short_conv``) and the recurrence starts from the exact
    carried state (``kcp_chunk_kda``: one fixed-size all-gather of (M, S~)).
  - MLA (``_attend_mla``): this rank's latents (c_kv, k_pe) are all-gathered along time (``gather_sequence``,
    backward: all-reduce of the gathered gradient, then this rank's slice); this rank's queries attend over
    keys [0, end) under a causal + same-document mask in GLOBAL positions, with weight absorption
    (``GatedMLA.attend_latent``, exact in fp32).

Loss: ``cp_shifted_targets`` gives each rank its next-token targets (the target of its last token is the next
rank's first token, ignored across a document boundary); ``cp_loss_sum`` returns (sum, count), and the global
mean is sum / all-reduced count (``cp_mean_loss``), which equals the single-process loss. Parameter gradients
are then the SUM over CP ranks (all-reduce them, as data parallel does).

Every rank must run every forward and backward of the model together: the halos, the KDA scan and the latent
gather are collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..model.mixer import Mixer
from ..ops.varlen import document_ids, same_document
from .process_group import collective_device
from .kcp import kcp_chunk_kda, kcp_short_conv, local_cu_seqlens

__all__ = ["ContextParallel", "gather_sequence", "cp_shifted_targets", "cp_model_loss", "cp_loss_sum", "cp_mean_loss"]


class _GatherSequence(torch.autograd.Function):
    """x [B,T_r,C] on every rank -> [B,sum_r T_r,C] (ranks in order); backward: all-reduce, take own slice."""

    @staticmethod
    def forward(ctx, x, group, ranges):
        r = dist.get_rank(group)
        longest = max(e - s for s, e in ranges)
        padded = F.pad(x, (0, 0, 0, longest - x.shape[1])).contiguous()  # gloo wants equal sizes
        parts = [torch.empty_like(padded) for _ in ranges]
        dist.all_gather(parts, padded, group=group)
        ctx.group, ctx.own = group, ranges[r]
        return torch.cat([p[:, : e - s] for p, (s, e) in zip(parts, ranges)], dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # every rank's loss may read every rank's latents
        s, e = ctx.own
        return grad[:, s:e], None, None


def gather_sequence(x: torch.Tensor, group, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Differentiable all-gather along time: x [B,T,C] (this rank's [start, end)) -> [B,T_global,C]."""
    return _GatherSequence.apply(x, group, ranges)


def _rank_ranges(group, start: int, end: int) -> list[tuple[int, int]]:
    """All ranks' [start, end), checked to tile [0, T_global) in rank order."""
    mine = torch.tensor([start, end], dtype=torch.long, device=collective_device(group))  # NCCL: on the GPU
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    ranges = [(int(p[0]), int(p[1])) for p in parts]
    prev = 0
    for r, (s, e) in enumerate(ranges):
        if s != prev or e <= s:
            raise ValueError(f"CP ranks must hold contiguous, non-empty segments tiling [0, T) in rank order; got "
                             f"{ranges} (rank {r} should start at {prev})")
        prev = e
    return ranges


class ContextParallel(Mixer):
    """The CP token mixer of one forward, passed as ``mixer=`` to ``K3ForCausalLM.forward`` / ``K3Model.forward``.
    ``K3ForCausalLM.forward`` then takes the GLOBAL row (input_ids and labels [B,T_global]) and this rank's share of
    it: its tokens (``tokens``), their targets and MTP inputs from the global row (``shifted``), and its share of
    the global mean loss (``mean``: the local CE sum over the group's target count).

    group: the CP process group (None = default). start, end: this rank's token range in the global sequence.
    cu_seqlens: GLOBAL document boundaries [N+1] of the packed row (B = 1), or None for unpacked batches.
    Construction is a collective (one small all-gather of the ranges): every rank of ``group`` builds its own.
    Build a new one for every batch; call the model with ``cu_seqlens=None`` (this object carries them).
    """

    def __init__(self, group=None, start: int = 0, end: int | None = None, cu_seqlens: torch.Tensor | None = None):
        if not dist.is_initialized():
            raise RuntimeError("ContextParallel needs torch.distributed initialised (dist.init_process_group)")
        if end is None:
            raise ValueError("ContextParallel needs this rank's token range: start and end")
        self.group, self.start, self.end = group, int(start), int(end)
        self.ranges = _rank_ranges(group, self.start, self.end)
        self.total = self.ranges[-1][1]
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.to(torch.long)
            if int(cu_seqlens[-1]) != self.total:
                raise ValueError(f"global cu_seqlens must end at the total length {self.total} of the rank ranges; "
                                 f"got {cu_seqlens.tolist()}")
            self.cu_local, self.continues = local_cu_seqlens(cu_seqlens, self.start, self.end)
        else:
            self.cu_local, self.continues = None, True
        self.cu_seqlens = cu_seqlens
        cpu = torch.device("cpu")  # mask and positions: built on the CPU whatever the default device, moved by attend
        doc = document_ids(cu_seqlens, self.total, cpu)
        q_pos, k_pos = torch.arange(self.start, self.end, device=cpu), torch.arange(self.end, device=cpu)
        self.mask = ((doc[q_pos, None] == doc[None, k_pos]) & (k_pos[None, :] <= q_pos[:, None]))[None]  # [1,T,S]
        doc_start = (cu_seqlens.cpu()[doc] if cu_seqlens is not None
                     else torch.zeros(self.total, dtype=torch.long, device=cpu))
        self.positions = (torch.arange(self.total, device=cpu) - doc_start)[None, self.start:self.end]  # [1,T] (RoPE)

    def tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return ids[:, self.start:self.end]

    def shifted(self, ids: torch.Tensor, shift: int, cu_seqlens=None, fill: int | None = -100) -> torch.Tensor:
        """This rank's slice of ``Mixer.shifted`` over the global row ids [B,T_global] (its own cu_seqlens): the
        targets of its last tokens are the next rank's first tokens, as in one process."""
        return super().shifted(ids, shift, self.cu_seqlens, fill)[:, self.start:self.end]

    def mean(self, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return _share_of_mean(total, count, self.group)

    def attend(self, layer, x: torch.Tensor, stats=None) -> torch.Tensor:
        """The token mixer of ``layer`` (a DecoderLayer) on this rank's tokens x [B,T,D] -> [B,T,D]; ``stats``: where
        an MLA layer's max logits go when asked for (``k3.layers.stats``)."""
        if x.shape[1] != self.end - self.start:
            raise ValueError(f"rank holds [{self.start}, {self.end}) = {self.end - self.start} tokens; "
                             f"the model got {x.shape[1]}")
        if self.cu_seqlens is not None and x.shape[0] != 1:
            raise ValueError(f"packed documents (cu_seqlens) need batch 1; got batch {x.shape[0]}")
        if layer.kind == "kda":
            return self._attend_kda(layer.self_attn, x)
        return self._attend_mla(layer.self_attn, x, stats)

    def _conv(self, x, taps):
        return kcp_short_conv(x, taps, self.group, self.cu_local, self.continues, activation=False)

    def _attend_kda(self, attn, x):
        """The KDA layer's own pieces around the halo'd convs (q, k, v stacked: one halo exchange) and the KCP
        recurrence."""
        q, k, v, f, b, gate = attn.stateless_inputs(x, conv=self._conv)  # before the SiLU: activations applies it
        q, k, v, g, beta = attn.activations(q, k, v, f, b, conv_silu=True)
        o, _ = kcp_chunk_kda(q, k, v, g, beta, self.group, cu_seqlens=self.cu_local,
                             first_doc_continues=self.continues, backend=attn.backend,
                             lower_bound=attn.kernel_lower_bound)
        return attn.output(o, gate)

    def _attend_mla(self, mla, x, stats=None):
        """This rank's queries over the gathered latents of keys [0, end), absorbed form, global mask."""
        B, T, _ = x.shape
        positions = self.positions.to(x.device).expand(B, T)
        inp = mla.project(x, positions)  # latents [B,T,R], [B,T,Dr]
        lat = gather_sequence(torch.cat([inp.c_kv, inp.k_pe], dim=-1), self.group, self.ranges)[:, : self.end]
        c_all, pe_all = lat.split([inp.c_kv.shape[-1], inp.k_pe.shape[-1]], dim=-1)  # [B,S,R], [B,S,Dr]
        mask = self.mask.to(x.device).expand(B, T, self.end)
        if stats is not None and stats.max_logit is not None:
            stats.add_max_logit(mla.layer_idx, _max_logit(mla, inp, c_all, pe_all, mask))
        return mla.output(mla.attend_latent(inp, c_all, pe_all, mask), inp.gate)


@torch.no_grad()
def _max_logit(mla, inp, c_all, pe_all, mask) -> torch.Tensor:
    """QK-clip's statistic under CP: this rank's queries' max pre-softmax logit per head [H] over the keys they see
    (the training loop takes the MAX over ranks). Same scores as ``attend_latent``: [B,H,T,S]."""
    s = (torch.einsum("bthr,bsr->bhts", mla.absorb(inp.q_nope), c_all.float())
         + torch.einsum("bthp,bsp->bhts", inp.q_pe.float(), pe_all.float())) * mla.scale
    return s.masked_fill(~mask[:, None], float("-inf")).amax(dim=(0, 2, 3))


def cp_shifted_targets(labels_global: torch.Tensor, cu_seqlens: torch.Tensor | None, start: int,
                       end: int, shift: int = 1) -> torch.Tensor:
    """Targets ``shift`` tokens ahead for this rank's tokens: labels_global [B,T_global] (usually the input ids)
    -> [B,T] with target[t] = label[t+shift], -100 (ignore) past the global end and wherever t+shift lies in
    another document. The last local tokens' targets come from the next rank's labels, as in one process."""
    B, T_global = labels_global.shape
    if not 0 <= start < end <= T_global:
        raise ValueError(f"rank range [{start}, {end}) must be a non-empty part of [0, {T_global})")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"packed documents (cu_seqlens) need labels of batch 1; got batch {B}")
    tgt = torch.full_like(labels_global, -100)
    tgt[:, : T_global - shift] = labels_global[:, shift:]
    tgt.masked_fill_(~same_document(T_global, shift, cu_seqlens, labels_global.device), -100)  # no wait for the device
    return tgt[:, start:end]


def cp_model_loss(model, ids_global: torch.Tensor, cu_seqlens, start: int, end: int, group=None, mtp: bool = True,
                  loss_chunk: int = 4096, labels_global: torch.Tensor | None = None, record: tuple[str, ...] = ()):
    """This rank's shares of the single-process losses of ``model`` on ``ids_global`` [B,T_global] split along
    time: -> the model's ``CausalLMOutput`` with "lm_loss" (lm share) and "mtp_loss" (MTP share, absent without MTP),
    0-d fp32 tensors to backpropagate, and the statistics of ``record``. Each share is this rank's targets' CE sum
    over the group's target count, so the group's shares SUM to the single-process mean (the MTP share: the mean
    over the MTP layers of theirs). ``mtp``: run the MTP layers (when the model has them); every rank of the group
    must pass the same (their attention is collective). ``labels_global`` (default: the ids): the targets, -100
    where a token is none (fine-tuning).

    It is the model's own forward with this rank's ``ContextParallel`` view as its mixer (so the root's FSDP hooks
    run as around any forward); the head's CE runs ``loss_chunk`` tokens at a time (``return_logits=False``): no
    [T, vocab] logits are held (what makes long CP segments affordable)."""
    view = ContextParallel(group, start, end, cu_seqlens)
    labels = ids_global if labels_global is None else labels_global
    return model(ids_global, labels=labels, mtp_weight=1.0 if mtp else 0.0, mixer=view, return_logits=False,
                 loss_chunk=loss_chunk, record=record)


def cp_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B,T,V], targets [B,T] (-100 = ignore) -> (summed CE fp32, number of counted targets)."""
    V = logits.shape[-1]
    total = F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1), ignore_index=-100, reduction="sum")
    return total, (targets != -100).sum()


def cp_mean_loss(logits: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's share of the global mean CE: local sum / all-reduced count. The shares of all ranks add up to
    the single-process loss, so backward on each share plus summed parameter gradients gives its gradients."""
    return _share_of_mean(*cp_loss_sum(logits, targets), group)


def _share_of_mean(total: torch.Tensor, count: torch.Tensor, group) -> torch.Tensor:
    count = count.clone()
    dist.all_reduce(count, group=group)
    if int(count) == 0:
        raise ValueError("no counted targets on any CP rank (all -100)")
    return total / count
