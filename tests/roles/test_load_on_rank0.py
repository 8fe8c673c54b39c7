"""A sharded role reads its weights on rank 0 alone: the other ranks build the model's skeleton on the meta
device, shard it and receive their shards from rank 0 (trainer/roles/fsdp.py `shard_from_rank0`).

Two ranks of the real PolicyWorker and CriticWorker, FSDP2 over gloo (the same code as over NCCL on GPUs), on a
~50M-parameter model: rank 1's peak host memory stays well under the whole fp32 model (before, every rank
loaded all of it), and the sharded weights gathered back equal the files on disk, buffers included."""

from __future__ import annotations

import os
import queue
import shutil
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from servers import free_port

WORLD = 2


def _build_model(path: Path, tie: bool) -> int:
    """A random Llama of ~50M parameters with the built-in tokenizer; returns its fp32 bytes."""
    from cloudrl.trainer.inputs.models import resolve_path
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=8000,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=10,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tiny = Path(resolve_path("builtin:tiny"))
    for name in os.listdir(tiny):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(tiny / name, path / name)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _resident(field: str = "VmRSS") -> int:
    """This process's resident memory (VmRSS) or its peak since the last reset (VmHWM), in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


def _rank(rank: int, cfg_dict: dict, path: str, port: int, role: str, results) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import transformers  # noqa: F401  (imported before the baseline: only the model counts)
    from cloudrl.trainer.roles.workers import CriticWorker, PolicyWorker
    from transformers import LlamaForCausalLM, LlamaForTokenClassification  # noqa: F401

    before = _resident()
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the resident size now
    worker = (PolicyWorker if role == "actor" else CriticWorker)(cfg_dict, path, rank=rank, world_size=WORLD)
    skeleton = all(p.is_meta for p in worker.model.parameters())
    worker.start_training("127.0.0.1", port)
    peak = _resident("VmHWM") - before
    state = worker.get_state()  # a collective: rank 0 receives the whole model
    buffers = {name: buf.clone() for name, buf in worker.model.named_buffers()}
    mismatched = None
    if rank == 0:
        from safetensors.torch import load_file

        on_disk = load_file(os.path.join(path, "model.safetensors"))
        prefix = "model." if role == "critic" else ""
        mismatched = sorted(
            name
            for name, value in on_disk.items()
            if name.startswith(prefix) and not torch.equal(state["model"][name], value)
        )
        if role == "critic":  # the value head the file does not hold: zero on every shard
            mismatched += [name for name, value in state["model"].items() if name.startswith("score") and value.any()]
    results.put((rank, skeleton, peak, mismatched, {k: v.tolist() for k, v in buffers.items()}))
    torch.distributed.destroy_process_group()


def _run(tmp_path: Path, role: str, tie: bool) -> tuple[int, dict]:
    from cloudrl.trainer.config import load_config

    path = tmp_path / "model"
    full_bytes = _build_model(path, tie)
    cfg = load_config(
        "local",
        [
            f"model.path={path}",
            "model.sft_warmup_steps=0",
            f"{role}.workers_per_node={WORLD}",
            f"{role}.micro_batch_size=8",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(rank, cfg.to_dict(), str(path), port, role, results)) for rank in range(WORLD)
    ]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + 240
    try:
        while len(got) < WORLD and time.monotonic() < deadline:
            try:
                rank, *rest = results.get(timeout=1)
            except queue.Empty:
                assert all(p.is_alive() or p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
                continue
            got[rank] = rest
        assert len(got) == WORLD, "the ranks did not report within 240 s"
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return full_bytes, got


def test_only_rank0_reads_the_policy_and_every_shard_holds_its_weights(tmp_path):
    # Tied input and output embeddings: the case a skeleton could silently untie (the other FSDP tests
    # run the built-in model, whose head is separate).
    full_bytes, got = _run(tmp_path, "actor", tie=True)
    (skel0, peak0, mismatched, buffers0), (skel1, peak1, _, buffers1) = got[0], got[1]
    assert skel0 and skel1  # every rank builds the skeleton; rank 0 reads the weights beside it
    assert mismatched == []  # gathered back, the shards are the files on disk
    assert buffers0 == buffers1 and any("inv_freq" in name for name in buffers0)  # rotary buffers broadcast
    # Rank 1 holds its half of the weights and one tensor in flight, never the whole model.
    assert peak1 < 0.85 * full_bytes, (peak1 / 2**20, full_bytes / 2**20)
    assert peak0 > full_bytes > peak1  # what only rank 0 pays: the read


def test_the_critic_is_read_on_rank0_alone_with_its_new_value_head_at_zero(tmp_path):
    full_bytes, got = _run(tmp_path, "critic", tie=False)
    (_, _, mismatched, _), (skel1, peak1, _, _) = got[0], got[1]
    assert skel1 and mismatched == []  # the backbone from disk and a zero head, on both ranks' shards
    assert peak1 < 0.85 * full_bytes, (peak1 / 2**20, full_bytes / 2**20)
