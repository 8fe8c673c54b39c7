"""The local default with LoRA learns: the per-algorithm learning test's setting (PPO, the easy task, 20 short
steps) with the actor training rank-8 adapters only, at the settings docs/trainer.md ("LoRA") recommends for
the built-in model: 3e-3 with the output head adapted too."""

from __future__ import annotations

import math

import pytest
from cloudrl.trainer.config import load_config
from cloudrl.trainer.driver import train
from runs import REWARD_RISES, first_and_last_means, metric_rows

pytestmark = pytest.mark.ray


def test_lora_actor_raises_the_reward(ray_local, tmp_path, capfd):
    overrides = {
        **REWARD_RISES,
        "trainer.run_dir": tmp_path,
        "model.lora_rank": 8,
        "model.lora_alpha": 16,
        "actor.lr": "3e-3",
        "model.lora_target_modules": "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]",
    }
    cfg = load_config("local", [f"{k}={v}" for k, v in overrides.items()])
    train(cfg)
    steps = [r for r in metric_rows(tmp_path) if r["step"] > 0]
    assert len(steps) == REWARD_RISES["trainer.total_steps"]
    assert all(math.isfinite(r[k]) for r in steps for k in ("actor/pg_loss", "critic/vf_loss"))
    rewards = [r["rollout/reward_mean"] for r in steps]
    first, last = first_and_last_means(rewards)
    assert last > first + 0.04, (first, last, rewards)
