"""K3Model (the trunk) and K3ForCausalLM (trunk + head + optional MTP), SPEC §1-§4.

Legend: B batch, T time, D hidden, V vocab. Single-device code; parallelism wraps it from k3.distributed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree

from ..config import K3Config
from ..layers.depth.attn_res import DepthStream, PseudoQuery
from ..layers.norm import RMSNorm
from ..layers.sequence.kda import KimiDeltaAttention
from ..layers.stats import Statistics
from ..ops.linear_ce import linear_ce_sum
from ..ops.precision import compute_dtype
from .block import DecoderLayer, _Query
from .init import init_weights
from .mixer import Mixer
from .mtp import MTPLayer


class CausalLMOutput(dict):
    """What ``K3ForCausalLM`` returns: a dict (``out["logits"]``) whose keys are also attributes (``out.logits``),
    as transformers' ``ModelOutput``. A field that was not computed is absent as a key and None as an attribute.
    ``max_logit`` and ``routing``: the forward's statistics when asked for (``record``; ``k3.layers.stats``)."""

    FIELDS = ("logits", "loss", "lm_loss", "mtp_loss", "max_logit", "routing")

    def __getattr__(self, name: str):
        if name in self:
            return self[name]
        if name in self.FIELDS:
            return None
        raise AttributeError(f"{type(self).__name__} has no field {name!r}; it holds {list(self)}")


# a pytree node, as dict is, so that FSDP2's hooks and torch.compile see the tensors inside
_pytree.register_pytree_node(CausalLMOutput, lambda o: (list(o.values()), list(o.keys())),
                             lambda values, keys: CausalLMOutput(zip(keys, values)),
                             serialized_type_name="k3.CausalLMOutput")


class K3Model(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps)
        if config.attn_res != "none":
            q = PseudoQuery(D, config.rms_norm_eps)
            self.output_attn_res_proj, self.output_attn_res_norm = q.proj, q.norm
        self.gradient_checkpointing = False

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None, mixer=None,
                inputs_embeds: torch.Tensor | None = None, stats: Statistics | None = None) -> torch.Tensor:
        """input_ids [B,T] -> pre-final-norm hidden [B,T,D] (the final AttnRes mix). ``mixer``: where the token
        mixers' state and kernels come from (``DecoderLayer.forward``): k3.inference's paged prefill / decode,
        k3.distributed's context parallelism; None for a plain forward. ``inputs_embeds`` [B,T,D]: the input
        embeddings to use instead of looking input_ids up (image features spliced in at placeholders, k3.vision).
        ``stats``: where the layers' statistics go (``k3.layers.stats``)."""
        c = self.config
        x = compute_dtype(self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds)
        stream = DepthStream.of(x, c) if mixer is None else mixer.depth_stream(x, c)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and mixer is None:
                _checkpointed(layer, stream, cu_seqlens, stats)
            else:
                layer(stream, cu_seqlens, mixer, stats)
        q = _Query(self.output_attn_res_proj, self.output_attn_res_norm) if c.attn_res != "none" else None
        return stream.output(q)


def _checkpointed(layer: DecoderLayer, stream: DepthStream, cu_seqlens, stats) -> None:
    """Recompute one layer in backward: the stream's tensors go in, the new ones come out."""
    from torch.utils.checkpoint import checkpoint

    n_blocks, had_partial = len(stream.blocks), stream.partial is not None
    mode, block_size, eps, sublayer = stream.mode, stream.block_size, stream.eps, stream.sublayer

    # ``run`` closes over plain values only, never ``stream``: the checkpoint's node keeps ``run``, and a stream
    # holding the node's own outputs would make a cycle through C++ that outlives a forward that fails
    def run(*tensors):
        s = DepthStream.__new__(DepthStream)
        s.mode, s.block_size, s.eps = mode, block_size, eps
        s.blocks, s.partial, s.sublayer = list(tensors[:n_blocks]), tensors[n_blocks] if had_partial else None, sublayer
        s.pending, s.sinks = None, {}  # (recorded by autograd: every write is added at once, every gradient summed)
        layer(s, cu_seqlens, None, stats)  # (the recomputation records the same statistics again)
        return (*s.blocks[n_blocks:], s.partial)

    blocks = list(stream.blocks)
    outs = checkpoint(run, *blocks, *([stream.partial] if had_partial else []), use_reentrant=False)
    stream.blocks = blocks + list(outs[:-1])
    stream.partial = outs[-1]
    stream.sublayer = sublayer + 2


class K3ForCausalLM(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = nn.ModuleList(MTPLayer(config, i) for i in range(config.num_nextn_predict_layers))
        init_weights(self, config.num_hidden_layers)

    def fuse_projections(self) -> "K3ForCausalLM":
        """For inference: every layer's projections of one input become one matmul (the weights become views of
        one tensor per layer, nothing is copied; ``k3.layers.fuse``). Used only where no gradient is needed, so
        training, checkpoints and optimisers see the same parameters. Call it after moving the model."""
        for m in self.modules():
            if m is not self and hasattr(m, "fuse_projections") and getattr(m, "in_proj", None) is None:
                m.fuse_projections()
        return self

    def set_kda_backend(self, backend: str) -> None:
        """"auto" (fla-core on CUDA when importable), "torch" (the reference) or "fla", for every KDA layer."""
        from ..ops.kda import BACKENDS

        if backend not in BACKENDS:
            raise ValueError(f"unknown KDA backend {backend!r}; expected one of {BACKENDS}")
        for m in self.modules():
            if isinstance(m, KimiDeltaAttention):
                m.backend = backend

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, mtp_weight: float = 0.3, mixer: Mixer | None = None,
                return_logits: bool = True, loss_chunk: int = 4096,
                inputs_embeds: torch.Tensor | None = None, record: tuple[str, ...] = ()) -> CausalLMOutput:
        """Returns a ``CausalLMOutput`` (``out["logits"]`` or ``out.logits`` [B,T,V]) and, with ``labels`` (same
        layout as input_ids, shifted inside; -100 = ignore), "loss" = next-token CE (+ mtp_weight * "mtp_loss" when
        the config has MTP layers) and "lm_loss".
        With ``cu_seqlens`` (B = 1, packed documents) no position predicts across a document boundary.

        ``return_logits=False`` (training): the losses only, computed ``loss_chunk`` tokens at a time with their
        gradients (``k3.ops.linear_ce``: the head's three GEMMs per chunk, in the forward), so no [B,T,V] logits
        (nor their fp32 copy and gradient) are ever held whole; the loss and every gradient equal the unchunked
        ones up to float summation order.

        ``mixer`` (``k3.model.mixer``): the layers' hook, and this forward's view of the sequence: which tokens of
        input_ids and labels it runs (``tokens``), their targets and MTP inputs (``shifted``) and the loss's mean
        (``mean``): context parallelism gives every rank the whole row and takes its share.
        ``inputs_embeds`` [B,T,D]: the trunk's input instead of embedding input_ids (which still name the tokens
        for MTP's next-token inputs). ``record``: statistics to return (``k3.layers.stats.STATISTICS``: "max_logit"
        for QK-clip, "routing" for Quantile Balancing)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B,T]; got shape {tuple(input_ids.shape)}")
        if cu_seqlens is not None and input_ids.shape[0] != 1:
            raise ValueError("packed documents (cu_seqlens) need input_ids of batch 1: [1, total_tokens]")
        if not return_logits and labels is None:
            raise ValueError("return_logits=False returns only losses: pass labels")
        if loss_chunk < 1:
            raise ValueError(f"loss_chunk must be >= 1; got {loss_chunk}")
        seq = mixer if mixer is not None else _OWN
        stats = Statistics(record) if record else None
        h = self.model(seq.tokens(input_ids), cu_seqlens, mixer, inputs_embeds, stats)
        normed = self.model.norm(h)
        out = CausalLMOutput(logits=self.lm_head(normed)) if return_logits else CausalLMOutput()
        if stats is not None:
            out.update((k, v) for k, v in vars(stats).items() if v is not None)
        if labels is None:
            return out

        def head_ce(hidden, shift, logits=None):  # mean CE of head(hidden) `shift` tokens ahead: whole or by chunks
            tgt = seq.shifted(labels, shift, cu_seqlens, fill=-100)
            if return_logits:
                total, count = _ce_sum(self.lm_head(hidden) if logits is None else logits, tgt)
            else:
                total, count = chunked_head_ce_sum(self.lm_head, hidden, tgt, loss_chunk)
            return seq.mean(total, count)  # NaN when nothing counts, as F.cross_entropy's mean

        loss = head_ce(normed, 1, out.get("logits"))
        out["lm_loss"] = loss
        if len(self.mtp) and mtp_weight:  # MTP layers run only when their loss counts
            mtp_losses = []
            for i, layer in enumerate(self.mtp):
                k = i + 1  # layer i predicts token t + 1 + k from h_t and token t + k
                # token t + k, where it lies in t's document; elsewhere (its loss is masked anyway) the token itself,
                # so nothing depends on what follows a document (batches split at document boundaries agree)
                nxt = seq.shifted(input_ids, k, cu_seqlens, fill=None)
                h = layer(h, self.model.embed_tokens(nxt), cu_seqlens, mixer, stats)
                mtp_losses.append(head_ce(h, 1 + k))
            out["mtp_loss"] = torch.stack(mtp_losses).mean()
            loss = loss + mtp_weight * out["mtp_loss"]
        out["loss"] = loss
        return out


_OWN = Mixer()  # no mixer: the forward's own view of the sequence (all of it) and the layers' own sub-layers


def _ce_sum(logits, tgt) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed CE fp32, number of counted targets) of logits [B,T,V] against tgt [B,T] (-100 ignored)."""
    V = logits.shape[-1]
    total = F.cross_entropy(logits.float().reshape(-1, V), tgt.reshape(-1), ignore_index=-100, reduction="sum")
    return total, (tgt != -100).sum()


def chunked_head_ce_sum(head: nn.Linear, hidden: torch.Tensor, tgt: torch.Tensor,
                        chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed CE fp32, number of counted targets) of head(hidden) [B,T,D] -> [B,T,V] against tgt [B,T] (-100
    ignored), ``chunk`` tokens at a time, the gradients computed in the forward (``k3.ops.linear_ce``): the [B,T,V]
    logits are never held whole, nor recomputed in the backward."""
    if head.bias is not None:
        raise ValueError("the chunked LM loss needs a head without bias (K3's lm_head has none)")
    total = linear_ce_sum(hidden.reshape(-1, hidden.shape[-1]), head.weight, tgt.reshape(-1), chunk)
    return total, (tgt != -100).sum()
