"""Bring-up faults that need no cluster: the head's watcher with its phase port already taken (it goes on
without phase reports and still ends the bring-up at its timeout, stopping the head), a watcher that fails
(it stops the head with one line), the fabric check's rendezvous held from the choice of its port to the
probes' connect, and Slurm paths that a container's mount list would split (refused with one line
naming the path and the fix, before any srun)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from dstack_runner import REPO_ROOT, base_env

BRINGUP = REPO_ROOT / "tasks" / "ray_bringup.py"
SBATCH = REPO_ROOT / "tasks" / "slurm" / "ray-cluster.sbatch"


def load_bringup():
    spec = importlib.util.spec_from_file_location("ray_bringup_ports", BRINGUP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_head() -> subprocess.Popen:
    """Stands in for the head's `ray start --block`: the watcher's SIGTERM ends it with -15."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def watch_args(head_pid: int, phase_port: int, timeout: float) -> list[str]:
    now = f"{time.time():.3f}"
    return [
        "watch",
        "--ray-pid",
        str(head_pid),
        "--ray-port",
        str(free_port()),
        "--dashboard-port",
        str(free_port()),  # nothing answers there: the head's node never shows as alive
        "--phase-port",
        str(phase_port),
        "--timeout",
        str(timeout),
        "--boot-start",
        now,
        "--installed",
        now,
        "--ray-started",
        now,
        "127.0.0.1",
        "127.0.0.2",
    ]


def test_a_taken_phase_port_leaves_the_watcher_bounding_the_bring_up():
    head = fake_head()
    try:
        with socket.create_server(("127.0.0.1", 0)) as taken:  # a Redis replica, a second cluster
            port = taken.getsockname()[1]
            watcher = subprocess.run(
                [sys.executable, str(BRINGUP), *watch_args(head.pid, port, 3)],
                capture_output=True,
                text=True,
                timeout=120,
                env=base_env(),
            )
        output = watcher.stdout + watcher.stderr
        assert "Traceback" not in output, output
        assert (
            f"[cloudrl rank 0] warning: the phase port 127.0.0.1:{port} cannot be bound (Address already in use): the "
            "workers' phase reports are off for this bring-up (the wait for every node, its 3s limit and the fabric "
            "check go on); set CLOUDRL_PHASE_PORT to a free port to have them" in output
        ), output
        assert "error: cluster not ready after 3s: 2 of 2 nodes did not join" in output, output
        assert watcher.returncode == load_bringup().HEAD_STOPPED
        assert head.wait(timeout=10) == -signal.SIGTERM  # the head was stopped: the job fails, not hangs
    finally:
        head.kill()
        head.wait()


def test_a_watcher_that_fails_stops_the_head_with_one_line(monkeypatch, capsys):
    bringup = load_bringup()
    head = fake_head()
    try:

        def broken(args):
            raise RuntimeError("state API changed\nsecond line")

        monkeypatch.setattr(bringup, "watch", broken)
        assert bringup.main(watch_args(head.pid, free_port(), 3)) == bringup.HEAD_STOPPED
        assert capsys.readouterr().out.splitlines() == [
            "[cloudrl rank 0] error: the bring-up watcher failed (RuntimeError: state API changed); stopped the head "
            "so the job fails instead of waiting forever without a ready line: start the cluster again"
        ]
        assert head.wait(timeout=10) == -signal.SIGTERM
    finally:
        head.kill()
        head.wait()


def test_phase_reports_count_only_from_the_node_of_their_rank():
    bringup = load_bringup()
    listener = bringup.PhaseListener("127.0.0.1", 0, ["127.0.0.1", "127.0.0.1", "127.0.0.2"])
    port = listener.sock.getsockname()[1]
    listener.start()
    try:
        for line in ("1 started 100.5", "2 started 100.5", "1 installed nan", "1 installed -inf", "x y z"):
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.sendall(line.encode())
        deadline = time.monotonic() + 10
        while not listener.phases and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the later reports have arrived too
        assert listener.phases == {1: {"started": 100.5}}  # rank 2 is 127.0.0.2; nan is no time
    finally:
        listener.close()


def test_the_fabric_rendezvous_port_is_held_from_its_choice_to_the_probes():
    """The driver's store binds the port the kernel picks and keeps it: no other process can take it
    before the probes connect (a port found free and closed again could be), and a probe joins it."""
    pytest.importorskip("torch")
    bringup = load_bringup()
    store = bringup.rendezvous_store("127.0.0.1")
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("", store.port))  # taken for as long as the check runs
    result = bringup.probe(0, 1, "127.0.0.1", store.port, 1 << 12)  # a 1-rank gloo all-reduce through it
    assert result["backend"] == "gloo" and result["latency_us"] > 0


# --- Slurm paths a container's mount list would split -------------------------------------------------


def sbatch(tmp_path, env: dict[str, str], srun: str = "printf 'srun-arg %s\\n' \"$@\"") -> subprocess.CompletedProcess:
    """The batch script with a stand-in `srun` (by default one that prints its arguments) and `scontrol`
    naming this host."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(f"#!/usr/bin/env bash\n{srun}\n")
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho localhost\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    base = base_env()
    return subprocess.run(
        ["bash", str(SBATCH)],
        env={
            **base,
            "PATH": f"{bin_dir}:{base['PATH']}",
            "SLURM_JOB_NUM_NODES": "1",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_SUBMIT_DIR": str(REPO_ROOT),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    "container, name, mounts, sep",
    [
        ("pyxis", "a,b", "pyxis's --container-mounts list", ","),
        ("pyxis", "a:b", "pyxis's --container-mounts list", ":"),
        ("apptainer", "a,b", "apptainer's --bind list", ","),
        ("docker", "a:b", "docker's -v", ":"),
    ],
)
def test_a_runs_dir_the_mount_list_would_split_is_refused(tmp_path, container, name, mounts, sep):
    runs = tmp_path / name
    result = sbatch(tmp_path, {"CLOUDRL_CONTAINER": container, "CLOUDRL_IMAGE": "img", "CLOUDRL_RUNS_DIR": str(runs)})
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"[cloudrl slurm] error: CLOUDRL_RUNS_DIR={runs} contains '{sep}', which {mounts} splits on, so the "
        "container would mount the wrong directory: export CLOUDRL_RUNS_DIR as a directory whose path has no ',' "
        "or ':' (a symlink to this one will do)."
    ]
    assert "srun-arg" not in result.stdout and not runs.exists()  # refused before anything started


@pytest.mark.parametrize("engine, as_user", [("docker", True), ("podman", False)])
def test_docker_runs_the_node_as_the_jobs_user(tmp_path, engine, as_user):
    """Docker's daemon runs containers as root unless told otherwise: the node container gets the job's
    uid:gid (and a HOME it can write); rootless podman maps its root to the user and gets no --user. Here
    `srun` runs its command and the stand-in engine records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "engine-args"
    stand_ins = {
        engine: f"printf '%s\\n' \"$@\" > {record}",
        "getent": "echo '127.0.0.1 STREAM localhost'",
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"CLOUDRL_CONTAINER": engine, "CLOUDRL_IMAGE": "img", "CLOUDRL_RUNS_DIR": str(tmp_path / "runs")}
    result = sbatch(tmp_path, env, srun='while [[ "$1" == --* ]]; do shift; done\nexec "$@"')
    assert result.returncode == 0, result.stderr
    args = record.read_text().splitlines()
    assert args[0] == "run" and "img" in args
    if as_user:
        at = args.index("--user")
        assert args[at + 1 : at + 4] == [f"{os.getuid()}:{os.getgid()}", "-e", "HOME=/tmp"]
    else:
        assert "--user" not in args


def test_a_checkout_path_the_mount_list_would_split_is_refused(tmp_path):
    tasks = tmp_path / "co,py" / "tasks"
    shutil.copytree(REPO_ROOT / "tasks", tasks)
    result = sbatch(
        tmp_path,
        {
            "CLOUDRL_CONTAINER": "apptainer",
            "CLOUDRL_IMAGE": "img",
            "CLOUDRL_BOOTSTRAP": str(tasks / "ray-bootstrap.sh"),
            "CLOUDRL_RUNS_DIR": str(tmp_path / "runs"),
        },
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"[cloudrl slurm] error: the bootstrap's directory {tasks} contains ',', which apptainer's --bind list "
        "splits on, so the container would mount the wrong directory: use a cloudrl checkout whose path has no "
        "',' or ':' (CLOUDRL_BOOTSTRAP=/that/checkout/tasks/ray-bootstrap.sh), or CLOUDRL_CONTAINER=none."
    ]


def test_paths_with_spaces_and_commas_still_run_where_nothing_splits_them(tmp_path):
    spaced = tmp_path / "my runs"
    result = sbatch(tmp_path, {"CLOUDRL_CONTAINER": "pyxis", "CLOUDRL_IMAGE": "img", "CLOUDRL_RUNS_DIR": str(spaced)})
    assert result.returncode == 0, result.stderr
    bootdir = REPO_ROOT / "tasks"
    assert f"srun-arg --container-mounts={bootdir}:{bootdir},{spaced}:{spaced}" in result.stdout.splitlines()
    comma = tmp_path / "a,b"  # no container: no mount list, the path reaches the nodes as it is
    result = sbatch(tmp_path, {"CLOUDRL_RUNS_DIR": str(comma)})
    assert result.returncode == 0, result.stderr
    assert "srun-arg bash" in result.stdout and comma.is_dir()
