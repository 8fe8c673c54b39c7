"""Stopping a run by signal. Ctrl+C (SIGINT) on `python -m cloudrl.trainer` stops as SIGTERM does: one
line, the step in flight finishes and is checkpointed, exit 130 (SIGTERM: 1), no KeyboardInterrupt
traceback. A second signal, or a step that does not finish within the grace time, ends the process at once
with one line. The real trainer's stop, its checkpoint and the resume that logs each step once are
tests/loop/test_recovery.py's."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest
from runs import REPO

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


# A trainer's stop as `python -m cloudrl.trainer` makes it: the signal asks, the step "finishes", the run
# saves it (a stand-in trainer: the real one is tests/loop/test_recovery.py's Ray run) and main() exits.
STOPPED = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from cloudrl.trainer import __main__ as entry
    from cloudrl.trainer.recovery import StopRequest

    class Trainer:
        global_step = 3

        def save_checkpoint(self):
            return Path("run/checkpoints/step_000003")

    def train(cfg):
        with StopRequest(grace_s=600) as stop:
            print("ready", flush=True)
            while not stop.requested:
                time.sleep(0.05)
            stop.checkpoint_and_stop(Trainer(), None)

    import cloudrl.trainer.driver as driver
    driver.train = train
    sys.exit(entry.main(["--preset", "local"]))
    """
)


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 1)])
def test_ctrl_c_stops_after_the_step_with_one_line_and_exit_130(sig, code):
    proc = subprocess.Popen(
        [sys.executable, "-c", STOPPED], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    head = [proc.stdout.readline().strip() for _ in range(2)]  # the config line, then the stand-in's
    assert head[0].startswith("cloudrl trainer: 0 config key(s) differ from the preset local") and head[1] == "ready"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    name = signal.Signals(sig).name
    assert proc.returncode == code, err
    assert out.strip().startswith(f"received {name}: finishing the step in flight")
    assert err.strip().splitlines() == [
        f"error: stopped by {name} after step 3, checkpointed in run/checkpoints/step_000003: resubmit the same "
        f"config with trainer.resume=auto to continue from the latest checkpoint"
    ]
