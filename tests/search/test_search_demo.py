"""bench/search_r1.py, the Search-R1 demo, without its PPO run: every phase says what it does (the warm-up
with a count), and every path its summary names still exists once it has ended, also on a second run into
the same directory. The trainer is replaced by a stand-in that writes what a run writes; the PPO run
itself is tests/search/test_search_task.py::test_the_policy_learns_to_search."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from cloudrl.trainer import driver

REPO = Path(__file__).resolve().parents[2]


def load_demo():
    spec = importlib.util.spec_from_file_location("search_r1_demo", REPO / "bench" / "search_r1.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_train(cfg) -> dict:
    """What a 2-step run leaves in trainer.run_dir, and the summary train() returns."""
    run = Path(cfg.trainer.run_dir)
    ckpt = run / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (run / "config.yaml").write_text(cfg.to_yaml())
    row = {"rollout/reward_mean": 0.5, "search/searches_per_sample": 0.25}
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, **row}) + "\n" for s in (1, 2)))
    return {
        "val_reward_before_rl": 0.1,
        "val_reward_after_rl": 0.9,
        "checkpoint": str(ckpt),
        "metrics": str(run / "metrics.jsonl"),
    }


def test_the_demo_says_what_it_does_and_its_summary_names_paths_that_exist(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(driver, "train", fake_train)
    demo = load_demo()
    args = ["--size", "24", "--val-size", "4", "--warmup-steps", "3", "--steps", "2", "--out", str(tmp_path / "d")]
    for attempt in range(2):  # the second run replaces the first one's files instead of resuming its run
        files = demo.main(args)
        out = capsys.readouterr().out
        summary = out.split("files (kept; the next run replaces them):\n")[1].splitlines()
        assert len(summary) == len(files) >= 6
        for label, path in files.items():
            assert path.exists(), f"{label}: {path}"
            assert path.is_relative_to(tmp_path / "d") and f"  {path}" in out
        phases = [line for line in out.splitlines() if line.startswith("search demo: ")]
        assert any("indexing 28 facts" in line for line in phases)
        assert any("warm-up step 3/3, loss" in line for line in phases)
        assert any("training: 2 PPO steps" in line for line in phases)
        assert ("replacing the previous demo's" in out) == (attempt == 1)


def test_the_warm_up_reports_every_step(tmp_path):
    from cloudrl.trainer.agents.search_task import warm_up_model
    from cloudrl.trainer.inputs.demo import WarmUp

    seen = []
    warm_up_model(
        tmp_path / "m", schedule=WarmUp(steps=3, batch_size=2), progress=lambda step, loss: seen.append((step, loss))
    )
    assert [step for step, _ in seen] == [1, 2, 3] and all(loss > 0 for _, loss in seen)
