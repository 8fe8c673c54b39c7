"""Checkpoints are data, not code: a pickle planted in a run directory's checkpoint (a `__reduce__` that
would write a marker file) never runs on resume; resume refuses it in one line, and so it does a
checkpoint saved without content hashes."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import pytest
import torch
from cloudrl.trainer.config import load_config
from cloudrl.trainer.errors import CheckpointError
from cloudrl.trainer.state import checkpoint, layout


class Planted:
    """What an attacker pickles: unpickling it calls `Path.write_text(marker, ...)`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


def planted_pickle(marker: Path) -> bytes:
    return pickle.dumps({"python": Planted(marker)})


def planted_torch_file(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": {"w": torch.ones(2)}, "payload": Planted(marker)}, buffer)
    return buffer.getvalue()


def _write_dcp(directory: Path) -> None:
    """A real one-rank DCP role directory (model and AdamW state), as a worker writes it."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    model_state, optim_state = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(directory))


def _save(run_dir: Path, step: int = 1, key: bytes | None = None) -> Path:
    def write_shards(tmp: Path) -> None:
        _write_dcp(tmp / "actor")
        (tmp / "actor.json").write_text(json.dumps({"last_epoch": 1}))

    config = load_config("local", ["algorithm.name=grpo"]).to_yaml()
    return checkpoint.save(
        str(run_dir),
        step,
        {"critic": {"model": {"w": torch.ones(2)}}},
        {"step": step},
        config,
        keep_last=5,
        write_shards=write_shards,
        key=key,
    )


def _rehash(path: Path) -> None:
    """What an attacker who writes the whole directory does: a manifest that matches the planted files."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"] = checkpoint.file_entries(path)
    (path / "manifest.json").write_text(json.dumps(manifest))


def _refused(path: Path, match: str, marker: Path) -> str:
    with pytest.raises(CheckpointError, match=match) as err:
        checkpoint.load(path, ["actor", "critic"])
    assert not marker.exists(), "the planted pickle ran"
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_clean_checkpoint_round_trips_as_data(tmp_path):
    path = _save(tmp_path / "run")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == 2 and manifest["run_id"]
    assert all(len(e["sha256"]) == 64 for e in manifest["files"].values())
    assert not (path / "rng.pt").exists() and (path / "rng.json").exists()  # no pickle written
    ckpt = checkpoint.load(path, ["actor", "critic"])
    assert ckpt.shapes["actor"] == {"weight": (2, 3), "bias": (2,)}
    assert torch.equal(ckpt.parts["critic"]["model"]["w"], torch.ones(2))
    before = torch.rand(3)
    checkpoint.set_rng_state(ckpt.rng)
    again = torch.rand(3)
    checkpoint.set_rng_state(ckpt.rng)
    assert torch.equal(torch.rand(3), again) and ckpt.run_id == manifest["run_id"]
    full = checkpoint.read_full(path, "actor")  # DCP bytes items (param_groups) read with weights_only=True
    assert full["optimizer"]["param_groups"][0]["lr"] == 0.1 and before.shape == (3,)


def test_a_planted_rng_pt_is_refused_and_never_runs(tmp_path):
    path = _save(tmp_path / "run")
    marker = tmp_path / "marker"
    (path / "rng.pt").write_bytes(planted_pickle(marker))
    message = _refused(path, "holds 1 file\\(s\\) its manifest does not list \\(rng.pt\\)", marker)
    assert "someone else can write to trainer.run_dir" in message


def test_a_swapped_tensor_file_is_refused_by_its_hash(tmp_path):
    path = _save(tmp_path / "run")
    marker = tmp_path / "marker"
    (path / "critic.pt").write_bytes(planted_torch_file(marker))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["critic.pt"]["size"] = (path / "critic.pt").stat().st_size  # sizes alone would pass
    (path / "manifest.json").write_text(json.dumps(manifest))
    _refused(path, rf"^cannot read checkpoint file {path}/critic.pt \(ContentMismatch: its SHA-256", marker)


@pytest.mark.parametrize("target", ["critic.pt", "actor/.metadata"])
def test_a_fully_planted_checkpoint_is_read_as_data_only(tmp_path, target):
    """Even with a manifest that matches (the attacker wrote the whole directory), a pickle's code never
    runs: tensors load with weights_only=True and the DCP metadata builds DCP's own classes only."""
    path = _save(tmp_path / "run")
    marker = tmp_path / "marker"
    payload = planted_torch_file(marker) if target.endswith(".pt") else planted_pickle(marker)
    (path / target).write_bytes(payload)
    _rehash(path)
    _refused(path, rf"^cannot read checkpoint file {path}/{target} \(", marker)


def test_the_workers_dcp_reader_and_planner_run_no_pickle(tmp_path):
    """What the workers use to read their shards (roles/worker_base.load_shards)."""
    import torch.distributed.checkpoint as dcp

    role = tmp_path / "actor"
    _write_dcp(role)
    marker = tmp_path / "marker"
    (role / ".metadata").write_bytes(planted_pickle(marker))
    with pytest.raises(BaseException, match="not part of a checkpoint.s metadata"):  # DCP: a BaseException
        dcp.load({}, checkpoint_id=str(role), storage_reader=checkpoint.safe_reader(str(role)), no_dist=True)
    assert not marker.exists()
    planner = checkpoint.safe_planner()
    planner.flatten_state_dict = False
    planner.state_dict = {}
    item = type("Item", (), {"dest_index": type("Index", (), {"fqn": "x"})()})()
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, io.BytesIO(planted_torch_file(marker)))
    assert not marker.exists()


def test_dcp_metadata_naming_a_file_outside_its_directory_is_refused(tmp_path):
    role = tmp_path / "actor"
    _write_dcp(role)
    with open(role / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file, written just above
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (role / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(pickle.UnpicklingError, match="outside its directory"):
        checkpoint.model_shapes(role / ".metadata")


def test_a_checkpoint_without_hashes_is_refused_naming_the_fix(tmp_path):
    """The layout of earlier releases: sizes only, and the RNG as a pickle."""
    path = _save(tmp_path / "run")
    marker = tmp_path / "marker"
    (path / "rng.json").unlink()
    (path / "rng.pt").write_bytes(planted_pickle(marker))
    sizes = {f.relative_to(path).as_posix(): f.stat().st_size for f in path.rglob("*") if f.is_file()}
    sizes.pop("manifest.json")
    (path / "manifest.json").write_text(json.dumps({"files": sizes}))
    message = _refused(path, "was saved without content hashes", marker)
    assert message.endswith(layout.NO_HASHES_FIX) and "trainer.resume=never" in message
    (path / "manifest.json").unlink()
    _refused(path, "has no manifest.json", marker)


def test_the_resume_point_refuses_a_planted_checkpoint_in_one_line(tmp_path):
    """The path a run takes (state/resume.py): resume=auto finds the planted checkpoint and stops."""
    from cloudrl.trainer.state.resume import decide_resume, place_run_dir

    run_dir = tmp_path / "run"
    path = _save(run_dir)
    marker = tmp_path / "marker"
    (path / "actor" / ".metadata").write_bytes(planted_pickle(marker))
    _rehash(path)
    overrides = [
        f"trainer.run_dir={run_dir}",
        "algorithm.name=grpo",
        "trainer.total_steps=5",
        "model.sft_warmup_steps=0",
    ]
    cfg = load_config("local", overrides)
    place_run_dir(cfg)
    with pytest.raises(CheckpointError, match=f"cannot read checkpoint file {path}/actor/.metadata"):
        decide_resume(cfg)
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------
# Signed manifests (trainer.checkpoint_key_env): a planted checkpoint with a matching manifest is refused
# ----------------------------------------------------------------------------------------------

KEY = b"k" * 40


def test_a_signed_checkpoint_loads_with_its_key_and_is_refused_with_another(tmp_path):
    path = _save(tmp_path / "run", key=KEY)
    manifest = json.loads((path / "manifest.json").read_text())
    assert len(manifest["signature"]["hmac_sha256"]) == 64
    assert checkpoint.load(path, ["actor", "critic"], KEY).state == {"step": 1}
    with pytest.raises(CheckpointError, match="does not match its signature .* signed with another key"):
        checkpoint.load(path, ["actor", "critic"], b"x" * 40)


def test_a_rehashed_planted_checkpoint_is_refused_when_checkpoints_are_signed(tmp_path):
    """What the hashes alone cannot stop: an attacker who writes the whole directory, manifest included."""
    path = _save(tmp_path / "run", key=KEY)
    marker = tmp_path / "marker"
    (path / "critic.pt").write_bytes(planted_torch_file(marker))
    _rehash(path)  # the signature is kept, the files list changes under it
    with pytest.raises(CheckpointError, match="does not match its signature") as err:
        checkpoint.load(path, ["actor", "critic"], KEY)
    assert not marker.exists() and "\n" not in str(err.value)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["signature"]  # or the signature dropped
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="is not signed, and trainer.checkpoint_key_env asks"):
        checkpoint.load(path, ["actor", "critic"], KEY)


def test_the_signing_key_is_read_by_name_and_never_shown(monkeypatch):
    from cloudrl.trainer.errors import ConfigError

    assert checkpoint.signing_key("") is None
    monkeypatch.delenv("CKPT_KEY", raising=False)
    with pytest.raises(ConfigError, match="CKPT_KEY is not set here: export it .*`cloudrl submit --env CKPT_KEY`"):
        checkpoint.signing_key("CKPT_KEY")
    monkeypatch.setenv("CKPT_KEY", "short-secret-value")
    with pytest.raises(ConfigError, match="holds 18 characters, fewer than 32") as err:
        checkpoint.signing_key("CKPT_KEY")
    assert "short-secret-value" not in str(err.value)
    monkeypatch.setenv("CKPT_KEY", "a" * 64)
    assert checkpoint.signing_key("CKPT_KEY") == b"a" * 64
    with pytest.raises(ConfigError, match="must be the NAME of an environment variable"):
        load_config("local", ["trainer.checkpoint_key_env=0123456789abcdef0123456789abcdef"])


def test_a_run_with_a_key_resumes_only_from_its_signed_checkpoint(tmp_path, monkeypatch):
    """The path a run takes (state/resume.py), with the key named in the config."""
    from cloudrl.trainer.state.resume import decide_resume

    run_dir = tmp_path / "run"
    path = _save(run_dir)  # saved before the key was turned on
    monkeypatch.setenv("CKPT_KEY", "b" * 64)
    overrides = [f"trainer.run_dir={run_dir}", "algorithm.name=grpo", "trainer.total_steps=5"]
    cfg = load_config("local", [*overrides, "trainer.checkpoint_key_env=CKPT_KEY"])
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is not signed"):
        decide_resume(cfg)
    signed = _save(tmp_path / "signed", key=b"b" * 64)
    overrides = [f"trainer.run_dir={tmp_path / 'next'}", "algorithm.name=grpo", "trainer.total_steps=5"]
    cfg = load_config("local", [*overrides, "trainer.checkpoint_key_env=CKPT_KEY", f"trainer.resume={signed}"])
    assert decide_resume(cfg).path == signed
