"""Generation on the rollout engines, with at most one batch in flight (`rollout.policy_lag=1`).

    completions, lag = queue.take(step, prompt_ids, settings)   # step's batch: started earlier, or now
    queue.start(step + 1, next_prompt_ids, next_settings)       # generates while this step trains
    queue.wait(); <weight sync>; queue.version += 1             # the engines get the new weights

A batch started before an update is generated with the weights of the step before: `take` returns how
many weight versions it lags behind the engines' current ones, which the driver logs and corrects with
importance weights (`rollout.logprob_correction_cap`). With `policy_lag=0` every batch is started in
`take` and the lag is 0. Engine calls go out one chunk per engine; an engine runs one call at a time, so
a weight sync sent while it generates waits for the generation to finish.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .batch import split_evenly


@dataclass
class InFlight:
    step: int
    prompt_ids: list[list[int]]
    refs: list
    version: int
    """The weight version the engines had when it started."""


class RolloutQueue:
    def __init__(self, engines: list):
        self.engines = engines
        self.version = 0
        """Weight syncs so far: the version the engines hold."""
        self.pending: InFlight | None = None

    def _launch(self, prompt_ids: list[list[int]], settings) -> list:
        chunks = split_evenly(prompt_ids, len(self.engines))
        return [e.generate.remote(chunk, settings) for e, chunk in zip(self.engines, chunks) if chunk]

    def generate(self, prompt_ids: list[list[int]], settings) -> list:
        """Completions for `prompt_ids` with the engines' current weights, in order (blocks)."""
        import ray

        return [c for part in ray.get(self._launch(prompt_ids, settings)) for c in part]

    def start(self, step: int, prompt_ids: list[list[int]], settings) -> None:
        """Start generating `step`'s batch now, with the weights the engines hold."""
        assert self.pending is None, "one batch in flight at most"
        self.pending = InFlight(step, prompt_ids, self._launch(prompt_ids, settings), self.version)

    def take(self, step: int, prompt_ids: list[list[int]], settings) -> tuple[list, int]:
        """`step`'s completions (started earlier, or now) and their lag in weight versions."""
        import ray

        if self.pending is None:
            self.start(step, prompt_ids, settings)
        batch, self.pending = self.pending, None
        if batch.step != step or batch.prompt_ids != prompt_ids:
            raise RuntimeError(f"step {step}: the batch in flight was started for step {batch.step} "
                               f"with other prompts")
        return [c for part in ray.get(batch.refs) for c in part], self.version - batch.version

    def wait(self) -> float:
        """Seconds spent waiting for the batch in flight to finish (0 when none is)."""
        import ray

        if self.pending is None:
            return 0.0
        start = time.perf_counter()
        ray.wait(self.pending.refs, num_returns=len(self.pending.refs))
        return time.perf_counter() - start
