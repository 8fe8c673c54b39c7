"""A full disk during a save ends with one line naming the disk and the fix, and the previous checkpoint
stays intact and loadable: on a real 2 MiB tmpfs (mounted here as root; skipped where mounting is not
allowed), whether torch.save, DCP's sharded writer or the size check before writing hits it."""

from __future__ import annotations

import gc
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from cloudrl.trainer.errors import CheckpointError
from cloudrl.trainer.state import checkpoint, layout, timeline


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}): needs root")
    try:
        yield mount
    finally:
        gc.collect()  # memory-mapped checkpoint tensors keep their files open
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


def _first(run_dir: Path) -> Path:
    return checkpoint.save(str(run_dir), 1, {"actor": {"w": torch.ones(16)}}, {"step": 1}, "a: 1\n", keep_last=2)


def _assert_refused_and_intact(err: pytest.ExceptionInfo, run_dir: Path, first: Path) -> None:
    message = str(err.value)
    assert "\n" not in message
    assert f"saving checkpoint {run_dir}/checkpoints/step_000002 failed: no space left on device" in message
    assert f"the previous checkpoint {first} is intact" in message and "larger volume" in message
    assert [p.name for p in layout.checkpoint_root(str(run_dir)).iterdir()] == ["step_000001"]  # no temp dir
    assert timeline.latest(str(run_dir)) == first
    assert torch.equal(checkpoint.load(first, ["actor"]).parts["actor"]["w"], torch.ones(16))


def test_torch_save_on_a_full_disk_is_one_line(small_disk):
    run_dir = small_disk / "run"
    first = _first(run_dir)
    with pytest.raises(CheckpointError) as err:  # torch.save reports ENOSPC as a RuntimeError
        checkpoint.save(str(run_dir), 2, {"actor": {"w": torch.ones(1024**2)}}, {"step": 2}, "", keep_last=2)
    _assert_refused_and_intact(err, run_dir, first)


def test_a_sharded_save_on_a_full_disk_is_one_line(small_disk):
    import torch.distributed.checkpoint as dcp

    run_dir = small_disk / "run"
    first = _first(run_dir)

    def write_shards(tmp: Path) -> None:  # what a worker on this node does (DCP raises a BaseException)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore")
            dcp.save({"model": {"w": torch.ones(1024**2)}}, checkpoint_id=str(tmp / "actor"))

    with pytest.raises(CheckpointError) as err:
        checkpoint.save(str(run_dir), 2, {}, {"step": 2}, "", keep_last=2, write_shards=write_shards)
    _assert_refused_and_intact(err, run_dir, first)


def test_a_disk_without_room_for_another_checkpoint_fails_before_writing(small_disk):
    run_dir = small_disk / "run"
    first = checkpoint.save(str(run_dir), 1, {"actor": {"w": torch.ones(200_000)}}, {"step": 1}, "", keep_last=2)
    (small_disk / "filler").write_bytes(b"\0" * (1024**2))  # what is left is less than step 1 took
    with pytest.raises(CheckpointError) as err:
        checkpoint.save(str(run_dir), 2, {"actor": {"w": torch.ones(200_000)}}, {"step": 2}, "", keep_last=2)
    assert str(err.value).startswith(f"saving checkpoint {run_dir}/checkpoints/step_000002 needs about 0.8 MiB")
    assert f"the previous checkpoint {first} is intact" in str(err.value)
    assert [p.name for p in layout.checkpoint_root(str(run_dir)).iterdir()] == ["step_000001"]


def test_a_kill_while_a_step_is_saved_again_loses_nothing(tmp_path):
    """Saving a step that exists renames the old one aside before the new one takes its place; a process
    killed in between leaves `.step_N.old*`, which the next save puts back instead of deleting."""
    run_dir = tmp_path / "run"
    first = _first(run_dir)
    aside = first.with_name(f".{first.name}.old4242")
    first.rename(aside)  # where a kill between the two renames leaves it
    checkpoint.save(str(run_dir), 3, {"actor": {"w": torch.zeros(16)}}, {"step": 3}, "", keep_last=5)
    assert [p.name for p in layout.list_checkpoints(str(run_dir))] == ["step_000001", "step_000003"]
    assert torch.equal(checkpoint.load(first, ["actor"]).parts["actor"]["w"], torch.ones(16))
    again = checkpoint.save(str(run_dir), 1, {"actor": {"w": torch.full((16,), 2.0)}}, {"step": 1}, "", keep_last=5)
    assert again == first and not list(first.parent.glob(".step_*"))
    assert torch.equal(checkpoint.load(first, ["actor"]).parts["actor"]["w"], torch.full((16,), 2.0))
