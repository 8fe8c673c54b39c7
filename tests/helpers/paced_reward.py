"""A reward that takes its time without using the CPU: 1.0 when the answer starts with the ground truth, after
sleeping PACE_S. Tests whose job must keep running while nodes come and go use it, so that the job's steps wait
idle instead of spinning on a 2-core machine that runs another test beside them."""

import time

PACE_S = 0.3


def paced(completions: list[str], ground_truth: list[str], **columns) -> list[float]:
    time.sleep(PACE_S)
    return [float(text.strip().startswith(truth)) for text, truth in zip(completions, ground_truth)]
