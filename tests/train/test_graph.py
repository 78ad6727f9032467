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
from k3.train.graph import Capacity, device_document_starts, graph_unsupported, layout
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


def test_a_capacity_covers_any_boundaries_up_to_its_slots_and_image_batches_are_refused():
    ids = torch.zeros(1, 8, dtype=torch.long)
    shapes, cu = layout({"input_ids": ids, "cu_seqlens": torch.tensor([0, 4, 8])})
    assert cu == [0, 4, 8]
    cap = Capacity.covering(shapes, cu)
    assert (cap.tokens, cap.documents) == (8, 16)
    assert cap.fits(*layout({"input_ids": ids + 5, "cu_seqlens": torch.tensor([0, 1, 2, 3, 8])}))  # boundaries: data
    assert cap.fits(shapes, list(range(9)) + [8] * 7)  # 15 documents (the last of 16 slots stays empty)
    assert not cap.fits(shapes, list(range(9)) + [8] * 8)
    assert not cap.fits(*layout({"input_ids": ids, "cu_seqlens": torch.tensor([0, 4, 8]), "labels": ids}))
    assert not cap.fits(*layout({"input_ids": ids.int(), "cu_seqlens": torch.tensor([0, 4, 8])}))
    bigger = Capacity.covering(shapes, list(range(0, 9)) + [8] * 12, cap)  # 20 documents: recaptured for more
    assert bigger.documents == 64 and Capacity.covering(shapes, cu, bigger).documents == 64  # slots only grow
    with pytest.raises(ValueError, match=r"\['media'\]: drop --cuda-graph"):
        layout({"input_ids": ids, "cu_seqlens": torch.tensor([0, 8]), "media": {}})


def test_device_document_starts_are_the_host_plans_in_a_fixed_shape():
    """The plan the graph's buffers hold, built from the padded cu_seqlens alone (``device_document_starts``: a fixed shape,
    no read-back), is for any boundaries what the layers' own planner builds from host values: each position's
    document start (QK-clip's kernel, the short conv's); empty documents (at the start, inside, at the end)
    included."""
    from k3.ops.varlen import document_starts

    T = 300
    cap = Capacity((), T, 16)
    S = cap.documents
    layouts = ([0, T], [0, 64, 65, 200, T], [0, 10, 10, 129, T], [0, 0, 64, 128, T, T], list(range(0, T, 20)) + [T])
    for cu in layouts:
        padded = torch.tensor(cu + [T] * (S + 1 - len(cu)))
        assert torch.equal(device_document_starts(padded, T), document_starts(torch.tensor(cu), "cpu"))
        assert padded[S - 1] == padded[S] == T  # the spare slots are empty


def test_the_buffers_take_each_batch_and_refuse_boundaries_that_do_not_cover_the_row():
    """``_Buffers.fill`` (what runs before every replay), on CPU tensors: a second batch of other boundaries
    overwrites the first's tokens, padded cu_seqlens and plans in place; boundaries that do not rise from 0 to the
    row's length are named."""
    from k3.train.graph import _Buffers

    T, plan = 128, ParallelPlan(ParallelDims(), device="cpu")
    first = {"input_ids": torch.arange(T)[None], "cu_seqlens": torch.tensor([0, 64, T])}
    cap = Capacity.covering(*layout(first))
    buffers = _Buffers(cap, plan.place(first), torch.device("cpu"))
    views = (buffers.cu.data_ptr(), buffers.starts.data_ptr())
    for cu in ([0, 64, T], [0, 5, 5, 100, T]):
        batch = {"input_ids": torch.arange(T)[None] + len(cu), "cu_seqlens": torch.tensor(cu)}
        buffers.fill(cap, batch, cu)
        assert torch.equal(buffers.input_ids, batch["input_ids"]) and buffers.labels is buffers.input_ids
        padded = torch.tensor(cu + [T] * (cap.documents + 1 - len(cu)))
        assert torch.equal(buffers.cu, padded)
        assert torch.equal(buffers.starts, device_document_starts(padded, T))
    assert (buffers.cu.data_ptr(), buffers.starts.data_ptr()) == views  # in place
    with pytest.raises(ValueError, match="rise from 0 to the 128"):
        buffers.fill(cap, first, [0, 100])


def test_a_layer_planning_from_host_values_under_a_graph_is_named():
    from k3.ops.varlen import cached_plan, register_plans
    from k3.train.graph import _NoHostValues

    cu = torch.tensor([0, 4, 8])
    register_plans(cu, _NoHostValues("no host values"), {("longest",): (None, 8)})
    assert cached_plan(cu, ("longest",), lambda h: 1 / 0) == (None, 8)
    with pytest.raises(RuntimeError, match="planned from the host values of cu_seqlens under --cuda-graph"):
        cached_plan(cu, ("mla", 1.0, "cpu"), lambda h: max(h))


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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
