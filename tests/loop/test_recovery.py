"""Preemption: SIGTERM (what `cloudrl stop` -> Ray's job stop sends the driver; Ctrl+C's SIGINT takes the
same path, tests/loop/test_signals.py) lets the step in flight finish, checkpoints it and ends the run with
one line; the checkpoint resumes, and metrics.jsonl holds each step once."""

from __future__ import annotations

import json
import os
import signal

import pytest
from cloudrl.trainer.state import checkpoint, layout, timeline
from runs import (
    REWARD_IN_DRIVER,
    ROLLOUT_IN_ACTOR,
    logged_steps,
    run_trainer,
    start_trainer,
    tiny_overrides,
    wait_for_step,
)

pytestmark = pytest.mark.ray


def test_sigterm_during_a_step_leaves_a_checkpoint_of_that_step_and_the_resume_logs_each_step_once(ray_local, tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "driver.log"
    extra = {"trainer.total_steps": 50, "trainer.save_every": 0, "trainer.export_hf": "false"}
    extra |= {**ROLLOUT_IN_ACTOR, **REWARD_IN_DRIVER}  # the two trained roles, which the checkpoint holds
    proc = start_trainer(run_dir, log, ray_local, **extra)
    try:
        done = wait_for_step(proc, run_dir, log)
        assert not layout.list_checkpoints(str(run_dir))  # save_every=0: none until the end
        proc.send_signal(signal.SIGTERM)  # the driver only, as Ray's job stop does
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    text = log.read_text()
    last = max(logged_steps(run_dir))
    assert done <= last < 50, text[-3000:]  # the step in flight finished, no further one started
    latest = timeline.latest(str(run_dir))
    assert latest is not None and latest.name == f"step_{last:06d}", text[-3000:]
    assert checkpoint.load(latest, ["actor", "critic"]).state["step"] == last
    assert code == 1
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert lines == [
        f"error: stopped by SIGTERM after step {last}, checkpointed in {latest}: resubmit the same "
        f"config with trainer.resume=auto to continue from the latest checkpoint"
    ], text[-3000:]
    assert "Traceback" not in text

    # A step logged after the checkpoint by a process then killed before saving it (a second signal, a lost
    # node), and a line cut short: the resumed run logs that step again, and only its own row remains.
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": last + 1, "time": 0.0, "rollout/reward_mean": -1.0}) + "\n")
        f.write('{"step": ')
    resumed = run_trainer(
        "--preset",
        "local",
        *tiny_overrides(run_dir, **{**extra, "trainer.total_steps": last + 1}),
        env={"RAY_ADDRESS": ray_local},
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {latest} at step {last}" in resumed.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)) and steps[-1] == last + 1, steps
    assert rows[-1]["rollout/reward_mean"] != -1.0  # the resumed run's own row, not the planted one
