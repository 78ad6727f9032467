"""Forward-only pipeline passes for the validation loss (``k3 train --pp``'s ``evaluate``): one batch at a time,
stage after stage, the packed depth state (k3.distributed.pipeline.pack) sent point to point between pipeline
ranks. No schedule is needed: nothing waits for a backward, and the validation batches are few.

Legend: T time, D hidden, M MTP embeddings carried.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..data.packing import count_targets
from ..ops.varlen import place_cu_seqlens
from .pipeline import sources_at
from .plan import PlacedBatch, place_tokens

__all__ = ["pipeline_evaluate"]


@torch.no_grad()
def pipeline_evaluate(plan, model, dataset, batch_size: int, max_batches: int, device, amp) -> float:
    """Mean next-token loss over the first ``max_batches`` validation batches (token-weighted), the same on every
    rank: every rank of a stage runs the whole batch, as ``k3.train.loop.evaluate`` does under FSDP."""
    was = [st.training for st in plan.stages]
    for st in plan.stages:
        st.eval()
    c, owner = model.config, plan.pipe.stage_ranks()
    S, mtp = plan.pipe.stages, plan.stages[0].n_mtp
    mine = {st_index: st for st_index, st in zip([s for s in range(S) if owner[s] == plan.pp_rank], plan.stages)}
    total, n = 0.0, 0
    try:
        for i, b in enumerate(dataset.eval_batches(batch_size)):
            if i >= max_batches:
                break
            count = count_targets(b["cu_seqlens"], b.get("labels"), 1)
            if count == 0:
                continue
            ids = place_tokens(b["input_ids"], device)
            labels = ids if "labels" not in b else place_tokens(b["labels"], device)
            plan.feed.batches = [PlacedBatch(ids, place_cu_seqlens(b["cu_seqlens"], device), labels, {},
                                             {1: 1.0, 2: 1.0}, ids.numel())]
            plan.feed.mtp_weight = 0.0
            mb = torch.zeros(1, 1, dtype=torch.long, device=device)
            x, T = ids, ids.shape[1]
            loss = torch.zeros(1, dtype=torch.float64, device=device)
            for s in range(S):
                if owner[s] != plan.pp_rank:
                    continue
                st = mine[s]
                if s > 0 and owner[s - 1] != plan.pp_rank:  # from the previous stage's rank
                    x = torch.empty(sources_at(c, st.lo) + mtp, 1, T, c.hidden_size, device=device)
                    dist.recv(x, group=plan.pp_group, group_src=owner[s - 1])
                with amp:
                    x = st(x, mb)
                if s == S - 1:
                    loss = x[0, :1].double()
                elif owner[s + 1] != plan.pp_rank:
                    dist.send(x.float().contiguous(), group=plan.pp_group, group_dst=owner[s + 1])
            dist.all_reduce(loss, group=plan.pp_group)  # only the last stage's rank holds it
            total, n = total + float(loss) * count, n + count
    finally:
        plan.feed.batches, plan.feed.parts = [], {}
        for st, w in zip(plan.stages, was):
            st.train(w)
    return total / max(n, 1)
