"""tasks/slurm/ray-cluster.sbatch on a real Slurm: sbatch → a 2-node Ray cluster → `cloudrl submit` → scancel.

tests/helpers/slurm_cluster.py runs Debian's slurm-wlm for real: slurmctld on a login node, one slurmd per
compute node, each a network namespace with its own hostname, /tmp, home and working dir. The batch
script, srun, the bootstrap and Ray all run unchanged; only GPUs are absent (0 GPUs per node). The
cluster starts with CLOUDRL_DEBUGGER=post-mortem and per-node custom resources, which the checks below
read back from each node, and role pinning uses.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from bundle_netns import netns_unavailable_reason
from cli_helpers import INTERRUPTIBLE
from dstack_runner import REPO_ROOT, base_env
from slurm_cluster import SSHD, SlurmCluster, slurm_unavailable_reason
from test_bundle_cluster import ON_WORKERS, client_env, run_job

SBATCH = REPO_ROOT / "tasks" / "slurm" / "ray-cluster.sbatch"
CLOUDRL = str(Path(sys.executable).parent / "cloudrl")
READY = r"\[cloudrl rank 0\] cluster ready: (\d+) nodes, (\d+) GPUs, dashboard on :8265"
# OpenRLHF-style node roles: the trainer's roles on node-0, the rollout engine on node-1.
RESOURCES = '{"0": {"trainer_node": 4}, "1": {"rollout_node": 1}}'
KNOBS = {
    "CLOUDRL_NUM_CPUS": "2",
    "CLOUDRL_RAY_START_ARGS": "--object-store-memory=100000000",
    "CLOUDRL_READY_TIMEOUT": "150",
    "CLOUDRL_JOIN_TIMEOUT": "150",
    "CLOUDRL_RAY_RESOURCES": RESOURCES,
    "CLOUDRL_DEBUGGER": "post-mortem",
    "CLOUDRL_FABRIC_CHECK": "0",
}

pytestmark = [pytest.mark.netns, pytest.mark.ray, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = netns_unavailable_reason() or slurm_unavailable_reason()
    if reason:
        pytest.skip(f"no Slurm test cluster here: {reason}")
    pytest.importorskip(
        "debugpy",
        reason="CLOUDRL_DEBUGGER=post-mortem needs debugpy in the image "
        "(pip install debugpy); the nodes have no network to get it",
    )
    cluster = SlurmCluster(2, tmp_path_factory.mktemp("slurm"), net=200 + os.getpid() % 50)
    try:
        cluster.create()
        cluster.user_env = {"RAY_AUTH_TOKEN": uuid.uuid4().hex * 2}  # exported before sbatch (docs/slurm.md)
        cluster.start_slurm()
        started = time.monotonic()
        cluster.job = cluster.sbatch(
            SBATCH, "--nodes=2", env={**KNOBS, "CLOUDRL_RUNS_DIR": str(cluster.shared / "runs")}
        )
        cluster.wait_output(cluster.job, READY, 180)
        ready = [line for line in cluster.job_output(cluster.job).splitlines() if "cluster ready:" in line]
        print(f"\nsbatch to cluster ready: {time.monotonic() - started:.1f}s; {ready}")
        yield cluster
    finally:
        cluster.stop()
    assert cluster.leftover_pids() == []


def test_sbatch_brings_up_one_ray_node_per_slurm_node(slurm):
    out = slurm.job_output(slurm.job)
    assert re.findall(READY, out) == [("2", "0")], out[-4000:]
    # Each node learnt its rank, the node count and the head from Slurm's environment.
    for rank in range(2):
        assert (
            f"[cloudrl rank {rank}] Slurm job {slurm.job} on node-{rank}: node {rank} of 2, 0 GPU(s), "
            f"head {slurm.ips[0]}"
        ) in out, out[-4000:]
    assert f"joining as worker {slurm.ips[1]}" in out
    assert slurm.job_state(slurm.job) == "RUNNING"
    # Every node's preemption-notice watcher found this job in Slurm's queue (its time limit: docs/slurm.md).
    for rank in range(2):
        assert f"[cloudrl rank {rank}] preemption notices: watching slurm every 5s" in out, out[-4000:]


def test_post_mortem_debugger_and_custom_resources_on_every_node(slurm):
    driver = ON_WORKERS + (
        "import json\n"
        "def probe():\n"
        "    import os, debugpy\n"
        "    return (os.environ.get('RAY_DEBUG'), os.environ.get('RAY_DEBUG_POST_MORTEM'), debugpy.__version__)\n"
        "@ray.remote(num_cpus=1)\n"
        "def on_head():\n"
        "    return probe()\n"
        "print('PROBE', json.dumps([ray.get(on_head.remote()), *on_workers(probe)]))\n"
        "print('RES', json.dumps({n['NodeManagerAddress']: {k: v for k, v in n['Resources'].items()\n"
        "    if k.endswith('_node')} for n in ray.nodes() if n['Alive']}))\n"
    )
    log = run_job(slurm, driver)
    probes = json.loads(re.search(r"^PROBE (.+)$", log, re.M).group(1))
    assert len(probes) == 2 and all(p[:2] == ["1", "1"] for p in probes), probes
    resources = json.loads(re.search(r"^RES (.+)$", log, re.M).group(1))
    assert resources == {slurm.ips[0]: {"trainer_node": 4.0}, slurm.ips[1]: {"rollout_node": 1.0}}


def test_cloudrl_submit_pins_roles_to_node_resources_and_succeeds(slurm, tmp_path):
    env = {**client_env(slurm), "RAY_ADDRESS": "http://127.0.0.1:8265"}

    def cloudrl(*args: str) -> subprocess.CompletedProcess:
        # The user's machine at the end of the dashboard tunnel: the head's network, the host's files.
        return slurm.exec(0, ["sh", "-c", 'cd "$0" && exec "$@"', str(tmp_path), CLOUDRL, *args], timeout=120, env=env)

    pin = "{trainer_node: 1}"
    run = cloudrl(
        "submit",
        "--preset",
        "local",
        "--name",
        "pinned",
        "trainer.total_steps=2",
        "model.sft_warmup_steps=0",
        "trainer.val_every=0",
        "trainer.save_every=0",
        f"actor.resources={pin}",
        f"critic.resources={pin}",
        f"reference.resources={pin}",
        "rollout.resources={rollout_node: 1}",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    deadline = time.monotonic() + 360
    while True:
        status = cloudrl("status", "pinned").stdout
        if re.search(r"^status: +(SUCCEEDED|FAILED|STOPPED)", status, re.M) or time.monotonic() > deadline:
            break
        time.sleep(3)
    log = cloudrl("logs", "pinned").stdout
    assert re.search(r"^status: +SUCCEEDED", status, re.M), status + log[-6000:]
    # The placement lines name nodes by id; `cloudrl logs --node N` heads its output with N's IP and id.
    ip_of = {}
    for rank in range(2):
        head = cloudrl("logs", "--node", str(rank)).stdout
        node_ip, node_id = re.match(r"# node \d \(([\d.]+), id (\w+)\)", head).groups()
        ip_of[node_id] = node_ip
    placed = {
        role: ip_of.get(node)
        for role, node in re.findall(r"^placement: (\w+): \d+ worker\(s\) on node\(s\) (\w+)$", log, re.M)
    }
    assert placed.get("actor") == placed.get("critic") == slurm.ips[0], (placed, log[-6000:])
    assert placed.get("rollout") == slurm.ips[1], (placed, log[-6000:])
    # The run landed under CLOUDRL_RUNS_DIR, on the shared filesystem.
    assert (slurm.shared / "runs" / "runs" / "local" / "metrics.jsonl").is_file()


@pytest.mark.skipif(
    not Path(SSHD).exists() or not shutil.which("ssh"),
    reason="no sshd/ssh client here (apt-get install -y openssh-server openssh-client)",
)
def test_dashboard_from_the_laptop_through_the_login_node(slurm, tmp_path):
    # sshd on the login node and on the head, as a site has them; the laptop reaches only the login node
    # (it runs in the login node's network here: the bridge has no uplink to the host). The hop is a
    # ProxyCommand: ProxyJump would take the login node's key from ~/.ssh only, the test's key is elsewhere.
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    (tmp_path / "authorized_keys").write_text((tmp_path / "client_key.pub").read_text())
    port = slurm.start_sshd(slurm.login, tmp_path)
    slurm.start_sshd(0, tmp_path)
    common = [
        "-o",
        f"IdentityFile={tmp_path / 'client_key'}",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "LogLevel=ERROR",
    ]
    hop = shlex.join(["ssh", *common, "-p", str(port), "-W", "%h:%p", f"root@{slurm.ips[slurm.login]}"])
    args = [
        CLOUDRL,
        "dashboard",
        "--ssh",
        f"root@{slurm.ips[0]}",
        "--port",
        "0",
        "-o",
        f"Port={port}",
        "-o",
        f"ProxyCommand={hop}",
        *common,
    ]
    env = {**base_env(), **client_env(slurm)}
    laptop = ["ip", "netns", "exec", slurm.ns[slurm.login]]
    proc = subprocess.Popen(
        laptop + args,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **INTERRUPTIBLE,
    )
    try:
        first = proc.stdout.readline()  # the URL line comes once the dashboard answers through ssh
        assert first.startswith(f"Ray dashboard of root@{slurm.ips[0]}: http://127.0.0.1:"), first + (
            proc.stderr.read() if proc.poll() is not None else ""
        )
        url = first.split(": ", 1)[1].split()[0]
        listed = subprocess.run(
            laptop + [CLOUDRL, "list", "--address", url], env=env, capture_output=True, text=True, timeout=60
        )
        assert listed.returncode == 0 and "SUCCEEDED" in listed.stdout, listed.stdout + listed.stderr
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(15)


def test_scancel_stops_every_process_on_every_node(slurm):
    # Runs last: the cluster is gone afterwards.
    before = {rank: slurm.node_pids(rank) for rank in range(2)}
    assert all(any("raylet" in cmd for cmd in pids.values()) for pids in before.values()), before
    out = slurm.login_run(["scancel", str(slurm.job)], timeout=30)
    assert out.returncode == 0, out.stderr
    deadline = time.monotonic() + 60
    while slurm.job_state(slurm.job) != "GONE" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert slurm.job_state(slurm.job) == "GONE"
    left = {}
    while time.monotonic() < deadline:
        left = {rank: slurm.node_pids(rank) for rank in range(2)}
        if not any(left.values()):
            break
        time.sleep(0.5)
    assert left == {0: {}, 1: {}}, left
