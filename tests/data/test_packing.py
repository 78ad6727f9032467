import json
import random

import pytest
import torch

from k3.data import Document, PackedDataset, pack, pack_stream, split_documents

EOS = 0


def make_docs(seed: int, n: int, max_len: int = 40) -> list[list[int]]:
    """Token documents with ids >= 1 (EOS = 0 never occurs inside), some longer than a sample, one empty."""
    rng = random.Random(seed)
    docs = [[rng.randrange(1, 500) for _ in range(rng.randrange(1, max_len))] for _ in range(n)]
    docs[3] = []
    return docs


def doc_starts(docs) -> list[int]:
    starts, pos = [], 0
    for d in docs:
        if d:
            starts.append(pos)
            pos += len(d) + 1
    return starts


# ---- split ----

def test_split_deterministic_disjoint_stable():
    docs = [Document(f"file_{i}.py", "x") for i in range(2000)]
    train, val = split_documents(docs, val_fraction=0.1, seed=0)
    assert (train, val) == split_documents(docs, val_fraction=0.1, seed=0)
    assert not {d.id for d in train} & {d.id for d in val}
    assert len(train) + len(val) == len(docs)
    assert 150 < len(val) < 250
    more = docs[::-1] + [Document(f"new_{i}.py", "y") for i in range(500)]
    train2, val2 = split_documents(more, val_fraction=0.1, seed=0)
    assert {d.id for d in val} == {d.id for d in val2 if d.id.startswith("file_")}
    assert {d.id for d in val} != {d.id for d in split_documents(docs, val_fraction=0.1, seed=1)[1]}
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(docs, val_fraction=1.0)


# ---- packing ----

def test_stream_holds_every_document_then_eos():
    docs = make_docs(0, 20)
    tokens, starts = pack_stream(docs, EOS)
    assert tokens.dtype == torch.int32 and starts.tolist() == doc_starts(docs)
    assert tokens.tolist() == [t for d in docs if d for t in d + [EOS]]


@pytest.mark.parametrize("seq_len", [1, 7, 16, 64])
def test_samples_cover_stream_with_document_boundaries(seq_len):
    docs = make_docs(1, 60)
    samples = pack(docs, seq_len, EOS)
    stream = [t for d in docs if d for t in d + [EOS]]
    assert len(samples) == len(stream) // seq_len
    starts = set(doc_starts(docs))
    for i, (ids, cu) in enumerate(samples):
        lo = i * seq_len
        assert ids.shape == (seq_len,) and ids.dtype == torch.int64 and cu.dtype == torch.int64
        assert cu[0] == 0 and cu[-1] == seq_len and bool((cu[1:] > cu[:-1]).all())
        assert {lo + int(c) for c in cu[1:-1]} == {s for s in starts if lo < s < lo + seq_len}
        for b in cu[1:-1].tolist():  # a segment closed by a document start ends in EOS
            assert ids[b - 1] == EOS
    flat = torch.cat([ids for ids, _ in samples]).tolist()
    assert flat == stream[: len(flat)] and len(stream) - len(flat) < seq_len


def test_every_token_exactly_once_when_stream_divides():
    docs = [[1, 2, 3], list(range(4, 14)), [14], [15, 16, 17, 18, 19], [20, 21, 22, 23]]  # 23 tokens + 5 EOS
    ds = PackedDataset(docs, seq_len=7, eos_id=EOS)
    assert len(ds) == 4 and ds.dropped_tokens == 0
    got = [ds.sample(i) for i in range(4)]
    assert [ids.tolist() for ids, _ in got] == [[1, 2, 3, 0, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13],
                                                 [0, 14, 0, 15, 16, 17, 18], [19, 0, 20, 21, 22, 23, 0]]
    # sample 2 opens with the EOS of the document cut by the previous sample: a segment of its own
    assert [cu.tolist() for _, cu in got] == [[0, 4, 7], [0, 7], [0, 1, 3, 7], [0, 2, 7]]
    flat = torch.cat([ids for ids, _ in got]).tolist()
    assert [t for t in flat if t != EOS] == list(range(1, 24)) and flat.count(EOS) == 5


def test_batches_pack_samples_with_shifted_cu_seqlens():
    ds = PackedDataset(make_docs(2, 80), seq_len=16, eos_id=EOS, shuffle_seed=3)
    B = 4
    it = ds.batches(B)
    visited = []
    for step in range(2 * len(ds) // B + 1):  # crosses epoch boundaries, some batches straddle two epochs
        n0 = step * B
        idx = [int(ds.order((n0 + j) // len(ds))[(n0 + j) % len(ds)]) for j in range(B)]
        batch = next(it)
        assert set(batch) == {"input_ids", "cu_seqlens"}
        assert batch["input_ids"].shape == (1, B * 16) and batch["input_ids"].dtype == torch.int64
        samples = [ds.sample(i) for i in idx]
        assert torch.equal(batch["input_ids"][0], torch.cat([s[0] for s in samples]))
        want = [0] + [int(c) + j * 16 for j, (_, cu) in enumerate(samples) for c in cu[1:]]
        assert batch["cu_seqlens"].tolist() == want
        visited += idx
    assert sorted(visited[: len(ds)]) == list(range(len(ds)))  # epoch 0 is a permutation
    assert ds.order(0).tolist() != ds.order(1).tolist() != list(range(len(ds)))


def test_resume_from_state_dict_yields_the_same_batches():
    docs = make_docs(4, 70)
    ref = PackedDataset(docs, seq_len=12, eos_id=EOS, shuffle_seed=7)
    it = ref.batches(5)
    for _ in range(9):
        next(it)
    state = json.loads(json.dumps(ref.state_dict()))  # survives a checkpoint file
    expected = [next(it) for _ in range(12)]

    resumed = PackedDataset(docs, seq_len=12, eos_id=EOS, shuffle_seed=0)
    resumed.load_state_dict(state)
    it2 = resumed.batches(5)
    for want in expected:
        got = next(it2)
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["cu_seqlens"], want["cu_seqlens"])

    by_step = PackedDataset(docs, seq_len=12, eos_id=EOS, shuffle_seed=7).batches(5, start_step=9)
    assert torch.equal(next(by_step)["input_ids"], expected[0]["input_ids"])


def test_load_state_dict_rejects_another_dataset():
    state = PackedDataset(make_docs(5, 30), seq_len=8, eos_id=EOS).state_dict()
    with pytest.raises(ValueError, match="num_samples"):
        PackedDataset(make_docs(6, 50), seq_len=8, eos_id=EOS).load_state_dict(state)


def test_eval_batches_one_pass_in_order():
    ds = PackedDataset(make_docs(7, 40), seq_len=10, eos_id=EOS)
    it = ds.batches(3)
    next(it)
    before = ds.state_dict()
    rows = torch.cat([b["input_ids"][0] for b in ds.eval_batches(4)])
    assert torch.equal(rows, ds.tokens[: len(ds) * 10].long()) and ds.state_dict() == before


def test_errors():
    with pytest.raises(ValueError, match="seq_len=100"):
        PackedDataset([[1, 2, 3]], seq_len=100, eos_id=EOS)
    ds = PackedDataset([[1, 2, 3]], seq_len=2, eos_id=EOS)
    with pytest.raises(IndexError, match="2 samples"):
        ds.sample(2)


def test_batch_runs_through_the_model():
    from k3 import K3Config, K3ForCausalLM

    model = K3ForCausalLM(K3Config.preset("tiny")).eval()
    ds = PackedDataset(make_docs(8, 30), seq_len=16, eos_id=EOS)
    batch = next(ds.batches(2))
    with torch.no_grad():
        out = model(**batch, labels=batch["input_ids"])
    assert out["logits"].shape[:2] == (1, 32) and torch.isfinite(out["loss"])


def test_split_always_holds_out_validation_when_it_can():
    """A small corpus whose documents all hash into train still gets one validation document: the lowest hash."""
    docs = [Document(f"chapter-{i}", "x") for i in range(5)]
    train, val = split_documents(docs, val_fraction=0.05, seed=0)
    assert len(val) == 1 and len(train) == 4 and val[0] not in train
    assert val == split_documents(docs[::-1], val_fraction=0.05, seed=0)[1]  # by hash, not position
    assert split_documents(docs[:1], val_fraction=0.05) == (docs[:1], [])  # one document: nothing to hold out
    assert split_documents(docs, val_fraction=0.0) == (docs, [])


def test_keeping_the_tail_scores_every_token():
    """drop_last=False: the last, shorter sample is kept (validation), and batches that hold it pack right."""
    docs = make_docs(9, 12)
    ds = PackedDataset(docs, seq_len=16, eos_id=EOS, shuffle_seed=None, drop_last=False)
    n = len(ds.tokens)
    assert n % 16 and len(ds) == n // 16 + 1 and ds.dropped_tokens == 0
    ids, cu = ds.sample(len(ds) - 1)
    assert len(ids) == n % 16 and cu[-1] == n % 16
    batches = list(ds.eval_batches(3))
    assert torch.equal(torch.cat([b["input_ids"][0] for b in batches]), ds.tokens.long())
    offset = 0
    for b in batches:  # boundaries: every sample start and every document start inside the batch
        width = b["input_ids"].shape[1]
        starts = {s - offset for s in ds.doc_starts.tolist() if offset < s < offset + width}
        assert b["cu_seqlens"].tolist() == sorted(starts | set(range(0, width, 16)) | {width})
        offset += width
    assert len(PackedDataset([[1, 2]], seq_len=16, eos_id=EOS, drop_last=False)) == 1  # 3 tokens: one short sample
