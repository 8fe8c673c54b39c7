"""reward.url in a real run: the reward workers send every rollout's samples to the reference reward server
(trainer/inputs/reward_server.py) on 127.0.0.1, and its scores are the rewards the step trains on."""

from __future__ import annotations

import threading

import pytest
from cloudrl.trainer.config import load_config
from cloudrl.trainer.driver import train
from cloudrl.trainer.inputs.reward_server import RewardServer
from runs import ROLLOUT_IN_ACTOR, WITHOUT_CRITIC, metric_rows, tiny_overrides

pytestmark = pytest.mark.ray


def test_the_reward_workers_score_through_the_server(ray_local, tmp_path):
    seen: list[dict] = []

    def scorer(items: list[dict]) -> list[float]:
        seen.extend(items)
        # 1 for a response holding the prompt's answer, else 0.25: a score only the server knows.
        return [1.0 if str(i["ground_truth"]) in i["response"] else 0.25 for i in items]

    server = RewardServer(("127.0.0.1", 0), scorer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/score"
        extra = {"trainer.total_steps": 1, "reward.function": "none", "reward.url": url}
        overrides = tiny_overrides(tmp_path, **extra, **WITHOUT_CRITIC, **ROLLOUT_IN_ACTOR)  # actor, reward workers
        train(load_config("local", overrides))
    finally:
        server.shutdown()
        server.server_close()
    cfg = load_config("local", overrides)
    samples = cfg.data.train_batch_size * cfg.rollout.n
    assert len(seen) >= samples  # the step's samples, and the validation passes' greedy answers
    assert all(set(item) >= {"prompt", "response", "ground_truth"} for item in seen), seen[:2]
    (row,) = [r for r in metric_rows(tmp_path) if r["step"] == 1 and "rollout/reward_mean" in r]
    # Each sample scored 1 or 0.25 by the server alone (reward.function=none scores 0): the mean is the
    # server's over `samples` of them.
    correct = (row["rollout/reward_mean"] - 0.25) / 0.75 * samples
    assert row["rollout/reward_mean"] >= 0.25 and correct == pytest.approx(round(correct), abs=1e-4), row
