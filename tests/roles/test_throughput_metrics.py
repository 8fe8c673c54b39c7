"""The per-step speeds a GPU user reads, on CPU: generation tokens/s (per GPU, and of the slowest engine) from the
engines' own timings, and the weight push split into its gather, its send and GB/s, on the object-store path
(actor rank 0's gather carried to the engines with the weights) and on the NCCL/IPC path (`CastSource` timing the
gathers apart from the sends). In process, no Ray: the rollout and policy workers are built directly."""

from __future__ import annotations

import pickle
import time
from types import SimpleNamespace

import pytest
import torch
from cloudrl.trainer.config import load_config
from cloudrl.trainer.inputs.models import resolve_path
from cloudrl.trainer.roles.workers import PolicyWorker, RolloutWorker
from cloudrl.trainer.rollout.engines import (
    Completion,
    Completions,
    PushedWeights,
    SamplingSettings,
    generation_throughput,
    object_store_push,
)
from cloudrl.trainer.rollout.weight_sync import WeightSyncGroup, cast_source


def _part(lengths: list[int], seconds: float, gpus: float, loss_mask: bool = False) -> Completions:
    out = Completions(
        Completion([1] * n, [0.0] * n, "stop", [1] * (n - 1) + [0] if loss_mask else None) for n in lengths
    )
    out.seconds, out.gpus = seconds, gpus
    return out


def test_generation_throughput_over_engines():
    # two engines of 2 GPUs each: 30 tokens in 2 s and 10 tokens (multi-turn: 2 of them observations) in 1 s
    parts = [_part([10, 20], 2.0, 2.0), _part([6, 6], 1.0, 2.0, loss_mask=True)]
    got = generation_throughput(parts)
    assert got["perf/generation_tokens_per_s_per_gpu"] == pytest.approx(40 / 2.0 / 4)  # the longest engine's time
    assert got["perf/slowest_engine_tokens_per_s"] == pytest.approx(10 / 1.0)  # 15 tok/s vs 10 tok/s
    assert generation_throughput([_part([4], 2.0, 0.0)])["perf/generation_tokens_per_s_per_gpu"] == 2.0  # CPU: 1 each
    assert generation_throughput([[Completion([1], [0.0], "stop")]]) == {}  # untimed parts: nothing reported
    again = pickle.loads(pickle.dumps(parts[0]))  # as Ray sends it from the engine
    assert (again.seconds, again.gpus, [c.token_ids for c in again]) == (2.0, 2.0, [c.token_ids for c in parts[0]])


def test_object_store_push_split():
    pushed = PushedWeights([("w", 1)])
    pushed.gather_s, pushed.nbytes = 0.5, 3_000_000_000
    again = pickle.loads(pickle.dumps(pushed))
    assert (list(again), again.gather_s, again.nbytes) == ([("w", 1)], 0.5, 3_000_000_000)
    loads = [{"idle_s": 0, "load_s": 1.0, "gather_s": 0.5, "bytes": 3e9}, {"idle_s": 0, "load_s": 2.5, "gather_s": 0.5}]
    assert object_store_push(loads) == {"timing/push_gather": 0.5, "perf/push_gb_per_s": pytest.approx(1.0)}
    assert object_store_push([{"idle_s": 0, "load_s": 1.0}]) == {}  # a push that did not say its size


@pytest.fixture(scope="module")
def workers():
    cfg = load_config("local", ["model.sft_warmup_steps=0"])
    path = resolve_path(cfg.model.path, cfg)
    return cfg, PolicyWorker(cfg.to_dict(), path), RolloutWorker(cfg.to_dict(), path)


def test_an_engine_times_its_generation_and_reports_the_push_it_loaded(workers):
    cfg, policy, engine = workers
    out = engine.generate([[5, 6, 7], [8, 9]], SamplingSettings(n=2, max_new_tokens=4, seed=1))
    assert out.seconds > 0 and out.gpus == 0.0  # a CPU engine
    speed = generation_throughput([out])
    assert speed["perf/generation_tokens_per_s_per_gpu"] == pytest.approx(
        sum(len(c.token_ids) for c in out) / out.seconds
    )
    weights = policy.weights()
    bf16 = (
        sum(p.numel() for p in policy.model.state_dict().values())
        * torch.tensor([], dtype=policy.compute_dtype).element_size()
    )
    assert weights.gather_s > 0 and weights.nbytes == bf16
    load = engine.load_weights(pickle.loads(pickle.dumps(weights)))
    assert load["gather_s"] == weights.gather_s and load["bytes"] == bf16
    split = object_store_push([load])
    assert split["timing/push_gather"] == weights.gather_s
    assert split["perf/push_gb_per_s"] == pytest.approx(bf16 / (weights.gather_s + load["load_s"]) / 1e9)


def test_the_gpu_push_times_its_gathers_apart_from_its_sends(workers):
    _, policy, _ = workers
    source = cast_source(policy.model, torch.bfloat16)
    sent = []

    def send_weights():  # the engines' side of the broadcast: 2 ms per tensor
        for _name, tensor in source:
            time.sleep(0.002)
            sent.append(tensor.numel() * tensor.element_size())

    group = WeightSyncGroup.__new__(WeightSyncGroup)  # its NCCL/IPC engines need vLLM on a GPU: stood in for
    group.source, group.transfer = source, SimpleNamespace(send_weights=send_weights)
    split = group.push()
    assert split["timing/push_broadcast"] >= 0.002 * len(sent)  # the sends are not counted as gathering
    assert 0 < split["timing/push_gather"] < split["timing/push_broadcast"]
    total = split["timing/push_gather"] + split["timing/push_broadcast"]
    assert split["perf/push_gb_per_s"] == pytest.approx(sum(sent) / total / 1e9, rel=1e-6)
