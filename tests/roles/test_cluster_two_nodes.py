"""Placement on a real 2-node Ray cluster on 127.0.0.1 (CPU): ranks on different nodes, and the
preflight that fails in seconds instead of leaving a placement group pending.

This module runs before any test starts the session's in-process Ray instance (`ray_local`): two
Ray clusters on one machine share its IP address, and a driver joining one of them can pick up the
other's node.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from runs import local_cluster, run_trainer, tiny_overrides

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, private_cache):
    """A real 2-node Ray cluster (3 logical CPUs and 2 logical GPUs each: Ray schedules GPUs as
    numbers, so the placement checks see GPU nodes; nothing here runs CUDA), brought up and torn
    down by `cloudrl local`."""
    with local_cluster(nodes=2, cpus_per_node=3, gpus_per_node=2) as state:
        yield state


def test_actor_ranks_run_on_different_nodes(two_nodes, tmp_path):
    result = run_trainer(
        "--preset",
        "local",
        *tiny_overrides(tmp_path, **{"actor.nodes": 2}),
        env={"RAY_ADDRESS": two_nodes["gcs_address"]},
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    placement = json.loads((tmp_path / "placement.json").read_text())
    actor_nodes = [w["node_id"] for w in sorted(placement["actor"], key=lambda w: w["rank"])]
    assert len(set(actor_nodes)) == 2, placement
    # The job log names both nodes (docs/multinode.md's walk looks for this line).
    line = next(x for x in result.stdout.splitlines() if x.startswith("placement: actor: 2 worker(s) on node(s) "))
    assert len(line.split("on node(s) ", 1)[1].split(", ")) == 2, line
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]
    assert "summary:" in result.stdout


PREFLIGHT = [
    (
        ["actor.nodes=2", "actor.gpus_per_node=8", "actor.micro_batch_size=4"],
        ["asks for 16 GPU", "actor.nodes=2 x actor.gpus_per_node=8", "has 4", "2 nodes with 2 GPUs, 3 CPUs"],
    ),
    (
        ["rollout.engine=vllm", "rollout.tensor_parallel_size=4", "rollout.cpus_per_engine=0.5"],
        ["rollout needs 2 CPU, 4 GPU on one node", "rollout.tensor_parallel_size=4", "no node has that much at all"],
    ),
]


@pytest.mark.parametrize("overrides,expected", PREFLIGHT, ids=["16-gpus-on-4", "tp4-on-2-gpu-nodes"])
def test_preflight_fails_fast_and_leaves_nothing(two_nodes, tmp_path, overrides, expected):
    start = time.monotonic()
    result = run_trainer(
        "--preset",
        "local",
        f"trainer.run_dir={tmp_path}",
        *overrides,
        env={"RAY_ADDRESS": two_nodes["gcs_address"]},
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-2000:]
    for text in expected:
        assert text in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert elapsed < 10, f"preflight took {elapsed:.1f}s"
    # No placement group may be left behind: ask the cluster from a separate driver.
    probe = (
        "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
        "print(sum(pg['state'] != 'REMOVED' for pg in ray.util.placement_group_table().values()))"
    )
    left = subprocess.run(
        [sys.executable, "-c", probe, two_nodes["gcs_address"]], capture_output=True, text=True, timeout=120
    )
    assert left.stdout.strip().splitlines()[-1] == "0", left.stdout + left.stderr
