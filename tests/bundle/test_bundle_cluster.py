"""The dstack bundle's Ray cluster, brought up by the task's own commands on a simulated cluster.

tests/helpers/bundle_netns.py plays dstack's runner: every node runs `commands` read from
tasks/ray-cluster.dstack.yml with the DSTACK_* environment of its rank, inside its own network
namespace (or, where namespaces are unavailable, on its own 127.0.0.x address), on a disk of its own
(its /tmp, home and working dir). Ray runs for real; only GPUs are simulated
(`DSTACK_GPUS_PER_NODE=8` becomes `ray start --num-gpus=8`).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from bundle_netns import Cluster, LoopbackCluster, NetnsCluster, netns_unavailable_reason
from dstack_runner import (
    REPO_ROOT,
    base_env,
    check_shipped_files,
    dstack_env,
    load_task,
    node_argv,
    nodes_num,
    shipped_files,
    task_env,
)

TASK_PATH = REPO_ROOT / "tasks" / "ray-cluster.dstack.yml"
BOOTSTRAP = REPO_ROOT / "tasks" / "ray-bootstrap.sh"
CLOUDRL = str(Path(sys.executable).parent / "cloudrl")
GPUS_PER_NODE = 8
# What a user's shell holds when running `dstack apply` (the task names these secrets). No W&B key:
# with one the bootstrap would install wandb, and the simulated nodes have no network.
LOCAL_ENV = {"WANDB_API_KEY": "", "HF_TOKEN": "test-hf-token", "RAY_AUTH_TOKEN": uuid.uuid4().hex * 2}
# Small nodes: three Ray nodes share two cores here.
TEST_KNOBS = {
    "CLOUDRL_NUM_CPUS": "1",
    "CLOUDRL_RAY_START_ARGS": "--object-store-memory=100000000",
    "CLOUDRL_READY_TIMEOUT": "120",
    "CLOUDRL_JOIN_TIMEOUT": "120",
    # The fabric check runs in the clusters of tests/bundle/test_bundle_variants.py; the others skip it.
    "CLOUDRL_FABRIC_CHECK": "0",
}
BRING_UP_TIMEOUT = 150

pytestmark = [pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def task() -> dict:
    task = load_task(TASK_PATH)
    check_shipped_files(TASK_PATH, task, REPO_ROOT)
    return task


_netns_reason: list[str | None] = []


def netns_reason() -> str | None:
    if not _netns_reason:
        _netns_reason.append(netns_unavailable_reason())
    return _netns_reason[0]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("netns", marks=[pytest.mark.netns, pytest.mark.ray]),
        pytest.param("loopback", marks=pytest.mark.ray),
    ],
)
def kind(request) -> str:
    """Where the simulated nodes live: network namespaces, or (where this machine has none for us)
    127.0.0.x addresses of the host. CLOUDRL_TEST_CLUSTER=loopback runs the stand-in instead."""
    forced = os.environ.get("CLOUDRL_TEST_CLUSTER") == "loopback"
    if request.param == "netns" and (netns_reason() or forced):
        pytest.skip(
            f"network namespaces unavailable ({netns_reason() or 'CLOUDRL_TEST_CLUSTER=loopback'}); "
            f"the loopback stand-in runs these checks instead"
        )
    if request.param == "loopback" and not (netns_reason() or forced):
        pytest.skip(
            "network namespaces are available and the netns run covers these checks; "
            "CLOUDRL_TEST_CLUSTER=loopback runs the 127.0.0.x stand-in"
        )
    return request.param


_next_net = iter(range(1, 250))


def new_cluster(kind: str, size: int, workdir: Path) -> Cluster:
    workdir.mkdir(parents=True, exist_ok=True)
    if kind == "netns":
        return NetnsCluster(size, workdir, net=(os.getpid() + next(_next_net)) % 250 + 1)
    return LoopbackCluster(size, workdir)


def start_node(cluster: Cluster, task: dict, rank: int, num_nodes: int | None = None, **knobs: str):
    """Start the node of `rank` as dstack would for a run of `num_nodes` nodes (default: the
    cluster's size) on the cluster's addresses: the task with its `nodes:` set to that number, its
    `files:` (read as tasks/ray-cluster.dstack.yml's) copied into the node's working dir."""
    ips = cluster.ips[: num_nodes or cluster.size]
    task = {**task, "nodes": len(ips)}
    env = {**base_env(), **task_env(task, LOCAL_ENV), **TEST_KNOBS, **knobs, **dstack_env(rank, ips, GPUS_PER_NODE)}
    return cluster.start(rank, node_argv(task, rank), env, files=shipped_files(TASK_PATH, task))


def client_env(cluster: Cluster) -> dict[str, str]:
    """What a Ray client needs to talk to this cluster (the token, when the nodes got one)."""
    token = cluster.nodes[0].env.get("RAY_AUTH_TOKEN")
    if token:
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    return {"RAY_AUTH_MODE": "disabled"}


def dashboard_port(cluster: Cluster) -> int:
    return cluster.dashboard_port if isinstance(cluster, LoopbackCluster) else 8265


READY = r"\[cloudrl rank 0\] cluster ready: (\d+) nodes, (\d+) GPUs, dashboard on :(\d+)"


# --- the 2-node cluster, shared by several checks -------------------------------------------------


@pytest.fixture(scope="module")
def two_nodes(kind, task, tmp_path_factory):
    cluster = new_cluster(kind, 2, tmp_path_factory.mktemp(f"two-nodes-{kind}"))
    try:
        cluster.create()
        started = time.monotonic()
        assert nodes_num(task) == 2, "the task's default is a 2-node cluster"
        # Ray token authentication, as every bring-up (the task's RAY_AUTH_TOKEN); a token of its own.
        token = {"RAY_AUTH_TOKEN": uuid.uuid4().hex + uuid.uuid4().hex}
        head = start_node(cluster, task, 0, **token)
        start_node(cluster, task, 1, **token)  # startup_order: master-first
        head.wait_for(READY, BRING_UP_TIMEOUT)
        bring_up = time.monotonic() - started
        print(f"\n{cluster.kind} 2-node cluster ready in {bring_up:.1f}s")
        yield cluster
    finally:
        cluster.stop()
    assert cluster.leftover_pids() == []


def test_head_prints_one_ready_line_with_all_nodes_and_gpus(two_nodes):
    head_log = two_nodes.nodes[0].output()
    ready = [line for line in head_log.splitlines() if "cluster ready:" in line]
    assert len(ready) == 1 and ready[0].startswith(
        f"[cloudrl rank 0] cluster ready: 2 nodes, 16 GPUs, dashboard on :{dashboard_port(two_nodes)} (head: install "
    )
    # Ray itself agrees: both addresses alive, as seen from the head.
    nodes = alive_nodes(two_nodes)
    assert sorted(nodes) == sorted(two_nodes.ips)
    assert all(gpus == GPUS_PER_NODE for gpus in nodes.values())


def test_both_nodes_run_in_the_foreground(two_nodes):
    # `--block`: the node's command is still running, so dstack keeps the job alive.
    assert all(node.proc.poll() is None for node in two_nodes.nodes.values())
    worker_log = two_nodes.nodes[1].output()
    assert f"joining as worker {two_nodes.ips[1]}" in worker_log


def run_job(cluster: Cluster, driver: str, *args: str) -> str:
    """Submit `python -c driver args` to the head's dashboard from the user's machine (inside the
    head's network namespace: dstack's SSH tunnel ends inside the head's container); its log."""
    client = (
        "import sys, time\n"
        "from ray.job_submission import JobSubmissionClient\n"
        "client = JobSubmissionClient(sys.argv[1])\n"
        "job = client.submit_job(entrypoint=sys.argv[2])\n"
        "deadline = time.monotonic() + 150\n"
        "while str(client.get_job_status(job)) not in ('SUCCEEDED', 'FAILED', 'STOPPED'):\n"
        "    assert time.monotonic() < deadline, 'job did not finish'\n"
        "    time.sleep(0.5)\n"
        "print('status', client.get_job_status(job))\n"
        "print(client.get_job_logs(job))\n"
    )
    url = f"http://127.0.0.1:{dashboard_port(cluster)}"
    entrypoint = shlex.join(["python", "-c", driver, *args])
    result = cluster.exec(0, [sys.executable, "-c", client, url, entrypoint], timeout=200, env=client_env(cluster))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "status SUCCEEDED" in result.stdout, result.stdout
    return result.stdout


# A job's driver: `on_workers(f)` runs `f` once on every worker node and returns the results.
ON_WORKERS = (
    "import os, sys, ray\n"
    "from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On\n"
    "ray.init()\n"
    "head = ray.get_runtime_context().get_node_id()\n"
    "workers = [n['NodeID'] for n in ray.nodes() if n['Alive'] and n['NodeID'] != head]\n"
    "def on_workers(f):\n"
    "    f = ray.remote(num_cpus=1)(f)\n"
    "    return ray.get([f.options(scheduling_strategy=On(w, soft=False)).remote() for w in workers])\n"
)


def test_job_submitted_to_the_head_dashboard_runs_on_a_worker(two_nodes):
    driver = ON_WORKERS + "print('task ran on', *on_workers(lambda: ray.util.get_node_ip_address()))\n"
    assert f"task ran on {two_nodes.ips[1]}" in run_job(two_nodes, driver)


def test_each_node_runs_ray_from_a_disk_of_its_own(two_nodes):
    for rank in range(2):
        # Ray's session dir (the node's raylet logs there) is in the node's own /tmp, and the node
        # ran the bootstrap that dstack shipped into its working dir.
        assert list(two_nodes.node_path(rank, "/tmp/ray").glob("session_2*/logs/raylet.out"))
        assert two_nodes.node_path(rank, "tasks/ray-bootstrap.sh").read_text() == BOOTSTRAP.read_text()


def test_a_task_on_node_1_sees_neither_node_0s_home_nor_the_users_machine(two_nodes, tmp_path):
    # A model directory that exists only on the user's machine, and a file only in node 0's home.
    on_host = tmp_path / "model"
    on_host.mkdir()
    two_nodes.node_path(0, "~/only-on-node-0").write_text("node 0's")
    driver = ON_WORKERS + (
        "model = sys.argv[1]  # a global: the worker's sys.argv is its own\n"
        "def seen():\n"
        "    return os.path.exists(os.path.expanduser('~/only-on-node-0')), os.path.isdir(model)\n"
        "print('head sees', *seen())\n"
        "print('node 1 sees', *on_workers(seen)[0])\n"
    )
    log = run_job(two_nodes, driver, str(on_host))
    # The loopback stand-in's nodes share the host's filesystem: only their homes are their own.
    on_host_seen = isinstance(two_nodes, LoopbackCluster)
    assert f"head sees True {on_host_seen}" in log, log
    assert f"node 1 sees False {on_host_seen}" in log, log


def test_dashboard_listens_on_loopback_only(two_nodes):
    port = dashboard_port(two_nodes)
    dashboard = [addr for addr in listening_tcp(two_nodes, 0) if addr.rsplit(":", 1)[1] == str(port)]
    assert dashboard, f"nothing listens on :{port}"
    assert set(dashboard) == {f"127.0.0.1:{port}"}, dashboard
    # And from the worker the head's dashboard port is closed (the GCS port is open).
    probe = (
        "import socket, sys\n"
        "def is_open(port):\n"
        "    try:\n"
        "        socket.create_connection((sys.argv[1], port), timeout=5).close()\n"
        "        return True\n"
        "    except OSError:\n"
        "        return False\n"
        "print(is_open(int(sys.argv[2])), is_open(int(sys.argv[3])))\n"
    )
    gcs_port = two_nodes.ray_port if isinstance(two_nodes, LoopbackCluster) else 6379
    result = two_nodes.exec(1, [sys.executable, "-c", probe, two_nodes.ips[0], str(port), str(gcs_port)], timeout=30)
    assert result.stdout.split() == ["False", "True"], result.stdout + result.stderr


def test_no_node_exports_metrics_without_a_token_by_default(two_nodes):
    """Ray's per-node metrics agent would serve Prometheus metrics on a port of every interface, without a
    token; the bootstrap turns it off (CLOUDRL_RAY_METRICS=off by default): the GCS's node table lists no
    metrics port (-1), and no node listens on one it lists."""
    script = (  # the GCS's node table, read without a driver (a driver needs the node's own raylet socket)
        "import json, sys\n"
        "from ray._raylet import GcsClient\n"
        "nodes = GcsClient(address=sys.argv[1]).get_all_node_info().values()\n"
        "print(json.dumps([n.metrics_export_port for n in nodes]))\n"
    )
    gcs = f"{two_nodes.ips[0]}:{two_nodes.ray_port if isinstance(two_nodes, LoopbackCluster) else 6379}"
    result = two_nodes.exec(0, [sys.executable, "-c", script, gcs], timeout=90, env=client_env(two_nodes))
    assert result.returncode == 0, result.stderr
    ports = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(ports) == len(two_nodes.ips), ports
    listening = {
        addr.rsplit(":", 1)[1] for rank in range(len(two_nodes.ips)) for addr in listening_tcp(two_nodes, rank)
    }
    exporting = [port for port in ports if port > 0 and str(port) in listening]
    assert ports == [-1] * len(ports) and not exporting, (ports, exporting)


def test_cloudrl_commands_authenticate_with_the_token_from_the_environment(two_nodes, tmp_path):
    # `cloudrl list` where dstack's tunnel ends (the head's loopback), with and without RAY_AUTH_TOKEN; an
    # empty HOME, so no ~/.ray/auth_token stands in for it.
    cli = [
        str(Path(sys.executable).parent / "cloudrl"),
        "list",
        "--address",
        f"http://127.0.0.1:{dashboard_port(two_nodes)}",
    ]
    home = {"HOME": str(tmp_path)}
    ok = two_nodes.exec(0, cli, timeout=90, env={**home, "RAY_AUTH_TOKEN": two_nodes.nodes[0].env["RAY_AUTH_TOKEN"]})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    refused = two_nodes.exec(0, cli, timeout=90, env=home)
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines() == [
        f"error: the cluster at http://127.0.0.1:{dashboard_port(two_nodes)} uses Ray token authentication and no "
        "token is set here: set RAY_AUTH_TOKEN to the cluster's token (`ray get-auth-token` on its head node)"
    ]


def test_from_another_host_of_the_cluster_network_only_token_checked_ray_ports_answer(two_nodes):
    # The worker's namespace stands for any host on the cluster network. The head's dashboard is closed
    # to it (test above); the per-node job agent listens on the cluster IP but rejects requests without
    # the token, and accepts them with it.
    if isinstance(two_nodes, LoopbackCluster):
        pytest.skip("the loopback stand-in has no separate network")
    probe = (
        "import sys, urllib.request, urllib.error\n"
        "def status(headers):\n"
        "    try:\n"
        "        return urllib.request.urlopen(urllib.request.Request(sys.argv[1], headers=headers), timeout=10).status\n"
        "    except urllib.error.HTTPError as e:\n"
        "        return e.code\n"
        "print(status({}), status({'Authorization': 'Bearer ' + sys.argv[2]}))\n"
    )
    url = f"http://{two_nodes.ips[0]}:52365/api/job_agent/jobs/nonexistent/logs"
    result = two_nodes.exec(1, [sys.executable, "-c", probe, url, two_nodes.nodes[0].env["RAY_AUTH_TOKEN"]], timeout=30)
    without, with_token = result.stdout.split()
    assert without == "401", result.stdout + result.stderr
    assert with_token != "401", result.stdout


def test_nccl_settings_default_to_the_interface_of_the_nodes_address(two_nodes, task):
    # The task leaves them to the bootstrap's default, `auto`: the interface that holds the node's dstack
    # IP (127.0.0.x stand-ins are held by no interface, so NCCL would pick); no InfiniBand devices here.
    assert not [e for e in task["env"] if e.split("=")[0] in ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE")]
    for node in two_nodes.nodes.values():
        line = next(line for line in node.output().splitlines() if "NCCL_SOCKET_IFNAME=" in line)
        expected = "eth0" if isinstance(two_nodes, NetnsCluster) else "<unset>"
        assert f"NCCL_SOCKET_IFNAME={expected} NCCL_IB_DISABLE=1" in line, line


def listening_tcp(cluster: Cluster, rank: int) -> list[str]:
    """`addr:port` of every listening TCP socket that the node sees (its namespace's, or the host's for
    the loopback stand-in), read from /proc/net/tcp{,6}: needs no `ss`."""
    out = cluster.exec(rank, ["cat", "/proc/net/tcp", "/proc/net/tcp6"], timeout=20)
    assert out.returncode == 0, out.stderr
    found = []
    for line in out.stdout.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[3] != "0A":  # 0A = LISTEN
            continue
        addr_hex, port_hex = fields[1].split(":")
        raw = bytes.fromhex(addr_hex)
        # The kernel prints each 32-bit word of the address in host (little-endian) order.
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
        addr = ipaddress.ip_address(raw)
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
            addr = addr.ipv4_mapped
        found.append(f"{addr}:{int(port_hex, 16)}")
    return found


def alive_nodes(cluster: Cluster) -> dict[str, int]:
    """{node IP: GPUs} of the alive Ray nodes, asked from inside the head."""
    script = (
        "import json, sys\n"
        "from ray.util.state import list_nodes\n"
        "nodes = list_nodes(address=sys.argv[1], filters=[('state', '=', 'ALIVE')])\n"
        "print(json.dumps({n.node_ip: int(n.resources_total.get('GPU', 0)) for n in nodes}))\n"
    )
    result = cluster.exec(
        0,
        [sys.executable, "-c", script, f"http://127.0.0.1:{dashboard_port(cluster)}"],
        timeout=60,
        env=client_env(cluster),
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- 3 nodes, one worker started 20 s before the head ---------------------------------------------


def test_three_nodes_with_a_worker_started_20s_before_the_head(kind, task, tmp_path):
    cluster = new_cluster(kind, 3, tmp_path)
    try:
        cluster.create()
        early = start_node(cluster, task, 2)
        # The early worker has been retrying for 20 s: its own attempt lines say so.
        early.wait_for(r"join attempt \d+: Ray head \S+ not answering yet \((2\d|[3-9]\d)s of", 60)
        started = time.monotonic()
        head = start_node(cluster, task, 0)
        start_node(cluster, task, 1)
        head.wait_for(READY, BRING_UP_TIMEOUT)
        print(f"\n{cluster.kind} 3-node cluster ready in {time.monotonic() - started:.1f}s after the head started")
        assert f"cluster ready: 3 nodes, {3 * GPUS_PER_NODE} GPUs" in head.output()
        log = early.output()
        assert early.proc.poll() is None, log
        assert log.count("join attempt") >= 5, log
        assert f"answers; joining as worker {cluster.ips[2]}" in log
        assert sorted(alive_nodes(cluster)) == sorted(cluster.ips)
    finally:
        cluster.stop()
    assert cluster.leftover_pids() == []


# --- a rollout node added to a running cluster (tasks/ray-rollout-spot.dstack.yml) ---------------------


def test_a_rollout_node_added_to_a_running_job_generates_and_its_loss_costs_no_restart(kind, task, tmp_path):
    """The rollout task is a run of its own: its one node is that run's rank 0 on another address, and with
    CLOUDRL_JOIN_HEAD it joins the running cluster's head as a worker instead of starting a head. A job
    running there with rollout.elastic, on a head that holds exactly its roles (4 CPUs), gets an engine on the
    new node (the model shipped to its disk from the driver's copy) that generates from the next weight push;
    when the node goes (every process of it killed, as a reclaimed spot instance), the job goes on with the
    head's engine, with no restart; when another rollout node joins, a new engine starts there in the lost
    one's slot and generates from the next push."""
    from runs import tiny_overrides

    rollout_path = REPO_ROOT / "tasks" / "ray-rollout-spot.dstack.yml"
    rollout = load_task(rollout_path)
    check_shipped_files(rollout_path, rollout, REPO_ROOT)
    cluster = new_cluster(kind, 3, tmp_path)
    run_dir = "/tmp/elastic-run" if kind == "netns" else str(tmp_path / "elastic-run")  # on the head's disk
    overrides = tiny_overrides(
        Path(run_dir),
        **{
            "trainer.total_steps": 100000,
            "rollout.elastic": "true",
            "rollout.max_engines": 2,
            # steps that wait idle on the reward instead of spinning while the nodes come and go
            "reward.function": "paced_reward.py:paced",
        },
    )
    job_dir = tmp_path / "job"  # on the user's machine: the reward file ships with the job
    job_dir.mkdir()
    shutil.copyfile(REPO_ROOT / "tests" / "helpers" / "paced_reward.py", job_dir / "paced_reward.py")
    try:
        cluster.create()
        head = start_node(cluster, task, 0, num_nodes=1, CLOUDRL_NUM_CPUS="4")
        head.wait_for(READY, BRING_UP_TIMEOUT)
        env = {**client_env(cluster), "RAY_ADDRESS": f"http://127.0.0.1:{dashboard_port(cluster)}"}
        submit = ["sh", "-c", 'cd "$0" && exec "$@"', str(job_dir), CLOUDRL, "submit", "--preset", "local"]
        submitted = cluster.exec(0, [*submit, *overrides], 120, env=env)
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        job = re.search(r"^submitted (\S+) to ", submitted.stdout, re.M).group(1)
        metrics = cluster.node_path(0, f"{run_dir}/metrics.jsonl")

        def rows() -> list[dict]:
            text = metrics.read_text() if metrics.exists() else ""
            return [json.loads(line) for line in text.splitlines() if line.strip() and json.loads(line)["step"] > 0]

        def until(what: str, ready, timeout_s: float = 240) -> None:
            deadline = time.monotonic() + timeout_s
            while not ready():
                assert time.monotonic() < deadline, f"no {what} within {timeout_s} s: {rows()[-3:]}"
                time.sleep(0.5)

        until("step 2", lambda: len(rows()) >= 2)
        shell = {**LOCAL_ENV, "CLOUDRL_JOIN_HEAD": cluster.ips[0]}  # what the user exports before `dstack apply`

        def add_rollout_node(rank: int):
            """`dstack apply` of the rollout task: a run of one node, on the cluster's address `rank`."""
            env = {**base_env(), **task_env(rollout, shell), **TEST_KNOBS, **dstack_env(0, [cluster.ips[rank]], 1)}
            node = cluster.start(rank, node_argv(rollout, 0), env, files=shipped_files(rollout_path, rollout))
            node.wait_for(
                rf"Ray head {cluster.ips[0]}:\d+ answers; joining as worker {cluster.ips[rank]} \(added to the "
                rf"running cluster\)",
                BRING_UP_TIMEOUT,
            )
            assert "starting the Ray head" not in node.output() and node.proc.poll() is None
            return node

        node = add_rollout_node(1)
        until("the node in Ray's list", lambda: sorted(alive_nodes(cluster)) == sorted(cluster.ips[:2]), 60)
        until("2 steps of the added engine", lambda: sum("rollout/engine_1_samples" in r for r in rows()) >= 2)
        node.kill()
        lost_after = len(rows())
        until("2 steps after the loss", lambda: len(rows()) >= lost_after + 3)
        add_rollout_node(2)
        until("the new engine", lambda: any("rollout/engine_replace_s" in r for r in rows()))
        back_at = len(rows())
        until("2 steps of the new engine", lambda: len(rows()) >= back_at + 3)
        logs = cluster.exec(0, [CLOUDRL, "logs", job], 60, env=env).stdout
        steps = rows()
    finally:
        cluster.stop()
    assert cluster.leftover_pids() == []
    assert re.search(rf"^rollout rank 1 on {re.escape(cluster.ips[1])} joined \(rollout.elastic", logs, re.M), logs[
        -3000:
    ]
    assert re.search(rf"^rollout rank 1 on {re.escape(cluster.ips[1])} was lost \(", logs, re.M), logs[-3000:]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))  # every step once
    assert all(r["trainer/restarts"] == 0 and r["rollout/samples"] == 16 for r in steps)
    added = [r for r in steps if "rollout/engine_1_samples" in r]
    assert added and all(r["rollout/engines_alive"] == 2 and r["rollout/engine_1_samples"] > 0 for r in added)
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in added)  # it generates with the trainer's weights
    # lost: from a step or two after the kill, one engine, up to the push at which the new one joined
    (replaced,) = [i for i, r in enumerate(steps) if "rollout/engine_replace_s" in r]
    alone = [i for i in range(lost_after, replaced + 1) if steps[i]["rollout/engines_alive"] == 1]
    assert alone and alone[0] <= lost_after + 2 and alone == list(range(alone[0], replaced + 1)), steps[lost_after:]
    back = rf"^rollout rank 1 on {re.escape(cluster.ips[2])} is back \d+ s after the loss: it generates"
    assert re.search(back, logs, re.M), logs[-3000:]
    after = steps[replaced + 1 :]
    assert after and all(r["rollout/engines_alive"] == 2 and r["rollout/engine_1_samples"] > 0 for r in after)
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in after)


# --- the variants run the same bootstrap --------------------------------------------------------


@pytest.mark.parametrize("variant", ["ray-cluster-groups.dstack.yml", "ray-cluster-amd.dstack.yml"])
def test_variants_run_the_same_bootstrap_on_every_rank(task, variant):
    path = REPO_ROOT / "tasks" / variant
    other = load_task(path)
    check_shipped_files(path, other, REPO_ROOT)
    size = nodes_num(other)
    assert size >= 2
    same = {**task, "nodes": size}
    for rank in range(size):
        assert node_argv(other, rank) == node_argv(same, rank) == ["/bin/sh", "-i", "-c", "bash tasks/ray-bootstrap.sh"]
    if other.get("groups"):
        # Ranks count through the groups in order: the head group comes first, with one node.
        assert other["groups"][0]["nodes"] == 1 and other["groups"][0].get("ports") == [8265]


# --- failures -------------------------------------------------------------------------------------


def test_head_fails_within_its_timeout_naming_the_missing_node(kind, task, tmp_path):
    # A 2-node run whose worker never comes: only the head starts (one Ray node, so the head's own
    # start-up stays well inside the timeout even on a busy 2-core machine).
    cluster = new_cluster(kind, 2, tmp_path)
    timeout_s = 30
    try:
        cluster.create()
        head = start_node(cluster, task, 0, CLOUDRL_READY_TIMEOUT=str(timeout_s))
        match = head.wait_for(r"error: cluster not ready after \d+s: .*", timeout_s + 90)
        failed_after = time.monotonic() - head.started_at
        message = match.group(0)
        assert f"1 of 2 nodes did not join: {cluster.ips[1]} (rank 1)" in message, message
        assert cluster.ips[0] not in message  # the head itself has joined
        assert "CLOUDRL_READY_TIMEOUT" in message
        # The head's Ray stops, so dstack sees the job fail.
        assert head.wait_exit(60) != 0
        print(
            f"\nhead gave up {failed_after:.1f}s after start (timeout {timeout_s}s, counted from Ray's "
            f"start), exited {time.monotonic() - head.started_at:.1f}s after start"
        )
        # Not before its timeout; after it, only by the bootstrap's own set-up (pip check, Python imports).
        assert timeout_s <= failed_after < timeout_s + 60
    finally:
        cluster.stop()
    assert cluster.leftover_pids() == []


def run_bootstrap(env: dict[str, str], timeout: float, token: bool = True) -> subprocess.CompletedProcess:
    auth = {"RAY_AUTH_TOKEN": LOCAL_ENV["RAY_AUTH_TOKEN"]} if token else {}
    return subprocess.run(
        ["bash", str(BOOTSTRAP)],
        env={**base_env(), **auth, **env},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
