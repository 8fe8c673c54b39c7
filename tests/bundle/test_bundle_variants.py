"""The task variants (node groups; AMD, with fake GPUs) brought up to their ready line on the simulated
cluster of tests/helpers/bundle_netns.py, with the bring-up's fabric check on: the all-reduce across the nodes runs
over Gloo (no GPUs here), and fails when a node shows an InfiniBand device (faked: a directory the test
creates and points CLOUDRL_FABRIC_IB_DIR at, standing in for /sys/class/infiniband). The AMD variant's GPUs
are `ray start --num-gpus` only: no ROCm here, only the bootstrap's device-visibility settings are real.
Also: the head tells a worker that reported its phase from one that never came.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from bundle_netns import netns_unavailable_reason
from dstack_runner import REPO_ROOT, base_env, dstack_env, load_task, node_argv, nodes_num, shipped_files, task_env
from test_bundle_cluster import LOCAL_ENV, READY, TEST_KNOBS, new_cluster

pytestmark = [pytest.mark.timeout(420), pytest.mark.ray, pytest.mark.netns]
GPUS = 8
# Small enough for two simulated nodes sharing two cores.
FABRIC_KNOBS = {"CLOUDRL_FABRIC_CHECK": "1", "CLOUDRL_FABRIC_BYTES": str(4 << 20), "CLOUDRL_FABRIC_TIMEOUT": "120"}
FABRIC = (
    r"\[cloudrl rank 0\] fabric check: gloo over tcp, 2 nodes, bus bandwidth [\d.]+ GB/s \(4 MB all-reduce\), "
    r"latency \d+ us"
)


@pytest.fixture(scope="module", autouse=True)
def needs_netns():
    if reason := netns_unavailable_reason():
        pytest.skip(f"network namespaces unavailable ({reason})")


def start(cluster, path: Path, rank: int, **knobs: str):
    task = load_task(path)
    env = {
        **base_env(),
        **task_env(task, LOCAL_ENV),
        **TEST_KNOBS,
        **FABRIC_KNOBS,
        **knobs,
        **dstack_env(rank, cluster.ips, GPUS),
    }
    return cluster.start(rank, node_argv(task, rank), env, files=shipped_files(path, task))


@pytest.fixture(scope="module", params=["ray-cluster-groups.dstack.yml", "ray-cluster-amd.dstack.yml"])
def variant(request, tmp_path_factory):
    path = REPO_ROOT / "tasks" / request.param
    assert nodes_num(load_task(path)) == 2
    cluster = new_cluster("netns", 2, tmp_path_factory.mktemp(request.param.split(".")[0]))
    try:
        cluster.create()
        started = time.monotonic()
        head = start(cluster, path, 0)
        start(cluster, path, 1)
        head.wait_for(READY, 200)
        print(f"\n{request.param}: ready {time.monotonic() - started:.1f}s after the head started")
        yield request.param, cluster
    finally:
        cluster.stop()
    assert cluster.leftover_pids() == []


def test_variant_reaches_its_ready_line_after_the_fabric_check(variant):
    name, cluster = variant
    log = cluster.nodes[0].output()
    fabric = re.search(FABRIC, log)
    assert fabric, log[-3000:]
    ready = [line for line in log.splitlines() if "cluster ready:" in line]
    assert len(ready) == 1 and log.index(ready[0]) > fabric.start()
    # The ready line reports the phases: the head's install and Ray start, the workers' reports, the check.
    assert re.fullmatch(
        r"\[cloudrl rank 0\] cluster ready: 2 nodes, 16 GPUs, dashboard on :8265 \(head: install \d+s, "
        r"Ray start \d+s; workers: last bootstrap began \d+s (after|before) the head's \(image pull\), slowest "
        r"install \d+s; all joined \d+s after the head's bootstrap began; fabric check \d+s\)",
        ready[0],
    ), ready[0]
    if "amd" in name:
        for rank in range(2):
            assert (
                "AMD GPUs: HIP_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 ROCR_VISIBLE_DEVICES=0,1,2,3,4,5,6,7"
                in cluster.nodes[rank].output()
            )


def test_fabric_check_fails_when_an_infiniband_device_exists_but_tcp_was_used(variant):
    name, cluster = variant
    if "amd" in name:
        pytest.skip("one variant's cluster is enough for the failure path")
    for rank in range(2):  # a fake device on the nodes' own /tmp
        cluster.node_path(rank, "/tmp/fake-ib/mlx5_0").mkdir(parents=True, exist_ok=True)
    env = {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": LOCAL_ENV["RAY_AUTH_TOKEN"],
        "DSTACK_NODE_RANK": "0",
        "CLOUDRL_FABRIC_IB_DIR": "/tmp/fake-ib",
        **FABRIC_KNOBS,
    }
    result = cluster.run_in_node(
        0, [sys.executable, "tasks/ray_bringup.py", "fabric", "--ray-port", "6379", *cluster.ips], timeout=180, env=env
    )
    assert result.returncode == 1, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if "fabric check" in line]
    assert len(lines) == 1 and lines[0].startswith("[cloudrl rank 0] error: fabric check: gloo over tcp, 2 nodes"), (
        lines
    )
    assert (
        f"but InfiniBand/EFA devices exist (mlx5_0 on {cluster.ips[0]}, mlx5_0 on {cluster.ips[1]}) and the "
        "collective ran over TCP sockets"
    ) in lines[0]
    assert "CLOUDRL_FABRIC_CHECK=0 accepts TCP" in lines[0]


def test_head_tells_a_worker_that_reported_from_one_that_never_came(tmp_path):
    # 3 nodes: rank 1 runs its bootstrap but never joins (its GCS probe points at a closed port), rank 2
    # never starts. The head names both, differently, when it gives up.
    path = REPO_ROOT / "tasks" / "ray-cluster.dstack.yml"
    cluster = new_cluster("netns", 3, tmp_path)
    try:
        cluster.create()
        head = start(cluster, path, 0, CLOUDRL_READY_TIMEOUT="25", CLOUDRL_FABRIC_CHECK="0")
        start(cluster, path, 1, CLOUDRL_RAY_PORT="6390", CLOUDRL_JOIN_TIMEOUT="120")
        message = head.wait_for(r"error: cluster not ready after \d+s: .*", 160).group(0)
        assert f"{cluster.ips[1]} (rank 1): Ray installed " in message, message
        assert (
            f"{cluster.ips[2]} (rank 2): no word yet (its container has not started: image still pulling, or "
            "the node never came)"
        ) in message, message
        assert head.wait_exit(60) != 0
    finally:
        cluster.stop()
    assert cluster.leftover_pids() == []
