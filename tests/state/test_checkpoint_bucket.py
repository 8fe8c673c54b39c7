"""Nothing that comes back from `trainer.checkpoint_uri` is trusted, against a real S3-compatible server
started here (moto in server mode on 127.0.0.1, stopped by PID): a planted pickle never runs, a `../`
key writes nothing outside, two runs sharing a URI keep their copies, a resumed older step keeps the
newer copies, and an interrupted fetch leaves nothing a later resume would pick."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from cloudrl.trainer.config import load_config
from cloudrl.trainer.errors import CheckpointError
from cloudrl.trainer.state import checkpoint, layout, storage, timeline
from servers import s3_server

pytest.importorskip("s3fs")
pytest.importorskip("moto")

from test_checkpoint_trust import planted_pickle, planted_torch_file  # noqa: E402  (tests/state/ is on sys.path)


@pytest.fixture(scope="module")
def s3_url():
    with s3_server() as url:
        yield url


@pytest.fixture
def fs(s3_url, monkeypatch, request):
    import s3fs

    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3_url,
    }.items():
        monkeypatch.setenv(name, value)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    bucket = f"ckpt-{hashlib.sha256(request.node.name.encode()).hexdigest()[:16]}"  # one bucket per test
    fs.mkdir(bucket)
    fs.bucket = bucket
    return fs


def _save(run_dir: Path, step: int, keep_last: int = 2, tag: str = "") -> Path:
    return checkpoint.save(
        str(run_dir), step, {"actor": {"w": torch.full((2,), float(step))}}, {"step": step, "tag": tag}, "", keep_last
    )


def _save_and_upload(run_dir: Path, step: int, uri: str, keep_last: int = 2, tag: str = "") -> Path:
    path = _save(run_dir, step, keep_last, tag)
    storage.upload(path, uri, keep_last)
    return path


def _remote(fs, uri: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(uri.removeprefix("s3://")))


def _plant_copy(fs, prefix: str, files: dict[str, bytes], manifest: dict | None = None) -> None:
    for name, data in files.items():
        fs.pipe(f"{prefix}/{name}", data)
    if manifest is not None:
        fs.pipe(f"{prefix}/manifest.json", json.dumps(manifest).encode())
    fs.pipe(f"{prefix}/COMPLETE", b"complete\n")


def _clean(run_dir: Path) -> None:
    """Nothing half-written that a later resume could pick, nothing outside run_dir."""
    root = layout.checkpoint_root(str(run_dir))
    assert not list(root.glob(".*download*")), list(root.iterdir())


def test_a_planted_pickle_in_the_bucket_never_runs(fs, tmp_path):
    uri = f"s3://{fs.bucket}/runs/victim"
    _save_and_upload(tmp_path / "victim", 1, uri)
    marker = tmp_path / "marker"
    planted = f"{fs.bucket}/runs/victim/step_999999"
    # A copy with an unlisted rng.pt (what older releases unpickled first) beside a real copy's files.
    real = tmp_path / "victim" / "checkpoints" / "step_000001"
    files = {f.relative_to(real).as_posix(): f.read_bytes() for f in real.rglob("*") if f.is_file()}
    _plant_copy(fs, planted, {**files, "rng.pt": planted_pickle(marker)})
    run_dir = tmp_path / "new-instance"
    with pytest.raises(CheckpointError) as err:
        storage.fetch_newest(uri, str(run_dir))
    message = str(err.value)
    assert "holds objects its manifest.json does not list (rng.pt)" in message and "\n" not in message
    assert "writable by this run only" in message
    assert not marker.exists() and not layout.list_checkpoints(str(run_dir))
    _clean(run_dir)

    # A fully consistent planted copy (the attacker rewrote the manifest): fetched, and read as data only.
    fs.rm(planted, recursive=True)
    swapped = dict(files, **{"actor.pt": planted_torch_file(marker)})
    local = tmp_path / "forged"
    for name, data in swapped.items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(data)
    manifest = json.loads(files["manifest.json"])
    manifest["files"] = checkpoint.file_entries(local)
    _plant_copy(fs, planted, {k: v for k, v in swapped.items() if k != "manifest.json"}, manifest)
    fetched = storage.fetch_newest(uri, str(run_dir))
    assert fetched == layout.checkpoint_root(str(run_dir)) / "step_999999"
    with pytest.raises(CheckpointError, match=f"^cannot read checkpoint file {fetched}/actor.pt"):
        checkpoint.load(fetched, ["actor"])
    assert not marker.exists()


def test_a_dot_dot_key_writes_nothing_outside(fs, tmp_path):
    uri = f"s3://{fs.bucket}/runs/victim"
    _save_and_upload(tmp_path / "victim", 1, uri)
    real = tmp_path / "victim" / "checkpoints" / "step_000001"
    files = {f.relative_to(real).as_posix(): f.read_bytes() for f in real.rglob("*") if f.is_file()}
    outside = "../../../outside-run-dir.txt"
    manifest = json.loads(files.pop("manifest.json"))
    _plant_copy(fs, f"{fs.bucket}/runs/victim/step_999999", {**files, outside: b"owned\n"}, manifest)
    run_dir = tmp_path / "deep" / "er" / "new-instance"
    with pytest.raises(CheckpointError) as err:
        storage.fetch_newest(uri, str(run_dir))
    assert "outside" in str(err.value) and "\n" not in str(err.value)
    assert not [p for p in tmp_path.rglob("outside-run-dir.txt")]
    _clean(run_dir)
    # The same name in the manifest (the only list a fetch follows) is refused too.
    fs.rm(f"{fs.bucket}/runs/victim/step_999999", recursive=True)
    manifest["files"][outside] = {"size": 6, "sha256": "0" * 64}
    _plant_copy(fs, f"{fs.bucket}/runs/victim/step_999999", files, manifest)
    with pytest.raises(CheckpointError, match="names a file outside the checkpoint"):
        storage.fetch_newest(uri, str(run_dir))
    assert not [p for p in tmp_path.rglob("outside-run-dir.txt")]


def test_two_runs_sharing_a_uri_keep_their_copies(fs, tmp_path):
    uri = f"s3://{fs.bucket}/shared"
    for step in (1, 2, 3):
        _save_and_upload(tmp_path / "a", step, uri, tag="a")
    assert _remote(fs, uri) == ["step_000002", "step_000003"]  # keep_last applies to the bucket
    run_a = layout.read_manifest(tmp_path / "a" / "checkpoints" / "step_000003")["run_id"]
    for step in (10, 11, 12):  # another run, same URI: it prunes only its own copies
        _save_and_upload(tmp_path / "b", step, uri, tag="b")
    assert _remote(fs, uri) == ["step_000002", "step_000003", "step_000011", "step_000012"]
    _save_and_upload(tmp_path / "b", 3, uri, tag="b")  # in the way of run a's step 3: moved aside, kept
    moved = [p for p in fs.find(f"{fs.bucket}/shared") if f"timeline-{run_a}" in p and p.endswith("trainer.json")]
    assert len(moved) == 1 and json.loads(fs.cat(moved[0]))["tag"] == "a"

    # A new instance of neither run: resume=auto cannot tell which one it continues, and says how to choose.
    with pytest.raises(CheckpointError) as err:
        storage.fetch_newest(uri, str(tmp_path / "fresh"))
    message = str(err.value)
    assert "holds checkpoints of 2 different runs" in message
    assert f"trainer.resume=s3://{fs.bucket}/shared/step_000002" in message
    # Run a's own instance knows its run (timeline.json): it fetches its own newest copy, not b's step 12.
    (tmp_path / "a" / "checkpoints" / "step_000002").rename(tmp_path / "gone")
    for p in layout.list_checkpoints(str(tmp_path / "a")):
        __import__("shutil").rmtree(p)
    timeline.forget(str(tmp_path / "a"))
    assert storage.fetch_newest(uri, str(tmp_path / "a")).name == "step_000002"
    # The choice the refusal named works: trainer.resume=<url of a copy>.
    cfg = load_config(
        "local", [f"trainer.run_dir={tmp_path / 'chosen'}", f"trainer.resume=s3://{fs.bucket}/shared/step_000012"]
    )
    storage.fetch_checkpoint(cfg)
    assert cfg.trainer.resume == str(tmp_path / "chosen" / "checkpoints" / "step_000012")
    assert checkpoint.load(Path(cfg.trainer.resume), ["actor"]).state["tag"] == "b"


def test_a_fresh_run_refuses_a_uri_holding_another_run(fs, tmp_path):
    uri = f"s3://{fs.bucket}/taken"
    _save_and_upload(tmp_path / "first", 1, uri)
    cfg = load_config(
        "local", [f"trainer.run_dir={tmp_path / 'second'}", "trainer.resume=never", f"trainer.checkpoint_uri={uri}"]
    )
    with pytest.raises(CheckpointError) as err:
        storage.fetch_checkpoint(cfg)
    assert str(err.value) == (
        f"trainer.checkpoint_uri={uri} already holds another run's checkpoints (step_000001) and this run starts "
        f"fresh (trainer.resume=never): give it a prefix of its own (e.g. trainer.checkpoint_uri={uri}-2), or "
        f"continue that run with trainer.resume=auto"
    )
    assert _remote(fs, uri) == ["step_000001"]


def test_resuming_an_older_step_keeps_the_newer_copies(fs, tmp_path):
    uri = f"s3://{fs.bucket}/branch"
    run_dir = tmp_path / "run"
    for step in (10, 20, 30):
        _save_and_upload(run_dir, step, uri, keep_last=3, tag="old")
    timeline.forget(str(run_dir))
    timeline.begin_timeline(str(run_dir), run_dir / "checkpoints" / "step_000010", continuing=False)
    for step in (15, 25):
        _save_and_upload(run_dir, step, uri, keep_last=1, tag="new")
    assert _remote(fs, uri) == ["step_000010", "step_000020", "step_000025", "step_000030"]  # 15: its own, pruned
    # A new instance without the run_dir follows the branch saved last, not the highest step.
    assert storage.fetch_newest(uri, str(tmp_path / "fresh")).name == "step_000025"


class CutShort:
    """The bucket's filesystem, but the second file of a download never arrives."""

    def __init__(self, fs, error: BaseException):
        self.fs, self.error, self.calls = fs, error, 0

    def __getattr__(self, name):
        return getattr(self.fs, name)

    def get_file(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 2:
            raise self.error
        return self.fs.get_file(*args, **kwargs)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), ConnectionResetError(104, "Connection reset by peer")])
def test_an_interrupted_fetch_leaves_nothing_a_resume_would_pick(fs, tmp_path, monkeypatch, error):
    uri = f"s3://{fs.bucket}/cut"
    _save_and_upload(tmp_path / "run", 1, uri)
    run_dir = tmp_path / "new-instance"
    real_fs = storage._fs
    cut = {}

    def cut_fs(uri):
        bucket_fs, root = real_fs(uri)
        cut["fs"] = CutShort(bucket_fs, error)
        return cut["fs"], root

    monkeypatch.setattr(storage, "_fs", cut_fs)
    with pytest.raises(type(error) if isinstance(error, KeyboardInterrupt) else CheckpointError) as err:
        storage.fetch_newest(uri, str(run_dir))
    if not isinstance(error, KeyboardInterrupt):
        assert "downloading step_000001 from trainer.checkpoint_uri" in str(err.value) and "\n" not in str(err.value)
    assert cut["fs"].calls == 2 and not layout.list_checkpoints(str(run_dir))
    _clean(run_dir)
    # A download directory a SIGKILL left behind is cleared by the next fetch, which then completes.
    stale = layout.checkpoint_root(str(run_dir)) / ".step_000001.download999-dead"
    (stale / "actor").mkdir(parents=True)
    monkeypatch.setattr(storage, "_fs", real_fs)
    assert storage.fetch_newest(uri, str(run_dir)).name == "step_000001"
    assert not stale.exists()
