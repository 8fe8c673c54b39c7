"""rollout.max_staleness=k: the engines generate the next k steps' batches while the current one trains."""

from __future__ import annotations

import json

import pytest
from cloudrl.trainer.config import ConfigError, load_config
from cloudrl.trainer.driver import train
from runs import REWARD_RISES, TINY_STRAIGHT_STEPS, first_and_last_means, tiny_overrides


def _rows(run_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["step"] > 0}


@pytest.mark.parametrize(
    "override, expected",
    [
        ("placement.rollout_in_actor=true", "placement.rollout_in_actor=false"),
        ("placement.colocate_all=true", "placement.colocate_all=false"),
        ("rollout.sleep_between_rollouts=true", "rollout.sleep_between_rollouts=false"),
        ("rollout.max_staleness=5", "rollout.max_staleness"),
    ],
)
def test_what_cannot_overlap_is_refused(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config("local", ["rollout.max_staleness=1", override])


def test_batches_more_than_one_step_ahead_refuse_dynamic_sampling():
    """A step's refill draws prompts only once its scores are in: batches started two steps ahead would
    have taken those prompts already."""
    base = ["algorithm.name=grpo", "algorithm.dynamic_sampling=true"]
    load_config("local", [*base, "rollout.max_staleness=1"])
    with pytest.raises(
        ConfigError, match="rollout.max_staleness=2 starts batches 2 steps ahead.*dynamic_sampling=false"
    ):
        load_config("local", [*base, "rollout.max_staleness=2"])


@pytest.mark.ray
@pytest.mark.parametrize("lag, partial", [(1, False), (2, False), (2, True)], ids=["lag1", "lag2", "lag2-partial"])
def test_lagging_run_learns(ray_local, tmp_path, lag, partial):
    """`lag` batches in flight: trained on samples `lag` policy versions old (importance-weighted), the
    reward still rises as in the run that generates in turn (tests/loop/test_trainer.py). With partial
    rollouts (rollout.partial, one token a segment) every batch ahead is generated in segments that look for
    new weights: it learns as well, and no token is more than `lag` versions old. On this task a batch is
    generated before the update ends, so the pushes find it done (rollout/partial_samples 0); a push that lands
    mid-batch is test_partial_rollouts.py's."""
    overrides = {
        **REWARD_RISES,
        "algorithm.name": "grpo",
        "algorithm.grpo_norm_by_std": "false",
        "rollout.max_staleness": lag,
        # A lagging batch was sampled one update ago. At the local preset's lr (2e-3) one update can move
        # the tiny policy's log-probs on the sampled tokens by several nats (rollout/logprob_diff 0.7-4.7),
        # so the truncated weights discard most samples and the run stalls; at 5e-4 the gap stays ~0.02.
        "actor.lr": "5e-4",
        "trainer.run_dir": tmp_path,
        "rollout.partial": str(partial).lower(),
    }
    train(load_config("local", [f"{k}={v}" for k, v in overrides.items()]))
    rows = _rows(tmp_path)
    rewards = [rows[s]["rollout/reward_mean"] for s in sorted(rows)]
    first, last = first_and_last_means(rewards)
    assert last > first + 0.04, (first, last, rewards)
    # the first step generates in turn; from the (lag+1)-th every batch was started lag updates ago
    assert [rows[s]["rollout/policy_lag"] for s in sorted(rows)] == [*range(lag), *[lag] * (len(rows) - lag)]
    lagged = [rows[s] for s in sorted(rows)[1:]]
    assert all(r["rollout/is_weight_mean"] > 0 for r in lagged)
    assert any(abs(r["rollout/is_weight_mean"] - 1) > 1e-4 for r in lagged), "old samples, yet weights of 1"
    assert all(r["rollout/staleness_max"] <= lag for r in rows.values())
    assert all(("rollout/partial_samples" in r) == partial for r in lagged)
    # what overlapped: the engines' wait for weights, the actor's time between updates
    assert all(r["timing/engine_weight_wait"] >= 0 and r["timing/actor_between_updates"] >= 0 for r in lagged[1:])


@pytest.mark.ray
def test_without_lag_the_queue_changes_nothing(ray_local, tiny_straight_run, tmp_path):
    """max_staleness=1 with a checkpoint after every step never has a batch in flight: it must equal the
    run that generates in turn (the shared tiny straight run: the same importance weighting, a checkpoint
    after every step), metric for metric."""
    queued = tmp_path / "queued"
    train(load_config("local", tiny_straight_run.overrides(queued, **{"rollout.max_staleness": 1})))
    a, b = _rows(tiny_straight_run.run_dir), _rows(queued)
    assert sorted(a) == sorted(b) == list(range(1, TINY_STRAIGHT_STEPS + 1))
    for step in sorted(a):
        assert b[step]["rollout/policy_lag"] == 0
        for key in ("rollout/reward_mean", "rollout/response_length", "actor/pg_loss", "critic/vf_loss"):
            assert a[step][key] == b[step][key], (step, key)


@pytest.mark.ray
def test_resumed_lagging_run_matches_the_uninterrupted_one(ray_local, tmp_path):
    """Two batches in flight (rollout.max_staleness=2), a checkpoint after step 3. No batch is started ahead of
    a step that checkpoints, so the step after it starts from the saved weights, in the straight run as in
    the resumed one: steps 4 to 6 (5 and 6 sampled while 4 and 5 trained) come out the same."""
    # No reward workers (reward.in_driver): the rewards are scored by the same code in the driver.
    common = {"trainer.save_every": 3, "trainer.keep_last": 5, "rollout.max_staleness": 2, "reward.in_driver": "true"}
    train(load_config("local", tiny_overrides(tmp_path / "straight", **common, **{"trainer.total_steps": 6})))
    train(load_config("local", tiny_overrides(tmp_path / "resumed", **common, **{"trainer.total_steps": 3})))
    summary = train(
        load_config(
            "local",
            tiny_overrides(tmp_path / "resumed", **common, **{"trainer.total_steps": 6, "trainer.resume": "auto"}),
        )
    )
    assert summary["resumed_from"] == 3
    straight, resumed = _rows(tmp_path / "straight"), _rows(tmp_path / "resumed")
    assert [straight[s]["rollout/policy_lag"] for s in range(1, 7)] == [0, 1, 2, 0, 1, 2]
    for step in (4, 5, 6):
        for key in ("rollout/reward_mean", "rollout/response_length", "actor/pg_loss", "rollout/is_weight_mean"):
            assert resumed[step][key] == straight[step][key], (step, key)
    for row in straight.values():
        assert row["timing/rollout_wait"] >= 0 and row["timing/sync"] > 0 and row["timing/step"] > 0
