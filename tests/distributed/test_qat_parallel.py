"""QAT (``qat="mxfp4"``) under data parallelism (FSDP2), expert parallelism (MoonEP) and context parallelism (KCP)
against one process: 2 gloo ranks, the tiny model with its MTP layer, packed documents; the logged losses and every
parameter gradient after ``reduce_grads`` (gathered to full, experts in their true order) equal the single-process
QAT ones on the same global batch (stated tolerance: RMS ratio 1e-5, as the unquantised checks). The fake quant sees
the same weights (gathered by FSDP, or fetched by MoonEP: MXFP4 blocks lie along each expert row) and the same
activation rows (MXFP8 blocks lie along features), so splitting the batch, the experts or the sequence changes
nothing but summation order."""

import copy
import os

import pytest
import torch

from .gloo import needs_backend, spawn, test_device
from .test_mesh_ep import TOL, compare_gradients, full, global_batch
from tests.conftest import assert_close

VOCAB = 128


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
    from k3.distributed.data_parallel import DataParallel
    from k3.distributed.expert_parallel import ExpertParallelBank
    from k3.distributed.mesh import DataContextParallelTraining, DataExpertParallelTraining

    os.environ["WORLD_SIZE"] = str(world)  # init_from_env reads it; the process group is already up
    batch, w = global_batch(world), 0.3
    model, ref, ref_grads = qat_reference(batch, w)

    dp = DataParallel(rank, world, test_device(rank))  # --dp 2
    m = copy.deepcopy(model)
    dp.shard(m)
    loss, lm, mtp, _ = dp.loss(m, batch, w, test_device(rank))
    loss.backward()
    dp.reduce_grads(m)
    assert lm == pytest.approx(ref["lm_loss"].item(), rel=1e-6)
    assert mtp == pytest.approx(ref["mtp_loss"].item(), rel=1e-6)
    grads = {n: full(p.grad) for n, p in m.named_parameters() if p.grad is not None}
    assert set(grads) == set(ref_grads)
    for n, g in grads.items():
        assert_close(f"dp rank {rank} grad {n}", ref_grads[n], g, TOL)

    ep = DataExpertParallelTraining(1, world)  # --ep 2
    m = copy.deepcopy(model)
    ep.shard(m)
    banks = [b for b in m.modules() if isinstance(b, ExpertParallelBank)]
    assert banks and all(b.qat == "mxfp4" for b in banks)
    compare_gradients(ep, m, batch, w, ref, ref_grads, rank, dp=1, ep=world, tag=" qat")

    cp = DataContextParallelTraining(1, world)  # --cp 2: each rank one half of the sequence
    m = copy.deepcopy(model)
    cp.shard(m)
    loss, lm, mtp, _ = cp.loss(m, batch, w, test_device(rank))
    loss.backward()
    cp.reduce_grads(m)
    assert lm == pytest.approx(ref["lm_loss"].item(), rel=1e-6)
    for n, p in m.named_parameters():
        if p.grad is not None:
            assert_close(f"cp rank {rank} grad {n}", ref_grads[n], full(p.grad), TOL)


@pytest.mark.distributed
@needs_backend(2)
def test_qat_under_dp2_ep2_and_cp2_equals_one_process(tmp_path):
    spawn(_check, 2, tmp_path)
