"""`cloudrl local up --debugger`: a breakpoint() in a worker of the local cluster pauses it, `up` and every
job's log print the attach command, and the printed command attaches (the one Ray test here: a real
`local up --debugger legacy`, a task paused at breakpoint(), `ray debug` run exactly as printed, `c`)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_helpers import cli_env, local_state, run_cli
from cloudrl.cli import local_cluster
from cloudrl.cli.app import app
from cloudrl.trainer.__main__ import debugger_hint
from typer.testing import CliRunner

GCS = "127.0.0.1:6380"
TOKEN_FILE = "/home/u/.cache/cloudrl/local-token-abc"


def test_the_attach_command_names_the_cluster_and_reads_its_token_from_the_file():
    command = local_cluster.attach_command(GCS, TOKEN_FILE, "/venv/bin/ray")
    assert command == (
        f"RAY_DEBUG=legacy RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$(cat {TOKEN_FILE}) /venv/bin/ray debug --address {GCS}"
    )


def test_the_nodes_run_the_debugger_asked_for_and_no_other(monkeypatch):
    legacy = local_cluster.debugger_env("legacy", "ATTACH")
    assert legacy["RAY_DEBUG"] == "legacy" and legacy["REMOTE_PDB_HOST"] == "127.0.0.1"  # pdb on loopback only
    assert (legacy["CLOUDRL_DEBUGGER"], legacy["CLOUDRL_DEBUGGER_ATTACH"]) == ("legacy", "ATTACH")
    assert legacy["RAY_DEBUG_POST_MORTEM"] == "0"
    assert local_cluster.debugger_env(None, "") == {}
    # A CLOUDRL_DEBUGGER left in the shell does not reach nodes started without --debugger (the job
    # log would claim a debugger that does not run).
    monkeypatch.setenv("CLOUDRL_DEBUGGER", "legacy")
    monkeypatch.setenv("CLOUDRL_DEBUGGER_ATTACH", "x")
    env = local_cluster._node_env("tok")
    assert "CLOUDRL_DEBUGGER" not in env and "CLOUDRL_DEBUGGER_ATTACH" not in env


def test_a_job_on_a_cluster_with_a_debugger_prints_how_to_attach():
    env = {"CLOUDRL_DEBUGGER": "legacy", "RAY_DEBUG": "legacy", "CLOUDRL_DEBUGGER_ATTACH": "ray debug --address A"}
    hint = debugger_hint(env)
    assert hint.startswith("debugger: legacy: a breakpoint() in a worker pauses it until you attach")
    assert "reward.timeout_s=0" in hint and hint.endswith(": ray debug --address A")
    assert debugger_hint({"CLOUDRL_DEBUGGER": "legacy", "RAY_DEBUG": "legacy"}).endswith("docs/debugging.md")
    assert debugger_hint({"CLOUDRL_DEBUGGER": "legacy"}) is None  # set in a shell only: no debugger runs
    assert debugger_hint({}) is None


@pytest.mark.parametrize(
    "args, words",
    [
        (["--debugger", "pdb"], ["--debugger pdb is not a debugger", "--debugger legacy"]),
        # debugpy would listen on the machine's network address (Ray's node address), with no token
        (["--debugger", "post-mortem"], ["network address", "no token", "--debugger legacy"]),
    ],
)
def test_a_debugger_up_will_not_run_is_one_line_before_any_node_starts(args, words, tmp_path, monkeypatch):
    monkeypatch.setenv("CLOUDRL_CACHE", str(tmp_path))
    result = CliRunner().invoke(app, ["local", "up", *args])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert all(word in lines[0] for word in words), lines[0]
    assert not (tmp_path / "local-cluster.json").exists()  # nothing was started


class Output:
    """A process's output as it comes, without waiting for newlines (prompts end without one)."""

    def __init__(self, proc: subprocess.Popen):
        self.text = ""
        self._thread = threading.Thread(target=self._read, args=(proc.stdout.fileno(),), daemon=True)
        self._thread.start()

    def _read(self, fd: int) -> None:
        while chunk := os.read(fd, 4096):
            self.text += chunk.decode(errors="replace")

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := re.compile(pattern).search(self.text, start):
                return found
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} within {timeout:g} s in:\n{self.text[-3000:]}")


PAUSED_TASK = """
import os, ray
from cloudrl.trainer.__main__ import debugger_hint

@ray.remote
def paused():
    hint = debugger_hint(os.environ)  # what a job's log says on this cluster
    breakpoint()
    return hint

ray.init(log_to_driver=True)
print("returned:", ray.get(paused.remote(), timeout=120), flush=True)
"""


def _popen(args, env) -> subprocess.Popen:
    return subprocess.Popen(
        args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.mark.ray
def test_a_breakpoint_pauses_the_worker_until_the_printed_command_attaches(tmp_path: Path):
    env = cli_env(tmp_path)
    driver = debug = None
    try:
        up = run_cli(["local", "up", "--cpus", "2", "--debugger", "legacy"], env)
        assert up.returncode == 0, up.stdout + up.stderr
        attach = up.stdout.split("attach with:\n")[1].splitlines()[0].strip()
        state = local_state(tmp_path)
        assert f"--address {state['gcs_address']}" in attach
        assert open(state["token_file"]).read().strip() not in up.stdout  # the token is read, never printed
        join = {**env, **local_cluster.auth_env(state), "RAY_ADDRESS": state["gcs_address"]}
        driver = _popen([sys.executable, "-c", PAUSED_TASK], {**join, "PYTHONUNBUFFERED": "1"})
        driver_out = Output(driver)
        driver_out.wait_for(r"RemotePdb session open at localhost:\d+, use 'ray debug' to connect", 90)
        assert driver.poll() is None  # paused, not skipped

        debug = _popen(["bash", "-c", attach], {**env, "PYTHONUNBUFFERED": "1"})  # as printed: token from its file
        debug_out = Output(debug)
        debug_out.wait_for(r"0\s*\|.*paused", 60)  # the paused task is listed
        debug.stdin.write(b"0\n")
        debug.stdin.flush()
        debug_out.wait_for(r"\(Pdb\)", 30)
        debug.stdin.write(b"c\n")
        debug.stdin.flush()
        returned = driver_out.wait_for(r"returned: (.*)\n", 60).group(1)
        assert returned.startswith("debugger: legacy: a breakpoint() in a worker pauses it until you attach")
        assert returned.endswith(attach)  # the hint every job's log prints carries the same command
        assert driver.wait(timeout=30) == 0
    finally:
        _stop(debug)
        _stop(driver)
        down = run_cli(["local", "down"], env)
        assert down.returncode == 0, down.stdout + down.stderr
