"""The trainer with search rollouts on a real local Ray instance: the rollout worker runs the turn
loop, the driver passes the loss mask and the per-step search metrics through. The tiny model is not
taught to search here (bench/search_r1.py is the run where it learns to); this checks the wiring."""

from __future__ import annotations

import json
import threading

import pytest

from cloudrl.trainer.config import load_config
from cloudrl.trainer.driver import train

from conftest import tiny_overrides

pytestmark = pytest.mark.ray


def test_ppo_steps_with_search_rollouts(ray_local, tmp_path):
    pytest.importorskip("bm25s")
    from cloudrl.trainer.retriever_server import RetrieverServer, build_index, load_index

    (tmp_path / "corpus.jsonl").write_text(json.dumps({"contents": "Addition\ntwo plus two makes four"}) + "\n")
    build_index(tmp_path / "corpus.jsonl", tmp_path / "index")
    server = RetrieverServer(("127.0.0.1", 0), load_index(tmp_path / "index"))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = load_config("local", tiny_overrides(
            tmp_path / "run", **{"search.enabled": "true", "search.url": f"http://127.0.0.1:{server.server_port}/retrieve",
                                 "search.max_response_tokens": 64, "rollout.max_new_tokens": 8,
                                 "trainer.export_hf": "false"}))
        train(cfg)
    finally:
        server.shutdown()
        server.server_close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) > 0 and "rollout/reward_mean" in r]
    assert len(steps) == 2
    for row in steps:
        assert row["search/turns_per_sample"] >= 1.0 and row["search/valid_call_rate"] <= 1.0
        assert row["search/observation_tokens"] >= 0.0 and "actor/pg_loss" in row
