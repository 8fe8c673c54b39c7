"""Preemption: SIGTERM (what `cloudrl stop` -> Ray's job stop sends the driver) lets the step in flight
finish, checkpoints it and ends the run with one line; the checkpoint resumes."""

from __future__ import annotations

import os
import signal

import pytest
from cloudrl.trainer.state import checkpoint
from runs import logged_steps, start_trainer, wait_for_step

pytestmark = pytest.mark.ray


def test_sigterm_during_a_step_leaves_a_checkpoint_of_that_step(ray_local, tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "driver.log"
    proc = start_trainer(
        run_dir, log, ray_local, **{"trainer.total_steps": 50, "trainer.save_every": 0, "trainer.export_hf": "false"}
    )
    try:
        done = wait_for_step(proc, run_dir, log)
        assert not checkpoint.list_checkpoints(str(run_dir))  # save_every=0: none until the end
        proc.send_signal(signal.SIGTERM)  # the driver only, as Ray's job stop does
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    text = log.read_text()
    last = max(logged_steps(run_dir))
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
