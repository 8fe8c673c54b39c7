"""What one lost rollout engine costs a run: no restart (rollout/engine_pool.py) against the restart from the
latest checkpoint that any other lost worker still costs (recovery.py), which is what an engine loss cost before.

    python bench/engine_loss.py                 # ~3 minutes on 2 cores
    python bench/engine_loss.py --steps 60 --kill-after 25 rollout.max_new_tokens=16

Runs the local preset three times on a local Ray instance of its own (two engines, a checkpoint every
--save-every steps): uninterrupted; with one engine process SIGKILLed after step --kill-after; and with the
reward worker SIGKILLed after the same step. Prints each run's wall time from its first step to its last (the
same steps; start-up and export left out), the time each loss added, the finished steps run a second time
(those after the checkpoint the restart resumed from), the restarts, and the ratio of the two losses' costs. Extra KEY=VALUE arguments go to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil


def kill_after(proc: subprocess.Popen, run_dir: Path, step: int, title: str, killed: list[int]) -> None:
    """SIGKILL the first process titled `ray::<title>` under the run once it has logged `step`; `killed` gets
    the last step logged then."""
    metrics = run_dir / "metrics.jsonl"
    done: list[int] = []
    while proc.poll() is None:
        done = [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
        if max(done, default=0) >= step:
            break
        time.sleep(0.02)
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if child.cmdline()[:1] and child.cmdline()[0].startswith(f"ray::{title}"):
                os.kill(child.pid, signal.SIGKILL)
                killed.append(max(done, default=0))
                return
        except psutil.Error:
            continue


def run(name: str, args: argparse.Namespace, overrides: list[str], root: Path, victim: str | None) -> dict:
    run_dir = root / name
    values = [
        f"trainer.run_dir={run_dir}",
        f"trainer.total_steps={args.steps}",
        f"trainer.save_every={args.save_every}",
        "trainer.keep_last=100",
        "trainer.val_every=0",
        "trainer.loggers=[jsonl]",
        "trainer.export_hf=false",
        "trainer.resume=never",
        "rollout.num_engines=2",
        *overrides,
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = root / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cloudrl.trainer", "--preset", "local", *values],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    killed: list[int] = []
    if victim:
        threading.Thread(target=kill_after, args=(proc, run_dir, args.kill_after, victim, killed), daemon=True).start()
    if proc.wait(timeout=3600):
        sys.exit(f"{name}: the run failed:\n{log.read_text()[-3000:]}")
    if victim and not killed:
        sys.exit(f"{name}: no ray::{victim} process was found to kill")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    resumed = json.loads((run_dir / "summary.json").read_text()).get("resumed_from")
    return {
        "name": name,
        "wall_s": steps[-1]["time"] - steps[0]["time"],
        "again": int(killed[0] - resumed) if killed and resumed is not None else 0,
        "restarts": int(max(r["trainer/restarts"] for r in steps)),
        "engines_min": min(r["rollout/engines_alive"] for r in steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-after", type=int, default=15)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE for every run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cloudrl-engine-loss-") as tmp:
        root = Path(tmp)
        runs = [
            run("uninterrupted", args, args.overrides, root, None),
            run("engine lost", args, args.overrides, root, "RolloutWorker"),
            run("reward worker lost (restart)", args, args.overrides, root, "RewardWorker"),
        ]
    base = runs[0]["wall_s"]
    print(
        f"local preset, 2 engines, {args.steps} steps, a loss after step {args.kill_after}, checkpoints every "
        f"{args.save_every} steps"
    )
    print(f"{'run':<30} {'wall s':>8} {'added s':>8} {'steps again':>12} {'restarts':>9} {'engines min':>12}")
    for r in runs:
        print(
            f"{r['name']:<30} {r['wall_s']:>8.1f} {r['wall_s'] - base:>8.1f} {r['again']:>12d} {r['restarts']:>9d} "
            f"{r['engines_min']:>12.0f}"
        )
    engine, restart = runs[1]["wall_s"] - base, runs[2]["wall_s"] - base
    print(
        f"time an engine loss adds: {engine:.1f} s, against {restart:.1f} s for a restart "
        f"({restart / max(engine, 0.1):.1f}x); steps run again: {runs[1]['again']} against {runs[2]['again']}"
    )


if __name__ == "__main__":
    main()
