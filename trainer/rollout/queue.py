"""Generation on the rollout engines, with up to `rollout.max_staleness` batches in flight, the batches'
rewards, and the weights the engines generate with.

    got = queue.take(step, prompts, settings, then=[(next_prompts, next_settings), ...])
                              # step's batch (started earlier, or now); `then`: the following steps' start
    scores = got.scores()     # scored on the reward workers as each part finished
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

A batch started before an update is generated with older weights: `take` returns how many weight versions
it lags behind the ones pushed since it started (at most `rollout.max_staleness`: the driver starts a batch at
most that many steps ahead), which the driver logs and corrects with importance weights
(`rollout.logprob_correction_cap`). With `max_staleness=0` every batch is started in `take` and the lag is 0.

Dynamic sampling is in dynamic_sampling.py; the other half of the overlap, the updates of sent steps, in
in_flight.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..algo.batch import from_wire, split_evenly
from ..hangs import WATCH
from ..waiting import get_all
from .engine_pool import EnginePool, died
from .engines import generation_throughput, object_store_push
from .environment import environment_rewards
from .multiturn import turn_metrics

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
    records: list = field(default_factory=list)
    """The prompt of each sample (n per prompt), for `score_here`."""
    score_here: Callable[[list, list], list[float]] | None = None
    """With reward.in_driver: (responses' token ids, their prompts) -> rewards, run in the driver."""
    generation: dict = field(default_factory=dict)
    """The engines' generation speed (engines.generation_throughput); {} where not measured."""
    score_labels: list[str] = field(default_factory=list)
    """The reward worker of each of `score_refs` (`reward rank 0 on 10.0.0.2`), for the hang watch."""
    requeued: int = 0
    """Prompts generated again on the other engines because the engine generating them was lost."""
    engines_alive: int = 0
    """Engines generating when the batch was taken (a lost one's replacement counts once it has weights)."""
    by_engine: dict[int, int] = field(default_factory=dict)
    """Samples each engine (its index in the pool: a replacement keeps the lost one's) generated for the batch."""
    version: int = 0
    """Weight pushes so far when it was taken: the version its update trains from."""

    def scores(self, reward_function: str = "", timeout_s: float = 0.0):
        """The rewards [N], in the completions' order: the reward workers' (waiting for each part at most
        `timeout_s` (reward.timeout_s; 0: no limit) after the one before it, which ran before it on the
        same worker or beside it; `reward_function` names it in the error), or `score_here`'s. Either way
        each episode's environment rewards (rollout.environment) are added."""
        import ray

        from ..inputs.rewards import too_slow

        if self.score_refs is None:
            responses = [c.token_ids for c in self.completions]
            scores = torch.tensor(self.score_here(responses, self.records), dtype=torch.float32)
        else:
            for ref in self.score_refs if timeout_s else ():
                if not ray.wait([ref], timeout=timeout_s)[0]:
                    raise too_slow(f"reward.function={reward_function}", timeout_s, where=" on a reward worker")
            parts = WATCH.wait("reward", self.score_refs, self.score_labels, "scoring the samples")
            scores = torch.cat([from_wire(s) for s in parts])
        # rollout.environment: each episode's summed environment rewards join its score
        return scores + torch.tensor(environment_rewards(self.completions), dtype=scores.dtype)

    def metrics(self, response_mask) -> dict[str, float]:
        """What the batch looked like: lengths, truncation, policy lag, the wait, multi-turn counts."""
        return {
            "timing/rollout_wait": self.waited_s,
            "rollout/response_length": float(response_mask.sum(-1).mean()),
            "rollout/truncated": sum(c.finish_reason == "length" for c in self.completions) / len(self.completions),
            "rollout/policy_lag": self.lag,
            "rollout/samples": len(self.completions),
            "rollout/engines_alive": self.engines_alive,
            "rollout/requeued_prompts": self.requeued,
            **{f"rollout/engine_{e}_samples": count for e, count in sorted(self.by_engine.items())},
            **staleness(self.completions, self.version, self.lag),
            **turn_metrics(self.completions),
            **self.generation,
        }


def staleness(completions: list, version: int, lag: int) -> dict[str, float]:
    """How many versions behind `version` the batch's tokens were generated: `rollout/staleness_max` and the
    mean over tokens, `rollout/staleness_mean` (a whole generation's tokens are all `lag` behind; under
    rollout.partial each token has its own version), and with rollout.partial `rollout/partial_samples`, the
    share of samples continued with newer weights than they started with."""
    behind = [[version - v for v in c.versions] if c.versions else [lag] * len(c.token_ids) for c in completions]
    tokens = [b for sample in behind for b in sample]
    out = {
        "rollout/staleness_max": float(max(tokens, default=0)),
        "rollout/staleness_mean": sum(tokens) / len(tokens) if tokens else 0.0,
    }
    if any(c.versions for c in completions):
        out["rollout/partial_samples"] = sum(len(set(c.versions or ())) > 1 for c in completions) / len(completions)
    return out


def samples_by_engine(engine_ids: list[int], parts: list[list]) -> dict[int, int]:
    """{engine: samples} over a batch's parts, each generated by the engine of the same index."""
    counts: dict[int, int] = {}
    for engine, part in zip(engine_ids, parts):
        counts[engine] = counts.get(engine, 0) + len(part)
    return counts


def sample_row(record: PromptRecord) -> dict:
    """A prompt's dataset row as an environment's `reset` gets it."""
    return {
        **record.extra,
        "prompt": record.prompt_text,
        "ground_truth": record.ground_truth,
        "data_source": record.data_source,
    }


@dataclass
class InFlight:
    step: int
    prompt_ids: list[list[int]]
    settings: object
    """The SamplingSettings it was started with (a lost engine's part is generated again with them)."""
    parts: list[list]
    """The prompts of each part, in order: the part of engine `engine_ids[j]`, generating as `refs[j]`."""
    engine_ids: list[int]
    refs: list
    score_refs: list | None
    version: int
    """The weight version the engines had when it started."""
    records: list
    """Each sample's prompt (n per prompt)."""
    score_labels: list[str]
    """The reward worker scoring each engine's part."""
    sent: float
    """time.monotonic() when the calls were sent (the hang watch counts from then)."""
    requeued: int = 0
    """Prompts sent again to other engines after their engine was lost."""
    partial: bool = False
    """Generated in segments that take newer weights (rollout.partial)."""


class RolloutQueue:
    def __init__(
        self,
        engines: list,
        labels: list[str],
        timeout_s: float,
        scorers: list | None = None,
        samples: bool = False,
        score_here: Callable[[list, list], list[float]] | None = None,
        scorer_labels: list[str] = (),
    ):
        """`scorers`: the reward workers, which score each engine's part as it finishes; None when
        the driver scores (reward.in_driver) with `score_here`. `samples`: the engines get each prompt's
        dataset row too (rollout.environment's `reset(sample)`)."""
        self.engines = EnginePool(engines, labels)
        """The engines, as they come and go (engine_pool.py)."""
        self.timeout_s, self.scorers = timeout_s, scorers
        self.scorer_labels = list(scorer_labels) or [f"reward worker {i}" for i in range(len(scorers or []))]
        self.samples = samples
        self.score_here = score_here
        self.version = 0
        """Weight pushes so far: the version the engines hold once they have loaded them."""
        self.pending: list[InFlight] = []
        """The batches in flight, oldest first, for consecutive steps."""
        self.loading: tuple[list, list[str], list[int]] = ([], [], [])
        """The last push's calls not yet collected by `settle`, their labels, and the engines of the first ones."""
        self.board = None
        """rollout.partial: the WeightBoard the engines look at between segments (`take_weights_mid_batch`)."""

    def take_weights_mid_batch(self) -> None:
        """rollout.partial: from now on the batches started ahead (`start`) are generated in segments, and
        each push is posted where the engines see it between two segments (rollout/partial.py)."""
        from .partial import board

        self.board = board()

    def _send(self, engine: int, chunk: list[PromptRecord], settings, part: int, partial: bool = False) -> tuple:
        """Engine `engine` generates `chunk` (in segments that take newer weights with `partial`); returns its
        call, and the scoring call and scorer label (or None)."""
        handle = self.engines.actors[engine]
        ids = [p.prompt_ids for p in chunk]
        if self.samples:
            ref = handle.generate.remote(ids, settings, [sample_row(p) for p in chunk])
        elif partial:
            ref = handle.generate.remote(ids, settings, None, self.board)
        else:
            ref = handle.generate.remote(ids, settings)
        if not self.scorers:
            return ref, None, None
        scorer = part % len(self.scorers)
        records = [p for p in chunk for _ in range(settings.n)]
        return ref, self.scorers[scorer].score.remote(ref, records), self.scorer_labels[scorer]

    def _launch(self, step: int, prompts: list[PromptRecord], settings, partial: bool = False) -> InFlight:
        sent = time.monotonic()
        engines = self.engines.alive()
        placed = [(e, c) for e, c in zip(engines, split_evenly(prompts, len(engines))) if c]
        calls = [self._send(e, chunk, settings, j, partial) for j, (e, chunk) in enumerate(placed)]
        score_refs = [c[1] for c in calls] if self.scorers else None
        records = [p for p in prompts for _ in range(settings.n)]
        prompt_ids = [p.prompt_ids for p in prompts]
        return InFlight(
            step,
            prompt_ids,
            settings,
            [chunk for _, chunk in placed],
            [e for e, _ in placed],
            [c[0] for c in calls],
            score_refs,
            self.version,
            records,
            [c[2] for c in calls] if self.scorers else [],
            sent,
            partial=partial,
        )

    def _wait(self, phase: str, batch: InFlight, what: str) -> list:
        """The engines' parts of `batch`, within the hang watch's bound for `phase` (hangs.py). Where lost
        engines are replaced, a part whose engine died is generated again by the engines left."""
        from ray.exceptions import RayActorError

        while True:
            labels = [self.engines.labels[e] for e in batch.engine_ids]
            try:
                return WATCH.wait(phase, batch.refs, labels, what, started=batch.sent)
            except RayActorError as exc:
                lost = [j for j, ref in enumerate(batch.refs) if died(ref)] if self.engines.replaceable else []
                if not lost:
                    raise
                for e in sorted({batch.engine_ids[j] for j in lost}):
                    self.engines.lost_one(e, exc)
                if not self.engines.alive():
                    raise
                self._requeue(batch, lost, what)

    def _requeue(self, batch: InFlight, lost: list[int], what: str) -> None:
        """Parts `lost` of `batch` split over the engines left, each in its part's place (the samples keep
        their order); the hang watch counts from now for the batch."""
        engines = self.engines.alive()
        count = sum(len(batch.parts[j]) for j in lost)
        for j in sorted(lost, reverse=True):
            chunk = batch.parts[j]
            placed = [(e, c) for e, c in zip(engines, split_evenly(chunk, len(engines))) if c]
            calls = [self._send(e, c, batch.settings, j + k, batch.partial) for k, (e, c) in enumerate(placed)]
            batch.parts[j : j + 1] = [c for _, c in placed]
            batch.engine_ids[j : j + 1] = [e for e, _ in placed]
            batch.refs[j : j + 1] = [c[0] for c in calls]
            if batch.score_refs is not None:
                batch.score_refs[j : j + 1] = [c[1] for c in calls]
                batch.score_labels[j : j + 1] = [c[2] for c in calls]
        batch.requeued += count
        batch.sent = time.monotonic()
        print(
            f"{what}: {count} prompts of the lost engine(s) go to the {len(engines)} engine(s) left",
            flush=True,
        )

    def generate(
        self, prompts: list[PromptRecord], settings, phase: str = "generation", what: str = "generating samples"
    ) -> Rollouts:
        """Samples for `prompts` with the weights pushed last (blocks); `phase` and `what` for the hang watch."""
        batch = self._launch(0, prompts, settings)
        parts = self._wait(phase, batch, what)
        completions = [c for part in parts for c in part]
        self.settle()
        return Rollouts(
            completions,
            0,
            0.0,
            batch.score_refs,
            batch.records,
            self.score_here,
            score_labels=batch.score_labels,
            requeued=batch.requeued,
            engines_alive=len(self.engines.alive()),
            by_engine=samples_by_engine(batch.engine_ids, parts),
        )

    def start(self, step: int, prompts: list[PromptRecord], settings) -> None:
        """Start generating `step`'s batch now, after the weights pushed last (and after the batches in
        flight, which must be the steps just before it)."""
        assert not self.pending or self.pending[-1].step == step - 1, "batches in flight are for consecutive steps"
        self.pending.append(self._launch(step, prompts, settings, partial=self.board is not None))

    def started_through(self, step: int) -> int:
        """The last step whose batch is in flight; `step` (the step being run, whose batch `take` starts
        when it is not) when none is."""
        return self.pending[-1].step if self.pending else step

    def take(self, step: int, prompts: list[PromptRecord], settings, then: list[tuple] = ()) -> Rollouts:
        """`step`'s samples: the oldest batch in flight (it must be this step's), or generated now. `then`:
        (prompts, settings) of the steps after the last one in flight, started right away, before this
        step's update (`rollout.max_staleness`)."""
        if not self.pending:
            self.start(step, prompts, settings)
        batch = self.pending.pop(0)
        if batch.step != step or batch.prompt_ids != [p.prompt_ids for p in prompts]:
            raise RuntimeError(f"step {step}: the batch in flight was started for step {batch.step} with other prompts")
        for ahead in then:
            self.start(self.started_through(step) + 1, *ahead)
        t0 = time.perf_counter()
        parts = self._wait("generation", batch, f"generating step {step}'s samples")
        completions = [c for part in parts for c in part]
        waited = time.perf_counter() - t0
        lag = self.version - batch.version
        return Rollouts(
            completions,
            lag,
            waited,
            batch.score_refs,
            batch.records,
            self.score_here,
            generation_throughput(parts),
            batch.score_labels,
            batch.requeued,
            len(self.engines.alive()),
            samples_by_engine(batch.engine_ids, parts),
            self.version,
        )

    def push(self, weights, others: list = (), other_labels: list[str] = ()) -> dict[str, float]:
        """Send `weights` (an object ref to `PolicyWorker.weights`) to every engine without waiting.
        `others`: calls the push depends on that `settle` checks as well (the other actor ranks'
        part in gathering the weights). Returns `settle()` of the previous push, with the times of the engines
        that join at this push (`EnginePool.admit`)."""
        timings = self.settle()
        if self.engines.joining:
            timings.update(self.engines.admit())
        if self.engines.max_engines:
            self.engines.grow()
        engines = self.engines.alive()
        if self.board is not None:  # batches in flight take them between two segments
            self.board.post.remote(self.version + 1, [weights])
        refs = [self.engines.actors[e].load_weights.remote(weights, self.version + 1) for e in engines]
        labels = [self.engines.labels[e] for e in engines]
        self.loading = (refs + list(others), [*labels, *other_labels], engines)
        self.version += 1
        return timings

    def generating(self) -> tuple[list, list[str]]:
        """The generate calls of the batches in flight, if any (`rollout.max_staleness` starts them before the
        update), and their engines' labels."""
        refs = [ref for batch in self.pending for ref in batch.refs]
        labels = [self.engines.labels[e] for batch in self.pending for e in batch.engine_ids]
        return refs, labels

    def pushed_by_actor(self) -> None:
        """The actor sent new weights to the engines itself (the GPU weight sync, weight_sync.py): a batch
        started before counts one more version of lag."""
        self.version += 1

    def settle(self) -> dict[str, float]:
        """Wait for the last push to be loaded everywhere. Returns, over the engines, the longest
        time an engine sat idle between finishing its batch and getting the weights
        (`timing/engine_weight_wait`) and the longest load (`timing/engine_load`); {} if nothing was
        pushed since the last call."""
        refs, labels, engines = self.loading
        if not refs:
            return {}
        self.loading = ([], [], [])
        results = self._loads(refs, labels, engines)
        loads = [r for r in results[: len(engines)] if r]
        if not loads:
            return {}
        return {
            "timing/engine_weight_wait": max(r["idle_s"] for r in loads),
            "timing/engine_load": max(r["load_s"] for r in loads),
            **object_store_push(loads),  # timing/push_gather, perf/push_gb_per_s
        }

    def _loads(self, refs: list, labels: list[str], engines: list[int]) -> list:
        """The push's calls' results (the first ones the engines' loads); where lost engines are replaced,
        an engine that died is marked lost (None in its place) instead of failing the run."""
        from ray.exceptions import RayActorError

        results: list = [None] * len(refs)
        waiting = list(range(len(refs)))
        while waiting:
            try:
                got = get_all(
                    [refs[i] for i in waiting], [labels[i] for i in waiting], self.timeout_s, "the weight sync"
                )
            except RayActorError as exc:
                dead = [i for i in waiting if i < len(engines) and died(refs[i])]
                if not self.engines.replaceable or not dead:
                    raise
                for i in dead:
                    self.engines.lost_one(engines[i], exc)
                waiting = [i for i in waiting if i not in dead]
                if not self.engines.alive():
                    raise
                continue
            for i, result in zip(waiting, got):
                results[i] = result
            return results
        return results
