"""Memory and time of the log-prob/entropy step of an update: the plain formulas vs the chunked one.

    python bench/logprob_memory.py                          # CPU: 2048 positions x 32k vocabulary
    python bench/logprob_memory.py --tokens 8192 --vocab 151936 --dtype bfloat16   # on a GPU

What the actor does with its model's logits in every update (trainer/roles/worker_base.py): log-probs of
the sampled tokens and their entropies at a temperature, forward and backward. "plain" is
`ppo_math.logprobs_from_logits` and `entropy_from_logits` on `logits.float() / temperature`; "chunked" is
`ppo_math.token_stats_from_logits`, which keeps only the logits as given and works through 1024 positions
at a time. Each variant runs in a fresh process; the peak is the CUDA allocator's on a GPU, else the
process's peak resident memory over what it held once the logits were made. Prints a table and the
ratios.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

VARIANTS = ("plain", "chunked")


def ppo_math():
    """trainer/algo/ppo_math.py (pure torch), installed or from this checkout (a GPU machine without cloudrl)."""
    try:
        from cloudrl.trainer.algo import ppo_math as pm
    except ImportError:
        import importlib.util
        from pathlib import Path

        path = Path(__file__).resolve().parents[1] / "trainer" / "algo" / "ppo_math.py"
        spec = importlib.util.spec_from_file_location("ppo_math", path)
        pm = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(pm)
    return pm


def run_variant(variant: str, tokens: int, vocab: int, dtype_name: str, device: str) -> dict:
    import torch

    pm = ppo_math()

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    cuda = device == "cuda"
    # made in place, so that no temporary sets the high-water mark before the step starts
    logits = torch.empty(1, tokens, vocab, device=device, dtype=dtype).normal_(0, 2).requires_grad_()
    targets = torch.randint(0, vocab, (1, tokens), device=device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    if variant == "plain":
        z = logits.float() / 0.9
        logprobs, entropy = pm.logprobs_from_logits(z, targets), pm.entropy_from_logits(z)
    else:
        logprobs, entropy = pm.token_stats_from_logits(logits, targets, 0.9, entropy=True)
    (logprobs.sum() - 0.01 * entropy.sum()).backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    logits_bytes = logits.numel() * logits.element_size()
    return {"variant": variant, "seconds": seconds, "peak_gib": peak / 2**30, "logits_gib": logits_bytes / 2**30}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="response positions in the micro-batch")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in its own process
    args = p.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.tokens, args.vocab, args.dtype, device)))
        return
    rows = []
    for variant in VARIANTS:
        argv = [sys.executable, __file__, "--variant", variant, "--tokens", str(args.tokens)]
        argv += ["--vocab", str(args.vocab), "--dtype", args.dtype]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            sys.exit(f"{variant} failed:\n{out.stderr[-2000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.tokens} positions x {args.vocab} vocabulary, {args.dtype} logits on {device}")
    print(f"logits: {rows[0]['logits_gib']:.2f} GiB (held by the model's output in both)")
    print(f"{'variant':10} {'peak GiB over logits':>22} {'seconds':>9}")
    for r in rows:
        print(f"{r['variant']:10} {r['peak_gib']:>22.2f} {r['seconds']:>9.3f}")
    plain, chunked = rows
    print(
        f"chunked / plain: peak {chunked['peak_gib'] / plain['peak_gib']:.2f}x, time {chunked['seconds'] / plain['seconds']:.2f}x"
    )


if __name__ == "__main__":
    main()
