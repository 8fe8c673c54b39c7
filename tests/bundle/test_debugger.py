"""CLOUDRL_DEBUGGER=legacy on the dstack bundle's 2-node cluster, and `cloudrl logs --node`.

The nodes run the task's own commands (tests/helpers/bundle_netns.py plays dstack's runner). A job's remote
function stops at `breakpoint()` on the worker node, whose pdb listens on that node's 127.0.0.1 only (no
--ray-debugger-external): the head cannot reach it. Ray's own `ray debug`, run on the worker node as
docs/debugging.md says (a Ray driver, on that node's raylet), lists the breakpoint and attaches to it,
and the test drives the pdb session through `ray debug`'s stdin.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bundle_netns import NetnsCluster, netns_unavailable_reason
from dstack_runner import base_env
from test_bundle_cluster import READY, client_env, new_cluster, start_node, task  # noqa: F401

CLOUDRL = str(Path(sys.executable).parent / "cloudrl")
RAY = [sys.executable, "-m", "ray.scripts.scripts"]

pytestmark = [pytest.mark.netns, pytest.mark.ray, pytest.mark.timeout(420)]

# A job whose remote function, pinned to the worker node, prints a line and stops at a breakpoint.
DRIVER = (
    "import ray\n"
    "from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On\n"
    "ray.init()\n"
    "head = ray.get_runtime_context().get_node_id()\n"
    "worker = [n['NodeID'] for n in ray.nodes() if n['Alive'] and n['NodeID'] != head][0]\n"
    "@ray.remote(num_cpus=1)\n"
    "def reward_fn():\n"
    "    secret = 6 * 7\n"
    "    print('reward_fn started on the worker node', flush=True)\n"
    "    breakpoint()\n"
    "    return secret\n"
    "print('result', ray.get(reward_fn.options(scheduling_strategy=On(worker, soft=False)).remote()))\n"
)


@pytest.fixture(scope="module")
def legacy(task, tmp_path_factory):  # noqa: F811 (fixture imported above)
    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable ({reason})")
    cluster: NetnsCluster = new_cluster("netns", 2, tmp_path_factory.mktemp("debugger"))
    try:
        cluster.create()
        for rank in range(2):
            start_node(cluster, task, rank, CLOUDRL_NUM_CPUS="2", CLOUDRL_DEBUGGER="legacy")
        cluster.nodes[0].wait_for(READY, 150)
        yield cluster
    finally:
        cluster.stop()
    assert cluster.leftover_pids() == []


def pdb_listeners(cluster: NetnsCluster, rank: int, port: int) -> list[str]:
    """The local addresses of the TCP sockets listening on `port` inside the node's network."""
    listening = cluster.exec(rank, ["ss", "-Hltn"], timeout=20)
    assert listening.returncode == 0, listening.stderr
    return [f[3] for f in map(str.split, listening.stdout.splitlines()) if f[3].rsplit(":", 1)[-1] == str(port)]


def test_ray_debug_lists_and_attaches_to_a_breakpoint_on_the_worker_node(legacy, tmp_path):
    env = {**client_env(legacy), "RAY_DEBUG": "legacy"}
    head = f"{legacy.ips[0]}:6379"
    # The job's driver runs on the head (submitted over the head's dashboard, as `cloudrl submit` does).
    driver = subprocess.Popen(
        legacy.ns_exec_prefix(0)
        + RAY
        + [
            "job",
            "submit",
            "--address",
            "http://127.0.0.1:8265",
            "--submission-id",
            "debug-me",
            "--",
            "python",
            "-c",
            DRIVER,
        ],
        env={**base_env(), **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        # `ray debug` runs on the worker node, where the task paused (it is a Ray driver: it needs that
        # node's raylet); it prints its table, then asks for an index: the first read finds stdin closed.
        deadline = time.monotonic() + 120
        while True:
            listed = legacy.run_in_node(1, RAY + ["debug", "--address", head], timeout=60, env=env)
            if "reward_fn" in listed.stdout or time.monotonic() > deadline:
                break
            time.sleep(2)
        table = listed.stdout.split("Active breakpoints:", 1)[-1]
        assert re.search(r"reward_fn.*<string>:10", table), listed.stdout + listed.stderr[-3000:]
        # The paused worker's pdb, as the job's log names it: on loopback, not on the node's address.
        deadline = time.monotonic() + 60
        while True:
            logs = legacy.exec(
                0, RAY + ["job", "logs", "--address", "http://127.0.0.1:8265", "debug-me"], timeout=60, env=env
            )
            opened = re.search(r"RemotePdb session open at (\S+):(\d+),", logs.stdout)
            if opened or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert opened and opened[1] == "localhost", logs.stdout[-3000:] + logs.stderr[-3000:]
        port = int(opened[2])
        # Bound to the worker node's 127.0.0.1 alone: neither its cluster address nor every interface.
        assert pdb_listeners(legacy, 1, port) == [f"127.0.0.1:{port}"]
        from_head = legacy.exec(0, ["bash", "-c", f": >/dev/tcp/{legacy.ips[1]}/{port}"], timeout=20)
        assert from_head.returncode != 0 and "Connection refused" in from_head.stderr, from_head.stderr
        # Attach to breakpoint 0 from the worker node, print a local, continue: the task returns.
        attached = legacy.run_in_node(
            1,
            ["sh", "-c", 'printf "0\\np secret * 2\\nc\\n" | "$@"', "sh", *RAY, "debug", "--address", head],
            timeout=60,
            env=env,
        )
        assert "84" in attached.stdout, attached.stdout + attached.stderr[-3000:]
        out, _ = driver.communicate(timeout=120)
        assert "result 42" in out, out[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def test_logs_node_shows_only_that_nodes_worker_output(legacy):
    env = {**client_env(legacy), "RAY_ADDRESS": "http://127.0.0.1:8265"}
    for wanted in ("1", legacy.ips[1]):
        shown = legacy.exec(0, [CLOUDRL, "logs", "--node", wanted, "--lines", "200"], timeout=60, env=env)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert shown.stdout.startswith(f"# node 1 ({legacy.ips[1]}, id "), shown.stdout[:500]
        assert "reward_fn started on the worker node" in shown.stdout, shown.stdout[-3000:]
    on_head = legacy.exec(0, [CLOUDRL, "logs", "--node", "0"], timeout=60, env=env)
    assert on_head.returncode == 0 and "reward_fn started" not in on_head.stdout, on_head.stdout[-3000:]
    bad = legacy.exec(0, [CLOUDRL, "logs", "--node", "10.9.9.9"], timeout=60, env=env)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "--node 10.9.9.9 is no alive node of the cluster at http://127.0.0.1:8265" in bad.stderr
    assert f"1 = {legacy.ips[1]} id " in bad.stderr
