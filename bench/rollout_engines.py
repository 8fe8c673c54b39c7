"""Rollout throughput of the transformers engine and the vLLM engine, and the cost of a weight sync.

    python bench/rollout_engines.py                  # 256 prompts x 64 new tokens, ~20M-parameter Llama
    python bench/rollout_engines.py --repeats 3      # more timed runs (the fastest is reported)

What it does, all on CPU unless the machine has a GPU:
1. Builds a ~20M-parameter Llama from a config (head dim 64, 8192-token word-level vocabulary, random
   weights) and saves it with its tokenizer, so both engines load the same directory.
2. Generates 256 random prompts (16-48 tokens) x 64 new tokens at temperature 1 with HFEngine and
   VLLMEngine, in this process with the same torch threads, after a short warm-up run each; reports
   generated tokens per second.
3. Times a weight sync the way the trainer does it on CPU: the full state dict goes into the Ray object
   store once and a RolloutWorker actor (a real vLLM engine) loads it; and, for comparison, the same
   `load_weights` in this process.
4. Times a representative PPO step without the sync: the vLLM rollout above, plus the policy's old
   log-probs (a forward pass) and one update (forward, backward, AdamW) over the same 256 sequences,
   and reports the sync as a share of the step. Critic, reference and reward would only make the step
   longer, so the share is an upper bound.

Results and the machine they were measured on: bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import replace

import torch

BENCH_CONFIG = dict(
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=6,
    num_key_value_heads=6,
    head_dim=64,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
VOCAB = 8192


def build_model(path: str) -> int:
    """A random Llama and a word-level tokenizer (tokens are ids; the bench never needs text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 3)])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=256,
    )
    config = LlamaConfig(vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=None, **BENCH_CONFIG)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def make_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(16, 48))] for _ in range(count)]


def timed_generate(engine, prompts, settings, repeats: int) -> tuple[float, int, list]:
    """Best wall time over `repeats` runs after a short warm-up run, the tokens generated, and the
    completions."""
    engine.generate(prompts[:32], replace(settings, max_new_tokens=8))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = engine.generate(prompts, settings)
        times.append(time.perf_counter() - start)
    return min(times), sum(len(c.token_ids) for c in out), out


def update_time(model, prompts, completions, micro_batch: int = 64) -> float:
    """Old log-probs (no grad) plus one forward/backward/AdamW step over the rollout batch."""
    seqs = [p + c.token_ids for p, c in zip(prompts, completions)]
    width = max(map(len, seqs))
    ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(s) for s in seqs])[:, None]).long()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(seqs), micro_batch):
            model(input_ids=ids[i : i + micro_batch], attention_mask=mask[i : i + micro_batch], use_cache=False)
    model.train()
    for i in range(0, len(seqs), micro_batch):
        logits = model(
            input_ids=ids[i : i + micro_batch], attention_mask=mask[i : i + micro_batch], use_cache=False
        ).logits
        logits.float().log_softmax(-1).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    return time.perf_counter() - start


def ray_sync_times(path: str, cfg, named: list, repeats: int) -> list[float]:
    """ray.put of the state dict + a RolloutWorker actor's load_weights, as driver.sync_weights does."""
    import ray
    from cloudrl.trainer.algo.batch import to_wire
    from cloudrl.trainer.roles.workers import RolloutWorker

    named = [(name, to_wire(t)) for name, t in named]  # as PolicyWorker.weights sends them
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        worker = ray.remote(num_cpus=1)(RolloutWorker).remote(cfg.to_dict(), path)
        ray.get(worker.load_weights.remote(ray.put(named)))  # warm-up (and waits for the engine start)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            ray.get(worker.load_weights.remote(ray.put(named)))
            times.append(time.perf_counter() - start)
        return times
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=256, help="Prompts per generation run.")
    parser.add_argument("--new-tokens", type=int, default=64, help="New tokens per prompt.")
    parser.add_argument("--repeats", type=int, default=1, help="Timed runs per engine after the warm-up.")
    args = parser.parse_args()

    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.rollout.engines import HFEngine, SamplingSettings
    from cloudrl.trainer.rollout.vllm_engine import VLLMEngine

    path = tempfile.mkdtemp(prefix="cloudrl-bench-")
    n_params = build_model(path)
    prompts = make_prompts(args.prompts)
    settings = SamplingSettings(n=1, max_new_tokens=args.new_tokens, temperature=1.0, seed=1)
    cfg = load_config(
        "local", ["rollout.engine=vllm", f"rollout.max_new_tokens={args.new_tokens}", "data.max_prompt_length=64"]
    )
    print(
        f"model: {n_params / 1e6:.1f}M parameters, {args.prompts} prompts x {args.new_tokens} new tokens, "
        f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs ({platform.machine()})"
    )

    hf = HFEngine.load(path)
    hf_time, hf_tokens, _ = timed_generate(hf, prompts, settings, args.repeats)
    print(f"hf    {hf_tokens} tokens in {hf_time:.2f}s")

    start = time.perf_counter()
    vllm = VLLMEngine(path, cfg)
    print(f"vllm  engine start {time.perf_counter() - start:.1f}s")
    vllm_time, vllm_tokens, completions = timed_generate(vllm, prompts, settings, args.repeats)
    print(f"vllm  {vllm_tokens} tokens in {vllm_time:.2f}s")

    named = [(name, p.detach().clone()) for name, p in hf.model.named_parameters()]
    local = []
    for _ in range(4):
        start = time.perf_counter()
        vllm.load_weights(named)
        local.append(time.perf_counter() - start)
    local_sync = statistics.median(local[1:])
    train_time = update_time(hf.model, prompts, completions)
    ray_sync = statistics.median(ray_sync_times(path, cfg, named, 3))
    step = vllm_time + train_time

    size_mb = sum(t.numel() * t.element_size() for _, t in named) / 2**20
    rows = [
        ("engine", "tokens", "seconds", "tokens/s"),
        ("hf", hf_tokens, f"{hf_time:.2f}", f"{hf_tokens / hf_time:.0f}"),
        ("vllm", vllm_tokens, f"{vllm_time:.2f}", f"{vllm_tokens / vllm_time:.0f}"),
    ]
    print()
    for row in rows:
        print(f"| {row[0]:<6} | {row[1]!s:>7} | {row[2]:>7} | {row[3]:>8} |")
    print(f"\nvllm / hf tokens per second: {(vllm_tokens / vllm_time) / (hf_tokens / hf_time):.2f}x")
    print(
        f"weight sync ({size_mb:.0f} MiB): {ray_sync:.3f}s through the Ray object store, "
        f"{local_sync:.3f}s in-process load_weights"
    )
    print(
        f"step without sync: {step:.2f}s (vllm rollout {vllm_time:.2f}s + old log-probs and one update "
        f"{train_time:.2f}s)"
    )
    print(
        f"sync share of the step: {ray_sync / (step + ray_sync):.1%} (object store), "
        f"{local_sync / (step + local_sync):.1%} (in-process)"
    )
    print(
        f"load average at the end (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())} "
        f"on {os.cpu_count()} CPUs; other work on the machine slows either engine"
    )


if __name__ == "__main__":
    main()
