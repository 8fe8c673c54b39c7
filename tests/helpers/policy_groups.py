"""A policy role on a real Ray cluster and a fixed batch to update it with: what the data-parallel tests of
tests/roles/ and tests/rollout/ share."""

from __future__ import annotations

import torch
from cloudrl.trainer.algo.batch import build_batch
from cloudrl.trainer.roles.launch import ActorGroup, create_placement_group
from cloudrl.trainer.roles.placement import plan, plan_slots
from cloudrl.trainer.roles.workers import PolicyWorker


def policy_group(cfg, model_path: str, world: int) -> tuple[ActorGroup, object]:
    """`world` PolicyWorker ranks of `model_path` in a placement group, started (process group, FSDP2)."""
    cfg.actor.workers_per_node = world
    request = plan(cfg)[0]
    pg = create_placement_group(request, 60)
    group = ActorGroup("actor", PolicyWorker, pg, plan_slots(cfg, request)["actor"], (cfg.to_dict(), model_path))
    group.start_training()
    return group, pg


def fixed_batch(cfg, size: int):
    """`size` random prompt/response pairs of random lengths, with advantages and old log-probs (seed 0)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [
        [int(t) for t in torch.randint(3, 20, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen)]
        for _ in range(size)
    ]
    responses = [
        [int(t) for t in torch.randint(3, 20, (int(torch.randint(0, 5, (1,), generator=gen)),), generator=gen)]
        for _ in range(size)
    ]
    batch = build_batch(prompts, responses, pad_id=0)
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=gen) * batch["response_mask"]
    batch["old_logprobs"] = -torch.rand(batch["response_mask"].shape, generator=gen) * batch["response_mask"]
    return batch
