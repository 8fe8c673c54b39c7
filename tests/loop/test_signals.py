"""Stopping a run by signal. Ctrl+C (SIGINT) on `python -m cloudrl.trainer` stops as SIGTERM does: one
line, the step in flight finishes and is checkpointed, exit 130, no KeyboardInterrupt traceback; the run
then resumes with one metrics row per step. A second signal, or a step that does not finish within the
grace time, ends the process at once with one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from cloudrl.trainer.state import checkpoint
from runs import REPO, logged_steps, start_trainer, tiny_overrides, wait_for_step

# A process inside StopRequest whose "step" never finishes.
HUNG = textwrap.dedent(
    """
    import sys, time
    from cloudrl.trainer.recovery import StopRequest
    with StopRequest(grace_s=float(sys.argv[1])):
        print("ready", flush=True)
        while True:
            time.sleep(0.05)
    """
)


def _hung(grace_s: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HUNG, str(grace_s)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_stops_at_once_with_one_line(second):
    proc = _hung(grace_s=600)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None  # the first one only asks
    start = time.monotonic()
    proc.send_signal(second)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - start < 10
    assert proc.returncode == 128 + second
    assert out.strip().startswith("received SIGINT: finishing the step in flight, then checkpointing it")
    name = signal.Signals(second).name
    assert err.strip().splitlines() == [
        f"error: received {name} again: stopped at once, without saving the step in flight; the latest "
        f"checkpoint is kept: resubmit the same config with trainer.resume=auto to continue from the latest checkpoint"
    ]


def test_a_step_that_never_finishes_ends_after_the_grace_time():
    proc = _hung(grace_s=2)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - start
    assert 1.5 < took < 20, took
    assert proc.returncode == 128 + signal.SIGTERM
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the step in flight did not finish within 2s of SIGTERM")


@pytest.mark.ray
def test_ctrl_c_checkpoints_the_step_in_flight_and_the_resume_logs_each_step_once(ray_local, tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": ray_local, "PYTHONUNBUFFERED": "1"}
    extra = {"trainer.total_steps": 50, "trainer.save_every": 0, "trainer.export_hf": "false"}
    log = tmp_path / "driver.log"
    proc = start_trainer(run_dir, log, ray_local, **extra)
    try:
        wait_for_step(proc, run_dir, log)
        proc.send_signal(signal.SIGINT)  # what Ctrl+C in the terminal sends the driver
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    text = log.read_text()
    last = max(logged_steps(run_dir))
    latest = checkpoint.latest(str(run_dir))
    assert code == 130, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert latest is not None and latest.name == f"step_{last:06d}", text[-3000:]
    assert [line for line in text.splitlines() if line.startswith("error:")] == [
        f"error: stopped by SIGINT after step {last}, checkpointed in {latest}: resubmit the same "
        f"config with trainer.resume=auto to continue from the latest checkpoint"
    ], text[-3000:]
    assert sum(line.startswith("received SIGINT:") for line in text.splitlines()) == 1

    # A step logged after the checkpoint by a process that was then killed before saving it (a second
    # signal, a lost node): the resumed run logs that step again, and only its own row may remain.
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": last + 1, "time": 0.0, "rollout/reward_mean": -1.0}) + "\n")
        f.write('{"step": ')  # and a line cut short
    extra["trainer.total_steps"] = last + 1
    resumed = subprocess.run(
        [sys.executable, "-m", "cloudrl.trainer", "--preset", "local", *tiny_overrides(run_dir, **extra)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {latest} at step {last}" in resumed.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)) and steps[-1] == last + 1, steps
    assert rows[-1]["rollout/reward_mean"] != -1.0  # the resumed run's own row, not the planted one
