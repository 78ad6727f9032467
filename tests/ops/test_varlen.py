"""Length groups for packed documents (k3.ops.varlen.length_groups): the partition that MLA's padded attention runs."""

import itertools
import random

import pytest

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
