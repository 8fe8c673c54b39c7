"""Rollout capacity that comes, slows down and goes, in one real run with no restart. A 1-node local Ray cluster
holds exactly the local preset's roles (4 CPUs), so the second engine that rollout.elastic asks for waits; a
worker node joins after step 3 (as `dstack apply` of fleets/rollout-spot.dstack.yml adds one) and the engine
starts there, joins at the next weight push and generates with the trainer's weights. Then that engine is held
to 3% of a CPU (a cgroup, as a throttled GPU or a busy host makes a node slow): the straggler watch names its
engine within a few steps. Then the node goes (its processes stopped, as a reclaimed spot instance): the run goes
on with one engine, and when another node joins, a new engine starts there in the lost one's slot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runs import (
    cpu_controller,
    cpu_limited,
    local_cluster,
    logged_steps,
    start_trainer,
    start_worker_node,
    stop_trainer,
    wait_nodes,
    wait_until,
)

pytestmark = pytest.mark.ray

PACED = Path(__file__).resolve().parents[1] / "helpers" / "paced_reward.py"
SLOW_PERCENT = 3
"""The slowed engine's share of one CPU: its generation goes from ~0.03 s to seconds. Only the engine's process
is held (as a throttled GPU slows the engine, not Ray's daemons on its node): with the node's raylet held too, a
busy machine made a step take 100 s."""
BATCH = {
    # An untrained model's answers, up to 24 tokens: a generation that the slowed node makes seconds long, so
    # its engine is more than stragglers.MIN_SECONDS late.
    "model.sft_warmup_steps": 0,
    "rollout.max_new_tokens": 24,
    "rollout.n": 4,
    # The steps wait on a reward that sleeps instead of spinning through the waits for the nodes.
    "reward.function": f"{PACED}:paced",
}


def test_an_engine_added_then_slowed_then_lost_costs_no_restart(private_cache, tmp_path):
    from cloudrl.cli.node_processes import stop_node

    if cpu_controller() is None:
        pytest.skip("no writable cgroup cpu controller on this machine: the slow node cannot be made")
    run_dir, log = tmp_path / "run", tmp_path / "driver.log"
    overrides = {
        "trainer.total_steps": 100000,  # stopped below, once the replacement has generated a few steps
        "rollout.elastic": "true",
        "rollout.max_engines": 2,
        "placement.timeout_s": 120,
        **BATCH,
    }

    def step() -> int:
        return max(logged_steps(run_dir), default=0)

    def logged(*parts: str):
        """Whether a line of the log holds every one of `parts`."""
        return lambda: any(all(p in line for p in parts) for line in log.read_text().splitlines())

    nodes = []
    with local_cluster(nodes=1, cpus_per_node=4, gpus_per_node=0) as state:
        proc = start_trainer(run_dir, log, state["gcs_address"], **overrides)
        try:
            wait_until("step 3", lambda: step() >= 3, proc, log, 300)
            nodes.append(start_worker_node(state, "w1", cpus=1))
            wait_nodes(state, 2)
            joined_after = step()
            wait_until("the added engine", logged("joined (rollout.elastic"), proc, log, 180)
            # The line comes at a step's weight push, after that step took its batch and before its metrics row.
            joined_at = step() + 1
            wait_until("2 steps more", lambda: step() >= joined_at + 2, proc, log, 120)

            with cpu_limited(nodes[0], SLOW_PERCENT, title="ray::RolloutWorker"):
                slowed_after = step()
                wait_until("the straggler line", logged("straggler: rollout rank 1 on "), proc, log, 180)
                named_by = step() + 1
                # the node goes while it generates the next step's part (~10 s at its speed)
                wait_until("the next step's batch", lambda: step() >= named_by, proc, log, 120)
                stop_node(nodes[0])
                wait_until("the loss", logged("rollout rank 1 on ", " was lost ("), proc, log, 120)
                lost_by = step() + 1
            nodes.append(start_worker_node(state, "w2", cpus=1))
            wait_until("the replacement", logged("is back"), proc, log, 180)
            back_at = step() + 1
            wait_until("2 steps more", lambda: step() >= back_at + 2, proc, log, 120)
        finally:
            stop_trainer(proc)
            for node in nodes:
                stop_node(node)
    text = log.read_text()
    assert "rollout.elastic: up to 2 engines; one more starts wherever the cluster has room" in text
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    by_step = {r["step"]: r for r in steps}
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))  # every step once: no restart, no step lost
    assert all(r["trainer/restarts"] == 0 for r in steps)
    assert all(r["rollout/samples"] == 32 for r in steps)  # the whole batch at every step, the loss's included

    # joined: no room until the node came; from the push after it, engine 1 generates its share
    assert {by_step[s]["rollout/engines_alive"] for s in range(1, joined_after + 1)} == {1}
    assert all(r["rollout/engine_0_samples"] == r["rollout/samples"] for r in steps if r["step"] <= joined_after)
    joined = [r for r in steps if "rollout/engine_join_s" in r]
    assert len(joined) == 1 and 0 < joined[0]["rollout/engine_join_s"] < 180
    added = [by_step[s] for s in range(joined_at + 1, slowed_after + 1)]
    assert added and all(r["rollout/engines_alive"] == 2 and r["rollout/engine_1_samples"] > 0 for r in added)
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in added)  # the new engine has the trainer's weights

    # slowed: named once, within a few steps (3 slow ones in a row are needed), and only it
    stragglers = [line for line in text.splitlines() if line.startswith("straggler: ")]
    assert len(stragglers) == 1 and stragglers[0].startswith("straggler: rollout rank 1 on "), stragglers
    assert float(stragglers[0].split(" took ")[1].split("x")[0]) >= 2.0, stragglers
    assert named_by - slowed_after <= 6, (slowed_after, named_by)
    assert all(by_step[s]["health/stragglers"] == 0 for s in range(1, slowed_after + 1))
    assert all(r["health/stragglers"] == 1 for r in steps if r["step"] >= named_by)

    # lost and back: one engine generates the whole batch meanwhile; the new one is back in the lost one's slot
    assert "a new engine is starting in its place" in text
    assert sum(r["rollout/requeued_prompts"] for r in steps) == 4  # its half of one batch, generated again
    alone = [r for r in steps if lost_by < r["step"] < back_at]
    assert all(r["rollout/engines_alive"] == 1 and r["rollout/engine_0_samples"] == 32 for r in alone)
    (replaced,) = [r for r in steps if "rollout/engine_replace_s" in r]
    assert lost_by <= replaced["step"] <= back_at and 0 < replaced["rollout/engine_replace_s"] < 300
    after = [r for r in steps if r["step"] > back_at]
    assert len(after) >= 2 and all(r["rollout/engines_alive"] == 2 and r["rollout/engine_1_samples"] > 0 for r in after)
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in after)
