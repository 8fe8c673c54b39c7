"""GRPO vs DAPO on the built-in arithmetic task: reward after N steps, and what dynamic sampling costs.

    python bench/dapo_vs_grpo.py                      # 20 steps each, operands 0..2, ~5 minutes on 2 cores
    python bench/dapo_vs_grpo.py --steps 40 data.arithmetic_max_operand=4

Runs `python -m cloudrl.trainer` twice on a local Ray instance of its own: `--preset local
algorithm.name=grpo` (the local default with GRPO advantages) and `--preset dapo` (clip-higher, dynamic
sampling, token-mean, overlong penalty, no KL), both with the same batch (prompts x samples) and steps.
Prints, for each, the mean rollout reward over the first and the last 5 steps (every sample generated,
dropped groups included), the greedy validation reward before and after, the samples generated per sample
trained on, the share of prompt groups kept, and the seconds per step. Extra KEY=VALUE arguments go to
both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Both runs: the batch of the per-algorithm learning tests (tests/helpers/runs.py REWARD_RISES).
COMMON = [
    "data.arithmetic_max_operand=2",
    "data.train_batch_size=16",
    "rollout.n=8",
    "actor.mini_batch_size=32",
    "actor.micro_batch_size=32",
    "critic.mini_batch_size=32",
    "critic.micro_batch_size=32",
    "trainer.val_every=0",
    "trainer.save_every=0",
    "trainer.loggers=[jsonl]",
    "trainer.export_hf=false",
    "trainer.resume=never",
]
RUNS = {"grpo": ("local", ["algorithm.name=grpo"]), "dapo": ("dapo", [])}


def run(preset: str, overrides: list[str], run_dir: Path) -> tuple[list[dict], float]:
    """The run's metrics rows and its wall time."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "cloudrl.trainer", "--preset", preset, f"trainer.run_dir={run_dir}", *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode:
        sys.exit(f"error: the {preset} run failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, time.perf_counter() - started


def summarise(rows: list[dict]) -> dict[str, float]:
    steps = [r for r in rows if "rollout/reward_mean" in r]
    rewards = [r["rollout/reward_mean"] for r in steps]
    vals = [r["val/reward_mean"] for r in rows if "val/reward_mean" in r]
    return {
        "reward_first5": statistics.mean(rewards[:5]),
        "reward_last5": statistics.mean(rewards[-5:]),
        "val_before": vals[0],
        "val_after": vals[-1],
        "samples_per_kept": statistics.mean(r.get("rollout/samples_per_kept", 1.0) for r in steps),
        "kept_fraction": statistics.mean(r.get("rollout/kept_fraction", 1.0) for r in steps),
        "s_per_step": statistics.median(r["timing/step"] for r in steps),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    a = p.parse_args(argv)
    if a.steps < 5:
        p.error(f"--steps ({a.steps}) must be at least 5 (first and last 5 steps are compared)")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (preset, extra) in RUNS.items():
            overrides = [*COMMON, f"trainer.total_steps={a.steps}", *extra, *a.overrides]
            rows, wall = run(preset, overrides, Path(tmp) / name)
            results[name] = {**summarise(rows), "wall_s": wall}
    columns = list(next(iter(results.values())))
    extra = f", {' '.join(a.overrides)}" if a.overrides else ""
    print(f"{a.steps} steps each: 16 prompts x 8 samples per step, operands 0..2{extra}")
    print("run   " + "  ".join(c.rjust(16) for c in columns))
    for name, r in results.items():
        print(name.ljust(6) + "  ".join(f"{r[c]:16.3f}" for c in columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
