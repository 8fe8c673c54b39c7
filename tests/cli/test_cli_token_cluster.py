"""The CLI against a real token-protected Ray cluster (`cloudrl local up`), and the trainer's private Ray.

One 1-node local cluster for the module. It must refuse anyone without its token, while `submit`,
`status` and `logs` work with the token the CLI keeps for it; `--env` values must reach the job and
appear nowhere else: not in the Jobs API, not in any file of Ray's session logs, not in the run directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import typer.testing
from cli_helpers import SHORT_RUN, cli_cluster, local_state, run_cli, wait_for_job_status
from cloudrl.cli.app import app

pytestmark = pytest.mark.ray
runner = typer.testing.CliRunner()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The local cluster's state, with "env" (the CLI's environment) and "token" added."""
    cache = tmp_path_factory.mktemp("cloudrl-cache")
    with cli_cluster(cache, nodes=1) as (env, _up):
        state = local_state(cache)
        state["env"] = env
        state["token"] = Path(state["token_file"]).read_text().strip()
        yield state


def auth(cluster: dict) -> dict[str, str]:
    return {"Authorization": f"Bearer {cluster['token']}"}


def test_the_local_cluster_refuses_anyone_without_its_token(cluster: dict) -> None:
    token_file = Path(cluster["token_file"])
    assert token_file.stat().st_mode & 0o777 == 0o600 and len(cluster["token"]) == 64
    assert cluster["session_name"].startswith("session_")
    url = cluster["dashboard_url"]
    # What ShadowRay did: post a job with no credentials (and with a wrong token).
    job = {"entrypoint": "echo pwned"}
    assert requests.post(f"{url}/api/jobs/", json=job, timeout=10).status_code == 401
    wrong = {"Authorization": f"Bearer {uuid.uuid4().hex}"}
    assert requests.post(f"{url}/api/jobs/", json=job, headers=wrong, timeout=10).status_code == 403
    assert requests.get(f"{url}/api/version", headers=auth(cluster), timeout=10).status_code == 200
    # The GCS refuses a driver without the token too.
    probe = "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR')"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex}
    joined = subprocess.run(
        [sys.executable, "-c", probe, cluster["gcs_address"]], env=env, capture_output=True, text=True, timeout=120
    )
    assert joined.returncode != 0 and "Authentication" in joined.stderr


def test_a_wrong_token_is_one_line(cluster: dict) -> None:
    # `localhost` is the same dashboard under another name: the CLI sends RAY_AUTH_TOKEN there, not its own.
    other_name = cluster["dashboard_url"].replace("127.0.0.1", "localhost")
    wrong = run_cli(["list", "--address", other_name], {**cluster["env"], "RAY_AUTH_TOKEN": "not-the-token"}, 60)
    assert wrong.returncode == 1
    assert wrong.stderr.strip().splitlines() == [
        f"error: the cluster at {other_name} uses Ray token authentication and it rejected RAY_AUTH_TOKEN: "
        "set RAY_AUTH_TOKEN to the cluster's token (`ray get-auth-token` on its head node)"
    ]
    right = run_cli(["list", "--address", other_name], {**cluster["env"], "RAY_AUTH_TOKEN": cluster["token"]}, 60)
    assert right.returncode == 0, right.stderr


def files_holding(root: Path, values: list[bytes]) -> list[str]:
    return [str(p) for p in sorted(root.rglob("*")) if p.is_file() and any(v in p.read_bytes() for v in values)]


def test_submit_and_status_with_the_token_and_secrets_appear_nowhere(
    cluster: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    canaries = {"WANDB_API_KEY": f"CANARY-W-{uuid.uuid4().hex}", "HF_TOKEN": f"CANARY-H-{uuid.uuid4().hex}"}
    proof = tmp_path / "proof.json"
    reward = tmp_path / "proof_reward.py"
    # The reward runs in the job: it records digests (never the values) of what its environment holds.
    reward.write_text(
        "import hashlib, json, os\n"
        "def score(completions, ground_truth, **kw):\n"
        f"    names = {sorted(canaries)!r}\n"
        "    digests = {n: hashlib.sha256(os.environ.get(n, '').encode()).hexdigest() for n in names}\n"
        f"    open({str(proof)!r}, 'w').write(json.dumps(digests))\n"
        "    return [0.0 for _ in completions]\n"
    )
    run_dir = tmp_path / "run"
    job = "token-secrets"
    env = {**cluster["env"], **canaries}
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
            f"reward.function={reward}:score",
            "trainer.loggers=[console,jsonl]",
            f"trainer.run_dir={run_dir}",
        ],
        env,
        timeout=400,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert f"job {job} SUCCEEDED" in submitted.stdout
    assert json.loads(proof.read_text()) == {n: hashlib.sha256(v.encode()).hexdigest() for n, v in canaries.items()}

    values = [v.encode() for v in canaries.values()]
    info = requests.get(f"{cluster['dashboard_url']}/api/jobs/{job}", headers=auth(cluster), timeout=10)
    assert info.status_code == 200
    assert not any(v in info.content for v in values)
    assert set(info.json()["runtime_env"]["env_vars"]) == {"PYTHONUNBUFFERED"}
    logs_dir = next(Path(cluster["root"]).glob("n0/session_*/logs"))
    assert any(logs_dir.glob("runtime_env_agent*"))  # the file Ray writes runtime envs to is there
    assert files_holding(logs_dir, values) == []
    assert files_holding(run_dir, values) == []
    assert not any(v.decode() in submitted.stdout + submitted.stderr for v in values)

    # `status` shows the last step from the end of the log, never downloading the whole log.
    from ray.job_submission import JobSubmissionClient

    def whole_log(*args: object, **kwargs: object) -> str:
        raise AssertionError("status downloaded the whole log")

    monkeypatch.setattr(JobSubmissionClient, "get_job_logs", whole_log)
    monkeypatch.setenv("CLOUDRL_CACHE", cluster["env"]["CLOUDRL_CACHE"])
    status = runner.invoke(app, ["status", job, "--local"])
    assert status.exit_code == 0, status.output
    assert "status:    SUCCEEDED" in status.output and "latest:    step 2/2" in status.output


def test_job_output_is_shown_without_its_control_sequences(cluster: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from cloudrl.cli.ray_api import ClusterClient, resolve_address

    monkeypatch.setenv("CLOUDRL_CACHE", cluster["env"]["CLOUDRL_CACHE"])
    client = ClusterClient(resolve_address(None, local=True))
    code = "import sys; sys.stdout.write('title\\x1b]0;owned\\x07 clip\\x1b]52;c;ZXZpbA==\\x07 end\\n')"
    job = client.jobs.submit_job(entrypoint=shlex.join(["python3", "-c", code]))
    assert wait_for_job_status(cluster["dashboard_url"], job, {"SUCCEEDED"}, 60, headers=auth(cluster)) == "SUCCEEDED"
    for args in (["logs", job, "--local"], ["logs", job, "--follow", "--local"]):
        shown = runner.invoke(app, args)
        assert shown.exit_code == 0, shown.output
        assert "\x1b" not in shown.output and "\x07" not in shown.output
        assert "title\\x1b]0;owned\\x07 clip\\x1b]52;c;ZXZpbA==\\x07 end" in shown.output


def test_the_trainers_private_ray_writes_no_readable_token(tmp_path: Path) -> None:
    """`connect` starting its own Ray: a 0700 root, token auth with a token kept in memory, nothing in ~/.ray."""
    home = tmp_path / "home"
    home.mkdir()
    probe = (
        "import json, os, ray\n"
        "from cloudrl.trainer.config import load_config\n"
        "from cloudrl.trainer.roles import cluster, placement\n"
        "cfg = load_config('local')\n"
        "assert cluster.connect(cfg, placement.plan(cfg))\n"
        "session = ray._private.worker._global_node.get_session_dir_path()\n"
        "print(json.dumps({'root': os.path.dirname(session), 'mode': os.environ.get('RAY_AUTH_MODE')}))\n"
        "ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(home)
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["mode"] == "token"
    private = Path(seen["root"]).parent  # Ray makes its own root 0777: it lies in a 0700 directory
    assert private.name.startswith("cloudrl-ray-") and private.stat().st_mode & 0o777 == 0o700
    assert not (home / ".ray").exists()
