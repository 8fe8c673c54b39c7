"""Preemption: SIGTERM (what `cloudrl stop` -> Ray's job stop sends the driver) lets the step in flight
finish, checkpoints it and ends the run with one line; the checkpoint resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from cloudrl.trainer.state import checkpoint
from runs import REPO, tiny_overrides

pytestmark = pytest.mark.ray


def _steps(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def test_sigterm_during_a_step_leaves_a_checkpoint_of_that_step(ray_local, tmp_path):
    run_dir = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "cloudrl.trainer",
        "--preset",
        "local",
        *tiny_overrides(run_dir, **{"trainer.total_steps": 50, "trainer.save_every": 0, "trainer.export_hf": "false"}),
    ]
    log = tmp_path / "driver.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            args,
            cwd=REPO,
            env={**os.environ, "RAY_ADDRESS": ray_local, "PYTHONUNBUFFERED": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.time() + 300
        while max(_steps(run_dir), default=0) < 1 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        done = max(_steps(run_dir), default=0)
        assert done >= 1, f"no step in time; driver log:\n{log.read_text()[-3000:]}"
        assert not checkpoint.list_checkpoints(str(run_dir))  # save_every=0: none until the end
        proc.send_signal(signal.SIGTERM)  # the driver only, as Ray's job stop does
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    text = log.read_text()
    last = max(_steps(run_dir))
    assert done <= last < 50, text[-3000:]  # the step in flight finished, no further one started
    latest = checkpoint.latest(str(run_dir))
    assert latest is not None and latest.name == f"step_{last:06d}", text[-3000:]
    assert checkpoint.load(latest, ["actor", "critic"]).state["step"] == last
    assert code == 1
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert lines == [
        f"error: stopped by SIGTERM after step {last}, checkpointed in {latest}: resubmit the same "
        f"config with trainer.resume=auto to continue from the latest checkpoint"
    ], text[-3000:]
    assert "Traceback" not in text
