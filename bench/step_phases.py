"""Where a step of a shipped preset goes: the weight sync's share, and what max_staleness hides.

    python bench/step_phases.py                       # the local preset, 30 steps each way, ~4 minutes on 2 cores
    python bench/step_phases.py --preset local --steps 60 --lags 1 rollout.max_new_tokens=16

Runs `python -m cloudrl.trainer --preset P` on a local Ray instance of its own, first as shipped (the
rollout engine and the actor in turn), then with each `rollout.max_staleness` of --lags (default 1,2: the
engine generates the next one or two batches while the actor and critic train), and prints the median of
each `timing/*` phase over the counted steps, the weight sync's share of a step, the step time saved
against the in-turn run's generation time, the time between two of the actor's updates
(`timing/actor_between_updates`) each way, and the step time of each lagging run against the in-turn
one. Extra KEY=VALUE arguments go to every run. The first --skip steps are warm-up.
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

PHASES = (
    "rollout",
    "rollout_wait",
    "reward",
    "ref",
    "values",
    "adv",
    "update",
    "sync",
    "actor_between_updates",
    "engine_weight_wait",
    "step",
)


def run(preset: str, overrides: list[str], run_dir: Path) -> list[dict]:
    args = [
        f"trainer.run_dir={run_dir}",
        "trainer.val_every=0",
        "trainer.save_every=0",
        "trainer.loggers=[jsonl]",
        "trainer.export_hf=false",
        "trainer.resume=never",
        *overrides,
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-m", "cloudrl.trainer", "--preset", preset, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode:
        sys.exit(
            f"error: the run with {' '.join(overrides) or 'the preset as shipped'} failed: "
            f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}"
        )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "timing/step" in r]


def medians(rows: list[dict]) -> dict[str, float]:
    return {p: statistics.median(r.get(f"timing/{p}", 0.0) for r in rows) for p in PHASES}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="local")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=3, help="warm-up steps not counted (default 3)")
    p.add_argument("--lags", default="1,2", help="rollout.max_staleness values to compare with in turn (default 1,2)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    a = p.parse_args(argv)
    if a.steps <= a.skip:
        p.error(f"--steps ({a.steps}) must be larger than --skip ({a.skip})")
    lags = [int(k) for k in a.lags.split(",") if k.strip()]
    if not lags or any(k < 1 for k in lags):
        p.error(f"--lags ({a.lags}) must list policy lags of 1 or more")
    common = [f"trainer.total_steps={a.steps}", *a.overrides]
    runs = [("in turn", []), *((f"max_staleness={k}", [f"rollout.max_staleness={k}"]) for k in lags)]
    with tempfile.TemporaryDirectory(prefix="cloudrl-phases-") as tmp:
        results = {}
        for name, extra in runs:
            print(f"[step_phases] {a.preset}, {name}: {a.steps} steps ...", flush=True)
            results[name] = medians(run(a.preset, [*common, *extra], Path(tmp) / name.replace("=", "")))
    print(f"\npreset {a.preset} {' '.join(a.overrides)}: median seconds per step over steps {a.skip + 1}-{a.steps}")
    print(f"{'phase':<22}" + "".join(f"{name:>14}" for name in results))
    for phase in PHASES:
        print(f"{phase:<22}" + "".join(f"{r[phase]:>14.4f}" for r in results.values()))
    turn = results["in turn"]
    print("(with a policy lag the next steps start while the update runs, so the phases overlap and do not add up)")
    print(
        f"\nweight sync share of a step, in turn: {turn['sync'] / turn['step']:.1%} (with a policy lag "
        f"the driver does not wait for it)"
    )
    print(f"generation per step in turn (the driver waiting for the engines): {turn['rollout_wait']:.4f} s")
    for name, lag in list(results.items())[1:]:
        saved = turn["step"] - lag["step"]
        print(
            f"{name}: step time saved {saved:.4f} s ({saved / turn['rollout_wait']:.0%} of that generation), "
            f"the actor between two updates {lag['actor_between_updates']:.4f} s "
            f"(in turn {turn['actor_between_updates']:.4f} s), step time / in turn {lag['step'] / turn['step']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
