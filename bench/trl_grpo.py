"""GRPO step time: cloudrl (on Ray) against TRL's GRPOTrainer, same model, prompts and batch.

    python bench/trl_grpo.py                     # 2 rounds x 8 runs x 12 steps, ~6 minutes (+1-2 once for the venv)
    python bench/trl_grpo.py --rounds 4 --threads 2

Run it with the Python that has cloudrl installed (the project's venv): cloudrl runs from this
interpreter. TRL runs from its own virtualenv, bench/.venv-trl, created on the first run with
torch, the same transformers as this interpreter, trl (pinned below) and cloudrl itself
(`pip install -e <repo> --no-deps`, so TRL is scored by cloudrl's own `arithmetic` reward function).

Each round runs, one after the other and each in its own process tree, for every thread count
(--threads, default: the CPU count, which is TRL's default, then 1):
1. cloudrl: `python -m cloudrl.trainer --preset local algorithm.name=grpo ...` on a local Ray instance,
   in five layouts (--layouts): `lean` (the actor worker generates with the policy it trains and
   the driver scores the rule reward, as TRL's single process does both), `actor` (the same with a
   reward worker), `workers` (a separate rollout worker that receives the weights every step, and
   a reward worker), `async` (`workers` with rollout.max_staleness=1: the worker generates the next
   batch while the actor trains) and `async2` (rollout.max_staleness=2: the next two). Every computing worker reserves that many CPUs, so torch uses that
   many threads; in `async` and `async2` the actor and the engine, which run at once, split them. Step times from run_dir/metrics.jsonl (`time` of each row, and `timing/step`).
2. TRL: bench/_trl_worker.py with the venv's Python, GRPOTrainer on the same model directory and
   prompts, torch limited to that many threads; step times from a TrainerCallback (on_step_end
   times, and on_step_begin -> on_step_end).
Odd rounds start with cloudrl, even rounds with TRL. The ratio compares the wall time between
consecutive step ends, everything each side does per step. The first --skip steps of every run are
warm-up and not counted; the table shows the median over the counted steps of all rounds, and the
median of the per-round ratios. What is matched and why: bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / "bench" / ".venv-trl"
# What the TRL side was tested with. transformers is taken from this interpreter (cloudrl's pin).
PINS = {"torch": "2.13.0", "trl": "1.16.0", "accelerate": "1.15.0", "datasets": "5.2.0"}
STEP_TIMEOUT_S = 900  # per subprocess: far above a normal run, so a hang ends with a clear line


class BenchError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[trl_grpo] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# Processes
# ----------------------------------------------------------------------------------------------


def run_logged(
    cmd: list[str], logfile: Path, env: dict | None = None, cwd: Path | None = None, timeout: float = STEP_TIMEOUT_S
) -> None:
    """Run `cmd` in its own session (its own process tree), output to `logfile`; on a non-zero
    exit or a timeout, end that tree and raise with the log's last lines."""
    with open(logfile, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise BenchError(f"{Path(cmd[0]).name} ... timed out after {timeout:.0f}s; log: {logfile}") from None
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    if rc != 0:
        tail = "\n".join("    " + line for line in logfile.read_text(errors="replace").splitlines()[-25:])
        raise BenchError(f"`{' '.join(cmd[:4])} ...` exited with {rc}; last lines of {logfile}:\n{tail}")


def clean_env(threads: int | None = None) -> dict:
    """The environment for a benchmarked process: no cluster address (cloudrl starts its own local
    Ray), and thread counts left to each framework's default unless `threads` is given."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ----------------------------------------------------------------------------------------------
# The TRL virtualenv
# ----------------------------------------------------------------------------------------------


def venv_python() -> Path:
    return VENV / "bin" / "python"


def ensure_trl_venv(transformers_version: str) -> dict:
    """Create or update bench/.venv-trl to the pins; return the versions it holds."""
    wanted = dict(PINS, transformers=transformers_version, cloudrl=str(REPO))
    stamp = VENV / "bench-pins.json"
    if venv_python().exists() and stamp.exists() and json.loads(stamp.read_text()) == wanted:
        return probe_venv()
    log(
        f"setting up {VENV.relative_to(REPO)} (once; 1-2 minutes): "
        + ", ".join(f"{k}=={v}" for k, v in wanted.items() if k != "cloudrl")
        + f", cloudrl -e {REPO}"
    )
    if not venv_python().exists():
        base = getattr(sys, "_base_executable", sys.executable)
        run_logged([base, "-m", "venv", str(VENV)], Path(tempfile.gettempdir()) / "trl_grpo-venv.log")
    install_log = VENV / "install.log"
    pkgs = [f"{k}=={v}" for k, v in wanted.items() if k != "cloudrl"]
    run_logged([str(venv_python()), "-m", "pip", "install", "--quiet", *pkgs], install_log, timeout=1800)
    run_logged(
        [str(venv_python()), "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(REPO)],
        VENV / "install-cloudrl.log",
        timeout=600,
    )
    versions = probe_venv()
    stamp.write_text(json.dumps(wanted, indent=1))
    return versions


def probe_venv() -> dict:
    code = (
        "import json, torch, transformers, trl, accelerate, datasets, cloudrl.trainer.inputs.rewards as r; "
        "print(json.dumps({m.__name__: m.__version__ for m in (torch, transformers, trl, accelerate, datasets)}))"
    )
    proc = subprocess.run([str(venv_python()), "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(
            f"{VENV.relative_to(REPO)} is broken ({proc.stderr.strip().splitlines()[-1:]}): delete it and run again"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------
# The two sides
# ----------------------------------------------------------------------------------------------


def cloudrl_overrides(a) -> list[str]:
    """GRPO on the local preset's task and model, shaped like the TRL run (see bench/README.md)."""
    n = a.generations
    mini = a.prompts_per_step * n
    return [
        "algorithm.name=grpo",
        "algorithm.kl_coef=0",  # TRL: beta=0.0 (no reference model)
        "algorithm.grpo_norm_by_std=true",  # TRL: scale_rewards="group"
        f"model.sft_warmup_steps={a.sft_warmup_steps}",
        f"data.train_batch_size={a.prompts_per_step}",
        f"rollout.n={n}",
        f"rollout.max_new_tokens={a.max_new_tokens}",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        "rollout.top_k=-1",
        f"actor.lr={a.lr}",
        "actor.warmup_steps=0",
        "actor.weight_decay=0.0",
        "actor.grad_clip=1.0",
        "actor.clip_low=0.2",
        "actor.clip_high=0.2",
        "actor.ppo_epochs=1",  # TRL: epsilon=0.2, num_iterations=1
        f"actor.mini_batch_size={mini}",
        f"actor.micro_batch_size={mini}",
        "model.dtype=float32",
        "model.gradient_checkpointing=false",
        f"trainer.total_steps={a.steps}",
        "trainer.val_every=0",
        "trainer.save_every=0",
        "trainer.loggers=[jsonl]",
        "trainer.export_hf=false",
        "trainer.resume=never",
    ]


def prepare_inputs(overrides: list[str], workdir: Path) -> tuple[str, Path, int]:
    """Materialise the model exactly as the cloudrl run will (same config -> same directory) and
    write the training prompts, as text plus cloudrl's token ids, for the TRL worker."""
    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.inputs.data import load_prompts
    from cloudrl.trainer.inputs.models import load_tokenizer, quiet_transformers, resolve_path

    quiet_transformers()
    cfg = load_config("local", overrides)
    model_dir = resolve_path(cfg.model.path, cfg)
    tokenizer = load_tokenizer(model_dir)
    records = load_prompts(cfg.data.train_files, tokenizer, split="train", data_cfg=cfg.data, seed=cfg.trainer.seed)
    prompts = workdir / "prompts.jsonl"
    with open(prompts, "w") as f:
        for r in records:
            f.write(
                json.dumps({"prompt": r.prompt_text, "ground_truth": r.ground_truth, "prompt_ids": r.prompt_ids}) + "\n"
            )
    return model_dir, prompts, len(records)


def run_cloudrl(overrides: list[str], workdir: Path, tag: str, skip: int) -> dict:
    run_dir = workdir / f"cloudrl-{tag}"
    cmd = [sys.executable, "-m", "cloudrl.trainer", "--preset", "local", *overrides, f"trainer.run_dir={run_dir}"]
    run_logged(cmd, workdir / f"cloudrl-{tag}.log", env=clean_env(), cwd=workdir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = sorted((r for r in rows if "timing/step" in r), key=lambda r: r["step"])
    if len(rows) <= skip:
        raise BenchError(f"cloudrl logged {len(rows)} steps in {run_dir}/metrics.jsonl; need more than --skip={skip}")
    counted = rows[skip:]
    times = [r["time"] for r in rows]
    return {
        "step_s": [r["timing/step"] for r in counted],
        "interval_s": [b - a for a, b in zip(times[skip:], times[skip + 1 :])],
        "length": [r["rollout/response_length"] for r in counted],
        "phases": [{k[len("timing/") :]: v for k, v in r.items() if k.startswith("timing/")} for r in counted],
    }


def run_trl(a, model_dir: str, prompts: Path, workdir: Path, tag: str, threads: int | None) -> dict:
    out = workdir / f"trl-{tag}.json"
    cmd = [
        str(venv_python()),
        str(REPO / "bench" / "_trl_worker.py"),
        "--model-dir",
        model_dir,
        "--prompts",
        str(prompts),
        "--steps",
        str(a.steps),
        "--lr",
        str(a.lr),
        "--prompts-per-step",
        str(a.prompts_per_step),
        "--num-generations",
        str(a.generations),
        "--max-new-tokens",
        str(a.max_new_tokens),
        "--out",
        str(out),
    ]
    run_logged(cmd, workdir / f"trl-{tag}.log", env=clean_env(threads), cwd=workdir)
    res = json.loads(out.read_text())
    skip = a.skip
    if len(res["step_s"]) <= skip:
        raise BenchError(f"TRL ran {len(res['step_s'])} steps; need more than --skip={skip}")
    return {
        "step_s": res["step_s"][skip:],
        "interval_s": res["interval_s"][skip:],
        "length": [lg["completions/mean_length"] for lg in res["logs"]][skip:],
        "phases": res["phases"][skip:],
        "threads": res["torch_threads"],
        "versions": {k: res[k] for k in ("trl", "transformers", "torch")},
    }


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def med(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def merge(runs: list[dict]) -> dict:
    out = {k: [x for r in runs for x in r[k]] for k in ("step_s", "interval_s", "length", "phases")}
    out["round_medians"] = [med(r["interval_s"]) for r in runs]
    return out


# cloudrl's layouts. Ray gives each worker as many torch threads as CPUs it reserves, so
# `threads` sets the CPUs of every worker that computes.
LAYOUTS = {
    "lean": (
        "rollout in actor, reward in driver",
        lambda t: ["placement.rollout_in_actor=true", "reward.in_driver=true", f"actor.cpus_per_worker={t}"],
    ),
    "actor": ("rollout in actor", lambda t: ["placement.rollout_in_actor=true", f"actor.cpus_per_worker={t}"]),
    "workers": ("rollout worker", lambda t: [f"actor.cpus_per_worker={t}", f"rollout.cpus_per_engine={t}"]),
    # The engine generates the next batch while the actor trains: the two run at once, so they split the
    # threads (at 1 thread each still gets one, 2 in all).
    "async": (
        "rollout worker, max_staleness=1",
        lambda t: [
            "rollout.max_staleness=1",
            f"actor.cpus_per_worker={max(1, t // 2)}",
            f"rollout.cpus_per_engine={max(1, t - t // 2)}",
        ],
    ),
    # Two batches ahead: the engine goes on to the batch after next instead of waiting for the update.
    "async2": (
        "rollout worker, max_staleness=2",
        lambda t: [
            "rollout.max_staleness=2",
            f"actor.cpus_per_worker={max(1, t // 2)}",
            f"rollout.cpus_per_engine={max(1, t - t // 2)}",
        ],
    ),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run (default 12)")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps not counted, per run (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs every configuration once (default 2)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate, both sides (default 1e-3)")
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--generations", type=int, default=4, help="completions per prompt (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument(
        "--sft-warmup-steps",
        type=int,
        default=0,
        help="format warm-up of builtin:tiny; 0 (default) keeps the random model, whose "
        "completions run to ~15 of the 16 tokens, so both sides generate the same amount",
    )
    p.add_argument(
        "--threads",
        default=f"{os.cpu_count() or 1},1",
        help="torch thread counts to compare at, each for both sides (default: this machine's "
        f"CPU count, which is TRL's default, and 1: {os.cpu_count() or 1},1)",
    )
    p.add_argument(
        "--layouts",
        default="lean,actor,workers,async",
        help="cloudrl layouts, any of: lean (placement.rollout_in_actor=true reward.in_driver=true: "
        "one worker generates and trains, the driver scores, as TRL's one process does), actor "
        "(the same with a reward worker) and workers (a separate rollout worker, weights synced "
        "every step, and a reward worker), async (workers with rollout.max_staleness=1: the "
        "next batch generates while the actor trains), async2 (rollout.max_staleness=2: the next two). "
        "Default: lean,actor,workers,async",
    )
    p.add_argument(
        "--cloudrl-extra",
        default="",
        metavar="'KEY=VALUE ...'",
        help="more cloudrl overrides, space separated, to try a setting",
    )
    p.add_argument("--keep", action="store_true", help="keep the run directories and logs")
    a = p.parse_args(argv)
    if a.steps <= a.skip:
        p.error(f"--steps ({a.steps}) must be larger than --skip ({a.skip})")
    threads = [int(t) for t in a.threads.split(",") if t.strip()]
    layouts = [x.strip() for x in a.layouts.split(",") if x.strip()]
    if not threads or any(t < 1 for t in threads):
        p.error("--threads takes positive integers, e.g. 2,1")
    if not layouts or any(x not in LAYOUTS for x in layouts):
        p.error(f"--layouts takes any of {', '.join(LAYOUTS)}")

    try:
        import cloudrl.trainer  # noqa: F401  (fail here, not in a subprocess)
        import torch
        import transformers
    except ImportError as exc:
        print(
            f"[trl_grpo] error: cloudrl is not importable from {sys.executable} ({exc}): run this with "
            f"the project's Python, e.g. /work/venv/bin/python bench/trl_grpo.py",
            file=sys.stderr,
        )
        return 1

    workdir = Path(tempfile.mkdtemp(prefix="trl-grpo-bench-"))
    load_before = os.getloadavg()
    started = time.time()
    base = cloudrl_overrides(a)
    runs: dict[tuple[str, int], list[dict]] = {}  # (side, threads) -> one result per round
    try:
        venv_versions = ensure_trl_venv(transformers.__version__)
        model_dir, prompts, n_prompts = prepare_inputs(base + a.cloudrl_extra.split(), workdir)
        log(f"model {model_dir}; {n_prompts} prompts; work dir {workdir}")
        for rnd in range(1, a.rounds + 1):
            for t in threads:
                # Odd rounds run cloudrl first, even rounds TRL first, so a machine that speeds up
                # or slows down over a round does not favour one side.
                sides = layouts + ["trl"] if rnd % 2 else ["trl"] + layouts
                for side in sides:
                    t0 = time.time()
                    if side == "trl":
                        res = run_trl(a, model_dir, prompts, workdir, f"r{rnd}-t{t}", t)
                        what = f"TRL, {res['threads']} thread(s)"
                    else:
                        overrides = base + LAYOUTS[side][1](t) + a.cloudrl_extra.split()
                        res = run_cloudrl(overrides, workdir, f"r{rnd}-{side}-t{t}", a.skip)
                        what = f"cloudrl, {LAYOUTS[side][0]}, {t} thread(s)"
                    runs.setdefault((side, t), []).append(res)
                    log(f"round {rnd}: {what}: {med(res['interval_s']):.3f} s/step wall ({time.time() - t0:.0f}s)")
    except Exception as exc:  # one clear line (and the logs) instead of a traceback
        what = str(exc) if isinstance(exc, BenchError) else f"{type(exc).__name__}: {exc}"
        print(f"[trl_grpo] error: {what}", file=sys.stderr)
        print(f"[trl_grpo] logs kept in {workdir}", file=sys.stderr)
        return 1

    print()
    print(
        f"GRPO, builtin:tiny on builtin:arithmetic: {a.prompts_per_step} prompts x {a.generations} = "
        f"{a.prompts_per_step * a.generations} completions/step, max {a.max_new_tokens} new tokens, lr {a.lr}, "
        f"beta 0, 1 iteration, float32, CPU"
    )
    print(f"{a.rounds} round(s) x {a.steps} steps per configuration, first {a.skip} of each run skipped")
    print()
    head = (
        f"{'engine':<52}{'threads':>8}{'s/step':>8}{'wall s/step':>13}{'steps':>7}{'compl. len':>12}"
        f"{'vs TRL':>8}{'rounds':>8}  per-round medians"
    )
    print(head)
    print("-" * len(head))
    verdicts = []
    for t in threads:
        trl = merge(runs[("trl", t)])
        for side in layouts + ["trl"]:
            m = merge(runs[(side, t)])
            name = "TRL GRPOTrainer" if side == "trl" else f"cloudrl (Ray), {LAYOUTS[side][0]}"
            ratio = med(m["interval_s"]) / med(trl["interval_s"])
            # Per round: this configuration's median over TRL's median in the same round (taken
            # minutes apart, so slow spells of the machine hit both).
            per_round = [x / y for x, y in zip(m["round_medians"], trl["round_medians"])]
            print(
                f"{name:<52}{t:>8}{med(m['step_s']):>8.3f}{med(m['interval_s']):>13.3f}{len(m['step_s']):>7}"
                f"{statistics.mean(m['length']):>12.1f}{ratio:>7.2f}x{med(per_round):>7.2f}x  "
                + " ".join(f"{x:.3f}" for x in m["round_medians"])
            )
            if side != "trl":
                verdicts.append((name, t, ratio, per_round))
    print(
        "s/step: median over all counted steps (cloudrl timing/step; TRL on_step_begin->on_step_end); "
        "wall s/step: between consecutive step ends,\neverything either side does per step. vs TRL: wall "
        "s/step over TRL's at the same thread count; rounds: median of the per-round ratios."
    )
    print()
    for name, t, ratio, per_round in verdicts:
        print(
            f"ratio {name}, {t} thread(s) / TRL: {ratio:.3f}x pooled, {med(per_round):.3f}x median of "
            f"{len(per_round)} rounds (range {min(per_round):.3f}-{max(per_round):.3f}; "
            f"{sum(r <= 1.0 for r in per_round)} of {len(per_round)} at or below 1.0) "
            f"(target <= 1.00x: {'met' if ratio <= 1.0 else 'NOT met'})"
        )

    # Where the time goes: per step, then the median over steps of each part.
    # cloudrl's phases: with max_staleness=1 they overlap (the next step starts while the update runs),
    # so they do not add up to the step; actor_between_updates and engine_weight_wait show what each
    # side waited.
    names = [
        "rollout_wait",
        "reward",
        "ref",
        "adv",
        "update_actor",
        "sync",
        "actor_between_updates",
        "engine_weight_wait",
    ]
    print()
    for (side, t), rs in runs.items():
        m = merge(rs)
        if side == "trl":
            parts = [
                {
                    "generate": ph.get("generate", 0.0),
                    "reward": ph.get("reward", 0.0),
                    "adv+rest of prepare": ph.get("prepare", 0.0) - ph.get("generate", 0.0) - ph.get("reward", 0.0),
                    "train forward": ph.get("loss_forward", 0.0),
                    "backward+optimizer+rest": s_ - ph.get("prepare", 0.0) - ph.get("loss_forward", 0.0),
                }
                for ph, s_ in zip(m["phases"], m["step_s"])
            ]
            label = f"TRL, {t} thread(s)"
        else:
            parts = [{"step": ph["step"], **{n: ph.get(n, 0.0) for n in names}} for ph in m["phases"]]
            label = f"cloudrl, {LAYOUTS[side][0]}, {t} thread(s)"
        print(f"{label}, medians (s): " + "  ".join(f"{k} {med([q[k] for q in parts]):.3f}" for k in parts[0]))

    load_after = os.getloadavg()
    print(
        f"\nmachine: nproc {os.cpu_count()}, {platform.processor() or platform.machine()}, python "
        f"{platform.python_version()}; cloudrl side torch {torch.__version__}, transformers "
        f"{transformers.__version__}; TRL side trl {venv_versions['trl']}, torch {venv_versions['torch']}, "
        f"transformers {venv_versions['transformers']}, accelerate {venv_versions['accelerate']}, "
        f"datasets {venv_versions['datasets']}"
    )
    print(
        f"load average (1 min) before/after: {load_before[0]:.1f}/{load_after[0]:.1f}; "
        f"total {time.time() - started:.0f}s"
    )
    if a.keep:
        print(f"runs and logs: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
