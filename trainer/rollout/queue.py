"""Generation on the rollout engines, with at most one batch in flight (`rollout.policy_lag=1`), the
batch's rewards, and the weights the engines generate with.

    got = queue.take(step, prompts, settings)       # step's batch: started earlier, or now
    queue.start(step + 1, next_prompts, settings)   # generates while this step trains
    scores = got.scores()                           # scored on the reward workers as each part finished
    ...update...
    queue.push(weights_ref)   # the engines load the new weights next; the previous push is checked first
    queue.settle()            # in turn: wait for this push

An engine is a Ray actor that runs one call at a time, in the order one caller sent them. So weights
pushed while an engine generates are loaded right after that batch, and before any batch started later:
`push` does not wait, and with a batch in flight neither the driver nor the actor stalls on the sync.
`settle` collects the loads (and raises a failed one); `push` and `generate` call it, so a push is
checked before anything generated with its weights is used. Each engine's part of a batch goes on to a
reward worker as soon as it is generated (Ray passes the result without the driver), so with a batch in
flight its rewards are ready when the driver takes it.

A batch started before an update is generated with the weights of the step before: `take` returns how
many weight versions it lags behind the ones pushed since, which the driver logs and corrects with
importance weights (`rollout.logprob_correction_cap`). With `policy_lag=0` every batch is started in
`take` and the lag is 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..algo.batch import from_wire, split_evenly
from ..waiting import get_all

if TYPE_CHECKING:
    from ..inputs.data import PromptRecord


@dataclass
class Rollouts:
    completions: list
    """n samples per prompt, prompt i's at [i*n, (i+1)*n)."""
    lag: int
    """Weight versions pushed between the start of its generation and now."""
    waited_s: float
    """Seconds the driver waited for it: generation that nothing else hid."""
    score_refs: list | None
    """The reward workers' scores, one call per engine part; None when the driver scores."""

    def scores(self):
        """The rewards [N], in the completions' order (waits for the reward workers)."""
        import ray
        import torch

        return torch.cat([from_wire(s) for s in ray.get(self.score_refs)])


@dataclass
class InFlight:
    step: int
    prompt_ids: list[list[int]]
    refs: list
    score_refs: list | None
    version: int
    """The weight version the engines had when it started."""


class RolloutQueue:
    def __init__(self, engines: list, labels: list[str], timeout_s: float, scorers: list | None = None):
        """`scorers`: the reward workers, which score each engine's part as it finishes; None when
        the driver scores (reward.in_driver)."""
        self.engines, self.labels, self.timeout_s, self.scorers = engines, labels, timeout_s, scorers
        self.version = 0
        """Weight pushes so far: the version the engines hold once they have loaded them."""
        self.pending: InFlight | None = None
        self.loading: tuple[list, list[str]] = ([], [])
        """The last push's calls not yet collected by `settle`, and their labels."""

    def _launch(self, step: int, prompts: list[PromptRecord], settings) -> InFlight:
        chunks = [c for c in split_evenly(prompts, len(self.engines)) if c]
        refs = [e.generate.remote([p.prompt_ids for p in chunk], settings) for e, chunk in zip(self.engines, chunks)]
        score_refs = None
        if self.scorers:
            score_refs = [
                self.scorers[i % len(self.scorers)].score.remote(ref, [p for p in chunk for _ in range(settings.n)])
                for i, (ref, chunk) in enumerate(zip(refs, chunks))
            ]
        return InFlight(step, [p.prompt_ids for p in prompts], refs, score_refs, self.version)

    def generate(self, prompts: list[PromptRecord], settings) -> Rollouts:
        """Samples for `prompts` with the weights pushed last (blocks)."""
        import ray

        batch = self._launch(0, prompts, settings)
        completions = [c for part in ray.get(batch.refs) for c in part]
        self.settle()
        return Rollouts(completions, 0, 0.0, batch.score_refs)

    def start(self, step: int, prompts: list[PromptRecord], settings) -> None:
        """Start generating `step`'s batch now, after the weights pushed last."""
        assert self.pending is None, "one batch in flight at most"
        self.pending = self._launch(step, prompts, settings)

    def take(self, step: int, prompts: list[PromptRecord], settings) -> Rollouts:
        """`step`'s samples: the batch in flight (it must be this step's), or generated now."""
        import ray

        if self.pending is None:
            self.start(step, prompts, settings)
        batch, self.pending = self.pending, None
        if batch.step != step or batch.prompt_ids != [p.prompt_ids for p in prompts]:
            raise RuntimeError(f"step {step}: the batch in flight was started for step {batch.step} with other prompts")
        t0 = time.perf_counter()
        completions = [c for part in ray.get(batch.refs) for c in part]
        return Rollouts(completions, self.version - batch.version, time.perf_counter() - t0, batch.score_refs)

    def push(self, weights, others: list = (), other_labels: list[str] = ()) -> dict[str, float]:
        """Send `weights` (an object ref to `PolicyWorker.weights`) to every engine without waiting.
        `others`: calls the push depends on that `settle` checks as well (the other actor ranks'
        part in gathering the weights). Returns `settle()` of the previous push."""
        timings = self.settle()
        refs = [e.load_weights.remote(weights) for e in self.engines]
        self.loading = (refs + list(others), [*self.labels, *other_labels])
        self.version += 1
        return timings

    def pushed_by_actor(self) -> None:
        """The actor sent new weights to the engines itself (the GPU weight sync, weight_sync.py): a batch
        started before counts one more version of lag."""
        self.version += 1

    def settle(self) -> dict[str, float]:
        """Wait for the last push to be loaded everywhere. Returns, over the engines, the longest
        time an engine sat idle between finishing its batch and getting the weights
        (`timing/engine_weight_wait`) and the longest load (`timing/engine_load`); {} if nothing was
        pushed since the last call."""
        refs, labels = self.loading
        if not refs:
            return {}
        self.loading = ([], [])
        results = get_all(refs, labels, self.timeout_s, "the weight sync")
        loads = [r for r in results[: len(self.engines)] if r]
        if not loads:
            return {}
        return {
            "timing/engine_weight_wait": max(r["idle_s"] for r in loads),
            "timing/engine_load": max(r["load_s"] for r in loads),
        }
