"""Packed documents (k3.ops.varlen): length groups (the partition MLA and the KDA reference run), padded rows, plans."""

import itertools
import random

import pytest
import torch

from k3.ops.varlen import length_groups


def _cost(lengths, groups, overhead):
    return sum(len(g) * max(lengths[i] for i in g) ** 2 + overhead for g in groups)


@pytest.mark.parametrize("seed", range(12))
def test_length_groups_is_the_cheapest_split_of_the_sorted_lengths(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(1, 60), rng.randint(200, 4096)]) for _ in range(rng.randint(1, 9))]
    overhead = rng.choice([0, 50 ** 2, 512 ** 2, 3000 ** 2])
    groups = length_groups(lengths, overhead)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every document once
    for g in groups:  # longest first inside a group (the group's padded length is its first document's)
        assert [lengths[i] for i in g] == sorted((lengths[i] for i in g), reverse=True)
    # brute force over every way to cut the longest-first order into runs
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    best = min(_cost(lengths, [order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))], overhead)
               for r in range(len(order)) for cuts in itertools.combinations(range(1, len(order)), r))
    assert _cost(lengths, groups, overhead) == pytest.approx(best)


def test_length_groups_limits_and_errors():
    lengths = [3000, 50, 60, 40, 2000, 100, 4000]
    assert length_groups(lengths, float("inf")) == [[6, 0, 4, 5, 2, 1, 3]]  # the plain padded batch
    assert length_groups(lengths, 0) == [[6], [0], [4], [5], [2], [1], [3]]  # all different: each alone
    # the default overhead keeps the long documents apart and runs the short ones together
    assert length_groups(lengths) == [[6], [0], [4], [5, 2, 1, 3]]
    assert length_groups([0, 5, 0]) == [[1]]  # empty documents have no rows
    assert length_groups([]) == []
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        length_groups([3, -1])


def test_cached_plan_builds_once_per_tensor_version_and_key():
    from k3.ops.varlen import cached_plan

    calls = []

    def build(cu):
        calls.append(cu)
        return list(cu)

    cu = torch.tensor([0, 3, 7])
    assert cached_plan(cu, "a", build) == [0, 3, 7]
    assert cached_plan(cu, "a", build) is cached_plan(cu, "a", build) and len(calls) == 1  # one device read
    cached_plan(cu, "b", build)  # another key: another plan
    cu[1] = 5  # an in-place change bumps the version: read again
    assert cached_plan(cu, "a", build) == [0, 5, 7]
    assert cached_plan(torch.tensor([0, 2]), "a", build) == [0, 2]  # another tensor
    assert len(calls) == 4
    others = [torch.tensor([0, i]) for i in range(1, 10)]
    for t in others:  # only the last 8 plans are kept
        cached_plan(t, "a", build)
    cached_plan(others[0], "a", build)
    assert len(calls) == 4 + 9 + 1


def test_padded_documents_round_trip_in_document_order():
    from k3.ops.varlen import pack_sequences, unpack_sequences

    cu = torch.tensor([0, 2, 2, 7, 8])  # lengths 2, 0 (empty), 5, 1
    x = torch.randn(1, 8, 3, requires_grad=True)
    rows, layout = pack_sequences(x, cu)
    assert rows.shape == (4, 5, 3) and layout.valid.sum(1).tolist() == [2, 0, 5, 1]
    assert torch.equal(rows[0, :2], x[0, :2]) and torch.equal(rows[2], x[0, 2:7]) and torch.equal(rows[3, 0], x[0, 7])
    assert not rows[~layout.valid].any()  # zeros at the padding
    y = unpack_sequences(rows * 2, layout)
    assert torch.equal(y, x * 2)
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, 2 * g)


@pytest.mark.parametrize("overhead,unit", [(0.0, 1), (float("inf"), 1), (10.0, 1), (0.0, 4), (float("inf"), 4)])
def test_grouped_documents_pad_and_scatter_move_every_token_once(overhead, unit):
    """Rows hold each document's tokens from t = 0, zeros after; scatter puts every real token back; no index repeats
    (gathering every pad slot from one position made CUDA's index_put backward serialise thousands of repeats)."""
    from k3.ops.varlen import grouped_documents

    cu = [0, 2, 7, 8, 8, 12]  # lengths 2, 5, 1, 0, 4
    lens = [2, 5, 1, 0, 4]
    plan = grouped_documents(cu, overhead, 2, unit=unit)
    assert sorted(d for grp in plan.groups for d in grp.documents) == [0, 1, 2, 4]  # the empty one has no row
    x = torch.randn(12, 3, dtype=torch.float64, requires_grad=True)
    parts = []
    for grp in plan.groups:
        n, L = grp.shape
        assert L % unit == 0 and L >= max(lens[d] for d in grp.documents)
        units = [-(-lens[d] // unit) for d in grp.documents]
        assert units[0] == max(units) and L == units[0] * unit  # the longest (in units) first, its rows' length
        assert grp.slots.unique().numel() == grp.slots.numel() == grp.positions.unique().numel()
        rows = grp.pad(x)  # [n, L, 3]
        for r, d in enumerate(grp.documents):
            assert torch.equal(rows[r, :lens[d]], x[cu[d]:cu[d + 1]]) and not rows[r, lens[d]:].any()
        assert torch.equal(grp.valid.sum(1), torch.tensor([lens[d] for d in grp.documents]))
        parts.append(rows * 3)
    assert torch.equal(plan.inverse.sort().values, torch.arange(12))
    y = plan.scatter(parts)
    assert torch.equal(y, x * 3)
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


def test_placed_cu_seqlens_carry_their_host_values():
    """place_cu_seqlens: the device copy's values are known on the host, so no plan reads the device back."""
    from k3.ops.varlen import cached_plan, known_host_values, place_cu_seqlens

    cu = torch.tensor([0, 5, 9, 16])
    placed = place_cu_seqlens(cu, "cpu")
    assert torch.equal(placed, cu) and placed is not cu and placed.dtype == cu.dtype
    assert known_host_values(placed) == [0, 5, 9, 16] and known_host_values(cu.clone()) is None
    assert cached_plan(placed, ("test",), lambda host: host) == [0, 5, 9, 16]


def test_document_starts_per_position_once_per_tensor_and_named_errors():
    """Each packed position's document start (empty documents take no position), built once per cu_seqlens tensor
    (the layers of a step share it); boundaries that do not rise from 0 are refused, naming them."""
    from k3.ops.varlen import document_starts

    cu = torch.tensor([0, 3, 3, 7, 8])
    starts = document_starts(cu, "cpu")
    assert starts.tolist() == [0, 0, 0, 3, 3, 3, 3, 7]
    assert document_starts(cu, "cpu") is starts
    for bad in ([0, 5, 4], [1, 4], [0]):
        with pytest.raises(ValueError, match=r"rise from 0 .* got \[" + str(bad[0])):
            document_starts(torch.tensor(bad), "cpu")
