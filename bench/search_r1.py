"""The local search task on CPU: the policy learns to search. Reward and searches per sample over a
short PPO run (docs/search-r1.md has the measured table).

    python bench/search_r1.py                 # ~3.5 minutes on 2 cores; --steps N, --size N, --seed N
    python bench/search_r1.py --steps 20 actor.lr=1e-4   # key=value: more config overrides
    python bench/search_r1.py --out /tmp/demo            # where it writes (default runs/search-r1-demo)

It writes the task (trainer/agents/search_task.py: 2,000 made-up names with one-digit codes to train on, 128
held-out ones to validate on, a corpus of all the facts), indexes the corpus with BM25, serves it on
127.0.0.1 (trainer/search/retriever_server.py), and warms the tiny model up on other made-up names: the
format, copying the name into the query, reading the code out of the observation, and searching in
about 1 sample in 5 (the others answer at once with a random digit). The header line says how well the
warmed-up model copies and reads on the held-out names and how often it chooses to search. Then it
trains with PPO and multi-turn search rollouts (one search per sample at most) and prints, per block
of steps, the mean reward (chance: 0.1), searches per sample, valid-call rate, turns and observation
tokens per sample.

Everything it writes stays in --out (task/, index/, model/, run/; a second run replaces them), so the
paths its summary names exist after it ends. Each phase prints a line as it starts, the warm-up every
50 steps and the training every step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OUTPUTS = ("task", "index", "model", "run")
"""What the demo writes under --out; a second run replaces these (and nothing else there)."""
KEYS = [
    "rollout/reward_mean",
    "search/searches_per_sample",
    "search/valid_call_rate",
    "search/turns_per_sample",
    "search/observation_tokens",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--size", type=int, default=2000, help="facts the training prompts ask about")
    parser.add_argument("--val-size", type=int, default=128, help="held-out facts for validation")
    parser.add_argument("--warmup-steps", type=int, default=300)
    parser.add_argument("--search-share", type=float, default=0.2, help="warm-up: how often the model searches")
    parser.add_argument("--block", type=int, default=10, help="steps per table row")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--out", type=Path, default=Path("runs/search-r1-demo"), help="where the task, index, model and run go"
    )
    parser.add_argument("overrides", nargs="*", help="more config overrides (key=value), after the bench's own")
    return parser.parse_args(argv)


def say(line: str) -> None:
    print(f"search demo: {line}", flush=True)


def fresh_out(out: Path) -> Path:
    """`out`, absolute, without a previous run's outputs (a run directory left there would be resumed)."""
    out = out.expanduser().resolve()
    old = [out / name for name in OUTPUTS if (out / name).exists()]
    if old:
        say(f"replacing the previous demo's {', '.join(p.name for p in old)} in {out}")
    for path in old:
        shutil.rmtree(path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def warm_up_progress(steps: int, every: int = 50):
    """A warm-up progress callback: one line every `every` steps and at the last, with the loss and time."""
    t0 = time.perf_counter()

    def progress(step: int, loss: float) -> None:
        if step % every == 0 or step == steps:
            say(f"warm-up step {step}/{steps}, loss {loss:.3f}, {time.perf_counter() - t0:.0f}s")

    return progress


def main(argv: list[str] | None = None) -> dict[str, Path]:
    """Run the demo; returns the files and directories its summary names (all under --out)."""
    args = parse_args(argv)

    from cloudrl.trainer.agents.search_task import make_facts, rl_overrides, warm_up_model, warm_up_report, write_task
    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.driver import train
    from cloudrl.trainer.inputs.demo import WarmUp
    from cloudrl.trainer.search.retriever_server import RetrieverServer, build_index, load_index

    out = fresh_out(args.out)
    say(f"writing the task to {out / 'task'}: {args.size} training facts, {args.val_size} held-out ones")
    paths = write_task(out / "task", args.size, args.val_size, args.seed)
    facts = make_facts(args.size + args.val_size, args.seed)
    say(f"indexing {len(facts)} facts with BM25 into {out / 'index'}")
    build_index(paths["corpus"], out / "index")
    server = RetrieverServer(("127.0.0.1", 0), load_index(out / "index"), topk=1)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/retrieve"
    try:
        say(f"retriever on {url}; warming the tiny model up on other names: {args.warmup_steps} steps")
        t0 = time.perf_counter()
        schedule = WarmUp(steps=args.warmup_steps, share=args.search_share, seed=args.seed)
        model = warm_up_model(
            out / "model", {name for name, _ in facts}, schedule, progress=warm_up_progress(args.warmup_steps)
        )
        warmup_s = time.perf_counter() - t0
        say(f"measuring the warmed-up model on the {args.val_size} held-out names")
        report = warm_up_report(model, facts[args.size :])
        warm = (
            f"warm-up {warmup_s:.0f}s (on {args.val_size} names it never saw: copies {report['copy']:.2f}, "
            f"reads {report['read']:.2f}, searches with p {report['p_search']:.2f})"
        )
        say(warm)
        cfg = load_config(
            "local",
            rl_overrides(paths["prompts"], paths["val"], url, model)
            + [
                "data.train_batch_size=16",
                "data.val_batch_size=64",
                "actor.mini_batch_size=128",
                "actor.micro_batch_size=128",  # one update per step of 16 x 8 samples
                "critic.mini_batch_size=128",
                "critic.micro_batch_size=128",
                f"trainer.total_steps={args.steps}",
                "trainer.val_every=0",
                "trainer.save_every=0",
                f"trainer.run_dir={out / 'run'}",
                "trainer.loggers=[console,jsonl]",  # a line per step: the table comes from metrics.jsonl
                "trainer.export_hf=false",
                f"trainer.seed={args.seed}",
                *args.overrides,
            ],
        )
        say(
            f"training: {args.steps} PPO steps with search rollouts, validating before and after "
            f"(the whole config: {out / 'run' / 'config.yaml'})"
        )
        t0 = time.perf_counter()
        summary = train(cfg)
        train_s = time.perf_counter() - t0
    finally:
        server.shutdown()
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) > 0 and "rollout/reward_mean" in r]
    files = outputs(out, summary)
    print(format_summary(warm, steps, train_s, summary, args.block, files))
    return files


def outputs(out: Path, summary: dict) -> dict[str, Path]:
    """The demo's files its summary names, by what they are."""
    files = {
        "task (prompts, held-out prompts, corpus)": out / "task",
        "BM25 index": out / "index",
        "warmed-up model": out / "model",
        "run directory": out / "run",
        "metrics": Path(summary["metrics"]),
        "config": out / "run" / "config.yaml",
    }
    if summary.get("checkpoint"):
        files["checkpoint"] = Path(summary["checkpoint"])
    return files


def format_summary(
    warm: str, steps: list[dict], train_s: float, summary: dict, block: int, files: dict[str, Path]
) -> str:
    """The header line, the table by blocks of `block` steps, and where every file is."""
    first = steps[0]
    lines = [
        "",
        f"{warm}, {len(steps)} PPO steps {train_s:.0f}s; greedy val reward "
        f"{summary['val_reward_before_rl']:.2f} -> {summary['val_reward_after_rl']:.2f}; step 1: reward "
        f"{first['rollout/reward_mean']:.2f}, searches/sample {first['search/searches_per_sample']:.2f}",
        "",
        "| steps | reward | searches/sample | valid calls | turns/sample | obs tokens/sample |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for start in range(0, len(steps), block):
        rows = steps[start : start + block]
        means = [sum(r.get(k, 0.0) for r in rows) / len(rows) for k in KEYS]
        lines.append(f"| {rows[0]['step']}-{rows[-1]['step']} | " + " | ".join(f"{m:.2f}" for m in means) + " |")
    lines += ["", "files (kept; the next run replaces them):"]
    width = max(len(label) for label in files)
    lines += [f"  {label.ljust(width)}  {path}" for label, path in files.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
