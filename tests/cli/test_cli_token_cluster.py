"""The CLI against a real token-protected Ray cluster (`cloudrl local up`), and the trainer's private Ray.

The local cluster is the one the CLI tests share (tests/cli/conftest.py). It must refuse anyone without
its token, while the CLI's commands work with the token it keeps for it. (A job submitted with that token
and `--env` secrets, which must appear nowhere but in the job, is test_cli_cluster.py's
test_submit_follow_status_logs_list.)
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import requests
import typer.testing
from cli_helpers import LocalCluster, run_cli, wait_for_job_status
from cloudrl.cli.app import app

pytestmark = pytest.mark.ray
runner = typer.testing.CliRunner()


def test_the_local_cluster_refuses_anyone_without_its_token(cluster: LocalCluster) -> None:
    token_file = Path(cluster.state["token_file"])
    assert token_file.stat().st_mode & 0o777 == 0o600 and len(cluster.token) == 64
    assert cluster.state["session_name"].startswith("session_")
    url = cluster.url
    # What ShadowRay did: post a job with no credentials (and with a wrong token).
    job = {"entrypoint": "echo pwned"}
    assert requests.post(f"{url}/api/jobs/", json=job, timeout=10).status_code == 401
    wrong = {"Authorization": f"Bearer {uuid.uuid4().hex}"}
    assert requests.post(f"{url}/api/jobs/", json=job, headers=wrong, timeout=10).status_code == 403
    assert requests.get(f"{url}/api/version", headers=cluster.auth, timeout=10).status_code == 200
    # The GCS refuses a driver without the token too.
    probe = "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR')"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex}
    joined = subprocess.run(
        [sys.executable, "-c", probe, cluster.state["gcs_address"]],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert joined.returncode != 0 and "Authentication" in joined.stderr


def test_a_wrong_token_is_one_line(cluster: LocalCluster) -> None:
    # `localhost` is the same dashboard under another name: the CLI sends RAY_AUTH_TOKEN there, not its own.
    other_name = cluster.url.replace("127.0.0.1", "localhost")
    wrong = run_cli(["list", "--address", other_name], {**cluster.env, "RAY_AUTH_TOKEN": "not-the-token"}, 60)
    assert wrong.returncode == 1
    assert wrong.stderr.strip().splitlines() == [
        f"error: the cluster at {other_name} uses Ray token authentication and it rejected RAY_AUTH_TOKEN: "
        "set RAY_AUTH_TOKEN to the cluster's token (`ray get-auth-token` on its head node)"
    ]
    right = run_cli(["list", "--address", other_name], {**cluster.env, "RAY_AUTH_TOKEN": cluster.token}, 60)
    assert right.returncode == 0, right.stderr


def test_job_output_is_shown_without_its_control_sequences(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cloudrl.cli.ray_api import ClusterClient, resolve_address

    monkeypatch.setenv("CLOUDRL_CACHE", str(cluster.cache))
    client = ClusterClient(resolve_address(None, local=True))
    code = "import sys; sys.stdout.write('title\\x1b]0;owned\\x07 clip\\x1b]52;c;ZXZpbA==\\x07 end\\n')"
    job = client.jobs.submit_job(entrypoint=shlex.join(["python3", "-c", code]))
    assert wait_for_job_status(cluster.url, job, {"SUCCEEDED"}, 60, headers=cluster.auth) == "SUCCEEDED"
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
