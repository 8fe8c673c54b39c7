"""rollout.elastic's config: what it needs is checked before anything starts, one line naming the keys."""

from __future__ import annotations

import pytest
from cloudrl.trainer.config import ConfigError, load_config

ELASTIC = ["rollout.elastic=true", "rollout.max_engines=3"]


def test_engines_added_up_to_a_bound_above_the_start():
    cfg = load_config("local", ELASTIC)
    assert cfg.rollout.elastic and cfg.rollout.max_engines == 3
    with pytest.raises(ConfigError, match="not above rollout.num_engines=4: set rollout.max_engines to more than 4"):
        load_config("local", [*ELASTIC, "rollout.num_engines=4"])
    with pytest.raises(
        ConfigError, match="rollout.max_engines=3 bounds the engines rollout.elastic adds, which is off"
    ):
        load_config("local", ["rollout.max_engines=3"])
    with pytest.raises(ConfigError, match="rollout.max_engines must be >= 0"):
        load_config("local", ["rollout.elastic=true", "rollout.max_engines=-1"])


@pytest.mark.parametrize(
    "override, expected",
    [
        ("placement.rollout_in_actor=true", "placement.rollout_in_actor=true: the actor's own workers generate"),
        ("rollout.sleep_between_rollouts=true", "rollout.sleep_between_rollouts=true: engines that sleep share"),
        ("placement.colocate_all=true", "placement.colocate_all=true: the engines share the trainers' GPUs"),
    ],
)
def test_layouts_where_engines_are_not_their_own_are_refused(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config("local", [*ELASTIC, override])
