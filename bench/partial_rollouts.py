"""What partial rollouts change on a long-tailed workload: token staleness and step time, whole vs partial.

    python bench/partial_rollouts.py                  # 2 runs x 30 steps, ~3 minutes on 2 cores
    python bench/partial_rollouts.py --steps 60 --lag 1 --segment 8

The workload: the local preset's built-in tiny model without its format warm-up, so its answers are random
characters that end at a random end-of-sequence: response lengths with a long tail (most samples a few tokens,
some many times the median, up to rollout.max_new_tokens), and a generation longer than the update, so the
pushes arrive while the batches ahead are generating. Two runs with `rollout.max_staleness=--lag`, one generating
whole batches and one with `rollout.partial=true` (segments of --segment tokens), on a local Ray instance of
their own. Printed: the median step time, the token-mean and the largest staleness (weight versions behind the
update a token trains), the share of samples continued with newer weights, the mean response length and the
share of samples cut at rollout.max_new_tokens, over the counted steps (the first --skip are warm-up), and partial against whole. Extra KEY=VALUE
arguments go to both runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_phases import run  # noqa: E402  (the same subprocess run and metrics reading)

WORKLOAD = [
    "model.sft_warmup_steps=0",  # random answers: lengths set by a random end-of-sequence
    "rollout.max_new_tokens=160",
    "data.train_batch_size=16",
    "rollout.n=8",
    "actor.mini_batch_size=128",
    "actor.micro_batch_size=64",
    "critic.mini_batch_size=128",
    "critic.micro_batch_size=64",
    "actor.lr=5e-4",  # samples `lag` versions old: tests/rollout/test_policy_lag.py's rate
]


def summary(rows: list[dict]) -> dict[str, float]:
    return {
        "step s": statistics.median(r["timing/step"] for r in rows),
        "staleness mean": statistics.mean(r["rollout/staleness_mean"] for r in rows),
        "staleness max": max(r["rollout/staleness_max"] for r in rows),
        "partial samples": statistics.mean(r.get("rollout/partial_samples", 0.0) for r in rows),
        "mean length": statistics.mean(r["rollout/response_length"] for r in rows),
        "at max_new_tokens": statistics.mean(r["rollout/truncated"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps not counted")
    p.add_argument("--lag", type=int, default=2, help="rollout.max_staleness of both runs")
    p.add_argument("--segment", type=int, default=8, help="rollout.partial_segment_tokens")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE for both runs")
    a = p.parse_args(argv)
    if a.steps <= a.skip or a.skip < 0 or a.lag < 1 or a.segment < 1:
        p.error("--steps must exceed --skip (>= 0); --lag and --segment must be at least 1")
    base = [*WORKLOAD, f"trainer.total_steps={a.steps}", f"rollout.max_staleness={a.lag}", *a.overrides]
    ways = {
        "whole": [],
        "partial": ["rollout.partial=true", f"rollout.partial_segment_tokens={a.segment}"],
    }
    results = {}
    with tempfile.TemporaryDirectory(prefix="cloudrl-partial-") as tmp:
        for name, extra in ways.items():
            print(f"[partial_rollouts] {name}: {a.steps} steps ...", flush=True)
            rows = [r for r in run("local", base + extra, Path(tmp) / name) if r["step"] > a.skip]
            results[name] = summary(rows)
    keys = list(results["whole"])
    print(f"\nlocal preset, untrained model (long-tailed lengths), rollout.max_staleness={a.lag}, {a.steps} steps:")
    print(f"| {'':8} | " + " | ".join(keys) + " |")
    print("|" + "---|" * (len(keys) + 1))
    for name, values in results.items():
        print(f"| {name:8} | " + " | ".join(f"{values[k]:.3g}" for k in keys) + " |")
    whole, partial = results["whole"], results["partial"]
    print(
        f"\npartial vs whole: step time {partial['step s'] / whole['step s']:.2f}x, token staleness "
        f"{partial['staleness mean']:.2f} vs {whole['staleness mean']:.2f} versions "
        f"({partial['partial samples']:.0%} of samples continued with newer weights)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
