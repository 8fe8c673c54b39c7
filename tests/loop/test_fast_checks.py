"""The checks that need no cluster run before any cluster starts: a missing reward file, data file or model
directory, or a hub that does not answer, fails in well under a second with one line, and no Ray process is
started (starting the private Ray instance alone takes 9-16 s on a 2-core machine).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cloudrl.trainer import job  # imports what run_job uses, torch among it: no test below times an import
from cloudrl.trainer.config import load_config
from cloudrl.trainer.errors import TrainerError
from cloudrl.trainer.inputs import hub_data
from cloudrl.trainer.inputs.checks import check_inputs
from cloudrl.trainer.state.storage import downloads_checkpoint

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


@pytest.fixture
def no_cluster(monkeypatch):
    """run_job with a `connect` that fails the test: nothing may join or start a cluster."""
    started = []

    def connect(cfg, requests):
        started.append(cfg)
        raise AssertionError("a cluster was started before the inputs were checked")

    monkeypatch.setattr(job, "connect", connect)
    return started


@pytest.fixture
def refusing_hub(monkeypatch, tmp_path):
    """HF_ENDPOINT on a loopback port nothing listens on, an empty HF cache, offline mode off."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    for name in hub_data.OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return port


def fails_fast(cfg, expected: str) -> float:
    """run_job(cfg) raises one line containing `expected`; returns how long that took."""
    started = time.perf_counter()
    with pytest.raises(TrainerError) as caught:
        job.run_job(cfg, trainer_class=None)
    took = time.perf_counter() - started
    message = str(caught.value)
    assert expected in message and "\n" not in message, message
    return took


@pytest.mark.parametrize(
    "override,expected",
    [
        ("reward.function=missing.py:fn", "reward file not found"),
        ("reward.function=nosuch", "unknown reward function 'nosuch'"),
        ("data.train_files=nosuch.jsonl", "data file not found: nosuch.jsonl"),
        ("data.val_files=hf:./no_saved_dir", "no directory no_saved_dir"),
        ("model.path=/nonexistent", "model.path=/nonexistent: the directory /nonexistent does not exist"),
        ("model.path=./no_model_here", "no_model_here does not exist"),
        ("critic.model_path=~/no_critic_here", "critic.model_path=~/no_critic_here: the directory"),
    ],
)
def test_missing_inputs_fail_before_any_cluster(override, expected, no_cluster, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config("local", [override, f"trainer.run_dir={tmp_path / 'run'}"])
    took = fails_fast(cfg, expected)
    assert took < 1.0, f"{override}: {took:.2f} s"
    assert no_cluster == []
    assert "malformed" not in expected and not (tmp_path / "run").exists()


def test_a_missing_model_directory_is_not_called_a_hub_id(no_cluster, tmp_path):
    cfg = load_config("local", ["model.path=/nonexistent/model", f"trainer.run_dir={tmp_path}"])
    with pytest.raises(TrainerError) as caught:
        job.run_job(cfg, trainer_class=None)
    assert "Repo id" not in str(caught.value) and "builtin:tiny" in str(caught.value)


def test_an_unreachable_hub_says_so_at_once_for_a_model(refusing_hub, no_cluster, tmp_path):
    cfg = load_config("local", ["model.path=someone/some-model", f"trainer.run_dir={tmp_path}"])
    took = fails_fast(cfg, "the Hugging Face hub does not answer")
    assert took < 5.0, took  # the hub client alone retries for ~25 s
    with pytest.raises(TrainerError, match="HF_HUB_OFFLINE=1"):
        job.run_job(cfg, trainer_class=None)


def test_an_unreachable_hub_says_so_at_once_for_a_dataset(refusing_hub, no_cluster, tmp_path):
    cfg = load_config("local", ["data.train_files=hf:openai/gsm8k:main@train", f"trainer.run_dir={tmp_path}"])
    took = fails_fast(cfg, f"127.0.0.1:{refusing_hub}: connection refused")
    assert took < 5.0, took
    with pytest.raises(TrainerError) as caught:
        job.run_job(cfg, trainer_class=None)
    assert "HF_HUB_OFFLINE=1" in str(caught.value) and "--source DIR" in str(caught.value)


def test_offline_mode_asks_nothing_of_the_hub(refusing_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_data.hub_unreachable() is None


def test_the_trainer_command_fails_in_seconds_without_starting_ray(tmp_path):
    """The whole command, against the 9-16 s a Ray start takes. RAY_ADDRESS names a dead port: had the
    command tried to join a cluster before the check, its error would be that one instead. Its time is
    compared with Python importing the trainer alone (torch's import), measured here on the same machine."""
    command = [sys.executable, "-m", "cloudrl.trainer", "reward.function=missing.py:fn", f"trainer.run_dir={tmp_path}"]
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import cloudrl.trainer.driver"], check=True, timeout=120, env=env)
    imports = time.monotonic() - started
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    took = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("error: reward file not found") and result.stderr.count("\n") == 1, result.stderr
    assert "Token authentication" not in result.stdout + result.stderr  # Ray never started
    assert took < imports + 2.0, (took, imports)


# ----------------------------------------------------------------------------------------------
# The run directory, the checkpoint to resume and the prompt column: checked before any cluster too
# ----------------------------------------------------------------------------------------------


def _checkpoint(run_dir: Path, algorithm: str = "ppo", step: int = 1) -> Path:
    import torch
    from cloudrl.trainer.state import checkpoint

    part = {"model": {"w": torch.zeros(2)}, "optimizer": {}, "scheduler": {}}
    config = load_config("local", [f"algorithm.name={algorithm}"]).to_yaml()
    return checkpoint.save(str(run_dir), step, {"actor": part, "critic": part}, {"step": step}, config, keep_last=2)


def _files(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def test_an_unwritable_run_dir_fails_before_any_cluster_and_creates_nothing(no_cluster, tmp_path):
    (tmp_path / "a-file").write_text("")
    for run_dir in ("/proc/cloudrl", str(tmp_path / "a-file" / "run")):
        cfg = load_config("local", [f"trainer.run_dir={run_dir}"])
        took = fails_fast(cfg, f"cannot write checkpoints to {run_dir}/checkpoints")
        assert took < 1.0, took
    assert no_cluster == [] and not Path("/proc/cloudrl").exists()
    assert _files(tmp_path) == {"a-file": b""}


def test_a_run_dir_that_passes_is_not_created_before_the_cluster(no_cluster, tmp_path):
    """Every check passes: the job reaches the cluster with run_dir still absent (created once the inputs
    are loaded), so a cluster that is missing or too small leaves nothing behind."""
    cfg = load_config("local", [f"trainer.run_dir={tmp_path / 'runs' / 'new'}"])
    with pytest.raises(AssertionError, match="a cluster was started"):
        job.run_job(cfg, trainer_class=None)
    assert len(no_cluster) == 1 and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_dataset_without_the_prompt_column_fails_before_any_cluster(suffix, no_cluster, tmp_path):
    rows = [{"question": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": "4"}]
    data = tmp_path / f"d{suffix}"
    if suffix == ".jsonl":
        data.write_text("\n" + "".join(json.dumps(r) + "\n" for r in rows))
        label = f"{data}:2"  # the first row, after a blank line
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), data)
        label = str(data)
    cfg = load_config("local", [f"trainer.run_dir={tmp_path / 'run'}", f"data.train_files={data}"])
    took = fails_fast(cfg, f"{label}: no 'prompt' column (it has question, answer): set data.prompt_key=<one of them>")
    assert took < 1.0, took
    assert no_cluster == [] and not (tmp_path / "run").exists()
    fine = load_config(
        "local", [f"trainer.run_dir={tmp_path / 'run'}", f"data.train_files={data}", "data.prompt_key=question"]
    )
    check_inputs(fine)


def test_a_first_row_the_check_cannot_read_is_left_to_the_loader(tmp_path):
    """Not JSON, or no row within the first MiB: the loader reads the whole file later and names the
    problem exactly; the check before the cluster refuses only what the loader would refuse."""
    from cloudrl.trainer.inputs.data import check_prompt_files

    for name, text in (("bad.jsonl", "{not json\n"), ("long.jsonl", "\n" * (2 * 1024**2) + '{"q": 1}\n')):
        (tmp_path / name).write_text(text)
        check_prompt_files(str(tmp_path / name), "data.train_files")


def test_a_run_dir_holding_another_run_fails_before_any_cluster(no_cluster, tmp_path):
    (tmp_path / "config.yaml").write_text("another run's config\n")
    before = _files(tmp_path)
    cfg = load_config("local", [f"trainer.run_dir={tmp_path}"])
    took = fails_fast(cfg, f"trainer.run_dir={tmp_path} holds another run's files (config.yaml)")
    assert took < 1.0, took
    assert no_cluster == [] and _files(tmp_path) == before


@pytest.mark.parametrize(
    "damage, overrides, expected",
    [
        ("truncate", [], "has 100 bytes but was saved with"),
        ("zeros", [], "cannot read checkpoint file"),
        ("", ["algorithm.name=grpo", "trainer.resume={path}"], "was saved by an algorithm.name=ppo run"),
        ("", ["trainer.total_steps=1"], "is at step 1 and trainer.total_steps=1: that run is finished"),
    ],
    ids=["truncated", "corrupted", "another-algorithm", "finished"],
)
def test_a_checkpoint_that_cannot_be_resumed_fails_before_any_cluster(
    damage, overrides, expected, no_cluster, tmp_path
):
    run_dir = tmp_path / "run"
    path = _checkpoint(run_dir)
    actor = path / "actor.pt"
    if damage == "truncate":
        with open(actor, "r+b") as f:
            f.truncate(100)
    elif damage == "zeros":
        actor.write_bytes(b"\0" * actor.stat().st_size)
    before = _files(run_dir)
    cfg = load_config("local", [f"trainer.run_dir={run_dir}", *(o.format(path=path) for o in overrides)])
    took = fails_fast(cfg, expected)
    assert took < 1.0, took
    assert no_cluster == [] and _files(run_dir) == before


def test_a_checkpoint_from_a_bucket_is_decided_after_its_download():
    """trainer.checkpoint_uri with resume=auto (or a resume URL): the checkpoint arrives once the cluster
    is known to fit, so the resume point is decided then (storage.fetch_checkpoint)."""
    uri = ["trainer.checkpoint_uri=s3://bucket/run"]
    assert downloads_checkpoint(load_config("local", uri))
    assert downloads_checkpoint(load_config("local", ["trainer.resume=s3://bucket/run/step_000002"]))
    assert not downloads_checkpoint(load_config("local", [*uri, "trainer.resume=never"]))
    assert not downloads_checkpoint(load_config("local"))


def _trainer_without_ray(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`python -m cloudrl.trainer` with RAY_ADDRESS on a port nothing listens on: a command that got as far
    as joining a cluster would fail with that address's error instead of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{dead}", "RAY_AUTH_MODE": "disabled"}
    env.pop("CLOUDRL_DEBUG", None)
    command = [sys.executable, "-m", "cloudrl.trainer", "--preset", "local", *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)


def test_the_trainer_command_refuses_a_bad_run_dir_or_dataset_without_ray(tmp_path):
    """test_trainer.py's bad-input cases (trainer.run_dir=/proc/..., a dataset without a prompt column),
    as commands: one line, exit 1, and never as far as Ray."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    cases = [
        (["trainer.run_dir=/proc/cloudrl"], "error: cannot write checkpoints to /proc/cloudrl/checkpoints"),
        (
            [f"trainer.run_dir={tmp_path / 'run'}", f"data.train_files={data}", "reward.function=exact_match"],
            f"error: {data}:1: no 'prompt' column (it has question, answer): set data.prompt_key=<one of them>",
        ),
    ]
    for overrides, expected in cases:
        result = _trainer_without_ray(tmp_path, *overrides)
        assert result.returncode == 1, result.stderr
        assert result.stderr.startswith(expected) and result.stderr.count("\n") == 1, result.stderr
        assert "RAY_ADDRESS" not in result.stderr and "Token authentication" not in result.stdout + result.stderr
    assert not (tmp_path / "run").exists()
