"""Checkpoint save and load: time and peak memory per rank, full gather vs sharded.

    python bench/checkpoint.py [--world 2] [--hidden 1024] [--layers 8]

Starts `--world` CPU ranks (gloo, FSDP2 over the policy's transformer blocks, as on GPUs) holding a
randomly initialised Llama-shaped policy (about 100M parameters, ~400 MB of fp32 weights, ~1.2 GB with
AdamW's moments by default) after one optimizer step, and checkpoints it both ways, each in fresh
processes:

- full:    the single-file layout: rank 0 gathers every weight and optimizer tensor (`get_state`) and
           writes one file; on load every rank reads the whole file and keeps its part (`set_state`).
- sharded: torch.distributed.checkpoint (`save_shards` / `load_shards`): each rank writes and reads
           only its own shard.

Peak memory is each rank's highest resident set size during the call above its size just before
(sampled every 5 ms). Prints one table.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import threading
import time
from pathlib import Path


class PeakRss:
    """Highest RSS of this process above its value at start, while active (bytes)."""

    def __enter__(self):
        import psutil

        self.proc, self.stop = psutil.Process(), threading.Event()
        self.base = self.peak = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        self.start = time.perf_counter()
        return self

    def _sample(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.delta = self.peak - self.base


def _worker(rank: int, world: int, port: int, mode: str, folder: str, shape: tuple[int, int], out) -> None:
    import torch
    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.roles.worker_base import TrainableWorker
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers = shape

    class BenchPolicy(TrainableWorker):
        def __init__(self):
            super().__init__(load_config("local", ["actor.fsdp=true"]).to_dict(), rank, world)
            torch.manual_seed(0)
            config = LlamaConfig(
                vocab_size=32000,
                hidden_size=hidden,
                intermediate_size=hidden * 11 // 4,
                num_hidden_layers=layers,
                num_attention_heads=hidden // 64,
                num_key_value_heads=hidden // 64,
                tie_word_embeddings=False,
            )
            self.model = LlamaForCausalLM(config)

    worker = BenchPolicy()
    worker.start_training("127.0.0.1", port)
    ids = torch.randint(0, 32000, (2, 16))
    worker.model(input_ids=ids, labels=ids).loss.backward()
    worker._step(1.0)
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    row = {"rank": rank, "mode": mode}
    if mode == "sharded":
        with PeakRss() as save:
            worker.save_shards(os.path.join(folder, "actor"))
        dist.barrier()
        scheduler = worker.scheduler.state_dict()
        gc.collect()
        with PeakRss() as load:
            worker.load_shards(os.path.join(folder, "actor"), scheduler)
    else:
        file = os.path.join(folder, "actor.pt")
        with PeakRss() as save:
            state = worker.get_state()
            if rank == 0:
                torch.save(state, file)
            del state
        dist.barrier()
        gc.collect()
        with PeakRss() as load:
            worker.set_state(torch.load(file, map_location="cpu", weights_only=True))
    dist.barrier()
    row.update(save_s=save.seconds, save_mb=save.delta / 2**20, load_s=load.seconds, load_mb=load.delta / 2**20)
    if rank == 0:
        row["files_mb"] = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file()) / 2**20
        row["params_m"] = sum(p.numel() for p in worker.model.parameters()) / 1e6
    out.put(row)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(mode: str, world: int, shape: tuple[int, int]) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="cloudrl-bench-ckpt-") as folder:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, mode, folder, shape, out)) for r in range(world)]
        for p in procs:
            p.start()
        rows = [out.get(timeout=1800) for _ in procs]
        for p in procs:
            p.join(timeout=120)
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--hidden", type=int, default=1024, help="model width (default 1024)")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks (default 8)")
    args = parser.parse_args()
    rows = [r for mode in ("full", "sharded") for r in run(mode, args.world, (args.hidden, args.layers))]
    first = rows[0]
    print(f"policy: {first['params_m']:.0f}M parameters (fp32), AdamW state, {args.world} CPU ranks (gloo, FSDP2)")
    print(
        f"{'layout':<8} {'rank':>4} {'save s':>7} {'save peak MB':>13} {'load s':>7} {'load peak MB':>13} {'on disk MB':>11}"
    )
    for r in rows:
        disk = f"{r['files_mb']:.0f}" if "files_mb" in r else ""
        print(
            f"{r['mode']:<8} {r['rank']:>4} {r['save_s']:>7.2f} {r['save_mb']:>13.0f} {r['load_s']:>7.2f} "
            f"{r['load_mb']:>13.0f} {disk:>11}"
        )


if __name__ == "__main__":
    main()
