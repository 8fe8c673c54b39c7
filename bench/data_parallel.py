"""Step time of the tiny-model PPO run with W=1 and W=2 actor/critic workers on a 2-node local cluster.

    python bench/data_parallel.py [--steps 30]

Brings up a 2-node Ray cluster on 127.0.0.1 (`cloudrl local up --nodes 2`), runs the `local` preset
once with one actor and one critic worker and once with two of each (one per node, gloo), and prints
the median step time, the update time, and the share of the step spent in the gradient all-reduce.
On a 2-core machine both nodes share the same cores, so this measures the overhead of data
parallelism, not a speed-up. The cluster is stopped at the end, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(gcs: str, run_dir: Path, steps: int, world: int) -> list[dict]:
    overrides = [
        f"trainer.run_dir={run_dir}",
        f"trainer.total_steps={steps}",
        "trainer.val_every=0",
        "trainer.save_every=0",
        "trainer.loggers=[jsonl]",
        "trainer.export_hf=false",
        f"actor.nodes={world}",
        f"critic.nodes={world}",
        "actor.micro_batch_size=128",
        "critic.micro_batch_size=128",  # the same micro-batches for W=1 and W=2
        "actor.fsdp=false",
        "critic.fsdp=false",
    ]  # plain data parallelism: whole copies, gradient all-reduce
    env = {**os.environ, "RAY_ADDRESS": gcs}
    proc = subprocess.run(
        [sys.executable, "-m", "cloudrl.trainer", "--preset", "local", *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode:
        sys.exit(f"error: the W={world} run failed: {proc.stderr.strip().splitlines()[-1:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cloudrl-bench-dp-"))
    os.environ.setdefault("CLOUDRL_CACHE", str(work / "cache"))
    os.environ["CLOUDRL_LOCAL_DASHBOARD_PORT"] = "0"
    from cloudrl.cli import local_cluster

    state = local_cluster.up(nodes=2, cpus_per_node=3, echo=lambda line: None)
    try:
        results = {w: run(state["gcs_address"], work / f"w{w}", args.steps, w) for w in (1, 2)}
    finally:
        local_cluster.down(echo=lambda line: None)
    skip = 3  # warm-up steps
    table = []
    for world, rows in results.items():
        rows = [r for r in rows if r["step"] > skip]
        step = median(rows, "timing/step")
        comm = median(rows, "timing/comm_actor") + median(rows, "timing/comm_critic")
        table.append((world, step, median(rows, "timing/update"), comm, comm / step if step else 0.0, len(rows)))
    print(
        f"tiny-model PPO, `local` preset, 2 Ray nodes on one {os.cpu_count()}-core machine, median over steps > {skip}"
    )
    print(f"{'workers':>8} {'s/step':>8} {'update s':>9} {'all-reduce s':>13} {'comm share':>11} {'steps':>6}")
    for world, step, update, comm, share, n in table:
        print(f"{world:>8} {step:>8.3f} {update:>9.3f} {comm:>13.4f} {share:>10.1%} {n:>6}")
    (w1, s1, *_), (w2, s2, *_) = table
    print(f"W=2 / W=1 step time: {s2 / s1:.2f}x  (overhead {s2 - s1:+.3f} s per step)")


if __name__ == "__main__":
    main()
