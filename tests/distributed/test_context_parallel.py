"""Whole-model context parallelism (SPEC §8) against the single-process model: logits, loss, parameter gradients.

One spawn of 2 ranks (gloo on CPU, or NCCL on cuda:rank with K3_TEST_BACKEND=nccl); every rank builds the same
tiny model (no MTP) from one seed, runs the single-process forward/backward on the whole packed row, then the CP
forward on its slice with
``mixer=ContextParallel(...)``, backward of its share of the global mean loss, all-reduces (sums) parameter
gradients and compares. Legend: T_global tokens in the packed row, [start, end) this rank's segment.
"""


import pytest
import torch
import torch.distributed as dist

from k3.config import K3Config
from k3.layers.sequence.mla import GatedMLA
from k3.distributed.context_parallel import (ContextParallel, cp_loss_sum, cp_mean_loss, cp_model_loss,
                                            cp_shifted_targets)
from k3.model.transformer import K3ForCausalLM

from .gloo import needs_gloo, spawn
from tests.conftest import assert_close

T_GLOBAL, VOCAB, TOL = 96, 128, 1e-4
# (global cu_seqlens or None for an unpacked batch of 2, rank 0's end): documents crossing the boundary at 48;
# an uneven split where a document starts exactly at rank 1's first token; an unpacked batch split unevenly
CASES = [([0, 20, 61, 96], 48), ([0, 5, 61, 70, 96], 61), (None, 37)]


def _model():
    torch.manual_seed(0)
    config = K3Config.preset("tiny").replace(num_nextn_predict_layers=0, vocab_size=VOCAB)
    return K3ForCausalLM(config).train()


def _check_case(rank, world, model, layout, split):
    B = 2 if layout is None else 1
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, T_GLOBAL))
    cu = torch.tensor(layout) if layout is not None else None
    start, end = (0, split) if rank == 0 else (split, T_GLOBAL)

    mlas = [m.layer_idx for m in model.modules() if isinstance(m, GatedMLA)]
    model.zero_grad(set_to_none=True)
    ref = model(ids, cu_seqlens=cu, labels=ids, record=("max_logit",))
    ref["loss"].backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(ref.max_logit) == sorted(mlas)

    model.zero_grad(set_to_none=True)
    cp = ContextParallel(None, start, end, cu)
    out = model(ids, mixer=cp, record=("max_logit",))  # the global row: the view takes this rank's tokens
    logits = out["logits"]
    for layer in mlas:  # QK-clip's statistic: the MAX over ranks equals one process's
        got = out.max_logit[layer].clone()
        dist.all_reduce(got, op=dist.ReduceOp.MAX)
        torch.testing.assert_close(got, ref.max_logit[layer], atol=1e-5, rtol=1e-5)
    targets = cp_shifted_targets(ids, cu, start, end)
    loss = cp_mean_loss(logits, targets)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)

    tag = f"rank {rank} cu={layout} split={split}"
    assert_close(f"{tag} logits", ref["logits"][:, start:end], logits, TOL)
    assert_close(f"{tag} loss", ref["loss"], total, TOL)
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        assert_close(f"{tag} grad {name}", ref_grads.get(name, torch.zeros_like(p)), g, TOL)


def _check_targets():
    ids = torch.arange(10)[None]
    cu = torch.tensor([0, 4, 10])
    assert cp_shifted_targets(ids, cu, 0, 5).tolist() == [[1, 2, 3, -100, 5]]
    assert cp_shifted_targets(ids, cu, 5, 10).tolist() == [[6, 7, 8, 9, -100]]
    s, n = cp_loss_sum(torch.zeros(1, 5, 10), cp_shifted_targets(ids, cu, 0, 5))
    assert int(n) == 4 and abs(float(s) - 4 * torch.log(torch.tensor(10.0)).item()) < 1e-5


def _check_chunked_loss(rank, model):
    """cp_model_loss's head CE chunk by chunk (5 tokens, several chunks per rank) equals one chunk per rank."""
    torch.manual_seed(2)
    ids, cu = torch.randint(0, VOCAB, (1, T_GLOBAL)), torch.tensor([0, 20, 61, 96])
    start, end = (0, 48) if rank == 0 else (48, T_GLOBAL)
    runs = []
    for chunk in (5, 4096):
        model.zero_grad(set_to_none=True)
        lm = cp_model_loss(model, ids, cu, start, end, None, mtp=False, loss_chunk=chunk)["lm_loss"]
        lm.backward()
        runs.append((lm.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (lm5, g5), (lm_all, g_all) = runs
    # fp32 rounding only (a chunked head matmul sums in another order on CUDA); a lost or doubled chunk is O(1)
    assert abs(lm5 - lm_all) <= 1e-5 * abs(lm_all) and set(g5) == set(g_all)
    for name in g5:
        assert_close(f"rank {rank} chunked grad {name}", g_all[name], g5[name], 1e-5)


def _check_all(rank, world):
    _check_targets()
    model = _model()
    _check_chunked_loss(rank, model)
    for layout, split in CASES:
        _check_case(rank, world, model, layout, split)
    with pytest.raises(ValueError, match="contiguous"):
        ContextParallel(None, 0, 10) if rank == 0 else ContextParallel(None, 20, 30)


@pytest.mark.slow
@pytest.mark.distributed
@needs_gloo
def test_context_parallel_model_matches_single_process(tmp_path):
    """2 ranks, three layouts (packed across the cut, a document starting at the cut with an uneven split, an
    unpacked batch): per-rank logits, the global mean loss and every summed parameter gradient."""
    spawn(_check_all, 2, tmp_path)
