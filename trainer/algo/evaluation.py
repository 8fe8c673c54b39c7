"""Validation statistics, pure Python: pass@k, mean@n and the response-length distribution.

    pass_at_k(n=8, c=3, k=2)                    # chance that 2 of the 8 samples, drawn without
                                                # replacement, hold at least one correct answer
    sampled_metrics(scores, n=8, correct=...)   # {"mean@8": ..., "pass@1": ..., "pass@2": ..., ...}
    length_metrics(lengths, truncated)          # mean, max and p90 length, the share cut at the limit

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
Code"): with n samples of which c are correct, pass@k = 1 - C(n-c, k) / C(n, k), the probability that
a random k-subset of the n samples holds a correct one, averaged over prompts. It is computed as the
product 1 - prod_{i=n-c+1..n} (1 - k/i), which is the same ratio without huge binomials.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the chance that k of the n samples (c of them correct), drawn without
    replacement, include a correct one. Needs 0 <= c <= n and 1 <= k <= n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def ks_for(n: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, ... below n, and n itself."""
    ks = [2**i for i in range(n.bit_length()) if 2**i < n]
    return ks + [n]


def sampled_metrics(scores: Sequence[float], n: int, threshold: float = 1.0) -> dict[str, float]:
    """mean@n (the mean reward over every sample) and pass@k for `ks_for(n)`, averaged over prompts.
    `scores`: n consecutive rewards per prompt; a sample counts as correct when its reward is at least
    `threshold` (1.0: the built-in rewards give 1 to a right answer)."""
    if n < 1 or len(scores) % n:
        raise ValueError(f"{len(scores)} scores are not n={n} per prompt")
    prompts = len(scores) // n
    if prompts == 0:
        return {}
    correct = [sum(s >= threshold for s in scores[i * n : (i + 1) * n]) for i in range(prompts)]
    out = {f"mean@{n}": sum(scores) / len(scores)}
    for k in ks_for(n):
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / prompts
    return out


def length_metrics(lengths: Sequence[int], truncated: Sequence[bool]) -> dict[str, float]:
    """The response lengths' mean, max and 90th percentile (nearest rank), and the share of responses
    cut at the length limit."""
    if not lengths:
        return {}
    ordered = sorted(lengths)
    p90 = ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
    return {
        "response_length_mean": sum(ordered) / len(ordered),
        "response_length_max": float(ordered[-1]),
        "response_length_p90": float(p90),
        "truncated": sum(bool(t) for t in truncated) / len(truncated),
    }
