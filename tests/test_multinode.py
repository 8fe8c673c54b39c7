"""Data-parallel training and placement on real Ray clusters (CPU, gloo)."""

from __future__ import annotations

import json

import pytest
import torch

from cloudrl.trainer.batch import build_batch, from_wire
from cloudrl.trainer.config import load_config
from cloudrl.trainer.driver import train, update_shards
from cloudrl.trainer.group import ActorGroup, _slots, create_placement_group
from cloudrl.trainer.models import resolve_path
from cloudrl.trainer.placement import ClusterTooSmall, check_fits, plan
from cloudrl.trainer.workers import PolicyWorker

from conftest import tiny_overrides

pytestmark = pytest.mark.ray


def _policy_group(cfg, model_path: str, world: int) -> tuple[ActorGroup, object]:
    cfg.actor.workers_per_node = world
    request = plan(cfg)[0]
    pg = create_placement_group(request, 60)
    bundles, per_worker = _slots(request, world, 1.0)
    group = ActorGroup(PolicyWorker, pg, bundles, per_worker, (cfg.to_dict(), model_path))
    group.init_distributed()
    return group, pg


def _fixed_batch(cfg, size: int):
    gen = torch.Generator().manual_seed(0)
    prompts = [[int(t) for t in torch.randint(3, 20, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen)]
               for _ in range(size)]
    responses = [[int(t) for t in torch.randint(3, 20, (int(torch.randint(0, 5, (1,), generator=gen)),), generator=gen)]
                 for _ in range(size)]
    batch = build_batch(prompts, responses, pad_id=0)
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=gen) * batch["response_mask"]
    batch["old_logprobs"] = -torch.rand(batch["response_mask"].shape, generator=gen) * batch["response_mask"]
    return batch


def test_two_workers_match_one_on_the_same_global_batch(ray_local):
    """One PPO update (2 mini-batches, several micro-batches) with W=2 gloo ranks gives the same
    parameters as W=1: the loss is normalised by the global token count and gradients are summed."""
    import ray
    from ray.util import remove_placement_group

    overrides = ["actor.mini_batch_size=16", "actor.micro_batch_size=4", "actor.lr=1e-3", "data.train_batch_size=8",
                 "rollout.n=4", "model.sft_warmup_steps=20", "critic.mini_batch_size=16", "critic.micro_batch_size=4"]
    cfg = load_config("local", overrides)
    model_path = resolve_path(cfg.model.path, cfg)
    batch = _fixed_batch(cfg, 32)
    results = {}
    for world in (1, 2):
        group, pg = _policy_group(load_config("local", overrides), model_path, world)
        try:
            shards, norms = update_shards(batch, world, cfg.actor, seed=3)
            assert len(norms) == 2 and all(s.size == 32 // world for s in shards)
            ray.get([w.update.remote(s, norms, 0.0) for w, s in zip(group.workers, shards)])
            results[world] = {k: from_wire(v) for k, v in ray.get(group.workers[0].weights.remote())}
            if world == 2:  # every rank holds the same parameters after the step
                rank1 = ray.get(group.workers[1].get_state.remote())
                assert rank1 is None  # only rank 0 hands out state
        finally:
            group.kill()
            remove_placement_group(pg)
    initial = {k: from_wire(v) for k, v in PolicyWorker(cfg.to_dict(), model_path).weights()}
    changed = 0
    for name, value in results[1].items():
        torch.testing.assert_close(results[2][name], value, rtol=1e-5, atol=1e-6, msg=name)
        changed += not torch.equal(value, initial[name])
    assert changed > len(results[1]) // 2


def test_checkpoint_from_two_workers_resumes_in_one(ray_local, tmp_path):
    """Checkpoints hold full state keyed by name: a W=2 run resumes as W=1 and continues like an
    uninterrupted W=1 run."""
    base = {"trainer.save_every": 1, "trainer.keep_last": 5}
    straight = tmp_path / "w1"
    train(load_config("local", tiny_overrides(straight, **base, **{"trainer.total_steps": 3})))
    mixed = tmp_path / "w2_then_w1"
    train(load_config("local", tiny_overrides(mixed, **base, **{"trainer.total_steps": 2,
                                                                  "actor.workers_per_node": 2,
                                                                  "critic.workers_per_node": 2})))
    placement = json.loads((mixed / "placement.json").read_text())
    assert len(placement["actor"]) == 2 and len(placement["critic"]) == 2
    summary = train(load_config("local", tiny_overrides(mixed, **base, **{"trainer.total_steps": 3})))
    assert summary["resumed_from"] == 2
    a = torch.load(straight / "checkpoints/step_000003/actor.pt", weights_only=False)["model"]
    b = torch.load(mixed / "checkpoints/step_000003/actor.pt", weights_only=False)["model"]
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)


def test_check_fits_messages_without_a_cluster():
    cfg = load_config("local", ["actor.nodes=2", "actor.workers_per_node=2", "actor.micro_batch_size=64"])
    check_fits(cfg, [{"CPU": 4}, {"CPU": 4}])  # two nodes with room for two actor ranks each
    with pytest.raises(ClusterTooSmall, match="on 2 different nodes"):
        check_fits(cfg, [{"CPU": 16}])
    with pytest.raises(ClusterTooSmall, match=r"asks for 8 h100 \(8 for actor"):
        check_fits(load_config("local", ["actor.resources={h100: 8}"]), [{"CPU": 8}])
