"""The dapo preset (trainer/presets/dapo.yaml: clip-higher, dynamic sampling, token-mean, overlong
penalty, no KL) raises the reward on the built-in task, on a real local Ray instance, and dynamic
sampling shows in its metrics."""

from __future__ import annotations

import pytest
from cloudrl.trainer.config import load_config
from cloudrl.trainer.driver import train
from runs import REWARD_RISES, first_and_last_means, step_metrics

pytestmark = pytest.mark.ray


def test_dapo_preset_raises_the_reward(ray_local, tmp_path) -> None:
    overrides = {**REWARD_RISES, "trainer.run_dir": tmp_path, "trainer.export_hf": "false"}
    cfg = load_config("dapo", [f"{k}={v}" for k, v in overrides.items()])
    assert cfg.algorithm.dynamic_sampling and cfg.algorithm.kl_coef == 0 and cfg.actor.clip_high == 0.28
    train(cfg)

    steps = step_metrics(tmp_path)
    assert len(steps) == REWARD_RISES["trainer.total_steps"]
    # Prompts were dropped and more drawn, within the preset's bound of 4 rounds; as the policy learns the
    # 9 prompts more of them come out all right, so late steps may hit the bound and fill up the batch.
    assert all(1 <= r["rollout/sampling_rounds"] <= 4 and r["rollout/filled_uniform"] < 1 for r in steps)
    assert all(r["rollout/kept_fraction"] < 1 for r in steps) and steps[0]["rollout/filled_uniform"] == 0
    rewards = [r["rollout/reward_mean"] for r in steps]  # over every sample generated, dropped ones too
    first, last = first_and_last_means(rewards)
    assert last > first + 0.04, (first, last, rewards)
