"""The update half of the overlap: the steps whose actor and critic updates were sent and are not yet collected.

With `rollout.max_staleness` >= 1 a step's update is collected only at the end of the next step (the next batch
already generates with the weights before it), so the driver's step itself reads straight through; without
policy lag every step is collected at its own end, after its weight push has been loaded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..algo.step_stats import Timer, combine
from ..hangs import WATCH
from .queue import RolloutQueue


@dataclass
class SentStep:
    """A step whose update calls were sent to the actor and critic workers, not yet collected."""

    step: int
    metrics: dict
    """Everything but the update's statistics."""
    timer: Timer
    started: float
    """perf_counter at the step's start."""
    update_sent: float
    """perf_counter when the updates were sent."""
    actor_refs: list
    critic_refs: list
    tokens: float
    """Prompt and response tokens of the step's batch (for perf/tokens_per_s)."""


class StepsInFlight:
    """Collects the updates of sent steps. A step is held while the next one runs (`rollout.max_staleness` >= 1:
    the next batch already generates with the weights before this update) unless something must see its
    weights first; then it is collected at the end of the next step. Without policy lag no step is held.

        finished = in_flight.add(sent, hold=...)   # [(step, metrics)] of the steps collected now, in order
    """

    def __init__(
        self, queue: RolloutQueue, settle_each_step: bool, actor_labels: list[str] = (), critic_labels: list[str] = ()
    ):
        """`settle_each_step`: wait for the step's weight push to be loaded before it counts as finished
        (in turn, without policy lag; the push's load timings join its metrics). The labels name the actor's
        and the critic's ranks to the hang watch."""
        self.queue = queue
        self.labels = {"actor": list(actor_labels), "critic": list(critic_labels)}
        self.settle_each_step = settle_each_step
        self.held: SentStep | None = None
        self.last_finished = 0.0
        """perf_counter when the last step was collected."""

    def add(self, sent: SentStep, hold: bool) -> list[tuple[int, dict]]:
        finished = []
        if self.held is not None:
            finished.append(self.collect(self.held))
            self.held = None
        if hold:
            self.held = sent
        else:
            finished.append(self.collect(sent))
        return finished

    def _updated(self, role: str, refs: list, sent: SentStep) -> list:
        """The `role`'s update results, within the hang watch's bound counted from when they were sent."""
        labels = self.labels[role] or [f"{role} rank {r}" for r in range(len(refs))]
        started = time.monotonic() - (time.perf_counter() - sent.update_sent)
        return WATCH.wait(f"{role} update", refs, labels, f"step {sent.step}: the {role}'s update", started=started)

    def collect(self, sent: SentStep) -> tuple[int, dict]:
        """The step's metrics once its updates are done (and, in turn, the engines have the new weights).
        `timing/step` is the time since the previous step was collected, or since this one started."""
        metrics = sent.metrics
        timer = sent.timer
        metrics.update(combine([r.stats for r in self._updated("actor", sent.actor_refs, sent)]))
        metrics["timing/update_actor"] = time.perf_counter() - sent.update_sent
        if sent.critic_refs:
            metrics.update(combine([r.stats for r in self._updated("critic", sent.critic_refs, sent)]))
            metrics["timing/update_critic"] = time.perf_counter() - sent.update_sent
        timer.add("update", time.perf_counter() - sent.update_sent)
        if self.settle_each_step:
            with timer("sync"):
                metrics.update(self.queue.settle())
        now = time.perf_counter()
        metrics.update(timer.times)
        metrics["timing/step"] = now - max(sent.started, self.last_finished)
        metrics["perf/tokens_per_s"] = sent.tokens / metrics["timing/step"]
        self.last_finished = now
        return sent.step, metrics
