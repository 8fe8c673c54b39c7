"""A preemption notice inside a live cluster: a 2-node local Ray cluster (a `cloudrl local` head on 127.0.0.1 plus
one `ray start` worker node) trains with the actor and the critic spanning both nodes. The worker node's notice
watcher (tasks/ray_bringup.py `notices`, as the bootstrap starts it on every node) polls a stand-in for AWS's
metadata service; once the cloud announces the spot termination, the watcher drains the node, the trainer
checkpoints the step it is on, and its roles restart on the head and a replacement node from that very step.
The job finishes every step, each logged once, and no role runs on the preempted node again."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from runs import REPO, local_cluster, start_worker_node, wait_nodes
from servers import MetadataService, free_port
from test_recovery_node_loss import CPUS, _driver, _finish


def test_only_a_draining_node_that_holds_roles_is_left(monkeypatch):
    """In process, Ray's draining set stubbed at its edge: a node drained for a notice that holds none of the
    run's roles changes nothing; one that does is named with what it holds and the time it has left."""
    from cloudrl.trainer import recovery
    from ray._private.state import state

    places = [{"node_id": "a" * 56, "ip": "10.0.0.1"}, {"node_id": "b" * 56, "ip": "10.0.0.2"}]
    roles = SimpleNamespace(groups=lambda: [SimpleNamespace(name="actor", places=places)])
    monkeypatch.setattr(state, "get_draining_nodes", lambda: {"c" * 56: 0})
    assert recovery.preemption_notice(roles) is None
    monkeypatch.setattr(state, "get_draining_nodes", lambda: {"c" * 56: 0, "b" * 56: int((time.time() + 60) * 1000)})
    node_id, what = recovery.preemption_notice(roles)
    assert node_id == "b" * 56
    assert re.fullmatch(
        r"node 10\.0\.0\.2 \(id b{12}, held actor rank 1\) to a preemption notice \(it goes away in (59|60)s\)", what
    )


@pytest.mark.ray
def test_a_preemption_notice_checkpoints_the_step_and_the_run_moves_off_the_node(private_cache, tmp_path):
    from cloudrl.cli.node_processes import stop_node

    service = MetadataService("aws", lead_s=120)
    nodes, watcher = [], None
    with local_cluster(nodes=1, cpus_per_node=CPUS, gpus_per_node=0) as state:
        try:
            raylet_port = free_port()
            nodes.append(start_worker_node(state, "w1", CPUS, extra=(f"--node-manager-port={raylet_port}",)))
            wait_nodes(state, 2)
            watcher_log = tmp_path / "watcher.log"
            with open(watcher_log, "w") as out:
                watcher = subprocess.Popen(
                    [sys.executable, str(REPO / "tasks" / "ray_bringup.py"), "notices", "--gcs", state["gcs_address"]]
                    + ["--node-ip", "127.0.0.1", "--node-manager-port", str(raylet_port), "--poll-s", "1"],
                    env={**os.environ, "CLOUDRL_METADATA_URL": service.url, "DSTACK_NODE_RANK": "1"},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            run_dir, log = tmp_path / "run", tmp_path / "run.log"
            # Saved only at the end: the checkpoint the run resumes from can only be the notice's.
            proc = _driver(run_dir, state["gcs_address"], log, **{"trainer.total_steps": 8, "trainer.save_every": 0})
            metrics = run_dir / "metrics.jsonl"
            deadline = time.time() + 400
            while time.time() < deadline and proc.poll() is None:
                if metrics.is_file() and any(json.loads(r)["step"] >= 1 for r in metrics.read_text().splitlines()):
                    break
                time.sleep(0.2)
            assert proc.poll() is None, log.read_text()[-3000:]
            placement = json.loads((run_dir / "placement.json").read_text())
            assert len({w["node_id"] for w in placement["actor"]}) == 2, placement  # both nodes hold the actor
            # The driver is held while the cloud announces and the watcher drains, so the notice comes
            # mid-run however fast the tiny steps are.
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                service.announce()
                deadline = time.time() + 60
                while "drained Ray node" not in watcher_log.read_text() and time.time() < deadline:
                    assert watcher.poll() is None, watcher_log.read_text()
                    time.sleep(0.2)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            said = watcher_log.read_text()
            assert "[cloudrl rank 1] preemption notices: watching aws every 1s" in said, said
            assert "preemption notice: AWS spot terminate at" in said and "drained Ray node" in said, said
            drained = said.split("drained Ray node ")[1][:12]
            nodes.append(start_worker_node(state, "w2", CPUS))  # the replacement instance
            code = _finish(proc, 500)
            text = log.read_text()
            assert code == 0, text[-4000:]
            assert watcher.wait(timeout=30) == 0, watcher_log.read_text()
            lost = [line for line in text.splitlines() if line.startswith("lost ")]
            assert len(lost) == 1, text[-4000:]
            said = re.fullmatch(
                r"lost node \S+ \(id (\w{12}), held (.+)\) to a preemption notice \(it goes away in \d+s\); step (\d+)"
                r" is checkpointed in \S+step_0*\3; restarting the roles from the latest checkpoint .*"
                r"\(restart 1 of trainer.max_restarts=3\)",
                lost[0],
            )
            assert said and said[1] == drained and "actor rank" in said[2], lost
            saved_at = int(said[3])
            summary = json.loads((run_dir / "summary.json").read_text())
            assert summary["steps"] == 8 and summary["resumed_from"] == saved_at, summary
            steps = [json.loads(r)["step"] for r in metrics.read_text().splitlines()]
            assert sorted(s for s in steps if s > 0) == list(range(1, 9)), steps  # every step, each once
            again = json.loads((run_dir / "placement.json").read_text())
            used = {w["node_id"][:12] for workers in again.values() for w in workers}
            assert drained not in used and len(used) == 2, (drained, again)  # the head and the replacement
        finally:
            if watcher is not None and watcher.poll() is None:
                watcher.kill()
            service.close()
            for node in reversed(nodes):
                stop_node(node)
