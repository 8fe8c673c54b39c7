"""rollout.elastic: capacity that joins the cluster mid-run generates from the next push. A 1-node local Ray
cluster holds exactly the local preset's roles (4 CPUs), so the second engine the run asks for waits; a worker
node joins after step 5 (as `dstack apply` of fleets/rollout-spot.dstack.yml adds one), the engine starts there,
joins at the next weight push and generates with the trainer's weights from then on, with no restart."""

from __future__ import annotations

import json

import pytest
from runs import local_cluster, logged_steps, start_trainer, start_worker_node, stop_trainer, wait_nodes, wait_until

pytestmark = pytest.mark.ray


def test_an_engine_starts_on_a_node_that_joins_and_generates_from_the_next_push(private_cache, tmp_path):
    from cloudrl.cli.node_processes import stop_node

    run_dir, log = tmp_path / "run", tmp_path / "driver.log"
    overrides = {
        "trainer.total_steps": 100000,  # stopped below, once the added engine has generated a few steps
        "rollout.elastic": "true",
        "rollout.max_engines": 2,
        "placement.timeout_s": 120,
    }
    nodes = []
    with local_cluster(nodes=1, cpus_per_node=4, gpus_per_node=0) as state:
        proc = start_trainer(run_dir, log, state["gcs_address"], **overrides)
        try:
            wait_until("step 5", lambda: max(logged_steps(run_dir), default=0) >= 5, proc, log, 300)
            nodes.append(start_worker_node(state, "w1", cpus=1))
            wait_nodes(state, 2)
            joined_after = max(logged_steps(run_dir))
            wait_until("joined engine", lambda: "joined (rollout.elastic" in log.read_text(), proc, log, 180)
            # The line comes at a step's weight push, after that step took its batch and before its metrics row.
            joined_at = max(logged_steps(run_dir)) + 1
            wait_until("5 steps more", lambda: max(logged_steps(run_dir)) >= joined_at + 5, proc, log, 120)
        finally:
            stop_trainer(proc)
            for node in nodes:
                stop_node(node)
    text = log.read_text()
    assert "rollout.elastic: up to 2 engines; one more starts wherever the cluster has room" in text
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    alive = {r["step"]: r["rollout/engines_alive"] for r in steps}
    assert {alive[s] for s in range(1, joined_after + 1)} == {1}  # no room until the node joined
    after = [r for r in steps if r["step"] > joined_at]
    assert len(after) >= 5 and {r["rollout/engines_alive"] for r in after} == {2}
    # per engine: before the join engine 0 generated every sample; after it the new engine 1 generates its share
    assert all(r["rollout/engine_0_samples"] == r["rollout/samples"] for r in steps if r["step"] <= joined_after)
    assert all(r["rollout/engine_1_samples"] > 0 for r in after)
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in after)  # the new engine has the trainer's weights
    assert all(r["trainer/restarts"] == 0 for r in steps)
