"""Files of nodes without the driver's disk travel in bounded chunks (state/transfer.py): checkpoint shards
out and back, and the HF export, which lands on the driver's disk where summary.json says."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cloudrl.trainer.errors import CheckpointError
from cloudrl.trainer.roles.workers import PolicyWorker
from cloudrl.trainer.state import transfer


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "adapter/adapter_model.safetensors"])
def test_a_relative_name_inside_its_directory_passes(name):
    assert transfer.checked_name(name) == name


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/../../x", "/etc/passwd", "a//b", "a/./b", "a\\b", 3])
def test_a_name_that_could_leave_its_directory_is_refused(name):
    with pytest.raises(CheckpointError, match="refused"):
        transfer.checked_name(name)


@pytest.mark.parametrize("files", [{"a": -1}, {"a": "5"}, {"a": 1.0}, {"a": True}, {"../a": 1}, [("a", 1)]])
def test_a_listing_with_a_bad_size_or_name_is_refused(files):
    with pytest.raises(CheckpointError, match="refused"):
        transfer.checked_listing(files)


def test_the_workers_side_reads_and_writes_chunks_in_order_only(tmp_path):
    transfer.write_chunk(str(tmp_path), "adapter/w", 0, b"abc")
    transfer.write_chunk(str(tmp_path), "adapter/w", 3, b"de")
    assert transfer.listing(str(tmp_path)) == {"adapter/w": 5}
    assert transfer.read_chunk(str(tmp_path), "adapter/w", 2, 2) == b"cd"
    with pytest.raises(CheckpointError, match="offset 9, but 5 bytes"):  # a lost chunk
        transfer.write_chunk(str(tmp_path), "adapter/w", 9, b"x")
    (tmp_path.parent / "outside").write_bytes(b"secret")
    with pytest.raises(CheckpointError, match="leaves its directory"):
        transfer.read_chunk(str(tmp_path), "../outside", 0, 10)


class _FakeWorker:
    """A worker's calls answered in this process (`transfer.get_all` patched to hand back the values)."""

    def __init__(self, files: dict[str, bytes], short: bool = False):
        self.files, self.short, self.calls, self.dropped = files, short, [], 0
        self.read_chunk = SimpleNamespace(remote=self._read)
        self.drop_scratch = SimpleNamespace(remote=self._drop)

    def _read(self, name, offset, size):
        self.calls.append((name, offset, size))
        data = self.files[name][offset : offset + size]
        return data[:-1] if self.short and offset else data

    def _drop(self):
        self.dropped += 1


def test_the_driver_pulls_chunk_by_chunk_and_checks_every_size(tmp_path, monkeypatch):
    monkeypatch.setattr(transfer, "get_all", lambda refs, labels, timeout_s, what: refs)
    monkeypatch.setattr(transfer, "CHUNK_BYTES", 4)
    files = {"__0_0.distcp": bytes(range(10)), "adapter/cfg": b"", "adapter/w": b"xyz"}
    worker = _FakeWorker(files)
    transfer.pull(worker, "actor rank 1", {k: len(v) for k, v in files.items()}, tmp_path / "a", 5, "saving")
    target = tmp_path / "a"
    pulled = {p.relative_to(target).as_posix(): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    assert pulled == files
    assert [c for c in worker.calls if c[0] == "__0_0.distcp"] == [
        ("__0_0.distcp", o, n) for o, n in ((0, 4), (4, 4), (8, 2))
    ]
    assert worker.dropped == 1
    # A worker whose file changed under it (or that lies) sends a chunk of another size: refused, scratch dropped.
    liar = _FakeWorker({"f": bytes(10)}, short=True)
    with pytest.raises(CheckpointError, match=r"actor rank 1 sent 3 bytes of 'f' at offset 4, where its listing"):
        transfer.pull(liar, "actor rank 1", {"f": 10}, tmp_path / "b", 5, "saving")
    assert liar.dropped == 1
    # A listing naming a file outside the target is refused before anything is written or read.
    with pytest.raises(CheckpointError, match="leaves its directory"):
        transfer.pull(_FakeWorker({}), "actor rank 1", {"../escape": 1}, tmp_path / "c", 5, "saving")
    assert not (tmp_path / "escape").exists() and not (tmp_path / "c").exists()


class BlindPolicy(PolicyWorker):
    """A policy rank whose node sees none of the driver's directories (as on a cluster without a shared
    disk), and that records the largest chunk it sent or received."""

    largest = 0
    chunks = 0

    def sees(self, directory: str) -> bool:
        return False

    def read_chunk(self, name: str, offset: int, size: int) -> bytes:
        data = super().read_chunk(name, offset, size)
        self.largest, self.chunks = max(self.largest, len(data)), self.chunks + 1
        return data

    def write_chunk(self, name: str, offset: int, data: bytes) -> None:
        self.largest, self.chunks = max(self.largest, len(data)), self.chunks + 1
        super().write_chunk(name, offset, data)

    def moved(self) -> tuple[int, int, str | None]:
        return self.largest, self.chunks, self.scratch


@pytest.mark.ray
def test_ranks_without_the_run_dir_save_resume_and_export_through_bounded_chunks(ray_local, tmp_path, monkeypatch):
    """Two FSDP2 ranks that see no directory of the driver's: their checkpoint reaches the driver's disk and
    comes back to them chunk by chunk (several per file, none larger than CHUNK_BYTES), restores the state
    exactly, and the policy's export lands in the driver's run_dir and loads with transformers."""
    import ray
    from cloudrl.trainer.algo.batch import update_shards
    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.inputs.models import resolve_path
    from cloudrl.trainer.roles.launch import ActorGroup, create_placement_group
    from cloudrl.trainer.roles.placement import plan, plan_slots
    from cloudrl.trainer.state import checkpoint
    from cloudrl.trainer.state.shards import export_policy, load_roles, save_roles
    from policy_groups import fixed_batch
    from ray.util import remove_placement_group
    from transformers import AutoModelForCausalLM

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
    chunk = 64 << 10
    monkeypatch.setattr(transfer, "CHUNK_BYTES", chunk)
    cfg = load_config(
        "local",
        [
            "actor.lr=1e-2",
            "actor.fsdp=true",
            "actor.mini_batch_size=16",
            "actor.micro_batch_size=8",
            "data.train_batch_size=8",
            "rollout.n=2",
            "model.sft_warmup_steps=20",
            "critic.mini_batch_size=16",
            "critic.micro_batch_size=8",
        ],
    )
    cfg.actor.workers_per_node = 2
    request = plan(cfg)[0]
    pg = create_placement_group(request, 60)
    slots = plan_slots(cfg, request)["actor"]
    group = ActorGroup("actor", BlindPolicy, pg, slots, (cfg.to_dict(), resolve_path(cfg.model.path, cfg)))
    roles = SimpleNamespace(actor=group, critic=None)
    run_dir = tmp_path / "run"

    def step(seed: int) -> None:
        shards, norms = update_shards(fixed_batch(cfg, 16), 2, cfg.actor, seed=seed)
        ray.get([w.update.remote(s, norms, 0.0) for w, s in zip(group.workers, shards)])

    def save(at: int) -> Path:
        write = lambda tmp: save_roles(roles, tmp, 60)  # noqa: E731
        return checkpoint.save(str(run_dir), at, {}, {"step": at}, "", keep_last=5, write_shards=write)

    try:
        group.start_training()
        step(1)
        first = save(1)
        step(2)  # the ranks move on, so only the load can bring the first state back
        load_roles(roles, checkpoint.load(first, ["actor"]), 60)
        again = save(2)
        export_policy(roles, run_dir / "hf_model", 60)
        moved = ray.get([w.moved.remote() for w in group.workers])
    finally:
        group.kill()
        remove_placement_group(pg)

    files = sorted(p.name for p in (first / "actor").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert min((first / "actor" / f).stat().st_size for f in files[1:]) > 3 * chunk  # several chunks per file
    for name in files[1:]:  # the resumed ranks wrote exactly what they had saved (.metadata has a save id)
        assert (again / "actor" / name).read_bytes() == (first / "actor" / name).read_bytes(), name
    saved, resaved = checkpoint.read_full(first, "actor"), checkpoint.read_full(again, "actor")
    assert saved["optimizer"]["state"] and saved["scheduler"] == resaved["scheduler"]
    for name, value in saved["model"].items():
        assert torch.equal(resaved["model"][name], value), name
    for largest, chunks, scratch in moved:
        assert 0 < largest <= chunk and chunks > len(files)
        assert scratch is None  # every scratch directory dropped once moved
    assert [p.name for p in run_dir.iterdir() if p.name.startswith(".hf_model")] == []
    exported = AutoModelForCausalLM.from_pretrained(str(run_dir / "hf_model"))
    for name, value in exported.state_dict().items():
        assert torch.equal(value, saved["model"][name].to(value.dtype)), name
