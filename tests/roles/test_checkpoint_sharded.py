"""Sharded checkpoints (torch.distributed.checkpoint): each rank writes its own shards, they load into
another number of ranks unchanged, a node without the driver's disk ships its files, and a process
killed mid-save leaves the previous checkpoint as the latest."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cloudrl.trainer.config import load_config
from cloudrl.trainer.inputs.models import resolve_path
from cloudrl.trainer.state import checkpoint, layout, timeline
from runs import REPO


def _assert_same_state(a: dict, b: dict) -> None:
    """Weights, every optimizer tensor and the scheduler, bit for bit."""
    assert a["model"].keys() == b["model"].keys()
    for name, value in a["model"].items():
        assert torch.equal(b["model"][name], value), name
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for name, slots in a["optimizer"]["state"].items():
        for slot, value in slots.items():
            assert torch.equal(b["optimizer"]["state"][name][slot], value), (name, slot)
    assert a["scheduler"] == b["scheduler"]


def _trained_worker(cfg, model_path):
    """One unsharded policy rank in this process, after one optimizer step (so its optimizer has state)."""
    from cloudrl.trainer.roles.workers import PolicyWorker

    worker = PolicyWorker(cfg.to_dict(), model_path)
    worker.start_training()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    worker.model(input_ids=ids, labels=ids).loss.backward()
    worker._step(1.0)
    return worker


def test_a_node_without_the_run_dir_ships_its_shard_files(tmp_path):
    """A rank whose node does not see the checkpoint directory writes to its scratch directory and lists its
    files (the driver pulls them in chunks: tests/state/test_shard_transfer.py); pushed back into a fresh
    rank's scratch the same way, they load with identical weights and optimizer state."""
    cfg = load_config("local", ["actor.lr=1e-2", "model.sft_warmup_steps=0"])  # no warm-up: fast
    model_path = resolve_path(cfg.model.path, cfg)
    worker = _trained_worker(cfg, model_path)
    files, scheduler = worker.save_shards(str(tmp_path / "not-mounted-here" / "actor"))
    assert sorted(files) == [".metadata", "__0_0.distcp"] and scheduler["last_epoch"] == 1
    assert not (tmp_path / "not-mounted-here").exists()
    step = tmp_path / "step"
    (step / "actor").mkdir(parents=True)
    for name, size in files.items():
        (step / "actor" / name).write_bytes(worker.read_chunk(name, 0, size))
    worker.drop_scratch()
    import json

    (step / "actor.json").write_text(json.dumps(scheduler))

    from cloudrl.trainer.roles.workers import PolicyWorker

    fresh = PolicyWorker(cfg.to_dict(), model_path)
    fresh.start_training()
    fresh.open_scratch()  # what the driver's push does, in one chunk per file
    for name in files:
        fresh.write_chunk(name, 0, (step / "actor" / name).read_bytes())
    fresh.load_shards(str(tmp_path / "not-mounted-here" / "actor"), scheduler, from_scratch=True)
    assert fresh.scratch is None  # dropped once read
    # The same rank saving straight into a directory it sees returns no files.
    again = tmp_path / "again"
    again.mkdir()
    assert fresh.save_shards(str(again / "actor")) == ({}, fresh.scheduler.state_dict())
    (again / "actor.json").write_text(json.dumps(scheduler))
    _assert_same_state(checkpoint.read_full(step, "actor"), checkpoint.read_full(again, "actor"))
    assert checkpoint.model_shapes(step / "actor" / ".metadata")["lm_head.weight"] == tuple(
        worker.model.lm_head.weight.shape
    )


SLOW_SAVE = """
import sys, time
from pathlib import Path
from cloudrl.trainer.state import checkpoint

def write_shards(tmp: Path):
    (tmp / "actor").mkdir()
    (tmp / "actor" / "__0_0.distcp").write_bytes(b"x" * 1000)
    print("writing", flush=True)
    time.sleep(60)

checkpoint.save(sys.argv[1], 2, {}, {"step": 2}, "", keep_last=2, write_shards=write_shards)
"""


def test_sigkill_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    run_dir = str(tmp_path)
    first = checkpoint.save(run_dir, 1, {"actor": {"model": {"w": torch.ones(2)}}}, {"step": 1}, "", keep_last=2)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, run_dir], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert list(layout.checkpoint_root(run_dir).glob(".step_000002.tmp*/actor/__0_0.distcp"))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert timeline.latest(run_dir) == first
    assert checkpoint.load(first, ["actor"]).state["step"] == 1
    # The next save clears what the killed process left behind.
    checkpoint.save(run_dir, 3, {}, {"step": 3}, "", keep_last=5)
    assert sorted(p.name for p in layout.checkpoint_root(run_dir).iterdir()) == ["step_000001", "step_000003"]


@pytest.mark.ray
def test_sharded_checkpoint_reshards_between_two_ranks_and_one(ray_local, tmp_path):
    """FSDP2 over 2 gloo ranks writes one shard file per rank, each about half; loaded at W=1 and
    saved again, then loaded back at W=2 and saved again, weights, optimizer state and scheduler are
    bit-identical to the original."""
    import ray
    from cloudrl.trainer.algo.batch import update_shards
    from cloudrl.trainer.state.shards import load_roles, save_roles
    from policy_groups import fixed_batch, policy_group
    from ray.util import remove_placement_group

    overrides = [
        "actor.mini_batch_size=16",
        "actor.micro_batch_size=8",
        "actor.lr=1e-2",
        "data.train_batch_size=8",
        "rollout.n=2",
        "model.sft_warmup_steps=20",
        "actor.fsdp=true",
        "critic.mini_batch_size=16",
        "critic.micro_batch_size=8",
    ]
    model_path = resolve_path(load_config("local", overrides).model.path, load_config("local", overrides))

    def with_group(world: int, body):
        cfg = load_config("local", overrides)
        group, pg = policy_group(cfg, model_path, world)
        try:
            return body(cfg, SimpleNamespace(actor=group, critic=None))
        finally:
            group.kill()
            remove_placement_group(pg)

    def save(cfg, roles, run_dir: Path, step: int) -> Path:
        return checkpoint.save(
            str(run_dir),
            step,
            {},
            {"step": step},
            "",
            keep_last=2,
            write_shards=lambda tmp: save_roles(roles, tmp, 120),
        )

    def train_and_save(cfg, roles):
        batch = fixed_batch(cfg, 16)
        shards, norms = update_shards(batch, 2, cfg.actor, seed=3)
        ray.get([w.update.remote(s, norms, 0.0) for w, s in zip(roles.actor.workers, shards)])
        return save(cfg, roles, tmp_path / "w2", 1)

    def reload_and_save(source: Path, target: Path):
        def body(cfg, roles):
            load_roles(roles, checkpoint.load(source, ["actor"]), 120)
            return save(cfg, roles, target, 1)

        return body

    original = with_group(2, train_and_save)
    sizes = {f.name: f.stat().st_size for f in (original / "actor").glob("__*.distcp")}
    assert sorted(sizes) == ["__0_0.distcp", "__1_0.distcp"]
    assert max(sizes.values()) < 0.75 * sum(sizes.values())  # each rank wrote its own half
    at_one = with_group(1, reload_and_save(original, tmp_path / "w1"))
    back_at_two = with_group(2, reload_and_save(at_one, tmp_path / "w2-again"))
    reference = checkpoint.read_full(original, "actor")
    assert reference["optimizer"]["state"]  # the step left Adam moments to compare
    _assert_same_state(reference, checkpoint.read_full(at_one, "actor"))
    _assert_same_state(reference, checkpoint.read_full(back_at_two, "actor"))
