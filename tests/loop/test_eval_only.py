"""Evaluation: the validation table's layout (fast), and `trainer.eval_only=true` end to end on a real
local Ray instance: it scores the plain model and then a trained run's latest checkpoint on two named
validation sets with n samples per prompt, writes run_dir/eval.json and leaves the run's files alone."""

from __future__ import annotations

import json

import pytest
from cloudrl.trainer.config import describe_keys, load_config
from cloudrl.trainer.driver import train
from cloudrl.trainer.metrics import format_eval_table
from runs import TINY_STRAIGHT_STEPS, metric_rows


def test_eval_table_has_a_row_per_set_and_a_column_per_statistic() -> None:
    metrics = {
        "val/reward_mean": 0.5,
        "val/pass@2": 0.75,
        "val/hard/reward_mean": 0.25,
        "val/hard/pass@2": 0.5,
    }
    lines = format_eval_table("runs/x/checkpoints/step_000002", 2, metrics).splitlines()
    assert lines[0] == "evaluation of runs/x/checkpoints/step_000002 (step 2)"
    assert lines[1].split() == ["set", "reward_mean", "pass@2"]
    assert lines[2].split() == ["val", "0.5", "0.75"]
    assert lines[3].split() == ["hard", "0.25", "0.5"]


def test_the_eval_only_flag_is_the_key() -> None:
    from cloudrl.trainer.__main__ import parse_args

    assert parse_args(["--preset", "dapo", "--eval-only"]).eval_only
    assert not parse_args(["--preset", "dapo"]).eval_only


def test_help_config_names_each_numeric_keys_range() -> None:
    lines = {line.split(" = ")[0].strip(): line for line in describe_keys().splitlines() if " = " in line}
    assert lines["reward.timeout_s"].endswith("Range: >= 0.")
    assert lines["trainer.val_temperature"].endswith("Range: > 0.")
    assert "Range" not in lines["actor.policy_loss"]  # a choice, not a number: "One of: ..."


@pytest.mark.ray
def test_eval_only_scores_the_model_then_the_latest_checkpoint(ray_local, tiny_straight_run, tmp_path) -> None:
    """The trained run is the shared tiny straight run (4 steps, a checkpoint after each, validation on the
    sets `small` and `again`, the same 3 prompts, with trainer.val_n=4 and val_temperature=0.7)."""
    eval_only = {"trainer.eval_only": "true"}
    fresh = tmp_path / "fresh"
    plain = train(load_config("local", tiny_straight_run.overrides(fresh, **eval_only)))
    assert plain["model"] == "builtin:tiny" and plain["step"] == 0
    assert not (fresh / "config.yaml").exists() and not (fresh / "checkpoints").exists()

    run_dir = tiny_straight_run.copy(tmp_path / "run")
    trained_rows = metric_rows(run_dir)
    config_before = (run_dir / "config.yaml").read_text()
    result = train(load_config("local", tiny_straight_run.overrides(run_dir, **eval_only)))
    assert result["step"] == TINY_STRAIGHT_STEPS and result["model"].endswith(f"step_{TINY_STRAIGHT_STEPS:06d}")
    assert result["model"].startswith(str(run_dir))  # the copy's checkpoint, not the shared run's
    m = result["metrics"]
    for prefix in ("val/", "val/small/", "val/again/"):  # the built-in set, then the named ones
        for stat in ("reward_mean", "mean@4", "pass@1", "pass@2", "pass@4", "response_length_p90", "truncated"):
            assert 0 <= m[prefix + stat] <= 4, (prefix, stat)
        assert m[prefix + "pass@1"] <= m[prefix + "pass@2"] <= m[prefix + "pass@4"]
    assert m["val/small/mean@4"] == m["val/again/mean@4"]  # the same prompts, the same seeds
    # The training run's own last validation used the same weights and settings.
    assert m["val/small/reward_mean"] == pytest.approx(trained_rows[-1]["val/small/reward_mean"])
    assert json.loads((run_dir / "eval.json").read_text())["metrics"] == m
    assert (run_dir / "config.yaml").read_text() == config_before and metric_rows(run_dir) == trained_rows
