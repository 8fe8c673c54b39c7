"""The driver's weight push (`WeightPush`) on a real Ray instance, with engine stand-ins that keep vLLM's
sleep state: `sleep` frees the weights and the KV cache, `wake_weights` and `wake_kv_cache` bring each back,
a load needs the weights awake and `generate` needs both. On the CPU build of vLLM sleep mode is a no-op,
so these stand-ins are what shows that an engine is fully awake after every push, on the NCCL path (the
actor ranks drive the engines themselves; the transfer is stubbed by the stand-in, since NCCL needs GPUs)
and on the object-store path, and that the push is chosen once from the config and where the actor runs."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import pytest
from cloudrl.trainer.config import load_config
from cloudrl.trainer.inputs.data import PromptRecord
from cloudrl.trainer.rollout.engines import Completion, SamplingSettings
from cloudrl.trainer.rollout.queue import RolloutQueue
from cloudrl.trainer.rollout.weight_sync import WeightPush

pytestmark = pytest.mark.ray


class SleepyEngine:
    """Holds vLLM's sleep state (weights and KV cache, each asleep or awake) and records every call."""

    def __init__(self):
        self.weights_awake = True
        self.kv_awake = True
        self.version = 0
        self.calls = []
        self.generate_s = 0.0
        self.generated_at = []
        """When each generate call ended (time.monotonic, the same clock for every process on this machine)."""

    def slow_down(self, seconds: float) -> None:
        self.generate_s = seconds

    def generation_ends(self) -> list[float]:
        return self.generated_at

    def sleep(self):
        self.calls.append("sleep")
        self.weights_awake = False
        self.kv_awake = False

    def wake_weights(self):
        self.calls.append("wake_weights")
        self.weights_awake = True

    def wake_kv_cache(self):
        self.calls.append("wake_kv_cache")
        self.kv_awake = True

    def load_weights(self, weights, version=None):
        """The object-store path."""
        self.calls.append("load_weights")
        if not self.weights_awake:
            raise RuntimeError("load_weights on an engine whose weights are asleep")
        self.version = weights["version"]
        return {"idle_s": 0.0, "load_s": 0.0}

    def receive_broadcast(self, version):
        """The NCCL path's engine side (vLLM's update_weights), stubbed: no NCCL without GPUs."""
        self.calls.append("receive_broadcast")
        if not self.weights_awake:
            raise RuntimeError("a weight broadcast reached an engine whose weights are asleep")
        self.version = version

    def generate(self, prompts, settings):
        self.calls.append("generate")
        if not (self.weights_awake and self.kv_awake):
            raise RuntimeError("generate on a sleeping engine: the KV cache or the weights were never woken")
        time.sleep(self.generate_s)
        self.generated_at.append(time.monotonic())
        return [Completion([self.version], [0.0], "stop") for _ in prompts for _ in range(settings.n)]

    def history(self):
        return self.calls


class ActorRank:
    """A policy rank: `weights` for the object store, `push_weights` drives the engines (the NCCL path)."""

    def __init__(self, engines):
        self.engines = engines
        self.version = 0
        self.group = None
        self.pushes_started = []

    def master_address(self):
        return "127.0.0.1", 29500

    def open_weight_sync(self, rollout_workers, addr, port):
        """Where the real rank joins vLLM's NCCL group with every engine worker (needs GPUs)."""
        self.group = (len(rollout_workers), addr, port)

    def joined(self):
        return self.group

    def push_starts(self) -> list[float]:
        return self.pushes_started

    def update(self):
        self.version += 1
        return self.version

    def weights(self):
        return {"version": self.version}

    def push_weights(self):
        import ray

        self.pushes_started.append(time.monotonic())  # where the real rank enters its first collective
        ray.get([e.receive_broadcast.remote(self.version) for e in self.engines])


class Group:
    """The parts of roles.launch.ActorGroup that WeightPush uses."""

    def __init__(self, workers, name: str, device: str = "cpu"):
        self.workers = workers
        self.name = name
        self.device = device

    def labels(self):
        return [f"{self.name} {i}" for i in range(len(self.workers))]

    def where(self):
        return [{"device": self.device} for _ in self.workers]


def _config(sleeps: bool, engine: str = "vllm", gpus: int = 1):
    """One engine at tensor_parallel_size=1 beside an actor on `gpus` GPUs (placement gives a GPU engine its
    own GPU whenever the actor has GPUs)."""
    return load_config(
        "local",
        [
            "algorithm.name=grpo",
            f"rollout.engine={engine}",
            f"actor.gpus_per_node={gpus}",
            f"rollout.sleep_between_rollouts={str(sleeps).lower()}",
            "trainer.worker_timeout_s=30",
        ],
    )


def _cluster(ray, actor_device: str, rollout_in_actor: bool = False, engine_gpus: float = 1.0):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
    engines = [ray.remote(SleepyEngine).remote() for _ in range(2)]
    actor = Group([ray.remote(ActorRank).remote(engines) for _ in range(2)], "actor", actor_device)
    rollout = actor if rollout_in_actor else Group(engines, "engine")
    roles = SimpleNamespace(actor=actor, rollout=rollout, rollout_in_actor=rollout_in_actor, engine_gpus=engine_gpus)
    queue = RolloutQueue(engines, rollout.labels(), 30.0)
    return roles, queue, engines


def _steps(ray, push, roles, queue, engines, steps: int = 2) -> list[list[str]]:
    """Rollout, release, update, push, as the driver's step does; returns each engine's calls."""
    prompts = [PromptRecord([i], f"p{i}", "", "test") for i in range(4)]
    settings = SamplingSettings(n=1, max_new_tokens=16)
    for step in range(1, steps + 1):
        got = queue.take(step, prompts, settings)
        assert {c.token_ids[0] for c in got.completions} == {step - 1}, "the batch used the last pushed weights"
        push.release_engines()
        update = [w.update.remote() for w in roles.actor.workers]
        push(after=update)
        queue.settle()
    return ray.get([e.history.remote() for e in engines])


def test_nccl_push_leaves_every_engine_fully_awake(ray_local):
    """Sleep mode with the GPU push: the engines' KV cache is woken after the broadcast, so the next
    step's generate finds them awake (without it, step 2 fails on a sleeping engine)."""
    import ray

    roles, queue, engines = _cluster(ray, "cuda:0")
    push = WeightPush(_config(sleeps=True), roles, queue)
    assert push.mode == "nccl"
    assert ray.get([w.joined.remote() for w in roles.actor.workers]) == [(2, "127.0.0.1", 29500)] * 2
    for calls in _steps(ray, push, roles, queue, engines):
        assert calls[:6] == [
            "generate",
            "sleep",
            "wake_weights",
            "receive_broadcast",
            "receive_broadcast",
            "wake_kv_cache",
        ]
        assert calls[6] == "generate"


def test_object_store_push_wakes_weights_then_loads_then_wakes_kv_cache(ray_local):
    import ray

    roles, queue, engines = _cluster(ray, "cpu")
    push = WeightPush(_config(sleeps=True), roles, queue)
    assert push.mode == "object_store"  # logical GPUs: the actor computes on the CPU
    for calls in _steps(ray, push, roles, queue, engines):
        assert calls[:5] == ["generate", "sleep", "wake_weights", "load_weights", "wake_kv_cache"]
        assert calls[5] == "generate"


def test_without_sleep_mode_the_engines_are_never_put_to_sleep(ray_local):
    import ray

    roles, queue, engines = _cluster(ray, "cuda:0")
    push = WeightPush(_config(sleeps=False), roles, queue)
    for calls in _steps(ray, push, roles, queue, engines, steps=3):
        assert "sleep" not in calls and "wake_weights" not in calls
        assert calls.count("receive_broadcast") == 2 * 3  # both actor ranks drive every engine, every step


def test_the_push_is_chosen_once_from_the_placement_and_the_actors_device(ray_local):
    import ray

    roles, queue, _ = _cluster(ray, "cuda:0", rollout_in_actor=True)
    assert WeightPush(_config(sleeps=False), roles, queue).mode == "none"
    roles, queue, _ = _cluster(ray, "cuda:0")
    assert WeightPush(_config(sleeps=False, engine="hf"), roles, queue).mode == "object_store"
    roles, queue, _ = _cluster(ray, "cuda:0", engine_gpus=0.0)  # the engines got no GPU
    push = WeightPush(_config(sleeps=False, gpus=0), roles, queue)
    assert push.mode == "object_store" and push.describe(_config(sleeps=False, gpus=0)).startswith(
        "weight push: Ray object store (engines on CPU"
    )


def test_with_max_staleness_the_nccl_push_waits_for_the_batch_in_flight(ray_local):
    """max_staleness=1 starts the next batch before the update. The actor ranks' push (collectives from its first
    line on GPUs) starts only after that batch is generated, so no rank waits inside a collective while an
    engine generates; the batch's samples still come from the weights before the push."""
    import ray

    roles, queue, engines = _cluster(ray, "cuda:0")
    push = WeightPush(_config(sleeps=False), roles, queue)
    ray.get([e.slow_down.remote(1.5) for e in engines])
    prompts = [PromptRecord([i], f"p{i}", "", "test") for i in range(4)]
    settings = SamplingSettings(n=1, max_new_tokens=16)
    queue.take(1, prompts, settings, then=[(prompts, settings)])  # step 2's batch starts now
    push(after=[w.update.remote() for w in roles.actor.workers])
    step_two_done = max(max(ends) for ends in ray.get([e.generation_ends.remote() for e in engines]))
    starts = [t for rank in ray.get([w.push_starts.remote() for w in roles.actor.workers]) for t in rank]
    assert len(starts) == 2 and min(starts) >= step_two_done
    lagged = queue.take(2, prompts, settings)
    assert {c.token_ids[0] for c in lagged.completions} == {0} and lagged.lag == 1
