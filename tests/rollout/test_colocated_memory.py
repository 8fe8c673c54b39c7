"""placement.colocate_all on GPUs, in process (no Ray, no GPU): the engines always sleep, take half of each GPU
unless told otherwise, wake only after the trainers handed back the memory their allocator cached from the
update, and the critic's update ends before the actor's starts. On CPU sleep mode and `torch.cuda.empty_cache`
do nothing, so recording stand-ins show the order: worker handles whose `.remote` runs the call at once and
logs it, `ray.wait` logging what it waited for, and `torch.cuda.empty_cache` logging that it ran."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from cloudrl.trainer.algo.batch import build_batch
from cloudrl.trainer.config import load_config
from cloudrl.trainer.config_checks import gpu_dtype_warning
from cloudrl.trainer.rollout import vllm_engine, weight_sync
from cloudrl.trainer.rollout.weight_sync import WeightPush


class Ref:
    """What a stand-in `.remote` returns: the call's name (for ray.wait's log) and its result."""

    def __init__(self, name, value):
        self.name, self.value = name, value


class Handle:
    """A Ray actor handle stand-in: `handle.method.remote(...)` runs the method now and logs `label.method`."""

    def __init__(self, label: str, log: list, **methods):
        self.label, self.log, self.methods = label, log, methods

    def __getattr__(self, method):
        def remote(*args, **kwargs):
            self.log.append(f"{self.label}.{method}")
            return Ref(f"{self.label}.{method}", self.methods.get(method, lambda *a, **k: None)(*args, **kwargs))

        return SimpleNamespace(remote=remote)


class Group:
    def __init__(self, name: str, log: list, count: int = 2, **methods):
        self.name = name
        self.workers = [Handle(f"{name}{i}", log, **methods) for i in range(count)]
        self.world_size = count

    def labels(self):
        return [f"{self.name} {i}" for i in range(len(self.workers))]

    def where(self):
        return [{"device": "cuda:0"} for _ in self.workers]


@pytest.fixture
def log(monkeypatch):
    """Every stand-in call and wait, in order."""
    import ray

    calls: list[str] = []
    monkeypatch.setattr(
        ray, "wait", lambda refs, num_returns=1, **kw: calls.append(f"wait {_names(refs)}") or (refs, [])
    )
    monkeypatch.setattr(ray, "get", lambda ref, **kw: ref.value)
    monkeypatch.setattr(weight_sync, "get_all", lambda refs, labels, timeout_s, what, *a: [r.value for r in refs])
    return calls


def _address():
    return "127.0.0.1", 29500


def _names(refs) -> str:
    return ",".join(r.name for r in refs)


def colocated(*overrides):
    return load_config(
        "local",
        [
            "rollout.engine=vllm",
            "placement.colocate_all=true",
            "actor.gpus_per_node=1",
            "critic.gpus_per_node=1",
            *overrides,
        ],
    )


# ---- the config -----------------------------------------------------------------------------------------


def test_colocated_vllm_engines_always_sleep():
    cfg = colocated()
    assert not cfg.rollout.sleep_between_rollouts  # nothing asked for it...
    assert vllm_engine.engines_sleep(cfg) and vllm_engine.sleep_level(cfg, on_gpu=True) == 2  # ...yet they sleep
    kwargs, _ = vllm_engine.engine_args(cfg, "/m", on_gpu=True)
    assert kwargs["enable_sleep_mode"]
    alone = load_config("local", ["rollout.engine=vllm"])
    assert not vllm_engine.engines_sleep(alone) and vllm_engine.sleep_level(alone, on_gpu=True) == 0
    assert not vllm_engine.engines_sleep(load_config("local", ["placement.colocate_all=true"]))  # HF engines


def test_engines_take_most_of_their_own_gpus_and_half_of_shared_ones():
    assert load_config("local", ["rollout.engine=vllm"]).rollout.gpu_memory_utilization == 0.85
    assert colocated().rollout.gpu_memory_utilization == 0.5
    # Set by the user, in either order, the value stays.
    for overrides in (
        ["rollout.gpu_memory_utilization=0.3", "placement.colocate_all=true"],
        ["placement.colocate_all=true", "rollout.gpu_memory_utilization=0.3"],
    ):
        assert load_config("local", overrides).rollout.gpu_memory_utilization == 0.3
    kwargs, _ = vllm_engine.engine_args(colocated(), "/m", on_gpu=True)
    assert kwargs["gpu_memory_utilization"] == 0.5


def test_float32_on_gpus_gets_one_line_naming_bfloat16():
    line = gpu_dtype_warning(load_config("local", ["actor.gpus_per_node=1", "critic.gpus_per_node=1"]))
    assert "model.dtype=bfloat16" in line and "\n" not in line
    assert gpu_dtype_warning(load_config("local")) == ""  # CPU: float32 is right
    assert gpu_dtype_warning(load_config("gsm8k-7b")) == ""  # bfloat16 already


# ---- the weight push: trainers release their cached memory, then the engines wake ----------------------


def test_trainers_release_cached_memory_before_the_engines_wake(log):
    roles = SimpleNamespace(
        actor=Group("actor", log, master_address=_address),
        critic=Group("critic", log),
        reward=Group("reward", log, count=1),
        rollout=Group("engine", log),
        rollout_in_actor=False,
        engine_gpus=2.0,
    )
    queue = SimpleNamespace(pushed_by_actor=lambda: log.append("queue.pushed_by_actor"), generating=lambda: ([], []))
    push = WeightPush(colocated(), roles, queue)
    assert push.mode == "nccl" and push.sleeps
    log.clear()
    push(after=[Ref("actor0.update", None), Ref("actor1.update", None)])
    release = ["actor0.release_memory", "actor1.release_memory", "critic0.release_memory"]
    release += ["critic1.release_memory", "reward0.release_memory"]
    assert log == [
        "wait actor0.update,actor1.update",
        *release,
        "engine0.wake_weights",
        "engine1.wake_weights",
        "queue.pushed_by_actor",
        "actor0.push_weights",
        "actor1.push_weights",
        "engine0.wake_kv_cache",
        "engine1.wake_kv_cache",
    ]


def test_engines_on_their_own_gpus_release_nothing(log):
    roles = SimpleNamespace(
        actor=Group("actor", log, master_address=_address),
        rollout=Group("engine", log),
        rollout_in_actor=False,
        engine_gpus=2.0,
    )
    cfg = load_config("local", ["rollout.engine=vllm", "actor.gpus_per_node=1", "rollout.gpus_per_engine=1"])
    cfg.rollout.sleep_between_rollouts = True
    queue = SimpleNamespace(pushed_by_actor=lambda: None, generating=lambda: ([], []))
    WeightPush(cfg, roles, queue)(after=[])
    assert not [c for c in log if c.endswith("release_memory")]


def test_release_memory_empties_the_cuda_cache_on_gpu_only(monkeypatch):
    """Stand-in for torch.cuda.empty_cache (a no-op without CUDA): it runs on a CUDA worker, not on a CPU one."""
    from cloudrl.trainer.roles.workers import CriticWorker, PolicyWorker, RewardWorker

    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    for cls in (PolicyWorker, CriticWorker, RewardWorker):
        worker = object.__new__(cls)
        worker.device = torch.device("cpu")
        worker.release_memory()
        assert emptied == []
        worker.device = torch.device("cuda")
        worker.release_memory()
        assert emptied == [True]
        emptied.clear()


# ---- the update: one role at a time on shared GPUs ----------------------------------------------------


def _trainer(cfg, log):
    from cloudrl.trainer.driver import Trainer

    trainer = object.__new__(Trainer)
    trainer.cfg, trainer.global_step = cfg, 1
    trainer.roles = SimpleNamespace(actor=Group("actor", log, count=1), critic=Group("critic", log, count=1))
    size = cfg.rollout_batch_size
    batch = build_batch([[5, 6]] * size, [[7, 8]] * size, pad_id=0)
    for key in ("advantages", "values", "returns", "old_logprobs", "ref_logprobs"):
        batch[key] = torch.zeros(batch["response_mask"].shape)
    return trainer, batch


def test_colocated_critic_finishes_its_update_before_the_actor_starts(log):
    cfg = colocated()
    trainer, batch = _trainer(cfg, log)
    actor_refs, critic_refs = trainer.update(batch, kl_coef=0.0)
    assert log == ["critic0.update", "wait critic0.update", "actor0.update"]
    assert [r.name for r in actor_refs] == ["actor0.update"] and [r.name for r in critic_refs] == ["critic0.update"]


def test_critic_on_its_own_gpus_updates_beside_the_actor(log):
    for cfg in (
        load_config("local", ["actor.gpus_per_node=1", "critic.gpus_per_node=1"]),
        load_config("local", ["placement.colocate_all=true"]),  # CPU workers: nothing to share
    ):
        log.clear()
        trainer, batch = _trainer(cfg, log)
        trainer.update(batch, kl_coef=0.0)
        assert sorted(log) == ["actor0.update", "critic0.update"]
