"""`cloudrl submit --follow` through a whole-cluster restart: the CLI waits for the cluster to come back
at the same address and submits the job again, which continues from its latest checkpoint.

The cluster is a real one (`cloudrl local up`), stopped with `cloudrl local down` mid-run and started
again on the same dashboard port, as a restarted dstack run comes back behind the same forwarded port.
The run directory is on this machine's disk, which both clusters see, as the dstack task's volume is.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
from cli_helpers import CLOUDRL, cli_env, free_port, local_state, pids_alive, process_tree, run_cli, stop_on_exit

pytestmark = pytest.mark.ray
WAITING = "waiting up to 240 s for the cluster to answer again"


def _up(env: dict, port: int) -> list[int]:
    up = run_cli(["local", "up", "--nodes", "1", "--dashboard-port", str(port), "--timeout", "150"], env, timeout=200)
    assert up.returncode == 0, up.stdout + up.stderr
    state = local_state(Path(env["CLOUDRL_CACHE"]))
    assert state["dashboard_url"].endswith(f":{port}"), up.stdout
    return [p for node in state["nodes"] for p in process_tree(node["pid"])]


def test_follow_resubmits_after_the_cluster_restarts(tmp_path: Path) -> None:
    env = cli_env(tmp_path / "cache")
    port, run_dir = free_port(), tmp_path / "run"
    started: list[int] = []
    try:
        started += _up(env, port)
        cmd = [
            CLOUDRL,
            "submit",
            "--local",
            "--follow",
            "--reconnect-wait",
            "240",
            "--name",
            "restarted",
            "trainer.total_steps=16",
            "trainer.save_every=2",
            "trainer.keep_last=3",
            "trainer.val_every=0",
            "model.sft_warmup_steps=0",
            "trainer.loggers=[jsonl]",
            "trainer.export_hf=false",
            f"trainer.run_dir={run_dir}",
        ]
        with stop_on_exit(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ) as follow:
            deadline = time.monotonic() + 240
            while not (run_dir / "checkpoints" / "step_000004").exists():
                assert follow.poll() is None and time.monotonic() < deadline, "no checkpoint at step 4"
                time.sleep(0.5)
            down = run_cli(["local", "down"], env, timeout=120)
            assert down.returncode == 0, down.stdout + down.stderr
            saved = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
            lines = []  # the follower's output as it comes: it must be waiting before the cluster is back
            reader = threading.Thread(target=lambda: lines.extend(follow.stdout), daemon=True)
            reader.start()
            deadline = time.monotonic() + 120
            while not any(WAITING in line for line in lines):
                assert follow.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
                time.sleep(0.2)
            started += _up(env, port)
            follow.wait(timeout=400)
            reader.join(timeout=30)
            out = "".join(lines)
        assert follow.returncode == 0, out[-3000:]
        assert "submitted it again as restarted-r1" in out
        assert out.rstrip().endswith("job restarted-r1 SUCCEEDED")
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == 16 and summary["resumed_from"] >= saved >= 4, (summary, saved)
    finally:
        run_cli(["local", "down"], env, timeout=120)
        for pid in pids_alive(started):
            subprocess.run(["kill", "-9", str(pid)], check=False)
