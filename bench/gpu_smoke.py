"""Single-GPU smoke test of the trainer's GPU code path, in one process, without Ray or vLLM.

    python bench/gpu_smoke.py                                   # ~100M-parameter random Qwen2, bf16, CUDA
    python bench/gpu_smoke.py --model /path/to/checkpoint       # a real local checkpoint instead
    python bench/gpu_smoke.py --model tiny --steps 2            # the built-in tiny model (CPU, CI)
    python bench/gpu_smoke.py --out results.json                # also write the results as JSON
    python bench/gpu_smoke.py --world 2                         # 2 GPUs: FSDP2 over NCCL across 2 ranks

Needs torch and transformers only (Ray and vLLM are imported only if installed, vLLM only with CUDA).
It runs trainer/roles/workers.py's PolicyWorker as one rank (world size 1): the NCCL process group, FSDP2
sharding with bf16 mixed precision over fp32 master weights (`actor.fsdp=true` on CUDA), AdamW, the
frozen reference, log-probs and the PPO update with a KL term; rollouts come from a separate HFEngine
that receives the policy's weights through `PolicyWorker.weights()` and `load_weights` each step (the
object-store weight sync, without the object store). It prints a table (generation and update
throughput, trainer-vs-engine log-prob gap, peak memory, an MFU estimate against `--peak-tflops`,
default 989 = H100 SXM dense bf16) and exits 1 unless every parameter changed and all numbers are finite.
With CUDA and vLLM 0.32 installed it also runs a VLLMEngine with sleep mode and a weight reload.

With `--world N` it runs one process per rank (GPU r as that process's only device): FSDP2 really splits
the parameters and NCCL carries the collectives; rank 0 generates and broadcasts the batch. What it does
not show: NCCL across nodes, the NCCL and CUDA IPC weight transfer to vLLM (weight_sync.py), and anything
about Ray actors and placement. On CPU (`--device cpu`, the default without CUDA) the worker
does not shard (FSDP applies to CPU workers only when there are several), and runs in float32.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch


def import_trainer():
    """cloudrl.trainer, from the installed package or, if it is not installed, from this checkout."""
    try:
        import cloudrl.trainer  # noqa: F401
    except ImportError:
        root = Path(__file__).resolve().parents[1] / "trainer"
        pkg = types.ModuleType("cloudrl")
        pkg.__path__ = []
        sys.modules["cloudrl"] = pkg
        spec = importlib.util.spec_from_file_location(
            "cloudrl.trainer", root / "__init__.py", submodule_search_locations=[str(root)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["cloudrl.trainer"] = module
        spec.loader.exec_module(module)


def build_synthetic(path: str, hidden: int, layers: int, vocab: int = 4096) -> None:
    """A random Qwen2 (head dim 64) and a word-level tokenizer whose tokens are w0..wN."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(vocab - 3)])}
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=2048,
    )
    heads = max(1, hidden // 64)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)


def make_prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    special = set(tokenizer.all_special_ids)
    ids = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 49, (count,), generator=gen).tolist()
    return [ids[torch.randint(len(ids), (n,), generator=gen)].tolist() for n in lengths]


def clock(cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def masked_mean_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).sum() / mask.sum().clamp(min=1))


def vllm_section(args, model_path: str, worker, prompts, settings, overrides) -> dict:
    """Start a VLLMEngine with sleep mode, generate, sleep, wake, reload the policy's weights, generate."""
    from cloudrl.trainer.algo.batch import build_batch, from_wire
    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.rollout.vllm_engine import VLLMEngine, check_vllm_available

    check_vllm_available()
    cfg = load_config(
        "local",
        overrides
        + [
            "rollout.engine=vllm",
            "rollout.sleep_between_rollouts=true",
            f"rollout.gpu_memory_utilization={args.vllm_memory}",
        ],
    )
    engine = VLLMEngine(model_path, cfg)
    engine.generate(prompts[:2], settings)  # warm-up
    start = clock(True)
    out = engine.generate(prompts, settings)
    seconds = clock(True) - start
    engine.sleep()
    engine.wake_weights()
    engine.load_weights((name, from_wire(t)) for name, t in worker.weights())
    engine.wake_kv_cache()
    after = engine.generate(prompts, settings)
    batch = build_batch(
        [p for p in prompts for _ in range(settings.n)],
        [c.token_ids for c in after],
        worker.tokenizer.pad_token_id,
        [c.logprobs for c in after],
    )
    diff = masked_mean_abs(worker.logprobs(batch), batch["engine_logprobs"], batch["response_mask"])
    return {"vllm_tokens_per_s": sum(len(c.token_ids) for c in out) / seconds, "vllm_logprob_diff_after_reload": diff}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_ranks(args, argv: list[str]) -> int:
    """Run this script once per rank (one GPU each, as CUDA_VISIBLE_DEVICES) and wait for all of them."""
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if cuda and torch.cuda.device_count() < args.world:
        print(f"--world {args.world} needs {args.world} GPUs; torch sees {torch.cuda.device_count()}", file=sys.stderr)
        return 1
    port = free_port()
    procs = []
    for rank in range(args.world):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(rank) if cuda else ""}
        procs.append(
            subprocess.Popen([sys.executable, __file__, *argv, "--rank", str(rank), "--port", str(port)], env=env)
        )
    codes = [p.wait() for p in procs]
    return max(codes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="'tiny' (builtin:tiny), a local checkpoint, or empty: a random Qwen2")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size of the random model")
    p.add_argument("--layers", type=int, default=8, help="layers of the random model")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--dtype", default="", help="model.dtype (default bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--steps", type=int, default=3, help="rollout + update steps (step 1 is the warm-up)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--micro", type=int, default=16, help="actor.micro_batch_size")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s (989: H100 SXM)")
    p.add_argument("--vllm", choices=["auto", "off"], default="auto", help="the vLLM section (CUDA + vLLM only)")
    p.add_argument("--vllm-memory", type=float, default=0.3, help="rollout.gpu_memory_utilization for vLLM")
    p.add_argument("--fsdp-on-cpu", action="store_true", help="shard with FSDP2 over gloo on CPU too (world size 1)")
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="more config overrides, e.g. model.lora_rank=16 (applied last)",
    )
    p.add_argument(
        "--world",
        type=int,
        default=1,
        help="ranks, one process and one GPU each: FSDP2 over NCCL (gloo on CPU) across them",
    )
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the launcher below
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.world > 1 and args.rank < 0:
        return launch_ranks(args, sys.argv[1:] if argv is None else list(argv))
    rank, world = max(args.rank, 0), args.world

    if args.device == "cpu":  # the worker takes CUDA whenever torch sees a device
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import_trainer()
    from cloudrl.trainer.algo.batch import build_batch, from_wire, update_shards
    from cloudrl.trainer.algo.step_stats import combine
    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.inputs.models import quiet_transformers, resolve_path
    from cloudrl.trainer.roles.workers import PolicyWorker
    from cloudrl.trainer.rollout.engines import HFEngine, SamplingSettings

    quiet_transformers()
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("--device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 1
    device = torch.device("cuda" if cuda else "cpu")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    tmp = tempfile.TemporaryDirectory(prefix="gpu-smoke-")
    model_path = {"": tmp.name, "tiny": None}.get(args.model, args.model) or resolve_path("builtin:tiny")
    if not args.model:
        build_synthetic(model_path, args.hidden, args.layers)
    seqs = args.prompts * args.n
    overrides = [
        f"model.path={model_path}",
        f"model.dtype={dtype}",
        "model.sft_warmup_steps=0",
        f"data.train_batch_size={args.prompts}",
        f"rollout.n={args.n}",
        "data.max_prompt_length=48",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "algorithm.name=grpo",
        "algorithm.kl_mode=loss",
        "algorithm.kl_coef=0.001",
        f"actor.gpus_per_node={1 if cuda else 0}",
        "actor.fsdp=true",
        f"actor.lr={args.lr}",
        f"actor.mini_batch_size={seqs}",
        f"actor.micro_batch_size={min(args.micro, seqs)}",
        f"trainer.run_dir={tmp.name}/run",
        *args.overrides,
    ]
    cfg = load_config("local", overrides)

    worker = PolicyWorker(cfg.to_dict(), model_path, rank=rank, world_size=world, with_reference=True)
    params = sum(t.numel() for t in worker.model.parameters())  # known on the meta device too
    if args.fsdp_on_cpu and not cuda:  # the worker shards a lone CPU rank only when asked here
        worker.sharded = True
    worker.start_training("127.0.0.1", args.port or free_port())  # NCCL (CUDA) or gloo group, FSDP2, AdamW
    engine = HFEngine.load(model_path, dtype, str(device)) if rank == 0 else None
    settings = SamplingSettings.from_config(cfg.rollout, seed=cfg.trainer.seed)
    prompts = make_prompts(worker.tokenizer, args.prompts, cfg.trainer.seed)
    gen = torch.Generator().manual_seed(cfg.trainer.seed)
    start_peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else None  # load, shard, optimizer
    start_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    initial = worker.get_state()  # a collective under FSDP; only rank 0 receives the weights
    initial = initial["model"] if initial is not None else {}

    steps = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        weights = worker.weights()  # a collective under FSDP: every rank gathers, rank 0 receives
        batch = None
        if rank == 0:  # rank 0 generates, like a rollout engine; the batch then reaches every rank
            engine.load_weights((name, from_wire(t)) for name, t in weights)
            t1 = clock(cuda)
            out = engine.generate(prompts, dataclasses.replace(settings, seed=cfg.trainer.seed + step))
            t2 = clock(cuda)
            batch = build_batch(
                [q for q in prompts for _ in range(args.n)],
                [c.token_ids for c in out],
                worker.tokenizer.pad_token_id,
                [c.logprobs for c in out],
            )
        if world > 1:
            box = [batch]
            torch.distributed.broadcast_object_list(box, src=0)
            batch = box[0]
        if rank != 0:
            t1 = t2 = t0
        mask = batch["response_mask"]
        logprobs = worker.logprobs(batch)
        batch["ref_logprobs"] = worker.ref_logprobs(batch)
        scores = torch.randn(seqs, generator=gen).view(args.prompts, args.n)
        scores = (scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6)
        batch["advantages"] = scores.view(-1, 1) * mask
        shards, norms = update_shards(batch, world, cfg.actor, cfg.trainer.seed + step)
        t3 = clock(cuda)
        stats = worker.update(shards[rank], norms, cfg.algorithm.kl_coef).stats
        t4 = clock(cuda)
        every = [stats]
        if world > 1:
            every = [None] * world
            torch.distributed.all_gather_object(every, stats)
        stats = combine(every)
        steps.append(
            dict(
                sync_s=t1 - t0,
                gen_s=t2 - t1,
                gen_tokens=int(mask.sum()),
                update_s=t4 - t3,
                update_tokens=int(batch["attention_mask"].sum()),
                logprob_diff=masked_mean_abs(logprobs, batch["engine_logprobs"], mask),
                update_logprob_diff=stats.get("rollout/logprob_diff", float("nan")),
                pg_loss=stats["actor/pg_loss"],
                kl=stats.get("actor/kl_loss", 0.0),
                grad_norm=stats["actor/grad_norm"],
                **{k: v for k, v in stats.items() if k.startswith(("memory/actor_", "perf/actor_"))},  # its own
            )
        )
        if rank == 0:
            print(f"step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in steps[-1].items()), flush=True)

    final = worker.get_state()  # a collective under FSDP; only rank 0 receives the state
    if rank != 0:
        torch.distributed.destroy_process_group()
        return 0
    final = final["model"]
    # What trains must change (every parameter, or under LoRA the adapters alone) and nothing else may.
    grads = {name: t.requires_grad for name, t in worker.model.named_parameters()}  # tied copies appear once
    trained = [k for k in initial if grads.get(k, True)]
    frozen = [k for k in initial if not grads.get(k, True)]
    unchanged = [k for k in trained if torch.equal(initial[k], final[k].to(initial[k].dtype))]
    frozen_moved = [k for k in frozen if not torch.equal(initial[k], final[k].to(initial[k].dtype))]
    timed = steps[1:] or steps  # step 1 pays for kernel selection and allocator growth
    mean = {k: sum(s[k] for s in timed) / len(timed) for k in timed[0]}
    update_tps = mean["update_tokens"] / mean["update_s"]
    if cuda:
        # The worker reads and resets the peak at each update's end (memory/actor_peak_allocated_gib, the
        # peak since the update before): the steps' peaks and what came after the last update.
        worker_peaks = [s.get("memory/actor_peak_allocated_gib", 0.0) for s in steps]
        name, peak_mem = torch.cuda.get_device_name(), max([torch.cuda.max_memory_allocated() / 2**30, *worker_peaks])
        mfu = 6 * params * update_tps / (args.peak_tflops * 1e12 * world)
    else:
        name = f"cpu {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
        peak_mem, mfu = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, None
    res = {
        "device": name,
        "world": world,
        "dtype": dtype,
        "sharded": bool(worker.sharded),
        "params": params,
        "steps": args.steps,
        "sequences_per_step": seqs,
        "gen_tokens_per_s": mean["gen_tokens"] / mean["gen_s"],
        "weight_sync_s": mean["sync_s"],
        "update_s_per_step": mean["update_s"],
        "update_tokens_per_s": update_tps,
        "rollout/logprob_diff": steps[-1]["logprob_diff"],
        "rollout/logprob_diff_max": max(s["logprob_diff"] for s in steps),
        "update/logprob_diff": steps[-1]["update_logprob_diff"],
        "peak_memory_gib": peak_mem,
        "peak_memory_kind": "cuda max_memory_allocated" if cuda else "process max RSS",
        "mfu": mfu,
        "peak_tflops": args.peak_tflops if cuda else None,
        "start_peak_memory_gib": start_peak_gib,
        "start_host_rss_gib": start_rss_gib,
        **{k: steps[-1][k] for k in steps[-1] if k.startswith("memory/")},  # the last step's, as metrics.jsonl
        **{k: mean[k] for k in mean if k.startswith("perf/")},  # the worker's own per-step numbers, timed steps
        "params_changed": len(trained) - len(unchanged),
        "params_total": len(trained),
        "frozen_params_moved": len(frozen_moved),
        "final_pg_loss": steps[-1]["pg_loss"],
        "final_grad_norm": steps[-1]["grad_norm"],
    }

    if args.vllm == "off":
        res["vllm"] = "skipped: --vllm off"
    elif world > 1:
        res["vllm"] = "skipped: run it with --world 1"
    elif not cuda:
        res["vllm"] = "skipped: needs CUDA (the CPU engine is covered by tests/rollout/test_vllm_engine.py)"
    elif importlib.util.find_spec("vllm") is None:
        res["vllm"] = "skipped: vllm is not installed"
    else:
        from cloudrl.trainer.errors import ConfigError

        try:
            res.update(vllm_section(args, model_path, worker, prompts, settings, overrides), vllm="ran")
        except ConfigError as exc:  # a vLLM outside the tested 0.32 line
            res["vllm"] = f"skipped: {exc}"
        except Exception as exc:  # noqa: BLE001  (reported in the table, and the exit status is 1)
            res["vllm"] = f"FAILED: {type(exc).__name__}: {exc}"
    res["modules_loaded"] = [m for m in ("ray", "vllm") if sys.modules.get(m) is not None]

    rows = [
        ("device", res["device"]),
        ("ranks", world),
        ("dtype", dtype),
        ("sharded (FSDP2)", res["sharded"]),
        ("parameters", f"{params / 1e6:.1f}M"),
        ("sequences per step", seqs),
        ("generation tokens/s (HFEngine)", f"{res['gen_tokens_per_s']:.0f}"),
        ("weight sync s (weights -> load_weights)", f"{res['weight_sync_s']:.3f}"),
        ("update s per step", f"{res['update_s_per_step']:.3f}"),
        ("update tokens/s", f"{update_tps:.0f}"),
        (
            "rollout/logprob_diff (last, max)",
            f"{res['rollout/logprob_diff']:.2e}, {res['rollout/logprob_diff_max']:.2e}",
        ),
        (f"peak memory GiB ({res['peak_memory_kind']})", f"{peak_mem:.2f}"),
        (
            "at start: device peak GiB, host max RSS GiB",
            f"{start_peak_gib if start_peak_gib is not None else float('nan'):.2f}, {start_rss_gib:.2f}",
        ),
        ("MFU", f"{mfu:.2%} of {args.peak_tflops:g} TFLOP/s bf16 (--peak-tflops)" if cuda else "n/a on CPU"),
        *((f"worker's {k}", f"{v:.4g}") for k, v in res.items() if k.startswith("perf/")),
        (
            "trained parameters changed",
            f"{res['params_changed']}/{res['params_total']} tensors after {args.steps} steps",
        ),
        (
            "vllm",
            res["vllm"]
            + (
                f": {res['vllm_tokens_per_s']:.0f} tokens/s, logprob_diff after reload "
                f"{res['vllm_logprob_diff_after_reload']:.2e}"
                if res["vllm"] == "ran"
                else ""
            ),
        ),
        ("ray / vllm imported", ", ".join(res["modules_loaded"]) or "neither"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"| {k:<{width}} | {v} |" for k, v in rows))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    numbers = [v for v in res.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    failures = [f"{len(unchanged)} trained parameter tensors unchanged: {unchanged[:5]}"] if unchanged else []
    if frozen_moved:
        failures.append(f"{len(frozen_moved)} frozen parameter tensors changed: {frozen_moved[:5]}")
    failures += [f"non-finite result in {res}"] if not all(math.isfinite(v) for v in numbers) else []
    failures += [f"vllm section: {res['vllm']}"] if res["vllm"].startswith("FAILED") else []
    for f in failures:
        print("FAILED:", f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
