"""A reward with partial credit: 1.0 for the right sum, less the further off the answer is."""

import re


def closeness(completions: list[str], ground_truth: list[str], **columns) -> list[float]:
    scores = []
    for text, truth in zip(completions, ground_truth):
        found = re.match(r"\s*(-?\d+)", text)
        if found is None:
            scores.append(0.0)  # no number: no credit
        else:
            scores.append(max(0.0, 1.0 - abs(int(found.group(1)) - int(truth)) / 10))
    return scores
