"""Validation statistics (trainer/algo/evaluation.py): pass@k against brute-force enumeration of the
k-subsets, mean@n, and the length distribution."""

from __future__ import annotations

import itertools

import pytest
from cloudrl.trainer.algo.evaluation import ks_for, length_metrics, pass_at_k, sampled_metrics


def _brute_force(n: int, c: int, k: int) -> float:
    """The share of the k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_enumerating_every_subset(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute_force(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_1_is_the_share_correct_and_bad_input_is_refused() -> None:
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 0, 10) == 0.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 2, 5)


def test_sampled_metrics_average_over_prompts() -> None:
    # Prompt 1: 1 of 4 correct; prompt 2: 4 of 4; rewards below 1 (a partial score) are not correct.
    scores = [1.0, 0.0, 0.5, 0.0] + [1.0, 1.0, 1.0, 1.0]
    out = sampled_metrics(scores, n=4)
    assert ks_for(4) == [1, 2, 4]
    assert out["mean@4"] == pytest.approx(5.5 / 8)
    assert out["pass@1"] == pytest.approx((0.25 + 1.0) / 2)
    assert out["pass@2"] == pytest.approx((_brute_force(4, 1, 2) + 1.0) / 2)
    assert out["pass@4"] == pytest.approx(1.0)
    assert ks_for(6) == [1, 2, 4, 6] and ks_for(1) == [1]


def test_length_metrics() -> None:
    lengths = list(range(1, 11))  # 1..10
    out = length_metrics(lengths, [n == 10 for n in lengths])
    assert out == {
        "response_length_mean": 5.5,
        "response_length_max": 10.0,
        "response_length_p90": 9.0,
        "truncated": 0.1,
    }
