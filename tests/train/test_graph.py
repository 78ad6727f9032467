"""CUDA graphs of the step (k3.train.graph) and the fixed layout they need (--packing stream), on the CPU: what is
refused and why, the layout a replay depends on, and the stream packing. The replays themselves against eager
steps: tests/gpu/test_train_gpu.py (CUDA only)."""

import dataclasses
import json

import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.data import PackedDataset
from k3.distributed.plan import ParallelDims, ParallelPlan
from k3.train.graph import graph_unsupported, layout
from k3.train.loop import TrainConfig, train
from k3.train.memory import POLICIES
from k3.train.metrics import read_metrics
from k3.train.trainer import Trainer

BASE = TrainConfig(out="", preset="tiny", data_max_bytes=400_000, tokenizer_bytes=200_000, vocab_size=512, steps=4,
                   batch_size=2, seq_len=64, lr=3e-3, eval_every=2, eval_batches=2, log_every=1, save_every=100)


def test_graphs_are_refused_where_a_replay_cannot_be_the_step():
    cuda = torch.device("cuda")
    assert graph_unsupported(cuda, 1, POLICIES["keep"]) is None
    assert graph_unsupported(cuda, 1, POLICIES["efficient"]) is None
    assert graph_unsupported(cuda, 1, POLICIES["recompute"]) is None
    assert "CUDA device" in graph_unsupported(torch.device("cpu"), 1, POLICIES["keep"])
    assert "torchrun" in graph_unsupported(cuda, 2, POLICIES["keep"])
    assert "offload" in graph_unsupported(cuda, 1, POLICIES["offload"])
    model = K3ForCausalLM(K3Config.preset("tiny"))
    with pytest.raises(ValueError, match="--cuda-graph: CUDA graphs need a CUDA device"):
        Trainer(dataclasses.replace(BASE, cuda_graph=True), ParallelPlan(ParallelDims(), "cpu"), model)


def test_the_layout_is_shapes_and_boundaries_and_image_batches_are_refused():
    ids = torch.zeros(1, 8, dtype=torch.long)
    a = layout({"input_ids": ids, "cu_seqlens": torch.tensor([0, 4, 8])})
    assert a == layout({"input_ids": ids + 5, "cu_seqlens": torch.tensor([0, 4, 8])})  # new tokens: same graph
    assert a != layout({"input_ids": ids, "cu_seqlens": torch.tensor([0, 3, 8])})
    assert a != layout({"input_ids": ids, "cu_seqlens": torch.tensor([0, 4, 8]), "labels": ids})
    assert a != layout({"input_ids": torch.zeros(1, 8, dtype=torch.int32), "cu_seqlens": torch.tensor([0, 4, 8])})
    with pytest.raises(ValueError, match=r"\['media'\]: drop --cuda-graph"):
        layout({"input_ids": ids, "cu_seqlens": torch.tensor([0, 8]), "media": {}})


def test_stream_packing_is_one_segment_per_sample_over_the_same_tokens():
    docs = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15]]
    marked = PackedDataset(docs, 4, eos_id=1, shuffle_seed=None)
    stream = PackedDataset(docs, 4, eos_id=1, shuffle_seed=None, boundaries=False)
    assert len(stream) == len(marked) == 3  # 15 stream tokens
    for i in range(len(stream)):
        (ia, _), (ib, cb) = marked.sample(i), stream.sample(i)
        assert torch.equal(ia, ib) and cb.tolist() == [0, 4]
    assert marked.sample(0)[1].tolist() == [0, 4]  # [5 6 7 EOS]
    assert marked.sample(1)[1].tolist() == [0, 3, 4]  # [8 9 EOS | 10]
    batch = next(stream.batches(3))
    assert batch["cu_seqlens"].tolist() == [0, 4, 8, 12]  # every batch the same layout


def test_packing_is_validated_and_fixed_on_resume(tmp_path):
    with pytest.raises(ValueError, match="TrainConfig.packing must be documents or stream"):
        TrainConfig(out="x", packing="rows")
    with pytest.raises(ValueError, match="must be documents for chat data"):
        TrainConfig(out="x", packing="stream", chat=True)
    cfg = dataclasses.replace(BASE, out=str(tmp_path / "run"), packing="stream", stop_after=2)
    train(cfg, ParallelPlan(ParallelDims(), "cpu"), log=lambda *a: None)
    with pytest.raises(ValueError, match="--packing stream \\(now documents\\)"):
        train(dataclasses.replace(cfg, packing="documents"), ParallelPlan(ParallelDims(), "cpu"), log=lambda *a: None)
    out = train(dataclasses.replace(cfg, stop_after=None), ParallelPlan(ParallelDims(), "cpu"), log=lambda *a: None)
    recs = read_metrics(tmp_path / "run")
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and out["step"] == 4
    assert all(r["loss"] > 0 for r in recs) and "val_loss" in recs[-1]


def test_a_run_saved_before_packing_existed_resumes_as_documents(tmp_path):
    from k3.checkpoint.manifest import record_checksums

    cfg = dataclasses.replace(BASE, out=str(tmp_path / "old"), stop_after=2)
    train(cfg, ParallelPlan(ParallelDims(), "cpu"), log=lambda *a: None)
    ck = tmp_path / "old" / "checkpoint"
    saved = json.loads((ck / "train_config.json").read_text())
    del saved["packing"]
    (ck / "train_config.json").write_text(json.dumps(saved))
    record_checksums(ck, [p.name for p in ck.iterdir() if p.name != "SHA256SUMS"])
    out = train(dataclasses.replace(cfg, stop_after=None), ParallelPlan(ParallelDims(), "cpu"), log=lambda *a: None)
    assert out["step"] == 4


def test_placed_loss_is_the_loss():
    """ParallelPlan.loss is placed_loss of place (the split a CUDA graph records the second half of)."""
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny"))
    plan = ParallelPlan(ParallelDims(), "cpu")
    batch = {"input_ids": torch.randint(0, 256, (1, 48)), "cu_seqlens": torch.tensor([0, 20, 48])}
    a = plan.loss(model, batch, 0.3)
    placed = plan.place(batch)
    b = plan.placed_loss(model, placed, 0.3)
    assert placed.tokens == 48 and placed.shares == {1: 1.0, 2: 1.0}
    torch.testing.assert_close(a.loss, b.loss, rtol=0, atol=0)
    torch.testing.assert_close(a.mtp_loss, b.mtp_loss, rtol=0, atol=0)
