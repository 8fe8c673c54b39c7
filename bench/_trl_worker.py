"""TRL's side of bench/trl_grpo.py: train trl.GRPOTrainer on the benchmark's model and prompts.

Run by bench/trl_grpo.py with bench/.venv-trl/bin/python (TRL, torch, transformers and cloudrl
installed --no-deps there, so the reward is cloudrl's own `arithmetic` function). Not meant to be
run by hand, but it can be:

    bench/.venv-trl/bin/python bench/_trl_worker.py --model-dir DIR --prompts prompts.jsonl \
        --steps 12 --lr 1e-3 --out result.json

It writes one JSON object to --out: the wall time of every optimizer step (on_step_begin ->
on_step_end of a TrainerCallback, which includes generation, reward, advantages, forward, backward
and the optimizer step), the time between consecutive step ends, and what TRL logged each step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, help="materialised builtin:tiny directory")
    p.add_argument("--prompts", required=True, help="JSONL with `prompt` (text) and `ground_truth` per line")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", required=True, help="where to write the result JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch
    import transformers
    import trl
    from cloudrl.trainer.inputs.rewards import arithmetic  # the very function cloudrl's reward worker calls
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    with open(args.prompts, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in rows])

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    tokenizer.padding_side = "left"
    # TRL tokenizes the prompt text itself: check it gets the ids cloudrl samples from.
    for r in rows[:200]:
        if "prompt_ids" in r and tokenizer(r["prompt"])["input_ids"] != r["prompt_ids"]:
            print(f"trl worker: error: TRL's tokenization of {r['prompt']!r} differs from cloudrl's", file=sys.stderr)
            return 1
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)

    completions_per_step = args.prompts_per_step * args.num_generations
    out_dir = tempfile.mkdtemp(prefix="trl-output-", dir=os.path.dirname(os.path.abspath(args.out)))
    config = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        max_steps=args.steps,
        seed=args.seed,
        # 64 completions per optimizer step: 16 prompts x 4 generations, one generation batch per
        # step, one forward/backward over all 64 (cloudrl: mini_batch_size = micro_batch_size = 64).
        per_device_train_batch_size=completions_per_step,
        gradient_accumulation_steps=1,
        generation_batch_size=completions_per_step,
        num_generations=args.num_generations,
        max_completion_length=args.max_new_tokens,
        # The algorithm, set explicitly to TRL 1.16's defaults where cloudrl's config matches them.
        beta=0.0,  # no KL term, no reference model (cloudrl: algorithm.kl_coef=0)
        num_iterations=1,  # one pass, on-policy (cloudrl: actor.ppo_epochs=1)
        loss_type="dapo",  # token mean over the whole batch (cloudrl's aggregate_loss)
        scale_rewards="group",  # (r - group mean) / group std (cloudrl: algorithm.grpo_norm_by_std)
        epsilon=0.2,  # clip range (cloudrl: actor.clip_low = clip_high = 0.2)
        temperature=1.0,
        top_p=1.0,
        top_k=0,  # plain sampling (cloudrl: rollout.temperature/top_p/top_k)
        max_grad_norm=1.0,  # cloudrl: actor.grad_clip
        # Where TRL's defaults differ from cloudrl's, TRL is set to cloudrl's.
        learning_rate=args.lr,
        lr_scheduler_type="constant",  # TRL default: linear decay; cloudrl: constant (warmup_steps=0)
        warmup_steps=0,
        weight_decay=0.0,
        # TRL's default is adamw_torch_fused (cloudrl's too), but TRL measured faster with the plain
        # kernel here (5 of 6 alternating runs; bench/README.md), so TRL gets the faster one.
        optim="adamw_torch",
        bf16=False,
        fp16=False,  # TRL default: bf16; cloudrl: model.dtype=float32
        gradient_checkpointing=False,  # TRL default: on; cloudrl: model.gradient_checkpointing=false
        disable_dropout=True,  # cloudrl always trains without dropout (the model has none anyway)
        mask_truncated_completions=False,
        log_completions=False,
        dataloader_num_workers=0,
    )

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin = None
            self.durations, self.ends, self.logs, self.phases = [], [], [], []
            self.current: dict[str, float] = {}

        def on_step_begin(self, args_, state, control, **kw):
            self.current = {}
            self.begin = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            now = time.perf_counter()
            self.durations.append(now - self.begin)
            self.ends.append(now)
            self.phases.append(dict(self.current))

        def timed(self, name, fn):
            def wrapper(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - t0

            return wrapper

        def on_log(self, args_, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.logs.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[arithmetic],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    # Where a step's time goes (the wrappers cost microseconds): _prepare_inputs is generation,
    # reward and advantages; _generate is the sampling alone; compute_loss the training forward
    # pass. The rest of a step is the backward pass and the optimizer step.
    for phase, name in (
        ("prepare", "_prepare_inputs"),
        ("generate", "_generate"),
        ("reward", "_calculate_rewards"),
        ("loss_forward", "compute_loss"),
    ):
        setattr(trainer, name, timer.timed(phase, getattr(trainer, name)))
    trainer.train()

    result = {
        "step_s": timer.durations,
        "interval_s": [b - a for a, b in zip(timer.ends, timer.ends[1:])],
        "phases": timer.phases,
        "logs": timer.logs,
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "settings": {
            k: str(getattr(config, k))
            for k in (
                "per_device_train_batch_size",
                "generation_batch_size",
                "steps_per_generation",
                "num_generations",
                "max_completion_length",
                "learning_rate",
                "beta",
                "num_iterations",
                "loss_type",
                "scale_rewards",
                "epsilon",
                "temperature",
                "top_p",
                "top_k",
                "lr_scheduler_type",
                "optim",
                "bf16",
                "gradient_checkpointing",
                "max_grad_norm",
            )
        },
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"trl worker: {len(timer.durations)} steps, pid {os.getpid()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
