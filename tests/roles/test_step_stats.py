"""The per-step numbers a trained role reports with its update: peak memory (host RSS on every device, the CUDA
allocator's peaks on GPU, each reset for the next step) and training tokens/s per worker; over ranks the memory
is the largest peak and the speed the mean. In process, one rank, no Ray; recording stand-ins for the
torch.cuda memory counters, which need a GPU."""

from __future__ import annotations

import mmap

import pytest
import torch
from cloudrl.trainer.algo.batch import build_batch, update_shards
from cloudrl.trainer.algo.step_stats import Accumulator, combine
from cloudrl.trainer.config import load_config
from cloudrl.trainer.inputs.models import resolve_path
from cloudrl.trainer.roles import worker_base
from cloudrl.trainer.roles.workers import CriticWorker, PolicyWorker

GIB = 1 << 30


def test_peaks_combine_as_the_largest_rank_and_speeds_as_the_mean():
    ranks = []
    for peak, speed in ((2.0, 100.0), (5.0, 300.0)):
        acc = Accumulator()
        acc.peak("memory/actor_peak_rss_gib", peak - 1)
        acc.peak("memory/actor_peak_rss_gib", peak)
        acc.add("perf/actor_tokens_per_s_per_worker", speed, 1.0)
        ranks.append(acc.result())
    merged = combine(ranks)
    assert merged["memory/actor_peak_rss_gib"] == 5.0
    assert merged["perf/actor_tokens_per_s_per_worker"] == 200.0
    assert combine([{"sums": {"a": 2.0}, "weights": {"a": 1.0}}]) == {"a": 2.0}  # a result without peaks


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1])


def test_cpu_reports_peak_rss_and_no_device_counters():
    cpu = torch.device("cpu")
    worker_base.memory_peaks(cpu)  # the peak so far, reset
    quiet = worker_base.memory_peaks(cpu)  # a step that allocated nothing: about what stays resident
    assert set(quiet) == {"peak_rss"} and 0.01 < quiet["peak_rss"] < 1024
    # 64 MiB above the recorded peak: a new peak whether or not this sandbox lets VmHWM reset (some refuse it
    # and the peak stays the process's lifetime one). Measured from what is resident now, since other
    # threads of a long test session may have freed memory since the quiet step.
    resident = _kib("VmRSS:") << 10
    size = (max(_kib("VmHWM:") << 10, resident) - resident) + (64 << 20)
    # Fresh pages straight from the kernel, every one written, then unmapped: an allocator could instead reuse
    # memory a previous test freed but kept resident, which would raise no peak at all.
    held = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        held[offset] = 1
    held.close()
    peak = worker_base.memory_peaks(cpu)["peak_rss"] * GIB
    assert peak >= resident + size - (16 << 20), (peak, resident, size)  # this step's allocation, 16 MiB slack


def test_cuda_reports_the_allocators_peaks_and_resets_them(monkeypatch):
    """Stand-ins for torch.cuda.max_memory_allocated/reserved and reset_peak_memory_stats (GPU only)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: calls.append("allocated") or 3 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: calls.append("reserved") or 4 * GIB)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append("reset"))
    peaks = worker_base.memory_peaks(torch.device("cuda"))
    assert (peaks["peak_allocated"], peaks["peak_reserved"]) == (3.0, 4.0) and "peak_rss" in peaks
    assert calls == ["allocated", "reserved", "reset"]  # read, then reset for the next step


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_an_update_reports_its_memory_and_tokens_per_second(role):
    sizes = [f"{r}.{k}=8" for r in ("actor", "critic") for k in ("mini_batch_size", "micro_batch_size")]
    cfg = load_config("local", [*sizes, "data.train_batch_size=1", "model.sft_warmup_steps=0"])
    path = resolve_path(cfg.model.path, cfg)
    worker = PolicyWorker(cfg.to_dict(), path) if role == "actor" else CriticWorker(cfg.to_dict(), path)
    worker.start_training()
    batch = build_batch([[5, 6, 7]] * 8, [[8, 9]] * 8, pad_id=0)
    for key in ("advantages", "values", "returns"):
        batch[key] = torch.zeros(batch["response_mask"].shape)
    shards, norms = update_shards(batch, 1, getattr(cfg, role), seed=0)
    result = worker.update(shards[0], norms, 0.0) if role == "actor" else worker.update(shards[0], norms)
    stats = combine([result.stats])
    assert stats[f"perf/{role}_tokens_per_s_per_worker"] > 0
    assert stats[f"memory/{role}_peak_rss_gib"] > 0.01
    assert f"memory/{role}_peak_allocated_gib" not in stats  # on CPU: host memory only, labelled as such
