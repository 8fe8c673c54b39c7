"""The rollout queue on a real Ray instance, with small engine and reward actors that record what they
were given: a push does not wait for the batch in flight, every batch sees exactly the weights pushed
before it started, a failed load is raised before anything generated after it is used, and each
engine's part is scored by a reward worker without passing through the driver; an engine whose process dies
costs its batch nothing (its prompts go to the engines left) and is replaced at the next push."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from cloudrl.trainer.algo.batch import to_wire
from cloudrl.trainer.inputs.data import PromptRecord
from cloudrl.trainer.rollout.engines import Completion, SamplingSettings
from cloudrl.trainer.rollout.environment import ENV_REWARD
from cloudrl.trainer.rollout.queue import RolloutQueue

pytestmark = pytest.mark.ray


class Engine:
    """Generates one 'token' per sample: the weight version it holds. `generate` takes `delay` seconds."""

    def __init__(self, delay: float = 0.0):
        self.version, self.delay, self.fail_loads = 0, delay, False

    def generate(self, prompts, settings):
        self._maybe_die("generate")
        time.sleep(self.delay)
        return [Completion([self.version, p[0]], [0.0, 0.0], "stop") for p in prompts for _ in range(settings.n)]

    def load_weights(self, weights, version=None):
        self._maybe_die("load_weights")
        if self.fail_loads:
            raise ValueError("engine cannot take these weights")
        self.version = weights["version"]
        return {"idle_s": 0.0, "load_s": 0.0}

    def break_loads(self):
        self.fail_loads = True

    def die_on(self, call: str):
        """The process exits (as an engine killed by OOM, or on a lost node) at its next `call`."""
        self.dies_on = call

    def where(self):
        return {"ip": "127.0.0.1", "node_id": "n", "pid": os.getpid(), "device": "cpu"}

    def _maybe_die(self, call: str):
        if getattr(self, "dies_on", None) == call:
            os._exit(1)


class UnstartableEngine(Engine):
    """A new engine on a node that lacks the model: it raises its start error from its first call."""

    def where(self):
        from cloudrl.trainer.errors import ModelLoadError

        raise ModelLoadError("builtin:tiny was not staged on node 1234abcd (spot-7)")


class EngineGroup:
    """The rollout ActorGroup's part the queue uses to replace a lost engine: a new Engine in its slot."""

    def __init__(self, ray, workers, new=Engine):
        self.ray, self.workers, self.respawned, self.new = ray, workers, [], new

    def respawn(self, rank):
        self.respawned.append(rank)
        self.workers[rank] = self.ray.remote(self.new).remote()
        return self.workers[rank]

    def grow(self):
        self.workers.append(self.ray.remote(self.new).remote())
        return self.workers[-1]

    def placed(self, rank, place):
        return f"engine {rank} (new)"


class Scorer:
    """Scores a sample by its prompt's first id, and records which prompts it saw."""

    def __init__(self):
        self.seen = []

    def score(self, completions, records):
        self.seen.append([r.prompt_ids[0] for r in records])
        return to_wire(torch.tensor([float(c.token_ids[1]) for c in completions]))  # numpy, as RewardWorker

    def calls(self):
        return self.seen


def _prompts(first: int, count: int) -> list[PromptRecord]:
    return [PromptRecord([first + i], f"p{first + i}", "", "test") for i in range(count)]


def _queue(ray, engines: int, delay: float = 0.0, scorers: int = 0):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
    actors = [ray.remote(Engine).remote(delay) for _ in range(engines)]
    reward = [ray.remote(Scorer).remote() for _ in range(scorers)] or None
    return RolloutQueue(actors, [f"engine {i}" for i in range(engines)], 30.0, reward), actors, reward


def test_a_push_waits_for_nothing_and_each_batch_sees_the_weights_pushed_before_it(ray_local):
    import ray

    queue, _, _ = _queue(ray, engines=2, delay=1.0)
    settings = SamplingSettings(n=2, max_new_tokens=16)
    first = queue.take(1, _prompts(0, 4), settings)
    assert first.lag == 0 and {c.token_ids[0] for c in first.completions} == {0}

    queue.start(2, _prompts(10, 4), settings)  # generates for a second with version 0
    queue.push(ray.put({"version": 1}))
    generating, labels = queue.generating()
    assert labels == ["engine 0", "engine 1"]
    assert ray.wait(generating, num_returns=len(generating), timeout=0)[1], "push waited for the batch in flight"
    second = queue.take(2, _prompts(10, 4), settings)
    assert second.lag == 1 and {c.token_ids[0] for c in second.completions} == {0}

    queue.start(3, _prompts(20, 4), settings)  # after the push: version 1 on every engine
    third = queue.take(3, _prompts(20, 4), settings)
    assert third.lag == 0 and {c.token_ids[0] for c in third.completions} == {1}
    assert [c.token_ids[1] for c in third.completions] == [p for p in range(20, 24) for _ in range(2)]

    queue.start(4, _prompts(30, 4), settings)
    queue.pushed_by_actor()  # the GPU path: the actor sent the weights to the engines itself
    assert queue.take(4, _prompts(30, 4), settings).lag == 1


def test_two_batches_in_flight_lag_two_versions_and_then_see_the_pushes(ray_local):
    """rollout.max_staleness=2: the batches of the next two steps are started before this step's push; each
    engine generates them in turn with the weights it has, and loads the push after them."""
    import ray

    queue, _, _ = _queue(ray, engines=2, delay=0.5)
    settings = SamplingSettings(n=1, max_new_tokens=16)
    ahead = [(_prompts(10, 2), settings), (_prompts(20, 2), settings)]
    first = queue.take(1, _prompts(0, 2), settings, then=ahead)
    assert first.lag == 0 and [b.step for b in queue.pending] == [2, 3] and queue.started_through(1) == 3
    queue.push(ray.put({"version": 1}))  # step 1's update: behind batches 2 and 3 on every engine
    second = queue.take(2, _prompts(10, 2), settings, then=[(_prompts(30, 2), settings)])  # step 4 starts
    queue.push(ray.put({"version": 2}))
    third = queue.take(3, _prompts(20, 2), settings)
    fourth = queue.take(4, _prompts(30, 2), settings)
    versions = [{c.token_ids[0] for c in got.completions} for got in (first, second, third, fourth)]
    assert versions == [{0}, {0}, {0}, {1}]  # batch 4 started after push 1, before push 2
    assert [got.lag for got in (first, second, third, fourth)] == [0, 1, 2, 1]
    queue.start(7, _prompts(0, 2), settings)
    with pytest.raises(AssertionError, match="consecutive steps"):
        queue.start(9, _prompts(0, 2), settings)


def test_a_failed_load_is_raised_before_its_batch_is_used(ray_local):
    import ray

    queue, actors, _ = _queue(ray, engines=2)
    ray.get(actors[1].break_loads.remote())
    queue.push(ray.put({"version": 1}))  # returns: the failure is not known yet
    with pytest.raises(ray.exceptions.RayTaskError, match="cannot take these weights"):
        queue.generate(_prompts(0, 2), SamplingSettings(n=1, max_new_tokens=16))


def test_each_engine_part_is_scored_as_it_finishes_in_order(ray_local):
    import ray

    queue, _, scorers = _queue(ray, engines=3, scorers=2)
    got = queue.take(1, _prompts(100, 6), SamplingSettings(n=2, max_new_tokens=16))
    assert got.scores().tolist() == [float(p) for p in range(100, 106) for _ in range(2)]
    # engine parts 0 and 2 went to the first reward worker, part 1 to the second
    assert ray.get(scorers[0].calls.remote()) == [[100, 100, 101, 101], [104, 104, 105, 105]]
    assert ray.get(scorers[1].calls.remote()) == [[102, 102, 103, 103]]


class EpisodeEngine:
    """Each sample an episode whose environment paid its prompt's id / 100 in turn rewards."""

    def generate(self, prompts, settings):
        return [
            Completion([7, p[0]], [0.0, 0.0], "stop", turns={ENV_REWARD: p[0] / 100}) for p in prompts for _ in range(2)
        ]


def test_scored_in_the_driver_each_sample_gets_its_prompts_reward_and_its_environments(ray_local):
    """reward.in_driver: the queue scores with the driver's function, each sample against its own prompt,
    and adds the environment's rewards as the reward workers' path does."""
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    engines = [ray.remote(EpisodeEngine).remote() for _ in range(2)]
    seen = []

    def score_here(responses, records):
        seen.append([(r[1], p.prompt_ids[0]) for r, p in zip(responses, records)])
        return [float(p.prompt_ids[0]) for p in records]

    queue = RolloutQueue(engines, ["engine 0", "engine 1"], 30.0, None, score_here=score_here)
    for got in (
        queue.take(1, _prompts(100, 4), SamplingSettings(n=2, max_new_tokens=16)),
        queue.generate(_prompts(100, 4), SamplingSettings(n=2, max_new_tokens=16)),
    ):
        assert got.scores().tolist() == pytest.approx([p + p / 100 for p in range(100, 104) for _ in range(2)])
    assert seen[0] == [(p, p) for p in range(100, 104) for _ in range(2)]  # each response with its own prompt


def test_a_batch_started_for_other_prompts_is_refused(ray_local):
    import ray

    queue, _, _ = _queue(ray, engines=1)
    queue.start(2, _prompts(0, 2), SamplingSettings(n=1, max_new_tokens=16))
    with pytest.raises(RuntimeError, match="started for step 2 with other prompts"):
        queue.take(2, _prompts(50, 2), SamplingSettings(n=1, max_new_tokens=16))


def test_a_lost_engines_prompts_go_to_the_others_and_a_new_engine_joins_at_the_next_push(ray_local):
    import ray

    queue, actors, scorers = _queue(ray, engines=3, scorers=2)
    group = EngineGroup(ray, list(actors))
    queue.engines.replace_lost(group)
    settings = SamplingSettings(n=2, max_new_tokens=16)
    ray.get(actors[1].die_on.remote("generate"))
    got = queue.take(1, _prompts(100, 9), settings)
    # every prompt's samples, in order, scored against their own prompt, as with no loss
    assert [c.token_ids[1] for c in got.completions] == [p for p in range(100, 109) for _ in range(2)]
    assert got.scores().tolist() == [float(p) for p in range(100, 109) for _ in range(2)]
    assert got.requeued == 3 and got.engines_alive == 2 and group.respawned == [1]
    metrics = got.metrics(torch.ones(18, 1))
    assert metrics["rollout/engines_alive"] == 2
    # per engine: the lost engine 1 generated nothing of the batch; its 3 prompts (6 samples) went to the others
    assert set(got.by_engine) == {0, 2} and sum(got.by_engine.values()) == 18 and min(got.by_engine.values()) > 6
    assert metrics["rollout/engine_0_samples"] == got.by_engine[0] and "rollout/engine_1_samples" not in metrics

    ray.get(group.workers[1].where.remote())  # the replacement has started
    queue.push(ray.put({"version": 1}))
    second = queue.take(2, _prompts(200, 9), settings)
    assert second.engines_alive == 3 and second.requeued == 0 and second.by_engine == {0: 6, 1: 6, 2: 6}
    assert {c.token_ids[0] for c in second.completions} == {1}  # the new engine got the push before its part
    assert [c.token_ids[1] for c in second.completions] == [p for p in range(200, 209) for _ in range(2)]


def test_an_engine_lost_while_loading_weights_is_replaced_and_the_push_goes_on(ray_local):
    import ray

    queue, actors, _ = _queue(ray, engines=2)
    queue.engines.replace_lost(EngineGroup(ray, list(actors)))
    ray.get(actors[0].die_on.remote("load_weights"))
    queue.push(ray.put({"version": 1}))
    assert queue.settle() == {"timing/engine_weight_wait": 0.0, "timing/engine_load": 0.0}
    got = queue.generate(_prompts(0, 4), SamplingSettings(n=1, max_new_tokens=16))
    assert got.engines_alive == 1 and {c.token_ids[0] for c in got.completions} == {1}


def test_without_replacement_or_with_no_engine_left_a_loss_is_raised(ray_local):
    """Where engines are not replaced (an NCCL group, sleeping engines) a loss goes to the restart as before;
    so does the loss of the last engine."""
    import ray

    settings = SamplingSettings(n=1, max_new_tokens=16)
    queue, actors, _ = _queue(ray, engines=2)
    ray.get(actors[0].die_on.remote("generate"))
    with pytest.raises(ray.exceptions.RayActorError):
        queue.take(1, _prompts(0, 4), settings)

    queue, actors, _ = _queue(ray, engines=2)
    queue.engines.replace_lost(EngineGroup(ray, list(actors)))
    for actor in actors:
        ray.get(actor.die_on.remote("generate"))
    with pytest.raises(ray.exceptions.RayActorError):
        queue.take(1, _prompts(0, 4), settings)


def test_a_new_engine_that_cannot_start_is_named_once_and_the_run_goes_on(ray_local, capsys):
    import ray

    queue, actors, _ = _queue(ray, engines=2)
    group = EngineGroup(ray, list(actors), new=UnstartableEngine)
    queue.engines.replace_lost(group)
    settings = SamplingSettings(n=1, max_new_tokens=16)
    ray.get(actors[1].die_on.remote("generate"))
    assert len(queue.take(1, _prompts(0, 4), settings).completions) == 4
    ray.wait([group.workers[1].where.remote()], timeout=30)
    queue.push(ray.put({"version": 1}))
    got = queue.take(2, _prompts(0, 4), settings)
    assert got.engines_alive == 1 and {c.token_ids[0] for c in got.completions} == {1}
    assert group.respawned == [1]  # a start error would come again: not tried again
    assert (
        "the new engine for engine 1 could not start: builtin:tiny was not staged on node 1234abcd (spot-7); the run "
        "goes on with 1 engine(s)" in capsys.readouterr().out
    )


def test_an_added_engine_joins_at_a_push_and_gets_every_later_one(ray_local, capsys):
    """rollout.elastic: one more engine is asked for at each push while there are fewer than max_engines; it
    joins at the first push after it has started, loading those weights before its first part."""
    import ray

    queue, actors, _ = _queue(ray, engines=1)
    group = EngineGroup(ray, list(actors))
    queue.engines.replace_lost(group)
    queue.engines.grow_to(3)
    settings = SamplingSettings(n=1, max_new_tokens=16)
    assert queue.take(1, _prompts(0, 4), settings).engines_alive == 1
    queue.push(ray.put({"version": 1}))  # asks for engine 1
    assert len(group.workers) == 2 and queue.take(2, _prompts(0, 4), settings).engines_alive == 1
    ray.get(group.workers[1].where.remote())
    queue.push(ray.put({"version": 2}))  # engine 1 joins (and engine 2 is asked for)
    got = queue.take(3, _prompts(0, 4), settings)
    assert got.engines_alive == 2 and {c.token_ids[0] for c in got.completions} == {2}
    ray.get(group.workers[2].where.remote())
    queue.push(ray.put({"version": 3}))  # engine 2 joins; no engine 3: max_engines=3
    got = queue.take(4, _prompts(0, 6), settings)
    assert got.engines_alive == 3 and len(group.workers) == 3 and got.by_engine == {0: 2, 1: 2, 2: 2}
    assert {c.token_ids[0] for c in got.completions} == {3}
    assert [c.token_ids[1] for c in got.completions] == list(range(6))
    out = capsys.readouterr().out
    assert "engine 1 (new) joined (rollout.elastic, " in out and "engine 2 (new) joined" in out


def test_an_added_engine_that_cannot_start_stops_the_adding(ray_local, capsys):
    import ray

    queue, actors, _ = _queue(ray, engines=1)
    group = EngineGroup(ray, list(actors), new=UnstartableEngine)
    queue.engines.replace_lost(group)
    queue.engines.grow_to(3)
    queue.push(ray.put({"version": 1}))
    ray.wait([group.workers[1].where.remote()], timeout=30)
    queue.push(ray.put({"version": 2}))
    queue.push(ray.put({"version": 3}))
    got = queue.generate(_prompts(0, 2), SamplingSettings(n=1, max_new_tokens=16))
    assert got.engines_alive == 1 and len(group.workers) == 2
    assert (
        "the engine added as rollout rank 1 could not start: builtin:tiny was not staged on node 1234abcd (spot-7); "
        "the run goes on with 1 engine(s); no more engines are added" in capsys.readouterr().out
    )
