"""QAT (``qat="mxfp4"``) under data parallelism (FSDP2), expert parallelism (MoonEP) and context parallelism (KCP),
each through k3.distributed.plan.ParallelPlan on 2 gloo ranks, against one process: the tiny model with its MTP
layer, packed documents; the logged losses, every parameter gradient after ``reduce_grads`` (gathered to full,
experts in their true order) and the global gradient norm equal the single-process QAT ones on the same global batch
(stated tolerance: RMS ratio 1e-5, as the unquantised checks in test_plan_layouts). The fake quant sees the same
weights (gathered by FSDP, or fetched by MoonEP: MXFP4 blocks lie along each expert row) and the same activation rows
(MXFP8 blocks lie along features), so splitting the batch, the experts or the sequence changes nothing but
summation order."""

import copy

import pytest
import torch

from .gloo import needs_backend, spawn
from .test_plan_layouts import VOCAB, compare_gradients, plan_in_process, segments_batch, slices_batch

# (dp, ep, cp) on 2 ranks and the global batch each is checked on
LAYOUTS = {"dp2": ((2, 1, 1), slices_batch), "ep2": ((1, 2, 1), slices_batch), "cp2": ((1, 1, 2), segments_batch)}


def qat_reference(batch: dict, mtp_weight: float):
    from k3.config import K3Config
    from k3.model.transformer import K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny").replace(vocab_size=VOCAB, qat="mxfp4")).train()
    clean = copy.deepcopy(model)
    out = model(batch["input_ids"], cu_seqlens=batch["cu_seqlens"], labels=batch["input_ids"], mtp_weight=mtp_weight)
    out["loss"].backward()
    return clean, out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check(rank, world):
    from k3.distributed.expert_parallel import ExpertParallelBank

    for name, ((dp, ep, cp), make_batch) in LAYOUTS.items():
        batch, w = make_batch(), 0.3
        model, ref, ref_grads = qat_reference(batch, w)
        par = plan_in_process(rank, world, dp, ep, cp)
        par.shard(model)
        if ep > 1:
            banks = [b for b in model.modules() if isinstance(b, ExpertParallelBank)]
            assert banks and all(b.qat == "mxfp4" for b in banks)
        compare_gradients(par, model, batch, w, ref, ref_grads, rank, tag=f" {name} qat")


@pytest.mark.slow
@pytest.mark.distributed
@needs_backend(2)
def test_qat_under_dp2_ep2_and_cp2_equals_one_process(tmp_path):
    spawn(_check, 2, tmp_path)
