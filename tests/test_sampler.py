"""The sampling chain of codebook 0 and of the code predictor, on our C kernel where it was
built and in numpy."""

from __future__ import annotations

import numpy as np
import pytest

from kazeia_stream.engine import sampler
from kazeia_stream.engine.sampler import CodeSampler, TalkerSampler, warp_and_draw
from kazeia_stream.model.config import Sampling

EOS = 2150


@pytest.fixture(autouse=True, params=["kernel", "numpy"])
def draws_on(request, monkeypatch):
    """Each test on either path: the kernel (skipped where it was not built) or numpy."""
    if request.param == "numpy":
        monkeypatch.setattr(sampler, "_kernel", lambda: None)
    elif sampler._kernel() is None:
        pytest.skip("the sampler's kernel was not built")


def _talker(**kw) -> TalkerSampler:
    params = kw.pop("params", Sampling(do_sample=False))
    suppress = np.array([i for i in range(2048, 3072) if i != EOS])
    return TalkerSampler(params, np.random.default_rng(0), eos=EOS, suppress=suppress, **kw)


def test_greedy_takes_the_argmax_of_allowed_codes():
    logits = np.zeros(3072, dtype=np.float32)
    logits[3000] = 9.0  # suppressed control row
    logits[17] = 5.0
    assert _talker()(logits) == 17


def test_eos_is_masked_until_min_new_tokens():
    sampler = _talker(min_new_tokens=2)
    logits = np.zeros(3072, dtype=np.float32)
    logits[EOS] = 10.0
    logits[5] = 1.0
    assert [sampler(logits), sampler(logits), sampler(logits)] == [5, 5, EOS]


def test_repetition_penalty_divides_positive_and_multiplies_negative_scores():
    sampler = _talker(repetition_penalty=2.0, min_new_tokens=0)
    logits = np.full(3072, -100.0, dtype=np.float32)
    logits[[1, 2]] = [4.0, 3.0]
    assert sampler(logits) == 1  # history: [1]
    assert sampler(logits) == 2  # 4 / 2 < 3
    logits[[1, 2, 3]] = [-1.0, -1.0, -1.5]
    assert sampler(logits) == 3  # -1 * 2 = -2 for both seen codes, below -1.5


def test_a_code_drawn_twice_is_penalized_once():
    sampler = _talker(repetition_penalty=2.0, min_new_tokens=0)
    logits = np.full(3072, -100.0, dtype=np.float32)
    logits[1] = 8.0
    assert [sampler(logits), sampler(logits)] == [1, 1]
    logits[2] = 3.0
    assert sampler(logits) == 1  # 8 / 2 = 4 above 3 (penalized twice, 2 would be below)


def test_top_k_never_draws_outside_the_k_best():
    logits = np.arange(2048, dtype=np.float32) / 100
    rng = np.random.default_rng(1)
    draws = {warp_and_draw(logits, Sampling(True, 0.9, 5, 1.0), rng) for _ in range(300)}
    assert draws == set(range(2043, 2048))


def test_top_p_keeps_the_smallest_set_above_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(2)
    draws = {warp_and_draw(logits, Sampling(True, 1.0, 0, 0.7), rng) for _ in range(300)}
    assert draws == {0, 1}


def test_ties_at_the_top_p_cut_are_dropped_in_index_order():
    """Four tied codes hold 4.2% each beside one of 83%: top-p 0.9 drops two of them (8.3% <=
    10%), the first two."""
    logits = np.array([5.0, 2.0, 2.0, 2.0, 2.0, -np.inf, -np.inf, -np.inf], dtype=np.float32)
    rng = np.random.default_rng(0)
    draws = {warp_and_draw(logits, Sampling(True, 1.0, 0, 0.9), rng) for _ in range(400)}
    assert draws == {0, 3, 4}


def test_draws_follow_the_tempered_distribution_and_the_seed():
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    a = CodeSampler(Sampling(True, 1.0, 50, 1.0), np.random.default_rng(7))
    b = CodeSampler(Sampling(True, 1.0, 50, 1.0), np.random.default_rng(7))
    xs = [a(logits) for _ in range(4000)]
    assert xs == [b(logits) for _ in range(4000)]
    freq = np.bincount(xs, minlength=3) / len(xs)
    assert np.allclose(freq, [0.6, 0.3, 0.1], atol=0.03)


def test_a_draw_is_numpy_choice_over_the_warped_distribution():
    """The draw is `rng.choice(n, p=softmax(warped))` itself (a seed's codes do not change
    with how we compute it), ties at the k-th score and top-p included."""

    def reference(logits: np.ndarray, p: Sampling, rng: np.random.Generator) -> int:
        scores = logits.astype(np.float64) / p.temperature
        kth = np.partition(scores, -p.top_k)[-p.top_k]
        scores[scores < kth] = -np.inf
        if p.top_p < 1.0:
            order = np.argsort(scores, kind="stable")  # ties at the cut in index order
            probs = np.exp(scores[order] - scores.max())
            drop = np.cumsum(probs / probs.sum()) <= 1.0 - p.top_p
            drop[-1] = False
            scores[order[drop]] = -np.inf
        e = np.exp(scores - np.max(scores))
        return int(rng.choice(len(e), p=e / e.sum()))

    gen = np.random.default_rng(3)
    for p in (Sampling(True, 0.9, 50, 1.0), Sampling(True, 0.7, 20, 0.8), Sampling(True, 1.0, 0, 0.9)):
        for trial in range(40):
            logits = (gen.standard_normal(2048) * 4).astype(np.float32)
            logits[:30] = logits[0]  # ties, at the k-th score or the top-p cut in some trials
            ours, theirs = np.random.default_rng(trial), np.random.default_rng(trial)
            assert [warp_and_draw(logits, p, ours) for _ in range(25)] == [
                reference(logits, p, theirs) for _ in range(25)
            ]


def test_nothing_to_draw_is_an_error_not_a_code():
    with pytest.raises(ValueError, match="every logit is -inf"):
        warp_and_draw(np.full(64, -np.inf, np.float32), Sampling(), np.random.default_rng(0))
