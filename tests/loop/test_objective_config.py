"""The objective's keys in the config: per-algorithm KL defaults, the refusals of combinations that cannot
work, the new keys' ranges and `--help-config` lines, and the gspo preset (no Ray, no subprocess)."""

from __future__ import annotations

import pytest
from cloudrl.trainer.config import ConfigError, config_from_dict, describe_keys, load_config


def _kl(*overrides: str) -> tuple[str, str]:
    a = load_config("local", list(overrides)).algorithm
    return a.kl_mode, a.kl_estimator


@pytest.mark.parametrize(
    "name, expected",
    [
        ("ppo", ("reward", "k1")),
        ("reinforce_pp", ("reward", "k1")),
        ("rloo", ("reward", "k1")),
        ("grpo", ("loss", "k3")),
        ("reinforce_pp_baseline", ("loss", "k3")),
    ],
)
def test_each_algorithm_gets_its_kl_defaults(name: str, expected: tuple[str, str]) -> None:
    assert _kl(f"algorithm.name={name}") == expected


def test_explicit_kl_keys_win_whatever_their_order() -> None:
    assert _kl("algorithm.kl_mode=reward", "algorithm.name=grpo", "algorithm.kl_coef=0") == ("reward", "k1")
    assert _kl("algorithm.name=grpo", "algorithm.kl_estimator=k2") == ("loss", "k2")
    assert _kl("algorithm.kl_estimator=k2", "algorithm.name=grpo") == ("loss", "k2")
    assert _kl("algorithm.name=grpo", "algorithm.name=ppo") == ("reward", "k1")
    assert _kl("algorithm.kl_mode=loss") == ("loss", "k3")


def test_a_preset_file_sets_kl_keys_explicitly_too(tmp_path) -> None:
    preset = tmp_path / "p.yaml"
    preset.write_text("algorithm:\n  kl_mode: reward\n  kl_estimator: k2\n  grpo_norm_by_std: false\n")
    a = load_config(str(preset), ["algorithm.name=grpo"]).algorithm
    assert (a.kl_mode, a.kl_estimator) == ("reward", "k2")


def test_a_saved_config_comes_back_as_saved() -> None:
    cfg = load_config(
        "local", ["algorithm.name=grpo", "algorithm.kl_estimator=k2", "actor.loss_agg_mode=seq-mean-token-sum"]
    )
    again = config_from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    "overrides, parts",
    [
        (
            ["algorithm.name=grpo", "algorithm.kl_mode=reward"],
            ["algorithm.kl_mode=reward", "algorithm.name=grpo", "algorithm.kl_mode=loss", "grpo_norm_by_std=false"],
        ),
        (["actor.policy_loss=cispo", "actor.dual_clip=3"], ["actor.dual_clip", "actor.policy_loss=cispo"]),
        (["algorithm.overlong_buffer=5"], ["algorithm.overlong_buffer=5", "rollout.max_new_tokens=4"]),
        (
            ["search.enabled=true", "rollout.max_episode_tokens=8", "algorithm.overlong_buffer=9"],
            ["rollout.max_episode_tokens=8"],
        ),
        (["algorithm.overlong_buffer=2", "algorithm.overlong_penalty=0"], ["algorithm.overlong_penalty > 0"]),
        (["algorithm.overlong_buffer=-1"], ["algorithm.overlong_buffer must be >= 0"]),
        (["algorithm.overlong_penalty=-1"], ["algorithm.overlong_penalty must be >= 0"]),
        (["actor.loss_agg_mode=seq-mean"], ["actor.loss_agg_mode='seq-mean' is not one of token-mean"]),
        (["actor.policy_loss=gpso"], ["did you mean gspo?"]),
    ],
)
def test_bad_objective_combinations_are_one_line(overrides: list[str], parts: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("local", overrides)
    message = str(err.value)
    assert "\n" not in message
    assert not [p for p in parts if p not in message], message


def test_working_combinations_load() -> None:
    load_config("local", ["algorithm.name=grpo", "algorithm.kl_mode=reward", "algorithm.grpo_norm_by_std=false"])
    load_config("local", ["algorithm.name=grpo", "algorithm.kl_mode=reward", "algorithm.kl_coef=0"])
    load_config("local", ["algorithm.overlong_buffer=4", "algorithm.mask_truncated=true"])
    for loss in ("ppo", "gspo", "cispo"):
        for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
            load_config("local", [f"actor.policy_loss={loss}", f"actor.loss_agg_mode={mode}"])


def test_help_config_lists_the_new_keys() -> None:
    lines = {line.split(" = ")[0].strip(): line for line in describe_keys().splitlines() if " = " in line}
    assert "One of: ppo, gspo, cispo." in lines["actor.policy_loss"]
    assert (
        "One of: token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm."
        in (lines["actor.loss_agg_mode"])
    )
    for key in ("algorithm.mask_truncated", "algorithm.overlong_buffer", "algorithm.overlong_penalty"):
        assert key in lines
    assert "Unless set" in lines["algorithm.kl_mode"]


def test_gspo_preset() -> None:
    cfg = load_config("gspo")
    assert (cfg.algorithm.name, cfg.actor.policy_loss, cfg.actor.loss_agg_mode) == (
        "grpo",
        "gspo",
        "seq-mean-token-mean",
    )
    assert (cfg.actor.clip_low, cfg.actor.clip_high) == (3e-4, 4e-4)
    assert (cfg.algorithm.kl_mode, cfg.algorithm.kl_estimator) == ("loss", "k3")
    assert cfg.trainer.run_dir == "runs/gspo"


def test_choosing_gspo_sets_the_papers_clip_range_and_aggregation_unless_set() -> None:
    """GSPO's ratio is a sequence's geometric mean: token-level PPO's 0.2 would clip almost nothing."""
    from cloudrl.trainer.config_checks import start_warnings

    a = load_config("local", ["actor.policy_loss=gspo"]).actor
    assert (a.clip_low, a.clip_high, a.loss_agg_mode) == (3e-4, 4e-4, "seq-mean-token-mean")
    # Keys set anywhere win, whatever their order; ppo and cispo keep the code's defaults.
    a = load_config("local", ["actor.clip_high=0.2", "actor.policy_loss=gspo", "actor.loss_agg_mode=token-mean"]).actor
    assert (a.clip_low, a.clip_high, a.loss_agg_mode) == (3e-4, 0.2, "token-mean")
    for loss in ("ppo", "cispo"):
        a = load_config("local", [f"actor.policy_loss={loss}"]).actor
        assert (a.clip_low, a.clip_high, a.loss_agg_mode) == (0.2, 0.2, "token-mean")
    # A wide range set by hand is allowed, and said at start.
    (line,) = start_warnings(load_config("local", ["actor.policy_loss=gspo", "actor.clip_high=0.2"]))
    assert "actor.policy_loss=gspo" in line and "actor.clip_high=0.2" in line and "3e-4 and 4e-4" in line
    assert start_warnings(load_config("gspo")) == start_warnings(load_config("local", ["actor.policy_loss=gspo"])) == []


def test_cispo_may_bound_its_weight_from_above_only() -> None:
    """clip_low=1 leaves the weight's lower bound at 0 (ratios are positive): CISPO's usual choice."""
    assert load_config("local", ["actor.policy_loss=cispo", "actor.clip_low=1"]).actor.clip_low == 1.0
    with pytest.raises(ConfigError, match=r"actor.clip_low must be in \(0, 1\]"):
        load_config("local", ["actor.clip_low=1.5"])
