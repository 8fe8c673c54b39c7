"""Node loss inside a live cluster: a 2-node local Ray cluster (a `cloudrl local` head on 127.0.0.1 plus
one `ray start` worker node) trains with the actor and the critic spanning both nodes; the worker node's
processes are SIGKILLed mid-run and a replacement node joins (as a cloud would replace the instance).
The job finishes every step with no command from the user, from the latest checkpoint, and ends where a
run resumed by hand from that checkpoint ends."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from cloudrl.trainer.state import checkpoint, layout, timeline
from runs import REPO, local_cluster, start_worker_node, tiny_overrides, wait_nodes

pytestmark = pytest.mark.ray
CPUS = 4


def _sigkill_node(node: dict) -> None:
    """The node's `ray start`, raylet, agents and workers at once, as when its instance disappears."""
    leader = psutil.Process(node["pid"])
    procs = [leader] + leader.children(recursive=True)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=30)


def _driver(run_dir: Path, gcs: str, log: Path, **extra) -> subprocess.Popen:
    values = {
        "trainer.total_steps": 4,
        "trainer.save_every": 2,
        "trainer.keep_last": 10,
        "trainer.export_hf": "false",
        "actor.nodes": 2,
        "critic.nodes": 2,
        "trainer.restart_wait_s": 180,
        "placement.timeout_s": 120,
        **extra,
    }
    args = [sys.executable, "-m", "cloudrl.trainer", "--preset", "local", *tiny_overrides(run_dir, **values)]
    with open(log, "w") as out:
        return subprocess.Popen(
            args,
            cwd=REPO,
            env={**os.environ, "RAY_ADDRESS": gcs, "PYTHONUNBUFFERED": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _finish(proc: subprocess.Popen, timeout_s: float) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_a_lost_worker_node_is_replaced_and_the_run_finishes(private_cache, tmp_path):
    from cloudrl.cli.node_processes import stop_node

    nodes = []
    with local_cluster(nodes=1, cpus_per_node=CPUS, gpus_per_node=0) as state:
        try:
            nodes.append(start_worker_node(state, "w1", CPUS))
            wait_nodes(state, 2)
            run_dir, log = tmp_path / "auto", tmp_path / "auto.log"
            proc = _driver(run_dir, state["gcs_address"], log)
            deadline = time.time() + 400
            while not layout.list_checkpoints(str(run_dir)) and time.time() < deadline and proc.poll() is None:
                time.sleep(0.1)
            assert layout.list_checkpoints(str(run_dir)), f"no checkpoint in time:\n{log.read_text()[-3000:]}"
            placement = json.loads((run_dir / "placement.json").read_text())
            assert len({w["node_id"] for w in placement["actor"]}) == 2  # both roles span both nodes
            assert len({w["node_id"] for w in placement["critic"]}) == 2
            _sigkill_node(nodes[0])
            saved_at = int(timeline.latest(str(run_dir)).name.split("_")[1])
            nodes.append(start_worker_node(state, "w2", CPUS))  # the replacement instance
            code = _finish(proc, 500)
            text = log.read_text()
            assert code == 0, text[-4000:]
            lost = [line for line in text.splitlines() if line.startswith("lost ")]
            assert len(lost) == 1 and "restart 1 of trainer.max_restarts=3" in lost[0], text[-4000:]
            assert any(role in lost[0] for role in ("actor rank", "critic rank", "a node", "rollout", "reward")), lost
            summary = json.loads((run_dir / "summary.json").read_text())
            assert summary["steps"] == 4 and summary["resumed_from"] == saved_at < 4
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            assert {r["step"] for r in rows if r["step"] > 0} == {1, 2, 3, 4}
            assert [r["trainer/restarts"] for r in rows if r["step"] > saved_at][-1] == 1

            # By hand: the same checkpoint in a fresh run_dir, resumed with trainer.resume=auto.
            by_hand = tmp_path / "by-hand"
            source = layout.checkpoint_root(str(run_dir)) / f"step_{saved_at:06d}"
            shutil.copytree(source, layout.checkpoint_root(str(by_hand)) / source.name)
            hand_log = tmp_path / "by-hand.log"
            assert _finish(_driver(by_hand, state["gcs_address"], hand_log), 400) == 0, hand_log.read_text()[-3000:]
            final = f"step_{4:06d}"
            for role in ("actor", "critic"):
                a = checkpoint.read_full(layout.checkpoint_root(str(run_dir)) / final, role)["model"]
                b = checkpoint.read_full(layout.checkpoint_root(str(by_hand)) / final, role)["model"]
                for name, value in a.items():
                    torch.testing.assert_close(b[name], value, rtol=1e-5, atol=1e-6, msg=f"{role}: {name}")
        finally:
            for node in reversed(nodes):
                stop_node(node)
