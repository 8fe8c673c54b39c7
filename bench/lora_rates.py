"""How fast the local default learns with LoRA adapters, setting by setting, against full fine-tuning.

    python bench/lora_rates.py                      # 5 runs x 300 steps, ~5 minutes on 2 cores
    python bench/lora_rates.py --seeds 1,2,3 --only recommended,full

Each run is `python -m cloudrl.trainer --preset local` with the setting's keys (on a local Ray instance of its
own), 300 steps. Printed per run: the rollout reward's mean over the first and the last 20 steps, its rise,
and that rise against full fine-tuning's (the preset as shipped, same seed). `recommended` is what
docs/trainer.md ("LoRA") tells a user to start from on the built-in model, and what
tests/loop/test_lora_learns.py trains.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_phases import run  # noqa: E402  (the same subprocess run and metrics reading)

EVERY_LINEAR_AND_HEAD = "model.lora_target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]"
SETTINGS = {
    "full": [],
    "recommended": ["model.lora_rank=8", "model.lora_alpha=64", "actor.lr=1e-3", EVERY_LINEAR_AND_HEAD],
    "alpha 16": ["model.lora_rank=8", "model.lora_alpha=16", "actor.lr=3e-3", EVERY_LINEAR_AND_HEAD],
    "all-linear": ["model.lora_rank=8", "model.lora_alpha=64", "actor.lr=1e-3"],
    "alpha 64, 5e-4": ["model.lora_rank=8", "model.lora_alpha=64", "actor.lr=5e-4", EVERY_LINEAR_AND_HEAD],
}
"""Label -> keys on the local preset. `full` is the baseline every rise is held against."""
WINDOW = 20


def rise(rows: list[dict]) -> tuple[float, float]:
    """The rollout reward's mean over the first and the last WINDOW steps."""
    rewards = [r["rollout/reward_mean"] for r in rows if r["step"] > 0]
    return statistics.mean(rewards[:WINDOW]), statistics.mean(rewards[-WINDOW:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", default="1", help="trainer.seed values, comma-separated (default 1)")
    p.add_argument("--only", default="", help=f"labels to run, comma-separated, from: {', '.join(SETTINGS)}")
    a = p.parse_args(argv)
    only = [s.strip() for s in a.only.split(",") if s.strip()] or list(SETTINGS)
    unknown = [s for s in only if s not in SETTINGS]
    if unknown:
        p.error(f"--only {','.join(unknown)}: not a setting; choose from {', '.join(SETTINGS)}")
    if a.steps < 2 * WINDOW:
        p.error(f"--steps must be at least {2 * WINDOW}")
    labels = ["full", *[s for s in only if s != "full"]]
    seeds = [int(s) for s in a.seeds.split(",")]
    results: dict[tuple[str, int], tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="cloudrl-lora-") as tmp:
        for seed in seeds:
            for label in labels:
                print(f"[lora_rates] {label}, seed {seed}: {a.steps} steps ...", flush=True)
                keys = [*SETTINGS[label], f"trainer.total_steps={a.steps}", f"trainer.seed={seed}"]
                results[label, seed] = rise(run("local", keys, Path(tmp) / f"{label}-{seed}".replace(" ", "_")))
    print(f"\nlocal preset, {a.steps} steps, rollout reward over the first and last {WINDOW} steps:")
    print("| setting | keys | seed | first | last | rise | rise vs full |")
    print("|---|---|---|---|---|---|---|")
    for (label, seed), (first, last) in results.items():
        full_first, full_last = results["full", seed]
        ratio = (last - first) / (full_last - full_first)
        keys = " ".join(k.replace(EVERY_LINEAR_AND_HEAD, "every block linear + lm_head") for k in SETTINGS[label])
        print(
            f"| {label} | {keys or 'as shipped'} | {seed} | {first:.3f} | {last:.3f} | {last - first:+.3f} | {ratio:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
