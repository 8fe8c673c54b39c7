"""tasks/ray-bootstrap.sh's Slurm inputs, CLOUDRL_DEBUGGER and CLOUDRL_RAY_RESOURCES: bad values stop the
node at once with one line naming the fix, before anything is installed or started. (The good values run
on a real Slurm and a namespace cluster in tests/test_slurm_cluster.py and tests/test_debugger.py.)"""

from __future__ import annotations

import subprocess

import pytest
from dstack_runner import REPO_ROOT, base_env

BOOTSTRAP = REPO_ROOT / "tasks" / "ray-bootstrap.sh"
ONE_NODE = {
    "DSTACK_NODE_RANK": "0",
    "DSTACK_MASTER_NODE_IP": "10.9.0.1",
    "DSTACK_NODES_NUM": "1",
    "DSTACK_GPUS_PER_NODE": "0",
    "DSTACK_NODES_IPS": "10.9.0.1",
    "RAY_AUTH_TOKEN": "t" * 64,
}


def bootstrap(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(BOOTSTRAP)],
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
            "[cloudrl rank ?] error: SLURM_JOB_NODELIST is not set: start this script with srun inside an allocation "
            "(sbatch tasks/slurm/ray-cluster.sbatch), not by hand.",
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
    ],
    ids=["slurm-without-nodelist", "unknown-debugger", "resource-not-a-number", "resources-not-json"],
)
def test_bad_switch_stops_the_node_with_one_line(env, line):
    result = bootstrap(env)
    assert result.returncode == 1
    errors = [ln for ln in result.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and errors[0].startswith(line), result.stderr
    assert "Traceback" not in result.stderr and "pip" not in result.stdout + result.stderr
