"""Model staging (trainer/roles/staging.py) identifies a model copy by its content: two fine-tunes of one
architecture (same file names, same sizes, other weights) never pass for each other, in place or in a
node's cache, and a weight file's hash is computed once and cached keyed by its size and mtime."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from cloudrl.trainer.errors import ModelLoadError
from cloudrl.trainer.roles import staging

SIZE = staging.SMALL_FILE_BYTES + 4096  # a weight file: over the size hashed on every call


def _fine_tune(path: Path, fill: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"hidden_size": 8}')
    (path / "model.safetensors").write_bytes(fill * SIZE)
    old = 1_600_000_000  # an mtime long past, as a model downloaded or exported earlier has
    os.utime(path / "model.safetensors", (old, old))
    return path


@pytest.fixture(autouse=True)
def node_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOUDRL_CACHE", str(tmp_path / "node-cache"))


def test_two_fine_tunes_of_one_architecture_differ(tmp_path):
    round1 = _fine_tune(tmp_path / "round1" / "hf_model", b"\1")
    round2 = _fine_tune(tmp_path / "round2" / "hf_model", b"\2")
    assert staging.fingerprint(round1) != staging.fingerprint(round2)
    # Round 1 was shipped to this node before: round 2 must not pick that copy from the cache.
    shipped = staging.unpack(str(round1), staging.fingerprint(round1), staging.pack(round1))
    elsewhere = str(tmp_path / "not-on-this-node" / "hf_model")
    assert staging.check_local(elsewhere, staging.fingerprint(round2)) is None
    assert staging.check_local(elsewhere, staging.fingerprint(round1)) == shipped
    # A stale copy at the same path on a node's own disk is not taken for the driver's model either.
    assert staging.check_local(str(round1), staging.fingerprint(round2)) is None


def test_a_weight_file_is_hashed_once_and_rehashed_when_it_changes(tmp_path, monkeypatch):
    model = _fine_tune(tmp_path / "m", b"\1")
    monkeypatch.setattr(staging, "RACY_SECONDS", 0.0)  # its ctime is now: cache it all the same
    reads: list[str] = []
    real = staging.read_sha256
    monkeypatch.setattr(staging, "read_sha256", lambda file: reads.append(str(file)) or real(file))
    first = staging.fingerprint(model)
    assert staging.fingerprint(model) == first and len(reads) == 1  # the second call used the cache
    with open(model / "model.safetensors", "r+b") as f:  # same size, other bytes, a new mtime
        f.write(b"\3")
    os.utime(model / "model.safetensors", (1_600_000_100, 1_600_000_100))
    assert staging.fingerprint(model) != first and len(reads) == 2


def test_a_damaged_cached_copy_is_not_used(tmp_path):
    model = _fine_tune(tmp_path / "m", b"\1")
    expected = staging.fingerprint(model)
    shipped = Path(staging.unpack(str(model), expected, staging.pack(model)))
    (shipped / "config.json").write_text('{"hidden_size": 9}')
    assert staging.check_local(str(tmp_path / "absent" / "m"), expected) is None
    assert Path(staging.unpack(str(model), expected, staging.pack(model))) == shipped  # shipped again, repaired
    assert staging.fingerprint(shipped) == expected


def test_a_copy_that_does_not_match_its_fingerprint_is_refused(tmp_path):
    model = _fine_tune(tmp_path / "m", b"\1")
    other = _fine_tune(tmp_path / "other" / "m", b"\2")
    with pytest.raises(ModelLoadError, match="has fingerprint .* not .*: the directory changed on the driver"):
        staging.unpack(str(model), staging.fingerprint(model), staging.pack(other))
    assert not [p for p in (tmp_path / "node-cache" / "models").iterdir()]
    shutil.rmtree(other)
