"""MoonEP planner (SPEC §8): exact balance, exact coverage, at most E/R replicas per rank and local own experts,
on random and adversarial loads; Theorem 2's tight load; a naive greedy pour that breaks the bound."""

import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3.distributed.moonep import plan, plan_arrays, validate

PAIRS = [(8, 2), (16, 4), (64, 8), (64, 16), (896, 8), (896, 32), (896, 64), (896, 128)]
KINDS = ["uniform", "one_expert", "r_experts", "one_rank", "rank_idle", "pow2", "dirichlet", "zipf", "sparse", "zeros"]
SETTINGS = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def split(n: int, k: int, rng: random.Random) -> list[int]:
    """A random composition of n into k nonnegative parts."""
    cuts = sorted(rng.randint(0, n) for _ in range(k - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [n])]


def spread(n: int, weights: list[float], rng: random.Random) -> list[int]:
    """n tokens in proportion to weights: floors, then the leftover on random experts."""
    total = sum(weights)
    out = [int(n * w / total) for w in weights]
    for _ in range(n - sum(out)):
        out[rng.randrange(len(out))] += 1
    return out


def make_loads(kind: str, E: int, R: int, seed: int, T: int) -> list[int]:
    """Loads of E experts with total R*T (or any multiple of R for the kinds that draw raw counts)."""
    rng, N, m = random.Random(seed), R * T, E // R
    loads = [0] * E
    if kind == "uniform":
        loads = spread(N, [1.0] * E, rng)
    elif kind == "one_expert":
        loads[rng.randrange(E)] = N
    elif kind == "r_experts":
        for e, t in zip(rng.sample(range(E), R), split(N, R, rng)):
            loads[e] = t
    elif kind == "one_rank":
        r = rng.randrange(R)
        loads[r * m:(r + 1) * m] = split(N, m, rng)
    elif kind == "rank_idle":  # Theorem 2's load: one rank idle, every other expert equally busy
        r, c = rng.randrange(R), R * (1 + rng.randrange(8))
        loads = [0 if e // m == r else c for e in range(E)]
    elif kind == "pow2":
        loads = [2 ** rng.randint(0, 20) for _ in range(E)]
    elif kind == "dirichlet":
        alpha = rng.choice([0.05, 0.3, 1.0, 5.0])
        loads = spread(N, [rng.gammavariate(alpha, 1.0) + 1e-12 for _ in range(E)], rng)
    elif kind == "zipf":
        order = rng.sample(range(E), E)
        loads = spread(N, [(order[e] + 1) ** -rng.choice([0.5, 1.0, 1.5]) for e in range(E)], rng)
    elif kind == "sparse":
        loads = [rng.randint(1, 5000) if rng.random() < 0.1 else 0 for _ in range(E)]
    loads[rng.randrange(E)] += -sum(loads) % R
    return loads


def replicas(row, r: int, m: int) -> list[int]:
    return [e for e, _ in row if e // m != r]


def assert_moonep(p, loads: list[int], R: int) -> None:
    """Every MoonEP property, checked here independently of validate(), then validate() too."""
    E = len(loads)
    m, T = E // R, sum(loads) // R
    assert len(p) == R
    covered = Counter()
    for r, row in enumerate(p):
        experts = [e for e, _ in row]
        assert len(set(experts)) == len(experts), f"rank {r}: duplicate expert"
        assert all(t > 0 for _, t in row), f"rank {r}: empty entry (zero-load experts must not appear)"
        assert sum(t for _, t in row) == T, f"rank {r}: not exactly balanced"
        assert len(replicas(row, r, m)) <= m, f"rank {r}: {len(replicas(row, r, m))} replicas > E/R = {m}"
        assert len(row) <= 2 * m
        if sum(loads[r * m:(r + 1) * m]) <= T:
            kept = dict(row)
            assert all(kept.get(e) == loads[e] for e in range(r * m, (r + 1) * m) if loads[e]), f"rank {r}: not local"
        covered.update(dict(row))
    assert [covered[e] for e in range(E)] == loads, "coverage"
    validate(p, loads, R)


@SETTINGS
@given(pair=st.sampled_from(PAIRS), kind=st.sampled_from(KINDS), seed=st.integers(0, 2**32 - 1),
       T=st.sampled_from([0, 1, 7, 1000, 4096 * 8]))
def test_planner_properties(pair, kind, seed, T):
    E, R = pair
    loads = make_loads(kind, E, R, seed, T)
    assert_moonep(plan(loads, R), loads, R)


@SETTINGS
@given(data=st.data())
def test_planner_properties_on_drawn_loads(data):
    E, R = data.draw(st.sampled_from([(2, 2), (4, 2), (6, 3), (8, 2), (12, 4), (16, 4), (16, 8)]))
    loads = data.draw(st.lists(st.integers(0, 60) | st.just(0), min_size=E, max_size=E))
    loads[-1] += -sum(loads) % R
    assert_moonep(plan(loads, R), loads, R)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("E,R", PAIRS, ids=[f"E{E}-R{R}" for E, R in PAIRS])
def test_every_pair_and_kind(E, R, kind):
    for seed in range(3):
        loads = make_loads(kind, E, R, seed, 4096 * 8)
        assert_moonep(plan(loads, R), loads, R)


@pytest.mark.parametrize("E,R", PAIRS, ids=[f"E{E}-R{R}" for E, R in PAIRS])
def test_theorem2_load_needs_and_gets_the_tight_count(E, R):
    """Rank 0 idle, every other expert carries c tokens: rank 0 must gather T in pieces of at most c, so any plan
    gives it >= ceil(E(R-1)/R^2) replicas; the planner uses exactly that many, within E/R."""
    m, c = E // R, 3 * R
    loads = [0] * m + [c] * (E - m)
    p = plan(loads, R)
    assert_moonep(p, loads, R)
    need = math.ceil(E * (R - 1) / R**2)
    assert need == math.ceil(sum(loads) // R / c)
    assert len(replicas(p[0], 0, m)) == need <= m


def naive_greedy(loads: list[int], R: int):
    """Each rank keeps its own tokens up to T (experts in id order); the overflow chunks are poured into the
    underloaded ranks' free room in rank order (two-pointer merge). Balanced and covering, but no chaining."""
    m, T = len(loads) // R, sum(loads) // R
    rows, overflow, room = [], [], []
    for r in range(R):
        row, free = [], T
        for e in range(r * m, (r + 1) * m):
            keep = min(loads[e], free)
            if keep:
                row.append((e, keep))
                free -= keep
            if loads[e] > keep:
                overflow.append([e, loads[e] - keep])
        rows.append(row)
        if free:
            room.append([r, free])
    i = j = 0
    while i < len(overflow):
        (e, t), (r, free) = overflow[i], room[j]
        x = min(t, free)
        rows[r].append((e, x))
        overflow[i][1] -= x
        room[j][1] -= x
        i, j = i + (overflow[i][1] == 0), j + (room[j][1] == 0)
    return rows


@pytest.mark.parametrize("E,R", [(64, 16), (896, 64), (896, 128)], ids=["E64-R16", "E896-R64", "E896-R128"])
def test_naive_greedy_breaks_the_bound(E, R):
    m = E // R
    loads = [0] * m + [R] * (E - m)  # Theorem 2's load: every overloaded rank must shed a little
    naive = naive_greedy(loads, R)
    T = sum(loads) // R
    assert all(sum(t for _, t in row) == T for row in naive)  # balanced ...
    covered = sum((Counter(dict(row)) for row in naive), Counter())
    assert covered == Counter({e: x for e, x in enumerate(loads) if x})  # ... covering
    assert len(replicas(naive[0], 0, m)) == R - 1 > m  # ... but rank 0 hosts a piece of every other rank
    with pytest.raises(ValueError, match="replica experts"):
        validate(naive, loads, R)
    assert max(len(replicas(row, r, m)) for r, row in enumerate(plan(loads, R))) <= m


@pytest.mark.parametrize("E,R", PAIRS, ids=[f"E{E}-R{R}" for E, R in PAIRS])
def test_plan_arrays_match_plan_and_tile_each_expert(E, R):
    loads = make_loads("zipf", E, R, 1, 4096)
    arr, rows = plan_arrays(torch.tensor(loads), R), plan(loads, R)
    M = 2 * E // R
    assert arr.experts.shape == arr.counts.shape == arr.offsets.shape == (R, M)
    assert arr.experts.dtype == torch.int64
    for r, row in enumerate(rows):
        n = len(row)
        assert arr.experts[r, :n].tolist() == [e for e, _ in row] and arr.counts[r, :n].tolist() == [t for _, t in row]
        assert (arr.experts[r, n:] == -1).all() and (arr.counts[r, n:] == 0).all()
    assert (arr.counts.sum(1) == sum(loads) // R).all()
    valid = arr.experts >= 0
    for e in range(E):
        mask = valid & (arr.experts == e)
        starts, counts = arr.offsets[mask].tolist(), arr.counts[mask].tolist()  # row-major = rank order
        assert starts == [sum(counts[:i]) for i in range(len(counts))] and sum(counts) == loads[e]


def test_tensor_and_list_inputs_agree_and_zero_experts_vanish():
    loads = [0, 5, 0, 3, 0, 0, 8, 0]
    assert plan(torch.tensor(loads), 2) == plan(loads, 2)
    assert all(loads[e] for row in plan(loads, 2) for e, _ in row)
    assert plan([0] * 8, 4) == [[], [], [], []]


@pytest.mark.parametrize("loads,R,match", [
    ([1, -2, 3, 2], 2, "negative"),
    ([1, 2, 3], 2, "not a positive multiple of num_ranks"),
    ([], 1, "not a positive multiple"),
    ([1, 2, 3, 3], 2, "not divisible by num_ranks"),
    ([1.5, 2.5], 2, "integer"),
    (torch.tensor([1.0, 1.0]), 2, "integer tensor"),
    (torch.ones(2, 2, dtype=torch.int64), 2, "1-D"),
    ([1, 1], 0, "positive int"),
])
def test_input_validation(loads, R, match):
    with pytest.raises(ValueError, match=match):
        plan(loads, R)


@pytest.mark.parametrize("bad,loads,R,match", [
    ([[(0, 2), (1, 2)]], [2, 2, 2, 2], 2, "expected num_ranks=2"),
    ([[(0, 2), (1, 1)], [(2, 2), (3, 2)]], [2, 2, 2, 2], 2, "rank 0 computes 3 tokens"),
    ([[(0, 3), (1, 1)], [(2, 1), (3, 1), (1, 2)]], [4, 2, 1, 1], 2, "expert 0 has 4 tokens but the plan computes 3"),
    ([[(1, 1), (2, 1)], [(1, 2)], [(2, 2)]], [0, 3, 3], 3, "rank 0 hosts 2 replica experts"),
    ([[(0, 2), (2, 2)], [(1, 2), (3, 2)]], [2, 2, 2, 2], 2, "locally"),
    ([[(0, 2), (1, 2), (3, 0)], [(2, 2), (3, 2)]], [2, 2, 2, 2], 2, "positive"),
    ([[(0, 2), (9, 2)], [(2, 2), (3, 2)]], [2, 2, 2, 2], 2, "outside"),
    ([[(0, 2), (0, 2)], [(2, 2), (3, 2)]], [2, 2, 2, 2], 2, "twice"),
])
def test_validate_names_the_violation(bad, loads, R, match):
    with pytest.raises(ValueError, match=match):
        validate(bad, loads, R)


def test_planner_at_k3_scale_is_valid():
    """Speed is measured in benchmarks/bench_planner.py, not here; this checks the K3-scale plan itself."""
    loads = make_loads("zipf", 896, 128, 0, 4096 * 8)
    validate(plan(loads, 128), loads, 128)
