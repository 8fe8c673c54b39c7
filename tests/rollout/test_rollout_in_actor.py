"""placement.rollout_in_actor: the actor's workers generate with the policy they train."""

from __future__ import annotations

import json
import math

import pytest
import torch
from cloudrl.trainer.algo.batch import from_wire, update_shards
from cloudrl.trainer.config import ConfigError, load_config
from cloudrl.trainer.driver import train
from cloudrl.trainer.inputs.models import load_causal_lm, load_tokenizer, resolve_path
from cloudrl.trainer.roles.placement import plan
from cloudrl.trainer.rollout.engines import HFEngine, SamplingSettings
from policy_groups import fixed_batch, policy_group
from runs import tiny_overrides

pytestmark = pytest.mark.ray

GREEDY = SamplingSettings(n=1, max_new_tokens=6, greedy=True)


def _big_step_setup():
    """A config whose single update visibly changes the samples (lr 0.5), its model and 12 prompts."""
    cfg = load_config(
        "local",
        [
            "placement.rollout_in_actor=true",
            "actor.lr=0.5",
            "model.sft_warmup_steps=20",
            "data.train_batch_size=8",
            "rollout.n=4",
            "actor.mini_batch_size=32",
            "actor.micro_batch_size=32",
            "critic.mini_batch_size=32",
            "critic.micro_batch_size=32",
        ],
    )
    model_path = resolve_path(cfg.model.path, cfg)
    tokenizer = load_tokenizer(model_path)
    return cfg, model_path, tokenizer, [tokenizer.encode(f"{a}+{b}=") for a in range(4) for b in range(3)]


def test_generation_follows_every_update(ray_local):
    """The engine wraps the trained module itself: after an update, the worker's samples are those
    of the new weights (checked against a separate copy loaded with them), and differ from before."""
    import ray
    from ray.util import remove_placement_group

    cfg, model_path, tokenizer, prompts = _big_step_setup()
    group, pg = policy_group(cfg, model_path, world=1)
    try:
        worker = group.workers[0]
        before = [c.token_ids for c in ray.get(worker.generate.remote(prompts, GREEDY))]
        shards, norms = update_shards(fixed_batch(cfg, 32), 1, cfg.actor, seed=1)
        ray.get(worker.update.remote(shards[0], norms, 0.0))
        after = [c.token_ids for c in ray.get(worker.generate.remote(prompts, GREEDY))]
        weights = ray.get(worker.weights.remote())
    finally:
        group.kill()
        remove_placement_group(pg)

    copy = load_causal_lm(model_path)
    copy.load_state_dict({name: from_wire(t) for name, t in weights})
    expected = [c.token_ids for c in HFEngine(copy.eval(), tokenizer).generate(prompts, GREEDY)]
    assert after == expected
    assert after != before, "the update did not change what the worker generates"


def _run(run_dir, **extra) -> tuple[dict, list[dict]]:
    cfg = load_config(
        "local",
        tiny_overrides(
            run_dir,
            **{
                "algorithm.name": "grpo",
                "placement.rollout_in_actor": "true",
                "actor.workers_per_node": 2,
                "actor.fsdp": "false",
                "trainer.val_every": 1,
                **extra,
            },
        ),
    )
    summary = train(cfg)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def test_grpo_with_two_generating_actor_ranks(ray_local, tmp_path):
    """Two data-parallel actor ranks each sample half the prompts; no rollout workers, no weight sync.
    Run twice: rewards scored by a reward worker, then in the driver (reward.in_driver); the same
    seeds give the same samples, so both must report the same rewards."""
    cfg = load_config(
        "local", tiny_overrides(tmp_path, **{"placement.rollout_in_actor": "true", "algorithm.name": "grpo"})
    )
    assert [r.role for r in plan(cfg)] == ["actor", "reward"]
    summary, rows = _run(tmp_path / "worker")
    placement = json.loads((tmp_path / "worker" / "placement.json").read_text())
    assert sorted(placement) == ["actor", "reward"] and len(placement["actor"]) == 2
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        assert row["rollout/response_length"] > 0
        for key in ("rollout/reward_mean", "actor/pg_loss", "val/reward_mean", "timing/rollout"):
            assert math.isfinite(row[key]), (key, row)
        assert row["timing/sync"] < 0.01  # nothing to push

    before = dict(load_causal_lm(resolve_path(cfg.model.path, cfg)).named_parameters())
    after = load_causal_lm(summary["exported_model"])
    assert not [n for n, p in after.named_parameters() if torch.equal(p, before[n])]

    _, driver_rows = _run(tmp_path / "driver", **{"reward.in_driver": "true"})
    assert sorted(json.loads((tmp_path / "driver" / "placement.json").read_text())) == ["actor"]
    for key in ("rollout/reward_mean", "rollout/reward_std"):
        assert driver_rows[1][key] == rows[1][key], key  # step 1: identical samples, identical scores
    assert driver_rows[0]["val/reward_mean"] == rows[0]["val/reward_mean"]


def test_reward_in_driver_refuses_a_reward_model():
    with pytest.raises(ConfigError, match="reward.in_driver=true scores rule-based rewards only"):
        load_config("local", ["reward.in_driver=true", "reward.model_path=/some/rm"])


@pytest.mark.parametrize(
    "override,expected",
    [
        ("rollout.engine=vllm", "needs rollout.engine=hf"),
        ("rollout.num_engines=2", "do not apply with placement.rollout_in_actor=true"),
        ("rollout.sleep_between_rollouts=true", "rollout.sleep_between_rollouts is for vLLM engines"),
    ],
)
def test_settings_that_contradict_it_are_config_errors(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config("local", ["placement.rollout_in_actor=true", override])


def test_fsdp_sharded_gpu_actor_is_refused():
    with pytest.raises(ConfigError, match="set actor.fsdp=false"):
        load_config("local", ["placement.rollout_in_actor=true", "actor.gpus_per_node=2", "actor.micro_batch_size=128"])
    with pytest.raises(ConfigError, match="set actor.fsdp=false"):  # two CPU ranks shard over gloo
        load_config(
            "local", ["placement.rollout_in_actor=true", "actor.workers_per_node=2", "actor.micro_batch_size=128"]
        )
    cfg = load_config(
        "local",
        ["placement.rollout_in_actor=true", "actor.gpus_per_node=2", "actor.fsdp=false", "actor.micro_batch_size=128"],
    )
    assert "rollout" not in [r.role for r in plan(cfg)]


def test_resumed_in_actor_run_matches_the_uninterrupted_one(ray_local, tmp_path):
    """A run stopped after step 1 and resumed samples steps 2 and 3 with the restored policy: same
    samples, same losses as the straight run, and every step reports its own rollout time."""
    common = {"trainer.save_every": 1, "reward.in_driver": "true", "trainer.val_every": 0}
    _, straight = _run(tmp_path / "straight", **{"trainer.total_steps": 3, **common})
    _run(tmp_path / "resumed", **{"trainer.total_steps": 1, **common})
    summary, resumed = _run(tmp_path / "resumed", **{"trainer.total_steps": 3, "trainer.resume": "auto", **common})
    assert summary["resumed_from"] == 1
    by_step = {r["step"]: r for r in straight if r["step"] > 0}
    assert sorted(by_step) == [1, 2, 3]
    for row in resumed:
        if row["step"] in (2, 3):
            for key in ("rollout/reward_mean", "rollout/response_length", "actor/pg_loss", "actor/entropy"):
                assert row[key] == by_step[row["step"]][key], (row["step"], key)
    for row in by_step.values():
        assert 0 < row["timing/rollout"] < row["timing/step"]
        assert 0 < row["timing/update_actor"] < row["timing/step"]
