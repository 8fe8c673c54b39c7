"""Slow nodes found: each watched phase's calls (an engine's generation, a rank's update, a reward worker's
scoring) are timed one by one, and a worker that takes 1.5x the others' median for 3 steps in a row is named
once, with its node, in the job log; `health/stragglers` counts the workers named so far.

    stragglers = Stragglers()
    for line in stragglers.observe("generation", {"rollout rank 0 on 10.0.0.2": 4.1, "rollout rank 1 on ...": 9.8}):
        print(line)

The hang watch (hangs.py) feeds it the time from a phase's send to each call's answer, as the driver saw it.
With rollout.max_staleness=1 a batch's answers are often all in before the driver asks, so a slow engine shows
less there than in the updates and the scoring.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

FACTOR = 1.5
"""A call this many times slower than the median of the others is slow."""
STEPS = 3
"""Slow this many times in a row, a worker is named."""
MIN_SECONDS = 0.5
"""A call must also take this much longer than the others' median to be slow: a gap under it is noise, not a
slow node (0.1 s against 0.4 s), while a call of 8 s against the others' 0.2 s is slow."""


class Stragglers:
    def __init__(self, factor: float = FACTOR, steps: int = STEPS, min_seconds: float = MIN_SECONDS):
        self.factor, self.steps, self.min_seconds = factor, steps, min_seconds
        self.in_a_row: dict[tuple[str, str], int] = defaultdict(int)
        self.named: set[str] = set()
        """The workers already named (each once per run attempt)."""

    def observe(self, phase: str, seconds: dict[str, float]) -> list[str]:
        """Record one round of `phase` (worker label -> seconds); the lines naming workers slow for `steps`
        rounds in a row, each worker once."""
        lines = []
        if len(seconds) < 2:
            return lines
        for label, took in seconds.items():
            others = statistics.median(t for other, t in seconds.items() if other != label)
            slow = took - others >= self.min_seconds and took >= self.factor * others
            key = (phase, label)
            self.in_a_row[key] = self.in_a_row[key] + 1 if slow else 0
            if self.in_a_row[key] >= self.steps and label not in self.named:
                self.named.add(label)
                lines.append(
                    f"straggler: {label} took {took / others:.1f}x the others' median {phase} time ({took:.1f}s "
                    f"against {others:.1f}s), {self.steps} times in a row: check that node (nvidia-smi: clocks, "
                    f"temperature, ECC errors; its network), or replace it and resume with trainer.resume=auto"
                )
        return lines

    def metrics(self) -> dict[str, float]:
        return {"health/stragglers": float(len(self.named))}
