"""One stack on every node (trainer/roles/versions.py): what a node reports, how reports are compared, and a
real 2-node cluster whose worker node reports another torch, stopped with one line before any worker starts."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys

import pytest
from cloudrl.trainer.roles.versions import MISSING, differences, node_versions
from runs import REPO, local_cluster, start_worker_node, tiny_overrides, wait_nodes

GPU_NODE = {"cuda": "12.8", "nccl": "2.28.9", "nvidia driver": "570.86.15", "gpu": "NVIDIA H100 80GB HBM3"}


def stack(**changes) -> dict[str, str]:
    base = {"python": "3.11.7", "torch": "2.13.0", "transformers": "5.19.0", "vllm": "0.32.0", "sglang": MISSING}
    base.update({"ray": "2.60.0", "peft": "0.21.2", **GPU_NODE})
    return {**base, **changes}


def test_this_node_reports_what_it_runs_without_importing_it():
    report = node_versions()
    assert report["python"] == platform.python_version()
    assert report["ray"] == "2.60.0" and report["torch"].startswith("2.")
    assert "torch" not in sys.modules or report["torch"] in sys.modules["torch"].__version__
    assert set(report) >= {"transformers", "vllm", "sglang", "peft", "cuda", "nccl", "nvidia driver", "gpu"}


def test_one_stack_has_no_difference():
    assert differences(stack(), {"node 10.0.0.2 (a1)": stack(), "node 10.0.0.3 (b2)": stack()}) == []


def test_a_node_with_another_package_is_named_with_the_drivers_version():
    found = differences(stack(), {"node a": stack(), "node b": stack(torch="2.12.0", vllm=MISSING)})
    assert found == ["node b: torch 2.12.0 (the driver: 2.13.0), vllm not installed (the driver: 0.32.0)"]


def test_python_must_match_to_the_minor_release():
    assert differences(stack(), {"node a": stack(python="3.11.9")}) == []
    assert differences(stack(), {"node a": stack(python="3.12.3")}) == ["node a: python 3.12.3 (the driver: 3.11.7)"]


def test_the_gpu_stack_is_compared_among_the_gpu_nodes_only():
    """A head without GPUs (the driver's node, or a CPU node of the job) differs from no GPU node."""
    cpu = stack(**dict.fromkeys(GPU_NODE, ""))
    assert differences(cpu, {"node cpu": cpu, "node a": stack(), "node b": stack()}) == []
    found = differences(cpu, {"node a": stack(), "node b": stack(cuda="12.4", gpu="NVIDIA A100-SXM4-80GB")})
    assert found == ["node b: cuda 12.4 (node a: 12.8), gpu NVIDIA A100-SXM4-80GB (node a: NVIDIA H100 80GB HBM3)"]


@pytest.mark.ray
def test_a_worker_node_with_another_torch_stops_the_job_before_any_worker_starts(private_cache, tmp_path):
    """The worker node's workers find package metadata saying torch 9.9.9 first on their path (as a node
    whose image installed another torch would); roles span both nodes."""
    from cloudrl.cli.node_processes import stop_node

    fake = tmp_path / "site" / "torch-9.9.9.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.9.9\n")
    nodes = []
    with local_cluster(nodes=1, cpus_per_node=4, gpus_per_node=0) as state:
        try:
            nodes.append(start_worker_node(state, "w1", 4, env={"PYTHONPATH": str(fake.parent)}))
            wait_nodes(state, 2)
            run_dir = tmp_path / "run"
            spanning = {"actor.nodes": 2, "critic.nodes": 2, "placement.timeout_s": 120}
            args = ["--preset", "local", *tiny_overrides(run_dir, **spanning)]
            result = subprocess.run(
                [sys.executable, "-m", "cloudrl.trainer", *args],
                cwd=REPO,
                env={**os.environ, "RAY_ADDRESS": state["gcs_address"]},
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
            errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
            assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
            # Only the worker node differs (its address is whatever Ray reports for it).
            found = re.search(
                r"the nodes do not run one stack: node \S+ \([0-9a-f]{8}\): torch 9\.9\.9 \(the driver: ", errors[0]
            )
            assert found and errors[0].count("torch 9.9.9") == 1, errors[0]
            assert "placement.check_versions=false" in errors[0]
            assert "placement: actor" not in result.stdout  # no worker started
            assert not (run_dir / "metrics.jsonl").exists()
        finally:
            for node in reversed(nodes):
                stop_node(node)
