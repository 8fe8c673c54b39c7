"""Where the PPO update's time goes: MFU of PolicyWorker.update by layout, with its breakdown.

    python bench/mfu.py                                  # CUDA: a random 1.1B Qwen2, bf16, 64 x ~1k-token sequences
    python bench/mfu.py --size tiny --device cpu         # the same code on CPU in seconds (a smoke run)
    python bench/mfu.py --out mfu.json                   # also write the rows as JSON

Needs torch and transformers only. One PolicyWorker (world size 1, FSDP2 over fp32 masters with bf16 compute
on CUDA, AdamW; no reference, which the update does not use) is built once; each variant then changes only what the config lets a user
change (packing, the micro-batch size or token budget, gradient checkpointing) and runs one
warm-up update and `--repeats` timed ones on the same synthetic batch: prompts of `--prompt-len` tokens and
responses of uniform random length up to `--response-len` (the ragged shape RL produces).

Per variant the table gives: the update's seconds; the warm-up update's (with `model.compile`'s compiled blocks,
that is where the compilation goes); of the update's, the optimizer step (`optimizer.step` and
`zero_grad`, timed between device synchronisations); the forward-only pass over the same batch (PPO's old
log-probs); the host synchronisations the update makes (`torch.cuda.set_sync_debug_mode`); the worker's own
peak memory; and the MFU as the trainer reports it (trainer/roles/flops.py: 6 x matmul parameters + attention,
per token, over the device's dense bf16 peak). The last column is the ratio to the first row (padded
micro-batches at the whole batch's width: the layout before each micro-batch was cut to its own). With the
flash-attn package installed a packed flash_attention_2 row is added. On CPU the MFU is not known (no peak)
and the table shows tokens per second only. `--profile N` profiles one more update of row N (time by kernel
kind, the top kernels, the device's idle time).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_smoke import free_port, import_trainer  # noqa: E402  (the trainer from the installed package or this checkout)

SIZES = {
    # name: hidden, layers, intermediate, heads, kv heads, vocab
    "1.1b": (2048, 22, 5632, 32, 4, 32000),  # TinyLlama-1.1B's shape
    "0.5b": (896, 24, 4864, 14, 2, 32000),  # Qwen2.5-0.5B's, with a 32k vocabulary
    "tiny": (128, 2, 256, 4, 2, 512),  # head dim 32: a CPU smoke run in seconds
}


def build_model(path: str, size: str) -> None:
    """A random Qwen2 of `size` and a word-level tokenizer w0..wN, saved as a local checkpoint."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    hidden, layers, inter, heads, kv, vocab = SIZES[size]
    words = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(vocab - 3)])}
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.save_pretrained(path)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    del model


def synthetic_batch(args, vocab: int):
    """Prompts of --prompt-len tokens, responses of 1..--response-len tokens (uniform), random ids."""
    from cloudrl.trainer.algo.batch import build_batch

    gen = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for _ in range(args.sequences):
        prompts.append(torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist())
        length = int(torch.randint(1, args.response_len + 1, (1,), generator=gen))
        responses.append(torch.randint(3, vocab, (length,), generator=gen).tolist())
    batch = build_batch(prompts, responses, 0)
    mask = batch["response_mask"]
    scores = torch.randn(args.sequences, generator=gen)
    batch["advantages"] = ((scores - scores.mean()) / scores.std()).view(-1, 1) * mask
    return batch


class OptimizerClock:
    """Wraps the worker's optimizer step and zero_grad: seconds between device synchronisations."""

    def __init__(self, worker, sync):
        self.seconds = 0.0
        self.sync = sync
        for name in ("step", "zero_grad"):
            setattr(worker.optimizer, name, self.timed(getattr(worker.optimizer, name)))

    def timed(self, fn):
        def call(*a, **kw):
            self.sync()
            start = time.perf_counter()
            out = fn(*a, **kw)
            self.sync()
            self.seconds += time.perf_counter() - start
            return out

        return call


def count_syncs(fn, cuda: bool):
    """fn()'s result and the host synchronisations it made (CUDA only; 0 on CPU)."""
    if not cuda:
        return fn(), 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, sum("synchroniz" in str(w.message) for w in seen)


def set_variant(worker, variant: dict) -> None:
    """Apply one variant's settings to the live worker: only what its config reads per call."""
    m, a = worker.cfg.model, worker.cfg.actor
    m.pack_sequences = variant["pack"]
    a.micro_batch_size = min(variant["micro"], a.mini_batch_size)
    a.max_tokens_per_micro_batch = variant["tokens"]
    model = worker.model
    if variant["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif model.is_gradient_checkpointing:
        model.gradient_checkpointing_disable()
    attention = variant.get("attention", "sdpa")
    m.attn_implementation = attention
    model.set_attn_implementation(attention)
    set_compiled(worker, variant.get("compile", False))


def set_compiled(worker, compiled: bool) -> None:
    """model.compile on the live worker: its blocks compiled in place as the worker does at start, or back to
    eager (Module.compile keeps the compiled call beside the module's own; dropping it restores eager)."""
    from cloudrl.trainer.inputs.models import transformer_blocks
    from cloudrl.trainer.roles.compile import compile_blocks

    worker.cfg.model.compile = compiled
    blocks = transformer_blocks(worker.model)
    if compiled and not any(b._compiled_call_impl for b in blocks):
        compile_blocks(worker.model, worker.device)
    elif not compiled:
        for block in blocks:
            block._compiled_call_impl = None


@contextlib.contextmanager
def batch_width(trim: bool):
    """With trim=False, padded micro-batches keep the whole batch's width (the layout before Batch.cut)."""
    from cloudrl.trainer.algo.batch import Batch

    if trim:
        yield
        return
    original = Batch.cut
    Batch.cut = lambda self, first, keep: self
    try:
        yield
    finally:
        Batch.cut = original


def run_variant(worker, batch, variant, args, cuda: bool) -> dict:
    with batch_width(variant.get("trim", True)):
        return _run_variant(worker, batch, variant, args, cuda)


def _run_variant(worker, batch, variant, args, cuda: bool) -> dict:
    from cloudrl.trainer.algo.batch import update_shards
    from cloudrl.trainer.algo.step_stats import combine

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    set_variant(worker, variant)
    gap = worker.check_packing() if variant["pack"] else float("nan")  # the start-up self-check, on this kernel
    cfg = worker.cfg
    clock = OptimizerClock(worker, sync)
    rows = []
    for repeat in range(args.repeats + 1):  # the first pays for kernel selection and allocator growth
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        worker.logprobs(batch)
        sync()
        forward_s = time.perf_counter() - start
        shards, norms = update_shards(batch, 1, cfg.actor, cfg.trainer.seed + repeat)
        clock.seconds = 0.0
        sync()
        start = time.perf_counter()
        result, syncs = count_syncs(functools.partial(worker.update, shards[0], norms, 0.0), cuda)
        sync()
        update_s = time.perf_counter() - start
        stats = combine([result.stats])
        rows.append(
            dict(
                update_s=update_s,
                optimizer_s=clock.seconds,
                forward_s=forward_s,
                syncs=syncs,
                # the worker's own peak since its previous update (it resets the counter as it reports)
                peak_gib=stats.get("memory/actor_peak_allocated_gib", float("nan")),
                mfu=stats.get("perf/actor_mfu", float("nan")),
                forward_mfu=stats.get("perf/actor_forward_mfu", float("nan")),
            )
        )
    timed = rows[1:]
    mean = {k: sum(r[k] for r in timed) / len(timed) for k in timed[0]}
    mean["syncs"] = timed[-1]["syncs"]
    mean["peak_gib"] = max(r["peak_gib"] for r in timed)
    mean["packing_gap"] = gap
    mean["first_update_s"] = rows[0]["update_s"]  # the warm-up: with compiled blocks, the compilation too
    return mean


VARIANTS = [
    # before length-sorted micro-batches: every padded micro-batch at the whole batch's width
    dict(name="padded 8, batch width", pack=False, micro=8, tokens=0, checkpointing=False, trim=False),
    # the default: 8 sequences per micro-batch, longest first, each cut to its own width
    dict(name="padded 8, own width", pack=False, micro=8, tokens=0, checkpointing=False),
    dict(name="padded 16, own width", pack=False, micro=16, tokens=0, checkpointing=False),
    dict(name="padded 32, own width", pack=False, micro=32, tokens=0, checkpointing=False),
    dict(name="packed, 4k tokens/micro", pack=True, micro=64, tokens=4096, checkpointing=False),
    dict(name="packed, 8k tokens/micro", pack=True, micro=64, tokens=8192, checkpointing=False),
    dict(name="packed, 16k tokens/micro", pack=True, micro=64, tokens=16384, checkpointing=False),
    dict(name="padded 16 + checkpointing", pack=False, micro=16, tokens=0, checkpointing=True),
    # model.compile: each transformer block compiled (trainer/roles/compile.py); the warm-up pays for compiling
    dict(name="padded 16, compiled blocks", pack=False, micro=16, tokens=0, checkpointing=False, compile=True),
    dict(name="padded 32, compiled blocks", pack=False, micro=32, tokens=0, checkpointing=False, compile=True),
    dict(name="packed 8k, compiled blocks", pack=True, micro=64, tokens=8192, checkpointing=False, compile=True),
    dict(name="padded 16 + checkpointing, compiled", pack=False, micro=16, tokens=0, checkpointing=True, compile=True),
    # a token budget for padded micro-batches (rows x width): many short rows together, few long ones
    dict(
        name="padded, 16k-token budget, compiled", pack=False, micro=64, tokens=16384, checkpointing=False, compile=True
    ),
    dict(
        name="padded, 24k-token budget, compiled", pack=False, micro=64, tokens=24576, checkpointing=False, compile=True
    ),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="1.1b")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--sequences", type=int, default=64, help="a multiple of 8")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=1024, help="responses are 1..this many tokens")
    p.add_argument("--repeats", type=int, default=2, help="timed updates per variant, after one warm-up")
    p.add_argument("--variants", default="", help="comma-separated row numbers (0 = the default layout)")
    p.add_argument("--profile", type=int, default=-1, help="profile one more update of this row: time by kernel kind")
    p.add_argument("--out", default="", help="write the rows as JSON here")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*optimizer.step\\(\\)` has been overridden.*")

    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import_trainer()
    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.inputs.models import quiet_transformers
    from cloudrl.trainer.roles.workers import PolicyWorker

    quiet_transformers()
    cuda = torch.cuda.is_available()
    variants = VARIANTS
    if args.variants:
        variants = [VARIANTS[int(i)] for i in args.variants.split(",")]
    if cuda and has_flash_attn():
        variants = variants + [dict(VARIANTS[6], name="packed 16k, flash_attention_2", attention="flash_attention_2")]
    tmp = tempfile.TemporaryDirectory(prefix="mfu-")
    start = time.perf_counter()
    build_model(tmp.name, args.size)
    print(f"built a random {args.size} Qwen2 in {time.perf_counter() - start:.1f} s", flush=True)
    overrides = [
        f"model.path={tmp.name}",
        f"model.dtype={'bfloat16' if cuda else 'float32'}",
        "model.sft_warmup_steps=0",
        "algorithm.name=grpo",
        f"actor.gpus_per_node={1 if cuda else 0}",
        "actor.lr=1e-6",
        f"data.train_batch_size={max(1, args.sequences // 8)}",
        "rollout.n=8",
        f"actor.mini_batch_size={args.sequences}",
        f"actor.micro_batch_size={min(8, args.sequences)}",
        f"data.max_prompt_length={args.prompt_len}",
        f"rollout.max_new_tokens={args.response_len}",
        f"trainer.run_dir={tmp.name}/run",
    ]
    cfg = load_config("local", overrides)
    worker = PolicyWorker(cfg.to_dict(), tmp.name, rank=0, world_size=1, with_reference=False)
    worker.start_training("127.0.0.1", free_port())
    batch = synthetic_batch(args, SIZES[args.size][5])
    tokens = int(batch["attention_mask"].sum())
    width = batch["attention_mask"].shape[1]
    params = sum(t.numel() for t in worker.model.parameters())
    device = torch.cuda.get_device_name() if cuda else "cpu"
    print(
        f"{device}: {params / 1e9:.2f}B parameters, {args.sequences} sequences, {tokens} real tokens "
        f"({tokens / (args.sequences * width):.0%} of the padded {args.sequences} x {width})",
        flush=True,
    )
    results = []
    for variant in variants:
        try:
            row = run_variant(worker, batch, variant, args, cuda)
        except Exception as exc:  # noqa: BLE001  (a variant the model or kernels cannot run is a row, not the end)
            row = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
            if cuda:
                torch.cuda.empty_cache()
        results.append(dict(variant=variant["name"], tokens=tokens, **row))
        print(json.dumps(results[-1]), flush=True)
    print_table(results, cuda)
    if 0 <= args.profile < len(variants):
        profile(worker, batch, variants[args.profile], cuda)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=device, params=params, rows=results), indent=2))
    return 0 if all("error" not in r for r in results[:1]) else 1


KERNEL_KINDS = (
    # kind, substrings of a kernel's name (lower case), first match wins
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "cudnn", "efficient")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "wgmma", "matmul", "sm90")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    ("copy", ("memcpy", "memset", "copy")),
    ("softmax / log-softmax", ("softmax",)),
)


def kernel_kind(name: str) -> str:
    lower = name.lower()
    for kind, marks in KERNEL_KINDS:
        if any(m in lower for m in marks):
            return kind
    return "other (elementwise, norms, reductions)"


def profile(worker, batch, variant: dict, cuda: bool) -> None:
    """One more update of `variant` under torch.profiler: device time by kernel kind, the top kernels, and the
    update's wall time the device was idle (host work and synchronisations)."""
    from cloudrl.trainer.algo.batch import update_shards
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    set_variant(worker, variant)
    shards, norms = update_shards(batch, 1, worker.cfg.actor, worker.cfg.trainer.seed)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    with batch_width(variant.get("trim", True)), torch_profile(activities=activities) as prof:
        worker.update(shards[0], norms, 0.0)
        sync()
    wall = time.perf_counter() - start
    if not cuda:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        return
    kinds: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        kinds[kernel_kind(event.name)] = kinds.get(kernel_kind(event.name), 0.0) + us
        kernels[event.name] = kernels.get(event.name, 0.0) + us
    busy = sum(kinds.values()) / 1e6
    print(f"profile of one update, {variant['name']}: wall {wall:.3f} s, device busy {busy:.3f} s (kernels summed)")
    for kind, us in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<40} {us / 1e6:8.3f} s  {us / 1e6 / wall:6.1%} of wall")
    print(f"  {'idle (host work, launches, syncs)':<40} {max(0.0, wall - busy):8.3f} s")
    print("  top kernels:")
    for name, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:12]:
        print(f"    {us / 1e6:8.3f} s  {name[:110]}")


def has_flash_attn() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def print_table(results: list[dict], cuda: bool) -> None:
    base = results[0].get("update_s")
    head = [
        "variant",
        "update s",
        "first s",
        "optimizer s",
        "forward s",
        "syncs",
        "peak GiB",
        "tokens/s",
        "MFU",
        "vs row 1",
    ]
    lines = [head]
    for r in results:
        if "error" in r:
            lines.append([r["variant"], r["error"]] + [""] * (len(head) - 2))
            continue
        lines.append(
            [
                r["variant"],
                f"{r['update_s']:.3f}",
                f"{r['first_update_s']:.1f}",
                f"{r['optimizer_s']:.3f}",
                f"{r['forward_s']:.3f}",
                str(r["syncs"]),
                f"{r['peak_gib']:.1f}",
                f"{r['tokens'] / r['update_s']:.0f}",
                f"{r['mfu']:.1%}" if cuda else "n/a",
                f"{base / r['update_s']:.2f}x" if base else "",
            ]
        )
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)))


if __name__ == "__main__":
    sys.exit(main())
