"""Secrets passed with --env reach the job's environment only: never a file of the run, never a line
the CLI prints.

A real short job on a one-node `cloudrl local` cluster, with WANDB_API_KEY and HF_TOKEN set to values
made up for this run (wandb is not among the loggers: there is no network). Every byte of every file
the run wrote is searched for them, and so is every output of submit, status, logs and list.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_helpers import SHORT_RUN, cli_cluster, run_cli

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment of `cloudrl` commands that reach a running local cluster with --local."""
    with cli_cluster(tmp_path_factory.mktemp("cloudrl-cache"), nodes=1) as (env, _up):
        yield env


def files_holding(root: Path, secrets: dict[str, bytes]) -> list[str]:
    """'NAME in PATH' for every file under root whose bytes contain a secret's value."""
    return [
        f"{name} in {path}"
        for path in sorted(root.rglob("*"))
        if path.is_file()
        for name, value in secrets.items()
        if value in path.read_bytes()
    ]


def test_env_secrets_reach_no_file_and_no_output(cli: dict[str, str], tmp_path: Path) -> None:
    values = {"WANDB_API_KEY": f"wandb-{uuid.uuid4().hex}", "HF_TOKEN": f"hf_{uuid.uuid4().hex}"}
    env = {**cli, **values}
    run_dir = tmp_path / "run"
    job = "secrets-stay-secret"
    submitted = run_cli(
        [
            "submit",
            "--local",
            "--follow",
            "--name",
            job,
            "--env",
            "WANDB_API_KEY",
            "--env",
            "HF_TOKEN",
            *SHORT_RUN,
            "trainer.save_every=1",
            "trainer.loggers=[console,jsonl,tensorboard]",
            f"trainer.run_dir={run_dir}",
        ],
        env,
        timeout=400,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert f"job {job} SUCCEEDED" in submitted.stdout
    # The run wrote what there is to search: its config, placement, metrics, checkpoints and event files.
    written = {p.relative_to(run_dir).parts[0] for p in run_dir.rglob("*") if p.is_file()}
    assert {"config.yaml", "placement.json", "metrics.jsonl"} <= written, written
    assert any(p.name.startswith("events.out.tfevents") for p in run_dir.rglob("*")), written
    assert any("checkpoint" in part or part.startswith("step") for part in written), written

    as_bytes = {name: value.encode() for name, value in values.items()}
    assert files_holding(run_dir, as_bytes) == []
    assert files_holding(Path(cli["CLOUDRL_CACHE"]), as_bytes) == []  # the CLI's state and model cache
    outputs = {"submit": submitted}
    for command in (["status", job], ["logs", job], ["list"]):
        outputs[command[0]] = run_cli([*command, "--local"], env, timeout=60)
        assert outputs[command[0]].returncode == 0, outputs[command[0]].stderr
    assert "step 2/2" in outputs["logs"].stdout  # the logs searched are the job's whole output
    leaks = [
        f"{name} in `cloudrl {command}` {stream}"
        for command, result in outputs.items()
        for stream in ("stdout", "stderr")
        for name, value in values.items()
        if value in getattr(result, stream)
    ]
    assert leaks == []
