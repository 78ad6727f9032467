"""Pipeline stages of a K3ForCausalLM (SPEC §8): contiguous decoder layers, and what travels between them.

A stage runs decoder layers [lo, hi). The first also holds the embedding, the last the output AttnRes query, the
final norm, the LM head and the MTP layers. With Block Attention Residuals (SPEC §3) a stage boundary between
layers l-1 and l must carry the whole depth state, not one hidden state:

    sources(l) = [b_0 = embedding, b_1, ..., b_{n-1}, partial sum of block n]       n = ceil(2l / S_b)

(S_b = the block size in sub-layers, ``DepthStream.sublayer_block_size``; the embedding is sealed as b_0 by the first
read). n depends only on l, so the shape is fixed per micro-batch: ONE tensor ``[n + 1 + M, B, T, D]`` (``pack``),
M = the MTP layers' next-token embeddings emb(x_{t+k}), computed by the first stage (which holds the embedding) and
carried to the last: the embedding's gradient then flows back through the pipeline, with no tied-weight
all-reduce between the first and last stage. ``unpack`` is its inverse (views of the received tensor, so autograd
sends back one gradient of the same shape). The ``mb`` keyword (the micro-batch's index, a [1, 1] tensor chunked
by the schedule) names the micro-batch in ``feed``, the step's placed micro-batches: document boundaries and
targets do not travel.

Legend: B batch, T time, D hidden, L decoder layers, P stages.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.depth.attn_res import DepthStream
from ..layers.stats import Statistics, merge_max_logits
from ..model.block import _Query
from ..model.mixer import Mixer
from ..model.transformer import _checkpointed, chunked_head_ce_sum
from ..ops.precision import compute_dtype

__all__ = ["StageModule", "sources_at", "split_layers", "layer_costs", "pack", "unpack", "StepFeed"]


def sources_at(config, layer: int) -> int:
    """How many depth sources cross the boundary before decoder layer ``layer`` (blocks + the partial sum)."""
    if config.attn_res == "none" or layer == 0:
        return 1
    bs = DepthStream.sublayer_block_size(config.attn_res, config.attn_res_block_size)
    return -(-2 * layer // bs) + 1


def layer_costs(config, seq_len: int) -> list[float]:
    """Relative cost (forward + backward FLOPs per token) of each decoder layer: 6 x its active parameters, plus
    MLA's attention over the sequence (4 x T x heads x (qk + v) head dims, causal half: 2 x ... x 3 for fwd+bwd)."""
    from ..model.params import count_parameters

    by = count_parameters(config)["by_component"]
    L = config.num_hidden_layers
    kinds = [config.layer_kind(i) for i in range(L)]
    n_kda, n_mla = kinds.count("kda"), kinds.count("mla")
    n_moe = sum(config.is_moe_layer(i) for i in range(L))
    moe = sum(by[c]["active"] for c in ("routed_experts", "shared_experts", "latent_proj", "router")) / max(n_moe, 1)
    dense = by["dense_ffn"]["active"] / max(L - n_moe, 1)
    per = (by["attn_res"]["active"] + by["norms"]["active"]) / L
    attn_mla = 3 * 2 * seq_len * config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim
                                                                 + config.v_head_dim)
    costs = []
    for i, kind in enumerate(kinds):
        mix = by["kda"]["active"] / max(n_kda, 1) if kind == "kda" else by["mla"]["active"] / max(n_mla, 1)
        ffn = moe if config.is_moe_layer(i) else dense
        costs.append(6 * (mix + ffn + per) + (attn_mla if kind == "mla" else 0))
    return costs


def head_cost(config) -> float:
    """The last stage's extra cost per token: the LM head (6 x D x V), and each MTP layer (its MLA layer + the head)."""
    head = 6 * config.hidden_size * config.vocab_size
    costs = layer_costs(config, 1)
    mla = max((c for i, c in enumerate(costs) if config.layer_kind(i) == "mla"), default=max(costs))
    return head * (1 + config.num_nextn_predict_layers) + mla * config.num_nextn_predict_layers


def split_layers(config, stages: int, seq_len: int, layers: list[int] | None = None) -> list[tuple[int, int]]:
    """[lo, hi) of each of ``stages`` stages: ``layers`` (decoder layers per stage, summing to L) as given, else the
    contiguous split minimising the most expensive stage (``layer_costs``, the last stage charged ``head_cost``), by
    dynamic programming over (stage, first layer): O(P L^2)."""
    L = config.num_hidden_layers
    if stages > L:
        raise ValueError(f"--pp x --pp-virtual = {stages} stages but the model has {L} decoder layers: every stage "
                         "needs at least one; lower --pp or --pp-virtual")
    if layers is not None:
        if len(layers) != stages or sum(layers) != L or min(layers) < 1:
            raise ValueError(f"--pp-layers {','.join(map(str, layers))}: needs {stages} counts (--pp x --pp-virtual), "
                             f"each >= 1, summing to the model's {L} decoder layers")
        bounds = [0]
        for n in layers:
            bounds.append(bounds[-1] + n)
        return list(zip(bounds[:-1], bounds[1:]))
    cost = layer_costs(config, seq_len)
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    tail = head_cost(config)
    inf = float("inf")
    # best[s][i]: the least max-stage cost of layers [i, L) over stages s..P-1; cut[s][i]: stage s's end
    best = [[inf] * (L + 1) for _ in range(stages + 1)]
    cut = [[L] * (L + 1) for _ in range(stages)]
    best[stages][L] = 0.0
    for s in range(stages - 1, -1, -1):
        for i in range(L):
            for j in range(i + 1, L - (stages - 1 - s) + 1):
                c = prefix[j] - prefix[i] + (tail if s == stages - 1 else 0.0)
                v = max(c, best[s + 1][j])
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    out, i = [], 0
    for s in range(stages):
        out.append((i, cut[s][i]))
        i = cut[s][i]
    return out


def pack(stream: DepthStream, mtp_embs: list[torch.Tensor]) -> torch.Tensor:
    """The depth state after a stage -> one tensor [sources + M, B, T, D] (see the module docstring)."""
    return torch.stack([*stream.blocks, stream.partial, *mtp_embs])


def unpack(x: torch.Tensor, config, layer: int, mtp: int) -> tuple[DepthStream, list[torch.Tensor]]:
    """A received [sources + M, B, T, D] tensor -> (the DepthStream before decoder layer ``layer``, the M MTP
    embeddings). Refuses a tensor whose number of sources is not the one this boundary must carry."""
    n = sources_at(config, layer)
    if x.shape[0] != n + mtp:
        raise RuntimeError(f"pipeline boundary before layer {layer}: received {x.shape[0]} tensors, expected "
                           f"{n} depth sources + {mtp} MTP embeddings; do all ranks run the same --pp-layers?")
    parts = list(x.unbind(0))
    c = config
    stream = DepthStream(parts[n - 1], c.attn_res, DepthStream.sublayer_block_size(c.attn_res, c.attn_res_block_size),
                         c.rms_norm_eps)
    stream.blocks, stream.sublayer = parts[: n - 1], 2 * layer
    return stream, parts[n:]


class StepFeed:
    """The step's micro-batches as every stage reads them: ``batches[i]`` a PlacedBatch (k3.distributed.plan),
    ``mtp_weight``, and what the last stage computed: ``parts[i]`` = [lm, mtp] weighted losses (detached)."""

    def __init__(self):
        self.batches, self.mtp_weight, self.parts, self.observe = [], 0.0, {}, None
        self.record, self.max_logit = (), None  # the statistics to record (k3.layers.stats); the step's max logits
        self.saved, self.peak = None, 0  # the step's SavedStats (when measured), the most live at a forward's end
        self.loss_scale = 1.0  # C x share, the plan's weighting (k3.distributed.plan), times 1 here (no CP)


class StageModule(nn.Module):
    """Decoder layers [lo, hi) of ``model`` (the same modules: parameters are shared, not copied), with the
    embedding on the first stage and the output query, norm, head and MTP on the last.

    forward(x, mb): first stage: x = input ids [1, T]; others: the packed depth state [n + M, 1, T, D]. Returns
    the packed state after layer hi - 1, or on the last stage the micro-batch's weighted [lm, mtp] losses [1, 2]."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool, feed: StepFeed, mtp: bool):
        super().__init__()
        c = model.config
        self.config, self.lo, self.hi, self.first, self.last, self.feed = c, lo, hi, first, last, feed
        self.gradient_checkpointing = lambda: model.model.gradient_checkpointing  # set by the memory policy
        self.n_mtp = len(model.mtp) if mtp else 0
        self.layers = nn.ModuleList(model.model.layers[lo:hi])
        if first:
            self.embed_tokens = model.model.embed_tokens
        if last:
            self.norm, self.lm_head, self.mtp = model.model.norm, model.lm_head, model.mtp if self.n_mtp else None
            if c.attn_res != "none":
                self.output_attn_res_proj = model.model.output_attn_res_proj
                self.output_attn_res_norm = model.model.output_attn_res_norm

    def forward(self, x: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
        placed = self.feed.batches[int(mb.reshape(-1)[0])]
        ids, cu = placed.input_ids, placed.cu_seqlens
        c = self.config
        if self.first:
            emb = compute_dtype(self.embed_tokens(x))
            stream = DepthStream(emb, c.attn_res, DepthStream.sublayer_block_size(c.attn_res, c.attn_res_block_size),
                                 c.rms_norm_eps)
            mtp_embs = [self.embed_tokens(_next_tokens(ids, k + 1, cu)).to(emb.dtype) for k in range(self.n_mtp)]
        else:
            stream, mtp_embs = unpack(x, c, self.lo, self.n_mtp)
        checkpointed = self.gradient_checkpointing() and self.training
        stats = Statistics(self.feed.record) if self.feed.record else None
        for layer in self.layers:
            if checkpointed:
                _checkpointed(layer, stream, cu, stats)
            else:
                layer(stream, cu, None, stats)
        out = pack(stream, mtp_embs) if not self.last else self._losses(stream, mtp_embs, placed,
                                                                        int(mb.reshape(-1)[0]), stats)
        if stats is not None:
            if self.feed.observe is not None and stats.routing:  # Quantile Balancing counts this micro-batch's
                self.feed.observe(stats.routing)  # routing in this stage's MoE layers (MTP's too)
            self.feed.max_logit = merge_max_logits(self.feed.max_logit, stats.max_logit)
        if self.feed.saved is not None:
            self.feed.peak = max(self.feed.peak, self.feed.saved.live_bytes())
        return out

    def _losses(self, stream, mtp_embs, placed, i: int, stats=None) -> torch.Tensor:
        """What ``K3ForCausalLM.forward(..., return_logits=False)`` computes after the trunk (mirrored here, checked
        equal to one process by tests/distributed/test_pipeline.py), weighted by the plan's shares."""
        ids, cu, labels, shares = placed.input_ids, placed.cu_seqlens, placed.labels, placed.shares
        q = _Query(self.output_attn_res_proj, self.output_attn_res_norm) if self.config.attn_res != "none" else None
        h = stream.output(q)
        lm = _head_ce(self.lm_head, self.norm(h), labels, 1, cu) * shares[1]
        mtp = torch.zeros((), dtype=lm.dtype, device=lm.device)
        if self.n_mtp and self.feed.mtp_weight:
            losses = []
            for k, (layer, e) in enumerate(zip(self.mtp, mtp_embs), start=1):
                h = layer(h, e, cu, None, stats)
                losses.append(_head_ce(self.lm_head, h, labels, 1 + k, cu))
            mtp = torch.stack(losses).mean() * shares[2]
        out = torch.stack([lm, mtp]).reshape(1, 2)
        self.feed.parts[i] = out.detach()
        return out


_WHOLE = Mixer()  # the model's own view of a sequence: targets and MTP inputs shifted within documents


def _next_tokens(ids: torch.Tensor, k: int, cu) -> torch.Tensor:
    """Token t + k where it lies in t's document, else token t (as K3ForCausalLM.forward's MTP inputs)."""
    return _WHOLE.shifted(ids, k, cu, fill=None)


def _head_ce(head, hidden: torch.Tensor, labels: torch.Tensor, shift: int, cu) -> torch.Tensor:
    """Mean CE of head(hidden) against the labels ``shift`` ahead, by 4096-token chunks (as the model's loss)."""
    total, count = chunked_head_ce_sum(head, hidden, _WHOLE.shifted(labels, shift, cu, fill=-100), 4096)
    return total / count
