"""The CLI against a real Ray cluster on 127.0.0.1, with the real trainer on the built-in tiny model.

One 2-node cluster for the whole module, started and stopped with `cloudrl local up/down` themselves
(so those are under test too); teardown checks that every process `up` started is gone. Nothing here
fakes Ray: the only fake is the version a proxy reports in the version-mismatch test.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import typer.testing
from cli_helpers import (
    CLOUDRL,
    INTERRUPTIBLE,
    SHORT_RUN,
    cli_env,
    job_count,
    local_auth,
    local_state,
    pids_alive,
    process_tree,
    run_cli,
    send_sigint,
    ssh_user,
    sshd,
    sshd_unavailable,
    stop_on_exit,
    version_faking_proxy,
    wait_for_job_status,
)
from cloudrl.cli import local_cluster
from cloudrl.cli import submit as submit_module
from cloudrl.cli.app import app

pytestmark = pytest.mark.ray
runner = typer.testing.CliRunner()


@dataclass
class Cluster:
    url: str
    cache: Path
    env: dict[str, str]
    auth: dict[str, str]
    """The Authorization header with the cluster's token: `local up` always turns token auth on."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    cache = tmp_path_factory.mktemp("cloudrl-cache")
    env = cli_env(cache)
    pids: list[int] = []
    try:
        up = run_cli(["local", "up", "--nodes", "2", "--timeout", "150"], env, timeout=200)
        state = local_state(cache)
        if state:
            pids = [p for node in state["nodes"] for p in process_tree(node["pid"])]
        assert up.returncode == 0, up.stdout + up.stderr
        assert "local cluster up: 2 node(s)" in up.stdout
        url = state["dashboard_url"]
        assert url.startswith("http://127.0.0.1:")
        yield Cluster(url, cache, env, local_auth(cache))
        pids = sorted(set(pids) | {p for node in state["nodes"] for p in process_tree(node["pid"])})
    finally:
        down = run_cli(["local", "down"], env, timeout=120)
        left = pids_alive(pids)
        for pid in left:  # never leave a process behind, even when `down` is broken
            subprocess.run(["kill", "-9", str(pid)], check=False)
    assert down.returncode == 0, down.stderr
    assert "stopped the local cluster (2 nodes" in down.stdout
    assert left == [], f"`cloudrl local down` left processes running: {left}"
    assert local_state(cache) is None


@pytest.fixture(autouse=True)
def cli_state(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process commands read the cluster's state (its token) where `local up` wrote it."""
    monkeypatch.setenv("CLOUDRL_CACHE", str(cluster.cache))


def invoke(args: list[str]) -> typer.testing.Result:
    return runner.invoke(app, args, catch_exceptions=False)


def test_local_up_joined_two_nodes(cluster: Cluster) -> None:
    nodes = requests.get(f"{cluster.url}/api/v0/nodes?detail=true", headers=cluster.auth, timeout=10).json()["data"][
        "result"
    ]["result"]
    alive = [n for n in nodes if n["state"] == "ALIVE"]
    assert len(alive) == 2
    assert all(n["resources_total"]["CPU"] >= 2 for n in alive)
    # A second `up` on the same state refuses instead of starting another cluster.
    again = run_cli(["local", "up"], cluster.env, timeout=30)
    assert again.returncode == 1
    assert "already running" in again.stderr and "cloudrl local down" in again.stderr


@pytest.mark.parametrize(
    ("cores", "nodes", "expected"),
    [
        (2, 2, 2),  # the cores split: 1 each, raised to the floor of 2
        (6, 2, 3),
        (16, 2, 8),
        (64, 2, 32),
        (64, 3, 21),  # a remainder core stays unassigned
        (2, 1, 4),  # a lone node still holds the local preset's 4 CPUs
    ],
)
def test_default_cpus_per_node_splits_the_cores(
    cores: int, nodes: int, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule the follow test below relies on, on machines other than this one (no cluster started)."""
    assert local_cluster.local_preset_cpus() == 4  # the last row's floor
    monkeypatch.setattr(local_cluster.os, "cpu_count", lambda: cores)
    assert local_cluster.default_cpus_per_node(nodes) == expected


def test_submit_follow_status_logs_list(cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUDRL_TEST_TOKEN", "value-that-must-not-be-printed")
    run_dir = tmp_path / "run"
    job = "e2e-follow"
    result = invoke(
        [
            "submit",
            "--address",
            cluster.url,
            "--name",
            job,
            "--follow",
            "--env",
            "CLOUDRL_TEST_TOKEN",
            *SHORT_RUN,
            f"trainer.run_dir={run_dir}",
        ]
    )
    out = result.output
    assert result.exit_code == 0, out
    # `local up` ran on this machine, so its nodes got this machine's default (see the rule's own test).
    cpus = local_cluster.default_cpus_per_node(2)
    assert f"cluster ok: Ray 2.60.0, 2 nodes with no GPU, {cpus} CPUs" in out
    assert f"submitted {job} to {cluster.url}" in out
    assert f"dashboard:   {cluster.url}/#/jobs/{job}" in out
    assert f"cloudrl logs {job} --follow --address {cluster.url}" in out
    assert f"cloudrl stop {job} --address {cluster.url}" in out
    assert "step 2/2" in out and "summary:" in out
    assert out.rstrip().endswith(f"job {job} SUCCEEDED")
    assert "value-that-must-not-be-printed" not in out
    assert (run_dir / "metrics.jsonl").exists()  # the real trainer ran and wrote its metrics
    info = requests.get(f"{cluster.url}/api/jobs/{job}", headers=cluster.auth, timeout=5).json()
    assert info["status"] == "SUCCEEDED"
    # --env values reach the job inside its package, never through Ray's runtime env (its job table).
    assert "CLOUDRL_TEST_TOKEN" not in info["runtime_env"]["env_vars"]
    assert "value-that-must-not-be-printed" not in json.dumps(info)
    assert info["entrypoint"].startswith("python3 -m cloudrl.trainer --preset local trainer.total_steps=2")

    status = invoke(["status", job, "--address", cluster.url])
    assert status.exit_code == 0, status.output
    assert "status:    SUCCEEDED" in status.output
    assert "latest:    step 2/2" in status.output and "rollout/reward_mean=" in status.output

    latest = invoke(["status", "--address", cluster.url])  # no JOB: the latest one
    assert f"job:       {job}" in latest.output

    logs = invoke(["logs", job, "--address", cluster.url])
    assert logs.exit_code == 0 and "summary:" in logs.output

    listed = invoke(["list", "--address", cluster.url])
    assert listed.exit_code == 0
    header, *rows = listed.output.splitlines()
    assert header.split() == ["ID", "STATUS", "START", "DURATION", "PRESET"]
    row = next(r for r in rows if r.startswith(job))
    assert "SUCCEEDED" in row and row.rstrip().endswith(
        f"local trainer.total_steps=2 model.sft_warmup_steps=0 trainer.run_dir={run_dir}"
    )

    # --local reaches the same cluster through the state file.
    monkeypatch.setenv("CLOUDRL_CACHE", str(cluster.cache))
    assert job in invoke(["list", "--local"]).output


def test_job_runs_the_shipped_trainer_copy(cluster: Cluster, tmp_path: Path) -> None:
    """The cluster's Python could import the editable checkout; the job must use what submit ships."""
    from cloudrl.cli.ray_api import ClusterClient, resolve_address

    preset = tmp_path / "mypreset.yaml"
    preset.write_text("trainer:\n  total_steps: 1\n")
    req = submit_module.build_request(str(preset), [], "shipped-copy", [])
    assert req.preset_arg == "mypreset"
    client = ClusterClient(resolve_address(cluster.url))
    package = submit_module.stage_package(tmp_path / "stage", req.preset_file)
    probe = (
        "import cloudrl.trainer, cloudrl.trainer.config as c; print('FILE', cloudrl.trainer.__file__); "
        "print('PRESET', c.load_config('mypreset').trainer.total_steps)"
    )
    job = client.jobs.submit_job(
        entrypoint=f'python3 -c "{probe}"', submission_id=req.submission_id, runtime_env=req.runtime_env(package)
    )
    assert wait_for_job_status(cluster.url, job, {"SUCCEEDED", "FAILED"}, 60, cluster.auth) == "SUCCEEDED"
    logs = client.jobs.get_job_logs(job)
    shipped = next(line.split(" ", 1)[1] for line in logs.splitlines() if line.startswith("FILE "))
    assert "runtime_resources" in shipped, shipped
    assert not shipped.startswith(str(Path(submit_module.__file__).resolve().parents[1]))
    assert "PRESET 1" in logs


def test_ctrl_c_detaches_then_stop_reports_stopped(cluster: Cluster, tmp_path: Path) -> None:
    job = "e2e-stop"
    try:
        proc = subprocess.Popen(
            [
                CLOUDRL,
                "submit",
                "--address",
                cluster.url,
                "--name",
                job,
                "--follow",
                "trainer.total_steps=500",
                "model.sft_warmup_steps=0",
                f"trainer.run_dir={tmp_path / 'run'}",
            ],
            env=cluster.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **INTERRUPTIBLE,
        )
        with stop_on_exit(proc):
            lines: queue.Queue[str] = queue.Queue()
            threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
            deadline = time.monotonic() + 90
            seen = ""
            while "Running entrypoint" not in seen:  # the follow stream has started
                assert time.monotonic() < deadline, f"no log stream within 90 s: {seen}"
                try:
                    seen += lines.get(timeout=1)
                except queue.Empty:
                    assert proc.poll() is None, proc.stderr.read()
            send_sigint(proc)
            assert proc.wait(30) == 130
            stderr = proc.stderr.read()
        assert f"detached from {job}; it keeps running" in stderr
        assert f"cloudrl stop {job} --address {cluster.url}" in stderr
        assert (
            wait_for_job_status(cluster.url, job, {"RUNNING"}, 10, cluster.auth) == "RUNNING"
        )  # Ctrl+C did not stop it

        stopped = invoke(["stop", job, "--address", cluster.url])
        assert stopped.exit_code == 0, stopped.output
        assert stopped.output.strip() == f"job {job} stopped"
        status = invoke(["status", job, "--address", cluster.url])
        assert "status:    STOPPED" in status.output
        # Following a stopped job ends at once, and not with success.
        followed = runner.invoke(app, ["logs", job, "--follow", "--address", cluster.url])
        assert followed.exit_code == 1 and f"job {job} STOPPED" in followed.stderr
    finally:  # a failure above must not leave a 500-step job loading the machine for later tests
        invoke(["stop", job, "--address", cluster.url])  # "had already ended" when the test got that far


def test_follow_of_a_failing_job_exits_1_with_the_trainers_error(cluster: Cluster, tmp_path: Path) -> None:
    job = "e2e-fails"
    result = runner.invoke(
        app,
        [
            "submit",
            "--address",
            cluster.url,
            "--name",
            job,
            "--follow",
            "model.path=/nonexistent/model",
            f"trainer.run_dir={tmp_path}",
        ],
    )
    assert result.exit_code == 1
    assert result.stderr.startswith(
        f"error: job {job} FAILED: error: model.path=/nonexistent/model: the directory /nonexistent/model does not exist"
    )
    assert f"(full logs: cloudrl logs {job} --address {cluster.url}; for the job's traceback" in result.stderr
    # `status` and `logs --follow` end with the same line: the trainer's own error, not Ray's exit-code message.
    status = invoke(["status", job, "--address", cluster.url])
    assert status.output.splitlines()[-1].startswith(
        "error:     model.path=/nonexistent/model: the directory /nonexistent/model does not exist"
    )
    followed = runner.invoke(app, ["logs", job, "--follow", "--address", cluster.url])
    assert followed.exit_code == 1
    assert followed.stderr.strip().splitlines()[-1] == result.stderr.strip().splitlines()[-1]


def test_preflight_too_many_gpus_fails_before_upload(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_upload(*args, **kwargs):
        raise AssertionError("staged the trainer for upload although the preflight should have failed")

    monkeypatch.setattr(submit_module, "stage_package", no_upload)
    before = job_count(cluster.url, cluster.auth)
    result = runner.invoke(app, ["submit", "--address", cluster.url, "actor.gpus_per_node=1"])
    assert result.exit_code == 1
    assert "asks for 1 GPU" in result.stderr and "actor.gpus_per_node=1" in result.stderr
    assert "the cluster has 0" in result.stderr
    assert "Traceback" not in result.output
    assert job_count(cluster.url, cluster.auth) == before


def test_preflight_reports_ray_version_mismatch(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    # The proxy is another address than the local cluster's: the CLI sends it RAY_AUTH_TOKEN, not its own.
    monkeypatch.setenv("RAY_AUTH_TOKEN", cluster.auth["Authorization"].removeprefix("Bearer "))
    monkeypatch.setattr(submit_module, "stage_package", lambda *a, **k: pytest.fail("uploaded"))
    before = job_count(cluster.url, cluster.auth)
    with version_faking_proxy(cluster.url, "2.0.0") as proxy:
        result = runner.invoke(app, ["submit", "--address", proxy])
    assert result.exit_code == 1
    assert f"the cluster runs Ray 2.0.0 but this machine has Ray {ray.__version__}" in result.stderr
    assert "pip install 'ray[default]==2.0.0'" in result.stderr
    assert job_count(cluster.url, cluster.auth) == before


def test_name_taken_fails_and_adds_no_job(cluster: Cluster) -> None:
    job = "e2e-follow"  # created by the follow test; submit the same name again
    if requests.get(f"{cluster.url}/api/jobs/{job}", headers=cluster.auth, timeout=5).status_code != 200:
        invoke(["submit", "--address", cluster.url, "--name", job, *SHORT_RUN, "trainer.total_steps=1"])
    before = job_count(cluster.url, cluster.auth)
    result = runner.invoke(app, ["submit", "--address", cluster.url, "--name", job, *SHORT_RUN])
    assert result.exit_code == 1
    assert f"a job named '{job}' already exists" in result.stderr and "--name" in result.stderr
    assert job_count(cluster.url, cluster.auth) == before


def test_unknown_job_names_the_list_command(cluster: Cluster) -> None:
    result = runner.invoke(app, ["logs", "no-such-job", "--address", cluster.url])
    assert result.exit_code == 1
    assert f"no job 'no-such-job' on {cluster.url}: `cloudrl list --address {cluster.url}`" in result.stderr


@pytest.mark.skipif(sshd_unavailable() is not None, reason=str(sshd_unavailable()))
def test_dashboard_over_ssh(cluster: Cluster, tmp_path: Path) -> None:
    remote_port = cluster.url.rsplit(":", 1)[1]
    with sshd(tmp_path) as (_, options):
        # No terminal and no key: ssh must fail at once instead of waiting on a password prompt.
        no_key = [o for o in options if not o.startswith(("IdentityFile", "IdentitiesOnly"))]
        no_key += ["IdentityFile=/dev/null", "IdentitiesOnly=yes"]
        denied = run_cli(
            [
                "dashboard",
                "--ssh",
                f"{ssh_user()}@127.0.0.1",
                "--remote-port",
                remote_port,
                "--port",
                "0",
                *[a for o in no_key for a in ("-o", o)],
            ],
            cluster.env,
            timeout=60,
        )
        assert denied.returncode == 1
        assert "Permission denied" in denied.stderr and "no terminal to type a password" in denied.stderr

        args = [
            CLOUDRL,
            "dashboard",
            "--ssh",
            f"{ssh_user()}@127.0.0.1",
            "--remote-port",
            remote_port,
            "--port",
            "0",
            *[a for o in options for a in ("-o", o)],
        ]
        token = cluster.auth["Authorization"].removeprefix("Bearer ")
        proc = subprocess.Popen(
            args,
            env={**cluster.env, "RAY_AUTH_TOKEN": token},  # the forward is another address than the cluster's own
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **INTERRUPTIBLE,
        )
        with stop_on_exit(proc):
            first = proc.stdout.readline()  # the URL line comes once the dashboard answers through ssh
            assert first.startswith(f"Ray dashboard of {ssh_user()}@127.0.0.1: http://127.0.0.1:"), (
                first + proc.stderr.read() if proc.poll() is not None else first
            )
            url = first.split(": ", 1)[1].split()[0]
            assert url != cluster.url
            assert (
                requests.get(f"{url}/api/version", headers=cluster.auth, timeout=5).json()["session_name"]
                == requests.get(f"{cluster.url}/api/version", headers=cluster.auth, timeout=5).json()["session_name"]
            )
            listed = run_cli(["list", "--address", url], {**cluster.env, "RAY_AUTH_TOKEN": token}, timeout=60)
            assert listed.returncode == 0 and "e2e-follow" in listed.stdout
            send_sigint(proc)
            assert proc.wait(15) == 0
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(f"{url}/api/version", timeout=3)  # the forward is gone with the command
