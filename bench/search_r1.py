"""The local search task on CPU: the policy learns to search. Reward and searches per sample over a
short PPO run (docs/search-r1.md has the measured table).

    python bench/search_r1.py                 # ~3.5 minutes on 2 cores; --steps N, --size N, --seed N
    python bench/search_r1.py --steps 20 actor.lr=1e-4   # key=value: more config overrides

It writes the task (trainer/search/task.py: 2,000 made-up names with one-digit codes to train on, 128
held-out ones to validate on, a corpus of all the facts), indexes the corpus with BM25, serves it on
127.0.0.1 (trainer/search/retriever_server.py), and warms the tiny model up on other made-up names: the
format, copying the name into the query, reading the code out of the observation, and searching in
about 1 sample in 5 (the others answer at once with a random digit). The header line says how well the
warmed-up model copies and reads on the held-out names and how often it chooses to search. Then it
trains with PPO and multi-turn search rollouts (one search per sample at most) and prints, per block
of steps, the mean reward (chance: 0.1), searches per sample, valid-call rate, turns and observation
tokens per sample.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--size", type=int, default=2000, help="facts the training prompts ask about")
    parser.add_argument("--val-size", type=int, default=128, help="held-out facts for validation")
    parser.add_argument("--warmup-steps", type=int, default=300)
    parser.add_argument("--search-share", type=float, default=0.2, help="warm-up: how often the model searches")
    parser.add_argument("--block", type=int, default=10, help="steps per table row")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="more config overrides (key=value), after the bench's own")
    args = parser.parse_args()

    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.driver import train
    from cloudrl.trainer.search.retriever_server import RetrieverServer, build_index, load_index
    from cloudrl.trainer.search.task import make_facts, rl_overrides, warm_up_model, warm_up_report, write_task

    with tempfile.TemporaryDirectory(prefix="cloudrl-search-bench-") as tmp:
        work = Path(tmp)
        paths = write_task(work / "task", args.size, args.val_size, args.seed)
        facts = make_facts(args.size + args.val_size, args.seed)
        build_index(paths["corpus"], work / "index")
        server = RetrieverServer(("127.0.0.1", 0), load_index(work / "index"), topk=1)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        t0 = time.perf_counter()
        model = warm_up_model(
            work / "model",
            {name for name, _ in facts},
            steps=args.warmup_steps,
            search_share=args.search_share,
            seed=args.seed,
        )
        warmup_s = time.perf_counter() - t0
        report = warm_up_report(model, facts[args.size :])
        url = f"http://127.0.0.1:{server.server_port}/retrieve"
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
                f"trainer.run_dir={work / 'run'}",
                "trainer.loggers=[jsonl]",
                "trainer.export_hf=false",
                f"trainer.seed={args.seed}",
                *args.overrides,
            ],
        )
        t0 = time.perf_counter()
        summary = train(cfg)
        train_s = time.perf_counter() - t0
        rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
        server.shutdown()
    steps = [r for r in rows if r.get("step", 0) > 0 and "rollout/reward_mean" in r]
    first = steps[0]
    print(
        f"\nwarm-up {warmup_s:.0f}s (on {args.val_size} names it never saw: copies {report['copy']:.2f}, "
        f"reads {report['read']:.2f}, searches with p {report['p_search']:.2f}), "
        f"{len(steps)} PPO steps {train_s:.0f}s; greedy val reward {summary['val_reward_before_rl']:.2f} -> "
        f"{summary['val_reward_after_rl']:.2f}; step 1: reward {first['rollout/reward_mean']:.2f}, "
        f"searches/sample {first['search/searches_per_sample']:.2f}\n"
    )
    keys = [
        "rollout/reward_mean",
        "search/searches_per_sample",
        "search/valid_call_rate",
        "search/turns_per_sample",
        "search/observation_tokens",
    ]
    print("| steps | reward | searches/sample | valid calls | turns/sample | obs tokens/sample |")
    print("|---|---:|---:|---:|---:|---:|")
    for start in range(0, len(steps), args.block):
        block = steps[start : start + args.block]
        means = [sum(r.get(k, 0.0) for r in block) / len(block) for k in keys]
        print(f"| {block[0]['step']}-{block[-1]['step']} | " + " | ".join(f"{m:.2f}" for m in means) + " |")


if __name__ == "__main__":
    main()
