"""sample(): greedy, top-k, top-p, seeded reproducibility by (seed, step), the empirical distribution, logprobs."""

import pytest
import torch

from k3.inference.sampler import hash_uniform, sample


def _sample(logits, temperature=1.0, top_k=0, top_p=1.0, seed=0, step=0, filtered=True, top_logprobs=True):
    B = logits.shape[0]

    def full(v, dtype):
        return v if torch.is_tensor(v) else torch.full((B,), v, dtype=dtype)

    return sample(logits, full(temperature, torch.float32), full(top_k, torch.long), full(top_p, torch.float32),
                  full(seed, torch.long), full(step, torch.long), filtered, top_logprobs)


@pytest.fixture
def logits():
    return torch.randn(6, 50) * 3


def test_greedy_is_argmax(logits):
    assert torch.equal(_sample(logits, temperature=0.0)[0], logits.argmax(-1))


def test_top_k_1_and_tiny_top_p_are_greedy(logits):
    for seed in range(5):
        assert torch.equal(_sample(logits, top_k=1, seed=seed)[0], logits.argmax(-1))
        assert torch.equal(_sample(logits, top_p=1e-6, seed=seed)[0], logits.argmax(-1))
        assert torch.equal(_sample(logits, temperature=5.0, top_k=1, top_p=0.5, seed=seed)[0], logits.argmax(-1))


def test_seed_and_step_decide_the_draw_whatever_shares_the_batch(logits):
    a = _sample(logits, seed=7, temperature=2.0)[0]
    assert torch.equal(a, _sample(logits, seed=7, temperature=2.0)[0])
    assert not torch.equal(a, _sample(logits, seed=8, temperature=2.0)[0])
    assert not torch.equal(a, _sample(logits, seed=7, step=1, temperature=2.0)[0])
    # row 0 (seed 7, step 0) next to other rows with other parameters draws the same token
    mixed = _sample(logits[:3], temperature=torch.tensor([2.0, 0.5, 0.0]), seed=torch.tensor([7, 1, 2]),
                    top_k=torch.tensor([0, 5, 0]))
    assert mixed[0][0] == a[0]


def test_filtered_false_is_the_unfiltered_draw(logits):
    for seed in range(4):
        assert torch.equal(_sample(logits, seed=seed, filtered=False)[0], _sample(logits, seed=seed)[0])


def test_hash_uniform_is_in_the_open_interval_and_uniform():
    u = hash_uniform(torch.arange(64), torch.zeros(64, dtype=torch.long), 4096)
    assert u.dtype == torch.float32 and float(u.min()) > 0 and float(u.max()) < 1
    counts = torch.histc(u, bins=16, min=0, max=1).double()
    expected = u.numel() / 16
    assert float(((counts - expected) ** 2 / expected).sum()) < 37.7  # df = 15, p = 1e-3
    assert torch.equal(u, hash_uniform(torch.arange(64), torch.zeros(64, dtype=torch.long), 4096))


def _chi2(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_distribution_matches_softmax():
    V, N = 8, 4000
    row = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3]])
    # N draws of one request: one seed, steps 0..N-1 (as a generation draws them)
    tokens = _sample(row.expand(N, V), seed=11, step=torch.arange(N))[0]
    counts = torch.bincount(tokens, minlength=V).double()
    assert _chi2(counts, row.softmax(-1)[0].double()) < 29.9  # df = 7: P(chi2 > 29.9) = 1e-4; deterministic draws


def test_temperature_top_k_top_p_distribution():
    V, N = 6, 4000
    row = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0]]).expand(N, V)
    # top_k = 3 at temperature 2: only the 3 best, renormalised softmax(x / 2)
    tokens = _sample(row, temperature=2.0, top_k=3, seed=torch.arange(N))[0]
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[3:].sum() == 0
    assert _chi2(counts[:3], (row[0, :3] / 2).softmax(-1).double()) < 18.4  # df = 2, p = 1e-4
    # top_p: probs ~ [.64 .23 .09 .03 ...]; top_p = 0.8 keeps the smallest set reaching 0.8: the first two
    tokens = _sample(row, top_p=0.8, seed=torch.arange(N))[0]
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[2:].sum() == 0 and counts[1] > 0
    assert _chi2(counts[:2], row[0, :2].softmax(-1).double()) < 15.1  # df = 1, p = 1e-4


def test_logprobs_are_of_raw_logits(logits):
    tokens, lps, top_lp, top_id = _sample(logits, temperature=0.3, top_k=5)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lps, ref.gather(-1, tokens[:, None]).squeeze(-1))
    vals, ids = ref.topk(5, dim=-1)
    assert torch.equal(top_id, ids)
    torch.testing.assert_close(top_lp, vals)


def test_without_top_logprobs_the_same_draw_and_zero_alternatives(logits):
    """top_logprobs=False (no row asked for logprobs) skips the alternatives: the same tokens and logprobs, the
    alternatives' columns zero."""
    for temp in (0.0, 0.8):
        a = _sample(logits, temperature=temp, seed=4, top_k=7)
        b = _sample(logits, temperature=temp, seed=4, top_k=7, top_logprobs=False)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert b[2].shape == a[2].shape and b[3].shape == a[3].shape
        assert not b[2].any() and not b[3].any()


def test_shape_errors_speak():
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        _sample(torch.randn(5)[None, None])


@pytest.mark.parametrize("V", [5000, 5003, 163840], ids=["V5000", "V5003-padded", "V163840"])
def test_the_two_stage_reductions_equal_the_one_stage_ones(V):
    """Large vocabularies reduce over slices, then over the slices: the tokens, the chosen and top log-probs and
    their ids equal the one-stage computation (argmax's first maximal index on ties across slices too)."""
    from k3.inference.sampler import SLICE, hash_uniform

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g) * 3
    logits[0, [7, V - 2]] = 50.0  # a tie across slices: the first index wins
    logits[1, [SLICE - 1, SLICE]] = 40.0  # a tie across a slice boundary
    temp = torch.tensor([0.0, 0.0, 0.7, 1.3])
    seed, step = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 5, 9, 2])
    tokens, lps, top_lp, top_id = _sample(logits, temperature=temp, seed=seed, step=step, filtered=False)
    ref = torch.log_softmax(logits, -1)
    race = logits / temp.clamp(min=1e-5)[:, None] - torch.log(-torch.log(hash_uniform(seed, step, V)))
    want = torch.where(temp == 0, logits.argmax(-1), race.argmax(-1))
    assert tokens.tolist() == want.tolist() and tokens[0] == 7 and tokens[1] == SLICE - 1
    torch.testing.assert_close(lps, ref.gather(-1, want[:, None]).squeeze(-1))
    vals, ids = ref.topk(5, dim=-1)
    torch.testing.assert_close(top_lp, vals)
    assert torch.equal(ref.gather(-1, top_id), ref.gather(-1, ids))  # the same values (ids may order ties apart)
