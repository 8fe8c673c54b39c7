"""The trainer with search rollouts on a real local Ray instance: the rollout worker runs the turn
loop, the driver passes the loss mask and the per-step search metrics through. The tiny model is not
taught to search here (bench/search_r1.py is the run where it learns to); this checks the wiring."""

from __future__ import annotations

import json

import pytest
from cloudrl.trainer.config import load_config
from cloudrl.trainer.driver import train
from runs import serving_retriever, step_metrics, tiny_overrides

pytestmark = pytest.mark.ray


def test_ppo_steps_with_search_rollouts(ray_local, tmp_path):
    pytest.importorskip("bm25s")
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"contents": "Addition\ntwo plus two makes four"}) + "\n")
    with serving_retriever(tmp_path / "corpus.jsonl", tmp_path / "index") as url:
        train(
            load_config(
                "local",
                tiny_overrides(
                    tmp_path / "run",
                    **{
                        "search.enabled": "true",
                        "search.url": url,
                        "rollout.max_episode_tokens": 64,
                        "rollout.max_new_tokens": 8,
                        "trainer.export_hf": "false",
                    },
                ),
            )
        )
    steps = step_metrics(tmp_path / "run")
    assert len(steps) == 2
    for row in steps:
        assert row["search/turns_per_sample"] >= 1.0 and row["search/valid_call_rate"] <= 1.0
        assert row["search/observation_tokens"] >= 0.0 and "actor/pg_loss" in row
