"""The CLI against a real Ray cluster on 127.0.0.1, with the real trainer on the built-in tiny model.

The 2-node cluster is the one the CLI tests share (tests/cli/conftest.py), started and stopped with
`cloudrl local up/down` themselves (so those are under test too); its teardown checks that every process
`up` started is gone. Nothing here fakes Ray: the only fake is the version a proxy reports in the
version-mismatch test.
"""

from __future__ import annotations

import hashlib
import json
import queue
import shlex
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import requests
import typer.testing
from cli_helpers import (
    CLOUDRL,
    INTERRUPTIBLE,
    SHORT_RUN,
    LocalCluster,
    job_count,
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


@pytest.fixture(autouse=True)
def cli_state(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process commands read the cluster's state (its token) where `local up` wrote it."""
    monkeypatch.setenv("CLOUDRL_CACHE", str(cluster.cache))


def invoke(args: list[str]) -> typer.testing.Result:
    return runner.invoke(app, args, catch_exceptions=False)


def test_local_up_joined_two_nodes(cluster: LocalCluster) -> None:
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


def files_holding(root: Path, secrets: dict[str, bytes]) -> list[str]:
    """'NAME in PATH' for every file under root whose bytes contain a secret's value."""
    return [
        f"{name} in {path}"
        for path in sorted(root.rglob("*"))
        if path.is_file()
        for name, value in secrets.items()
        if value in path.read_bytes()
    ]


def test_submit_follow_status_logs_list(cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One short job of the real trainer, and everything asserted about submitting it and watching it.

    `cloudrl submit --local --follow` reaches the running cluster through the state file; `status`, `logs`
    and `list` follow with `--local` and with `--address`. Secrets passed with --env (WANDB_API_KEY and
    HF_TOKEN made up for this run: wandb is not among the loggers, there is no network) reach the job's
    environment and nothing else: not Ray's job table, no file of Ray's session logs, of the run directory
    or of the CLI's cache, and no output of submit, status, logs or list.
    """
    secrets = {
        "WANDB_API_KEY": f"wandb-{uuid.uuid4().hex}",
        "HF_TOKEN": f"hf_{uuid.uuid4().hex}",
        "CLOUDRL_TEST_TOKEN": "value-that-must-not-be-printed",
    }
    proof = tmp_path / "proof.json"
    reward = tmp_path / "proof_reward.py"
    # The reward runs in the job: it records digests (never the values) of what its environment holds.
    reward.write_text(
        "import hashlib, json, os\n"
        "def score(completions, ground_truth, **kw):\n"
        f"    names = {sorted(secrets)!r}\n"
        "    digests = {n: hashlib.sha256(os.environ.get(n, '').encode()).hexdigest() for n in names}\n"
        f"    open({str(proof)!r}, 'w').write(json.dumps(digests))\n"
        "    return [0.0 for _ in completions]\n"
    )
    run_dir = tmp_path / "run"
    job = "e2e-follow"
    overrides = [
        *SHORT_RUN,
        "trainer.save_every=1",
        "trainer.loggers=[console,jsonl,tensorboard]",
        f"reward.function={reward}:score",
        f"trainer.run_dir={run_dir}",
    ]
    env = {**cluster.env, **secrets}
    submitted = run_cli(
        ["submit", "--local", "--follow", "--name", job, *[a for n in secrets for a in ("--env", n)], *overrides],
        env,
        timeout=400,
    )
    out = submitted.stdout
    assert submitted.returncode == 0, out + submitted.stderr
    assert "starting one" not in out  # --local found the running cluster in the state file
    # `local up` ran on this machine, so its nodes got this machine's default (see the rule's own test).
    cpus = local_cluster.default_cpus_per_node(2)
    assert f"cluster ok: Ray 2.60.0, 2 nodes with no GPU, {cpus} CPUs" in out
    assert f"submitted {job} to {cluster.url}" in out
    assert f"dashboard:   {cluster.url}/#/jobs/{job}" in out
    assert f"cloudrl logs {job} --follow --local" in out
    assert f"cloudrl stop {job} --local" in out
    assert "step 2/2" in out and "summary:" in out
    assert out.rstrip().endswith(f"job {job} SUCCEEDED")
    # The job's environment held each value.
    assert json.loads(proof.read_text()) == {n: hashlib.sha256(v.encode()).hexdigest() for n, v in secrets.items()}
    # The run wrote what there is to search: its config, placement, metrics, checkpoints and event files.
    written = {p.relative_to(run_dir).parts[0] for p in run_dir.rglob("*") if p.is_file()}
    assert {"config.yaml", "placement.json", "metrics.jsonl"} <= written, written
    assert any(p.name.startswith("events.out.tfevents") for p in run_dir.rglob("*")), written
    assert any("checkpoint" in part or part.startswith("step") for part in written), written

    response = requests.get(f"{cluster.url}/api/jobs/{job}", headers=cluster.auth, timeout=5)
    info = response.json()
    assert info["status"] == "SUCCEEDED"
    # --env values reach the job inside its package, never through Ray's runtime env (its job table).
    assert "CLOUDRL_TEST_TOKEN" not in info["runtime_env"]["env_vars"]
    assert set(info["runtime_env"]["env_vars"]) == {"PYTHONUNBUFFERED"}
    assert "value-that-must-not-be-printed" not in json.dumps(info)
    assert info["entrypoint"].startswith("python3 -m cloudrl.trainer --preset local trainer.total_steps=2")

    values = {name: value.encode() for name, value in secrets.items()}
    assert not any(v in response.content for v in values.values())
    node_logs = sorted(Path(cluster.state["root"]).glob("n*/session_2*/logs"))
    assert node_logs and any(node_logs[0].glob("runtime_env_agent*"))  # Ray's file of runtime envs is searched
    assert [hit for logs_dir in node_logs for hit in files_holding(logs_dir, values)] == []
    assert files_holding(run_dir, values) == []
    assert files_holding(cluster.cache, values) == []  # the CLI's state and model cache

    # `status` shows the last step from the end of the log, never downloading the whole log.
    from ray.job_submission import JobSubmissionClient

    def whole_log(*args: object, **kwargs: object) -> str:
        raise AssertionError("status downloaded the whole log")

    with monkeypatch.context() as patched:
        patched.setattr(JobSubmissionClient, "get_job_logs", whole_log)
        status = invoke(["status", job, "--local"])
        assert status.exit_code == 0, status.output
        assert "status:    SUCCEEDED" in status.output and "latest:    step 2/2" in status.output
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
    assert "SUCCEEDED" in row and row.rstrip().endswith(f"local {shlex.join(overrides)}")
    assert "local trainer.total_steps=2 model.sft_warmup_steps=0 trainer.save_every=1" in row

    # The same commands as a user runs them, with the secrets in their environment: nothing prints one.
    outputs = {"submit": submitted}
    for command in (["status", job], ["logs", job], ["list"]):
        outputs[command[0]] = run_cli([*command, "--local"], env, timeout=60)
        assert outputs[command[0]].returncode == 0, outputs[command[0]].stderr
    assert "step 2/2" in outputs["logs"].stdout  # the logs searched are the job's whole output
    assert job in outputs["list"].stdout  # --local reaches the same cluster through the state file
    leaks = [
        f"{name} in `cloudrl {command}` {stream}"
        for command, result in outputs.items()
        for stream in ("stdout", "stderr")
        for name, value in secrets.items()
        if value in getattr(result, stream)
    ]
    assert leaks == []


def test_job_runs_the_shipped_trainer_copy(cluster: LocalCluster, tmp_path: Path) -> None:
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


def test_ctrl_c_detaches_then_stop_reports_stopped(cluster: LocalCluster, tmp_path: Path) -> None:
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


def test_follow_of_a_failing_job_exits_1_with_the_trainers_error(cluster: LocalCluster, tmp_path: Path) -> None:
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
    # Submitted with --address, the next steps name that address.
    assert f"submitted {job} to {cluster.url}" in result.stdout
    assert f"dashboard:   {cluster.url}/#/jobs/{job}" in result.stdout
    assert f"cloudrl logs {job} --follow --address {cluster.url}" in result.stdout
    assert f"cloudrl stop {job} --address {cluster.url}" in result.stdout
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


def test_preflight_too_many_gpus_fails_before_upload(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
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


def test_preflight_reports_ray_version_mismatch(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
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


def finished_job(cluster: LocalCluster, prefix: str) -> str:
    """A job of this test's own on the cluster (a shell `true`, no trainer), waited for until it succeeded."""
    from cloudrl.cli.ray_api import ClusterClient, resolve_address

    job = f"{prefix}-{uuid.uuid4().hex[:8]}"
    ClusterClient(resolve_address(cluster.url)).jobs.submit_job(entrypoint="true", submission_id=job)
    assert wait_for_job_status(cluster.url, job, {"SUCCEEDED", "FAILED"}, 60, cluster.auth) == "SUCCEEDED"
    return job


def test_name_taken_fails_and_adds_no_job(cluster: LocalCluster) -> None:
    job = finished_job(cluster, "name-taken")  # submit the same name again
    before = job_count(cluster.url, cluster.auth)
    result = runner.invoke(app, ["submit", "--address", cluster.url, "--name", job, *SHORT_RUN])
    assert result.exit_code == 1
    assert f"a job named '{job}' already exists" in result.stderr and "--name" in result.stderr
    assert job_count(cluster.url, cluster.auth) == before


def test_unknown_job_names_the_list_command(cluster: LocalCluster) -> None:
    result = runner.invoke(app, ["logs", "no-such-job", "--address", cluster.url])
    assert result.exit_code == 1
    assert f"no job 'no-such-job' on {cluster.url}: `cloudrl list --address {cluster.url}`" in result.stderr


@pytest.mark.skipif(sshd_unavailable() is not None, reason=str(sshd_unavailable()))
def test_dashboard_over_ssh(cluster: LocalCluster, tmp_path: Path) -> None:
    remote_port = cluster.url.rsplit(":", 1)[1]
    job = finished_job(cluster, "over-ssh")  # what `list` through the forward must show
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
            assert listed.returncode == 0 and job in listed.stdout
            send_sigint(proc)
            assert proc.wait(15) == 0
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(f"{url}/api/version", timeout=3)  # the forward is gone with the command
