"""Training throughput and peak memory: padded vs packed sequences vs packed with a token budget.

    python bench/packing.py [--sequences 32] [--max-len 512] [--budget 1024] [--updates 2]

A randomly initialised Llama (about 20M parameters: 8 layers, hidden 384, head dim 64, 8192-token
vocabulary, float32) trains as the actor does (`PolicyWorker.update`: forward, PPO loss, backward, AdamW)
on one batch of `--sequences` sequences: prompts of 16..64 tokens, responses log-uniform in 16..`--max-len`
tokens (reasoning RL's shape: most short, a few long). Three modes, each in a fresh process:

- padded:           `actor.micro_batch_size=8` micro-batches padded to the batch's width (the default);
- packed:           `model.pack_sequences=true`, the same 8 sequences per micro-batch without padding;
- packed + budget:  packed, micro-batches of up to `--budget` tokens (`actor.max_tokens_per_micro_batch`).

Training tokens/s counts the real (prompt and response) tokens of the batch over an update's seconds,
the best of `--updates` updates. Peak memory is the process's highest resident set size during the
updates above its size before them (sampled every 5 ms). Prints one table and the ratios to padded.

Then a LoRA row (`model.lora_rank=--lora-rank`, all-linear, vs full fine-tuning, each in a fresh process after
one update on 8 of the sequences): trainable parameters, the bytes of the actor's checkpoint shards (what
`save_shards` writes: the trained weights and their AdamW moments) and the bytes of one weight push to the
engines (`PolicyWorker.weights`, in model.dtype). `--only lora` runs just that part.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODEL = dict(
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=6,
    num_key_value_heads=6,
    head_dim=64,
    vocab_size=8192,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
MICRO = 8


def _write_model(folder: str) -> int:
    import torch
    from cloudrl.trainer.inputs.demo import build_char_tokenizer
    from cloudrl.trainer.inputs.models import quiet_transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    quiet_transformers()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(pad_token_id=0, eos_token_id=1, bos_token_id=None, **MODEL))
    model.save_pretrained(folder)
    build_char_tokenizer().save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _batch(sequences: int, max_len: int, seed: int = 0):
    import torch
    from cloudrl.trainer.algo.batch import build_batch

    gen = torch.Generator().manual_seed(seed)
    vocab = MODEL["vocab_size"]
    prompt_lengths = torch.randint(16, 65, (sequences,), generator=gen).tolist()
    u = torch.rand(sequences, generator=gen)
    response_lengths = torch.exp(math.log(16) + u * (math.log(max_len) - math.log(16))).round().long().tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in prompt_lengths]
    responses = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in response_lengths]
    batch = build_batch(prompts, responses, pad_id=0)
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=gen) * batch["response_mask"]
    return batch


def _run_mode(mode: str, folder: str, args, out) -> None:
    import torch
    from checkpoint import PeakRss
    from cloudrl.trainer.algo.batch import update_shards
    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.inputs.models import quiet_transformers
    from cloudrl.trainer.roles.packing import micro_batches
    from cloudrl.trainer.roles.workers import PolicyWorker

    quiet_transformers()
    torch.set_num_threads(args.threads)
    extra = {
        "padded": [],
        "packed": ["model.pack_sequences=true"],
        "packed + budget": ["model.pack_sequences=true", f"actor.max_tokens_per_micro_batch={args.budget}"],
    }[mode]
    n = args.sequences
    cfg = load_config(
        "local",
        [
            f"model.path={folder}",
            "model.sft_warmup_steps=0",
            f"data.train_batch_size={n}",
            "rollout.n=1",
            "algorithm.name=reinforce_pp",
            "algorithm.kl_coef=0",
            f"actor.mini_batch_size={n}",
            f"actor.micro_batch_size={MICRO}",
            *extra,
        ],
    )
    worker = PolicyWorker(cfg.to_dict(), folder)
    worker.start_training()
    batch = _batch(n, args.max_len)
    a = cfg.actor
    groups = micro_batches(batch, a.micro_batch_size, a.max_tokens_per_micro_batch, cfg.model.pack_sequences)
    width = batch["input_ids"].shape[1]
    grid = sum(len(mb["attention_mask"]) * width for _, mb in groups)
    real = int(batch["attention_mask"].sum())
    computed = real if cfg.model.pack_sequences else grid
    seconds = []
    with PeakRss() as peak:
        for _ in range(args.updates):
            shards, norms = update_shards(batch, 1, cfg.actor, seed=0)
            start = time.perf_counter()
            worker.update(shards[0], norms, kl_coef=0.0)
            seconds.append(time.perf_counter() - start)
    out[mode] = {
        "micro": len(groups),
        "computed": computed,
        "real": real,
        "seconds": min(seconds),
        "peak_mib": peak.delta / 2**20,
    }


def _run_lora(mode: str, folder: str, args, out) -> None:
    import torch
    from cloudrl.trainer.algo.batch import update_shards
    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.inputs.models import quiet_transformers
    from cloudrl.trainer.roles.workers import PolicyWorker

    quiet_transformers()
    torch.set_num_threads(args.threads)
    n = 8
    lora = [f"model.lora_rank={args.lora_rank}", f"model.lora_alpha={2 * args.lora_rank}"] if mode == "lora" else []
    cfg = load_config(
        "local",
        [
            f"model.path={folder}",
            "model.sft_warmup_steps=0",
            f"data.train_batch_size={n}",
            "rollout.n=1",
            "algorithm.name=reinforce_pp",
            "algorithm.kl_coef=0",
            f"actor.mini_batch_size={n}",
            f"actor.micro_batch_size={n}",
            "model.pack_sequences=true",
            *lora,
        ],
    )
    worker = PolicyWorker(cfg.to_dict(), folder)
    worker.start_training()
    batch = _batch(n, 64, seed=1)
    shards, norms = update_shards(batch, 1, cfg.actor, seed=0)
    worker.update(shards[0], norms, kl_coef=0.0)  # the optimizer's moments exist from here
    with tempfile.TemporaryDirectory(prefix="cloudrl-bench-lora-") as ckpt:
        worker.save_shards(os.path.join(ckpt, "actor"))
        written = sum(f.stat().st_size for f in os.scandir(os.path.join(ckpt, "actor")))
    pushed = sum(t.nbytes for _, t in worker.weights())
    out[mode] = {
        "trainable": sum(p.numel() for p in worker.model.parameters() if p.requires_grad),
        "checkpoint": written,
        "push": pushed,
        "push_tensors": len(worker.weights()),
    }


def _lora_table(folder: str, args, ctx, results) -> None:
    for mode in ("full", "lora"):
        proc = ctx.Process(target=_run_lora, args=(mode, folder, args, results))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            sys.exit(f"{mode}: the LoRA benchmark process failed (exit code {proc.exitcode})")
    full, lora = results["full"], results["lora"]
    print()
    print("| actor | trainable parameters | checkpoint MiB | weight push MiB (tensors) |")
    print("|---|---:|---:|---:|")
    for mode, label in (("full", "full fine-tuning"), ("lora", f"LoRA rank {args.lora_rank}, all-linear")):
        r = results[mode]
        print(
            f"| {label} | {r['trainable'] / 1e6:.2f}M | {r['checkpoint'] / 2**20:.1f} | "
            f"{r['push'] / 2**20:.1f} ({r['push_tensors']}) |"
        )
    print()
    print(
        f"LoRA / full: trainable parameters {lora['trainable'] / full['trainable']:.3f}x, checkpoint "
        f"{lora['checkpoint'] / full['checkpoint']:.3f}x, weight push {lora['push'] / full['push']:.2f}x "
        f"(the engines get the merged model)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=32, help="sequences per batch (one optimizer step)")
    parser.add_argument("--max-len", type=int, default=512, help="longest response (the issue's shape: 1024)")
    parser.add_argument("--budget", type=int, default=1024, help="tokens per micro-batch of packed + budget")
    parser.add_argument("--updates", type=int, default=2, help="timed updates per mode (the best counts)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--lora-rank", type=int, default=16, help="model.lora_rank of the LoRA row")
    parser.add_argument("--only", choices=("packing", "lora"), help="run one part (default: both)")
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    with tempfile.TemporaryDirectory(prefix="cloudrl-bench-packing-") as folder:
        params = _write_model(folder)
        print(
            f"model: Llama, {params / 1e6:.1f}M parameters, float32, {args.threads} torch threads; "
            f"{args.sequences} sequences, prompts 16..64 tokens, responses log-uniform 16..{args.max_len} tokens"
            + (" (scaled down from 1024 to run in minutes on 2 cores)" if args.max_len < 1024 else "")
        )
        if args.only != "packing":
            _lora_table(folder, args, ctx, results)
        if args.only == "lora":
            return
        for mode in ("padded", "packed", "packed + budget"):
            proc = ctx.Process(target=_run_mode, args=(mode, folder, args, results))
            proc.start()
            proc.join()
            if proc.exitcode != 0:
                sys.exit(f"{mode}: the benchmark process failed (exit code {proc.exitcode})")
    base = results["padded"]
    print()
    print("| mode | micro-batches | tokens computed | real tokens | s/update | training tokens/s | peak MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode in ("padded", "packed", "packed + budget"):
        r = results[mode]
        label = f"packed + budget {args.budget}" if mode == "packed + budget" else mode
        print(
            f"| {label} | {r['micro']} | {r['computed']} | {r['real']} | {r['seconds']:.2f} | "
            f"{r['real'] / r['seconds']:.0f} | {r['peak_mib']:.0f} |"
        )
    print()
    for mode in ("packed", "packed + budget"):
        r = results[mode]
        print(
            f"{mode} / padded: tokens/s {base['seconds'] / r['seconds']:.2f}x, "
            f"peak memory {r['peak_mib'] / max(base['peak_mib'], 1e-9):.2f}x"
        )


if __name__ == "__main__":
    main()
