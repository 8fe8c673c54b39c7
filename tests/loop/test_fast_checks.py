"""The checks that need no cluster run before any cluster starts: a missing reward file, data file or model
directory, or a hub that does not answer, fails in well under a second with one line, and no Ray process is
started (starting the private Ray instance alone takes 9-16 s on a 2-core machine).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cloudrl.trainer import job
from cloudrl.trainer.config import load_config
from cloudrl.trainer.errors import TrainerError
from cloudrl.trainer.inputs import hub_data
from cloudrl.trainer.roles import launch, placement  # noqa: F401  (imported by run_job: not timed below)

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
