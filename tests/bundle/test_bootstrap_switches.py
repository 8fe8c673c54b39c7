"""Slurm's inputs (tasks/slurm/ray-node.sh, which runs tasks/ray-bootstrap.sh), CLOUDRL_DEBUGGER and
CLOUDRL_RAY_RESOURCES: bad values stop the node at once with one line naming the fix, before anything is
installed or started. CLOUDRL_DEBUGGER=legacy keeps the pdb on loopback: a stand-in Python shows the
`ray start` it gets. (The good values run on a real Slurm and a namespace cluster in
tests/bundle/test_slurm_cluster.py and tests/bundle/test_debugger.py.)"""

from __future__ import annotations

import shutil
import socket
import subprocess

import pytest
from dstack_runner import REPO_ROOT, base_env

BOOTSTRAP = REPO_ROOT / "tasks" / "ray-bootstrap.sh"
SLURM_NODE = REPO_ROOT / "tasks" / "slurm" / "ray-node.sh"
ONE_NODE = {
    "DSTACK_NODE_RANK": "0",
    "DSTACK_MASTER_NODE_IP": "10.9.0.1",
    "DSTACK_NODES_NUM": "1",
    "DSTACK_GPUS_PER_NODE": "0",
    "DSTACK_NODES_IPS": "10.9.0.1",
    "RAY_AUTH_TOKEN": "t" * 64,
}


def bootstrap(env: dict[str, str], argv: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv or ["bash", str(BOOTSTRAP)],
        env={**base_env(), **env},
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    "env, line",
    [
        (
            {"SLURM_JOB_ID": "42"},
            "[cloudrl rank ?] error: DSTACK_NODE_RANK is not set. dstack sets it for every task; run this script as a "
            "dstack task command (dstack apply -f tasks/ray-cluster.dstack.yml), or under Slurm through sbatch "
            "tasks/slurm/ray-cluster.sbatch, not by hand.",
        ),
        (
            {**ONE_NODE, "CLOUDRL_DEBUGGER": "vscode"},
            "[cloudrl rank 0] error: CLOUDRL_DEBUGGER=vscode is not a debugger: use post-mortem or legacy, or leave it "
            "unset.",
        ),
        (
            {**ONE_NODE, "CLOUDRL_RAY_RESOURCES": '{"rollout_node": "one"}'},
            """[cloudrl rank 0] error: CLOUDRL_RAY_RESOURCES={"rollout_node": "one"} is not a JSON object of resource """
            """amounts (amounts must be numbers >= 0, names without spaces): write e.g. '{"rollout_node": 1}', or """
            """'{"0": {"trainer_node": 1}, "1": {"rollout_node": 1}}' per node.""",
        ),
        (
            {**ONE_NODE, "CLOUDRL_RAY_RESOURCES": "rollout_node=1"},
            "[cloudrl rank 0] error: CLOUDRL_RAY_RESOURCES=rollout_node=1 is not a JSON object of resource amounts "
            "(Expecting value: line 1 column 1 (char 0))",
        ),
        (
            {**ONE_NODE, "CLOUDRL_RAY_METRICS": "yes"},
            "[cloudrl rank 0] error: CLOUDRL_RAY_METRICS=yes: use on (each node exports Ray's metrics) or off.",
        ),
    ],
    ids=[
        "slurm-job-but-no-dstack-inputs",
        "unknown-debugger",
        "resource-not-a-number",
        "resources-not-json",
        "metrics",
    ],
)
def test_bad_switch_stops_the_node_with_one_line(env, line):
    result = bootstrap(env)
    assert result.returncode == 1
    errors = [ln for ln in result.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and errors[0].startswith(line), result.stderr
    assert "Traceback" not in result.stderr and "pip" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "env, line",
    [
        (
            {"SLURM_JOB_ID": "42"},
            "[cloudrl rank ?] error: SLURM_JOB_NODELIST is not set: start this script with srun inside an allocation "
            "(sbatch tasks/slurm/ray-cluster.sbatch), not by hand.",
        ),
        (
            {},
            "[cloudrl rank ?] error: SLURM_JOB_ID is not set: this script runs inside a Slurm job (sbatch "
            "tasks/slurm/ray-cluster.sbatch); under dstack the task runs tasks/ray-bootstrap.sh itself.",
        ),
    ],
    ids=["without-nodelist", "outside-a-slurm-job"],
)
def test_slurm_node_script_stops_on_missing_slurm_inputs_with_one_line(env, line):
    result = bootstrap(env, ["bash", str(SLURM_NODE), str(BOOTSTRAP)])
    assert result.returncode == 1
    errors = [ln for ln in result.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and errors[0].startswith(line), result.stderr
    assert "Traceback" not in result.stderr and "pip" not in result.stdout + result.stderr


def test_slurm_node_script_without_scontrol_names_the_fix(tmp_path):
    # A PATH with nothing on it but `hostname`: no scontrol, and no DSTACK_NODES_IPS passed in.
    (tmp_path / "hostname").symlink_to(shutil.which("hostname"))
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node-[0-1]", "PATH": str(tmp_path)}
    result = bootstrap(env, [shutil.which("bash"), str(SLURM_NODE), str(BOOTSTRAP)])
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"[cloudrl rank ?] error: scontrol is not on PATH on {socket.gethostname()}: put Slurm's client tools on "
        "the PATH, or export DSTACK_NODES_IPS (one address per node)."
    ]
    assert "Traceback" not in result.stderr and "pip" not in result.stdout + result.stderr


def test_slurm_node_script_hands_slurms_inputs_to_the_bootstrap_as_dstacks(tmp_path):
    """The DSTACK_* inputs the node script derives from Slurm's variables are what the bootstrap reads: a
    stand-in bootstrap prints them."""
    stand_in = tmp_path / "ray-bootstrap.sh"
    stand_in.write_text(
        "for v in DSTACK_NODE_RANK DSTACK_NODES_NUM DSTACK_MASTER_NODE_IP DSTACK_GPUS_PER_NODE; do\n"
        '    echo "$v=${!v}"\n'
        "done\n"
        'echo "DSTACK_NODES_IPS=$(echo $DSTACK_NODES_IPS)"\n'
    )
    env = {
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node-[0-1]",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NUM_NODES": "2",
        "CUDA_VISIBLE_DEVICES": "0,1,2",
        "DSTACK_NODES_IPS": "10.9.0.1\n10.9.0.2\n",  # as the sbatch script passes them to containers
    }
    result = bootstrap(env, ["bash", str(SLURM_NODE), str(stand_in)])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("[cloudrl rank 1] Slurm job 42 on ") and lines[0].endswith(
        ": node 1 of 2, 3 GPU(s), head 10.9.0.1"
    ), lines
    assert lines[1:] == [
        "DSTACK_NODE_RANK=1",
        "DSTACK_NODES_NUM=2",
        "DSTACK_MASTER_NODE_IP=10.9.0.1",
        "DSTACK_GPUS_PER_NODE=3",
        "DSTACK_NODES_IPS=10.9.0.1 10.9.0.2",
    ]


# CLOUDRL_PYTHON for the bootstrap: Ray at the pin, every package importable, pip and ray_bringup.py's steps
# doing nothing, and `ray start` printing its arguments and the debugger's variables instead of starting.
STAND_IN_PYTHON = """#!/usr/bin/env bash
case "$1 $2" in
    "-c import ray; print(ray.__version__)") echo 2.60.0 ;;
    "-m ray.scripts.scripts")
        shift 2
        printf 'ray-arg %s\\n' "$@"
        for v in RAY_DEBUG REMOTE_PDB_HOST RAY_DEBUGGER_EXTERNAL; do echo "ray-env $v=${!v-<unset>}"; done
        ;;
esac
"""


@pytest.mark.parametrize("rank", [0, 1], ids=["head", "worker"])
def test_legacy_debugger_keeps_the_pdb_on_loopback(rank, tmp_path):
    """`ray start` on every node gets RAY_DEBUG=legacy with REMOTE_PDB_HOST=127.0.0.1 and never
    --ray-debugger-external (which would open the pdb on every interface), whatever the node's
    environment held."""
    stand_in = tmp_path / "python3"
    stand_in.write_text(STAND_IN_PYTHON)
    stand_in.chmod(0o755)
    # The worker waits for the head's GCS port and reports its phases to the head: a listening
    # socket on loopback answers both.
    with socket.create_server(("127.0.0.1", 0)) as head:
        port = str(head.getsockname()[1])
        env = {
            **ONE_NODE,
            "DSTACK_NODE_RANK": str(rank),
            "DSTACK_MASTER_NODE_IP": "127.0.0.1",
            "DSTACK_NODES_NUM": "2",
            "DSTACK_NODES_IPS": "127.0.0.1\n127.0.0.2\n",
            "CLOUDRL_RAY_PORT": port,
            "CLOUDRL_PHASE_PORT": port,
            "CLOUDRL_JOIN_TIMEOUT": "10",
            "CLOUDRL_PYTHON": str(stand_in),
            "CLOUDRL_DEBUGGER": "legacy",
            "RAY_DEBUGGER_EXTERNAL": "1",
            "REMOTE_PDB_HOST": "0.0.0.0",
        }
        result = bootstrap(env)
    assert result.returncode == 0, result.stdout + result.stderr
    args = [ln.removeprefix("ray-arg ") for ln in result.stdout.splitlines() if ln.startswith("ray-arg ")]
    assert args[0] == "start" and ("--head" in args) == (rank == 0), result.stdout
    assert not any(a.startswith("--ray-debugger-external") for a in args), args
    assert [ln for ln in result.stdout.splitlines() if ln.startswith("ray-env ")] == [
        "ray-env RAY_DEBUG=legacy",
        "ray-env REMOTE_PDB_HOST=127.0.0.1",
        "ray-env RAY_DEBUGGER_EXTERNAL=<unset>",
    ]
    assert "CLOUDRL_DEBUGGER=legacy: a paused worker waits for a debugger that takes no token" in result.stdout
