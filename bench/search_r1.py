"""The local search task on CPU: reward and searches per sample over a short PPO run (docs/search-r1.md
has the measured tables; the policy does not learn to search yet).

    python bench/search_r1.py                 # ~4 minutes on 2 cores; --steps N, --size N

It writes the task (trainer/search_task.py: 64 made-up names with one-digit codes, a corpus of the
facts), indexes the corpus with BM25, serves it on 127.0.0.1 (trainer/retriever_server.py), warms the
tiny model up (the format, and reading an observation, but it searches in only half of the examples),
and trains with
PPO and multi-turn search rollouts (one search per sample at most). Then it prints, per block of steps,
the mean reward (chance: 0.1), searches per sample, valid-call rate and observation tokens per sample.
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
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--size", type=int, default=64, help="facts in the corpus")
    parser.add_argument("--warmup-steps", type=int, default=150)
    parser.add_argument("--block", type=int, default=10, help="steps per table row")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.driver import train
    from cloudrl.trainer.retriever_server import RetrieverServer, build_index, load_index
    from cloudrl.trainer.search_task import make_facts, warm_up_model, write_task

    with tempfile.TemporaryDirectory(prefix="cloudrl-search-bench-") as tmp:
        work = Path(tmp)
        paths = write_task(work / "task", args.size, args.seed)
        build_index(paths["corpus"], work / "index")
        server = RetrieverServer(("127.0.0.1", 0), load_index(work / "index"), topk=1)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        t0 = time.perf_counter()
        model = warm_up_model(work / "model", make_facts(args.size, args.seed), steps=args.warmup_steps,
                              seed=args.seed)
        warmup_s = time.perf_counter() - t0
        cfg = load_config("local", [
            f"model.path={model}", "model.sft_warmup_steps=0",
            f"data.train_files={paths['prompts']}", f"data.val_files={paths['prompts']}",
            "data.train_batch_size=16", "data.val_batch_size=64", "reward.function=answer_em", "algorithm.kl_coef=0.01",
            "algorithm.lam=1.0",  # as Search-R1: with lam < 1 the long observation span decays the credit of a search
            "rollout.n=8", "rollout.max_new_tokens=24",
            "search.enabled=true", f"search.url=http://127.0.0.1:{server.server_port}/retrieve", "search.topk=1",
            "search.max_turns=1", "search.max_response_tokens=112", "search.max_obs_tokens=64",
            "actor.lr=2e-4", "critic.lr=1e-3",  # 10x below the arithmetic preset's: responses are ~20x longer
            "actor.mini_batch_size=128", "actor.micro_batch_size=128",
            "critic.mini_batch_size=128", "critic.micro_batch_size=128",
            f"trainer.total_steps={args.steps}", "trainer.val_every=0", "trainer.save_every=0",
            f"trainer.run_dir={work / 'run'}", "trainer.loggers=[jsonl]", "trainer.export_hf=false",
            f"trainer.seed={args.seed}",
        ])
        t0 = time.perf_counter()
        summary = train(cfg)
        train_s = time.perf_counter() - t0
        rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
        server.shutdown()
    steps = [r for r in rows if r.get("step", 0) > 0 and "rollout/reward_mean" in r]
    print(f"\nwarm-up {warmup_s:.0f}s, {len(steps)} PPO steps {train_s:.0f}s; "
          f"greedy val reward {summary['val_reward_before_rl']:.2f} -> {summary['val_reward_after_rl']:.2f}\n")
    keys = ["rollout/reward_mean", "search/searches_per_sample", "search/valid_call_rate",
            "search/turns_per_sample", "search/observation_tokens"]
    print("| steps | reward | searches/sample | valid calls | turns/sample | obs tokens/sample |")
    print("|---|---:|---:|---:|---:|---:|")
    for start in range(0, len(steps), args.block):
        block = steps[start:start + args.block]
        means = [sum(r.get(k, 0.0) for r in block) / len(block) for k in keys]
        print(f"| {block[0]['step']}-{block[-1]['step']} | " + " | ".join(f"{m:.2f}" for m in means) + " |")


if __name__ == "__main__":
    main()
