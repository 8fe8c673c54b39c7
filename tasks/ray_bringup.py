"""The Python steps of tasks/ray-bootstrap.sh, one subcommand each (shipped beside it by the task's
`files:`; under Slurm it lies beside it on the shared filesystem). Standard library only, plus Ray and
torch, which the image has; the subcommands that run before the bootstrap installs Ray use the standard
library alone.

Every node, while it prepares the start flags of its Ray node:

`resources RAW KEY...`: this node's share of CLOUDRL_RAY_RESOURCES (RAW), a JSON object of amounts for
all nodes or an object of such objects keyed by node rank or host name (the KEYs, first match wins).
Prints the compact JSON ("" for none), or the one line that names the problem, with exit status 1.

`with-resource --start-args=ARGS NAME=AMOUNT`: ARGS (CLOUDRL_RAY_START_ARGS) with NAME added to its
`--resources=` flag, merged into one flag. Prints the new ARGS.

`interface IP`: the name of the network interface that holds IPv4 address IP ("" if none).

`object-store`: the object store size in bytes: half of /dev/shm, at most 30% of RAM.

`notices --gcs HOST:PORT --node-ip IP`: beside the node's Ray process, watches the cloud's preemption notice
(AWS spot instance-action, GCP `preempted`, Azure Scheduled Events `Preempt`/`Terminate`, or a Slurm job's
time limit CLOUDRL_SLURM_NOTICE_S ahead; the first that answers, or `--source`). On a notice it drains this node's Ray node with reason preemption
and the notice's deadline (Ray's GCS: the node takes no new work), which the trainer reads after each step:
it checkpoints that step and restarts its roles on the nodes that stay (docs/recovery.md). With no metadata
service answering (on premises) it says so and ends.

The head only:

`watch`: beside the head's Ray process (in the foreground of the bootstrap). Listens for the workers' phase
reports (`RANK PHASE EPOCH` lines: `started` when a worker's bootstrap begins, so its image is pulled;
`installed` once it has cloudrl's Ray), polls Ray's state API until every node of DSTACK_NODES_IPS is alive,
runs the fabric check, then prints the one ready line with how long each phase took. On timeout it names each
missing node and what it last reported, and stops the head. The phase reports are best effort: with the phase
port taken it says so and goes on without them; any failure of the watcher itself stops the head with one
line, since the watcher is what bounds the wait.

`fabric`: a Ray driver that runs one process per node and an all-reduce across them with torch.distributed
(NCCL on GPUs, Gloo on CPUs). Prints `fabric check: <backend> over <transport>, N nodes, bus bandwidth
X GB/s, latency Y us`, and fails when a node has InfiniBand/EFA devices but the collective ran over TCP
sockets.
"""

from __future__ import annotations

import argparse
import datetime
import email.utils
import fcntl
import glob
import json
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

PHASES = ("started", "installed")
HEAD_STOPPED = 3
"""`watch`'s exit status once it has stopped the head; the bootstrap stops the head on any other failure."""
RANK_LOG = f"[cloudrl rank {os.environ.get('DSTACK_NODE_RANK', '0')}]"
# Where a node's InfiniBand and EFA devices appear (EFA devices are RDMA devices too). Tests point it at a
# directory of their own to fake a device.
IB_DIR = os.environ.get("CLOUDRL_FABRIC_IB_DIR", "/sys/class/infiniband")


def say(line: str) -> None:
    print(f"{RANK_LOG} {line}", flush=True)


# --- every node: the start flags of its Ray node --------------------------------------------------


def node_resources(raw: str, keys: list[str]) -> str:
    """This node's custom resources from CLOUDRL_RAY_RESOURCES, as compact JSON ("" for none); ValueError
    (the text names the problem and the fix) when `raw` is no object of amounts."""
    try:
        given = json.loads(raw)
        if not isinstance(given, dict):
            raise ValueError("not an object")
        if given and all(isinstance(v, dict) for v in given.values()):
            given = next((given[k] for k in keys if k in given), {})
        if not all(isinstance(v, (int, float)) and v >= 0 and " " not in k for k, v in given.items()):
            raise ValueError("amounts must be numbers >= 0, names without spaces")
    except ValueError as e:
        raise ValueError(
            f"CLOUDRL_RAY_RESOURCES={raw} is not a JSON object of resource amounts ({e}): write e.g. "
            """'{"rollout_node": 1}', or '{"0": {"trainer_node": 1}, "1": {"rollout_node": 1}}' per node."""
        ) from None
    return json.dumps(given, separators=(",", ":")) if given else ""


def with_resource(start_args: str, name: str, amount: float) -> str:
    """Ray start flags with `name: amount` joined to the resources they already give, in one
    `--resources=` flag (Ray would keep only the last of several). Split on whitespace, as the bootstrap
    splits them for Ray: quotes are part of the JSON, not shell quoting."""
    resources, kept = {}, []
    for arg in start_args.split():
        if arg.startswith("--resources="):
            resources.update(json.loads(arg.split("=", 1)[1]))
        else:
            kept.append(arg)
    resources[name] = amount
    return " ".join(kept + ["--resources=" + json.dumps(resources, separators=(",", ":"))])


def interface_of(ip: str) -> str:
    """The name of the interface that holds IPv4 address `ip` ("" if none). Python, not `ip`: many images
    do not ship iproute2."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _, name in socket.if_nameindex():
        try:  # SIOCGIFADDR
            addr = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))[20:24]
        except OSError:
            continue
        if socket.inet_ntoa(addr) == ip:
            return name
    return ""


def object_store_bytes() -> int:
    """Half of /dev/shm, at most 30% of RAM (Ray's own default share), at least Ray's 75 MiB minimum:
    /dev/shm also holds NCCL's and vLLM's shared-memory buffers, and Ray alone would take 95% of it."""
    shm = os.statvfs("/dev/shm")
    shm_bytes = shm.f_bavail * shm.f_frsize
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(min(shm_bytes // 2, ram * 3 // 10), 78643200)


# --- the head: watch ---------------------------------------------------------------------------------------


class PhaseListener(threading.Thread):
    """Collects {rank: {phase: epoch seconds}} from the workers' one-line TCP reports, each accepted only
    from the address of the node whose rank it names. When the port cannot be bound (another service, a
    second cluster on the host's network), `problem` says why and nothing is collected: the reports only
    make the waiting lines more precise."""

    def __init__(self, host: str, port: int, nodes: list[str]):
        super().__init__(daemon=True)
        self.nodes, self.phases = nodes, {}
        self.closed = False
        self.problem = ""
        try:
            self.sock = socket.create_server((host, port), reuse_port=False)
        except OSError as e:
            self.sock = None
            self.problem = f"{host}:{port} cannot be bound ({os.strerror(e.errno) if e.errno else e})"
            return
        self.sock.settimeout(0.5)

    def run(self) -> None:
        while self.sock is not None and not self.closed:
            try:
                conn, (peer, *_) = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(2)
                try:
                    rank, phase, epoch = conn.recv(200).decode("ascii", "replace").split()
                    rank, when = int(rank), float(epoch)
                    if (
                        phase in PHASES
                        and 0 < rank < len(self.nodes)
                        and peer == self.nodes[rank]
                        and 0 < when < math.inf
                    ):
                        self.phases.setdefault(rank, {})[phase] = when
                except (ValueError, OSError, OverflowError):
                    continue  # not a phase report (or not from that rank's node, or no time): ignored

    def close(self) -> None:
        self.closed = True
        if self.sock is not None:
            self.sock.close()


def stop_head(ray_pid: int) -> None:
    """SIGTERM to the head's Ray process (the bootstrap's own PID, which `exec` handed to Ray): the job fails."""
    try:
        os.kill(ray_pid, signal.SIGTERM)
    except ProcessLookupError:  # already gone
        pass


def describe(rank: int, ip: str, phases: dict[str, float], now: float) -> str:
    if rank == 0:
        return f"{ip} (rank 0): the head's own Ray node is still starting"
    if "installed" in phases:
        return f"{ip} (rank {rank}): Ray installed {now - phases['installed']:.0f}s ago, not joined yet"
    if "started" in phases:
        return f"{ip} (rank {rank}): installing Ray (bootstrap started {now - phases['started']:.0f}s ago)"
    return (
        f"{ip} (rank {rank}): no word yet (its container has not started: image still pulling, or the node never came)"
    )


def watch(args: argparse.Namespace) -> int:
    ray_pid, port, timeout, expected = args.ray_pid, args.dashboard_port, args.timeout, args.nodes
    start = time.monotonic()
    listener = PhaseListener(expected[0], args.phase_port, expected)
    if listener.problem:
        say(
            f"warning: the phase port {listener.problem}: the workers' phase reports are off for this bring-up "
            f"(the wait for every node, its {timeout:.0f}s limit and the fabric check go on); set "
            "CLOUDRL_PHASE_PORT to a free port to have them"
        )
    listener.start()
    from ray.util.state import list_nodes  # imported after `start`: the import counts against the timeout

    alive, last_report, error, joined_at = {}, -1.0, "dashboard not answering yet", {}
    while True:
        elapsed = time.monotonic() - start
        try:
            os.kill(ray_pid, 0)
        except ProcessLookupError:
            say("error: the Ray head exited before the cluster was ready")
            return HEAD_STOPPED
        try:
            nodes = list_nodes(
                address=f"http://127.0.0.1:{port}",
                filters=[("state", "=", "ALIVE")],
                timeout=10,
                raise_on_missing_output=False,
            )
            alive = {n.node_ip: n for n in nodes}
            error = ""
        except Exception as e:  # the dashboard starts a few seconds after the GCS
            error = f"dashboard not answering yet ({type(e).__name__})"
        for ip in alive:
            joined_at.setdefault(ip, time.time())
        missing = [(rank, ip) for rank, ip in enumerate(expected) if ip not in alive]
        if not missing:
            break
        now = time.time()
        lines = [describe(rank, ip, listener.phases.get(rank, {}), now) for rank, ip in missing]
        if elapsed >= timeout:
            say(
                f"error: cluster not ready after {timeout:.0f}s: {len(missing)} of {len(expected)} nodes did not "
                f"join: {'; '.join(lines)}. Check those nodes' logs (dstack logs <run> --job <rank>); raise "
                "CLOUDRL_READY_TIMEOUT if they are still pulling the image."
            )
            stop_head(ray_pid)
            return HEAD_STOPPED
        if elapsed - last_report >= 10:
            last_report = elapsed
            say(
                f"waiting for nodes ({len(expected) - len(missing)}/{len(expected)} joined, {elapsed:.0f}s of "
                f"{timeout:.0f}s): {'; '.join(lines)}" + (f"; {error}" if error else "")
            )
        time.sleep(1)
    listener.close()
    all_joined = time.time()
    fabric_s = None
    if os.environ.get("CLOUDRL_FABRIC_CHECK", "1") != "0":
        fabric_start = time.time()
        fabric_argv = [sys.executable, __file__, "fabric", "--ray-port", str(args.ray_port), *expected]
        # Its all-reduce has CLOUDRL_FABRIC_TIMEOUT; the rest (joining Ray, scheduling the probes) gets 120 s more.
        limit = float(os.environ.get("CLOUDRL_FABRIC_TIMEOUT", "300")) + 120
        try:
            check = subprocess.run(fabric_argv, timeout=limit)
        except subprocess.TimeoutExpired:
            say(
                f"error: fabric check did not finish within {limit:.0f}s (CLOUDRL_FABRIC_TIMEOUT + 120 s); stopped "
                "the head. Check that the nodes reach each other on every port; CLOUDRL_FABRIC_CHECK=0 skips the check"
            )
            check = subprocess.CompletedProcess(fabric_argv, 1)
        if check.returncode != 0:
            stop_head(ray_pid)
            return HEAD_STOPPED
        fabric_s = time.time() - fabric_start
    gpus = sum(int(n.resources_total.get("GPU", 0)) for n in alive.values())
    say(
        f"cluster ready: {len(alive)} nodes, {gpus} GPUs, dashboard on :{port} "
        f"({timings(args.boot_start, args.installed, args.ray_started, all_joined, listener.phases, fabric_s)})"
    )
    return 0


def timings(
    boot: float,
    installed: float,
    ray_started: float,
    all_joined: float,
    phases: dict[int, dict[str, float]],
    fabric_s: float | None,
) -> str:
    parts = [f"head: install {installed - boot:.0f}s, Ray start {ray_started - installed:.0f}s"]
    started = [p["started"] for p in phases.values() if "started" in p]
    installs = [p["installed"] - p["started"] for p in phases.values() if {"started", "installed"} <= set(p)]
    if started:
        # Another machine's clock: a worker whose bootstrap began with the head's may read a little before it.
        lead = round(max(started) - boot)
        when = f"{lead}s after" if lead >= 0 else f"{-lead}s before"
        parts.append(
            f"workers: last bootstrap began {when} the head's (image pull), "
            f"slowest install {max(installs, default=0):.0f}s"
        )
    parts.append(f"all joined {all_joined - boot:.0f}s after the head's bootstrap began")
    if fabric_s is not None:
        parts.append(f"fabric check {fabric_s:.0f}s")
    return "; ".join(parts)


# --- the head: fabric --------------------------------------------------------------------------------------


def probe(rank: int, world: int, master: str, port: int, size: int) -> dict:
    """One node's side of the collective (runs in a Ray worker process on that node)."""
    import datetime

    import torch
    import torch.distributed as dist

    on_gpu = torch.cuda.is_available()
    nccl_log = f"/tmp/cloudrl-fabric-nccl.{os.getpid()}.log"
    if on_gpu:
        os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=nccl_log)
    timeout = datetime.timedelta(seconds=120)
    # A client of the rendezvous the fabric driver holds open (rendezvous_store): no rank binds a port.
    store = dist.TCPStore(master, port, is_master=False, timeout=timeout)
    dist.init_process_group("nccl" if on_gpu else "gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")

    def timed(tensor, reps: int) -> float:
        dist.all_reduce(tensor)  # warm-up: connections, NCCL channels
        if on_gpu:
            torch.cuda.synchronize()
        dist.barrier()
        began = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(tensor)
        if on_gpu:
            torch.cuda.synchronize()
        return (time.perf_counter() - began) / reps

    latency = timed(torch.ones(1, device=device), 20)
    per_op = timed(torch.ones(size // 4, device=device), 5)
    dist.destroy_process_group()
    transport = "tcp"
    if on_gpu:
        import re

        text = open(nccl_log, errors="replace").read() if os.path.exists(nccl_log) else ""
        nets = sorted(set(re.findall(r"via NET/([A-Za-z][\w ]*?)(?:/|\s|$)", text)))
        transport = "+".join(nets) or "intra-node only"
    bus_bw = size / per_op * 2 * (world - 1) / world / 1e9
    return {
        "ip": os.environ.get("CLOUDRL_NODE_IP", ""),
        "backend": "nccl" if on_gpu else "gloo",
        "transport": transport,
        "latency_us": latency * 1e6,
        "bus_gbs": bus_bw,
        "fast_devices": sorted(os.path.basename(p) for p in glob.glob(os.path.join(IB_DIR, "*"))),
    }


def rendezvous_store(host: str):
    """torch.distributed's rendezvous for the probes, held by this process for the whole check: a TCPStore
    on a port the kernel picks as it binds, so no other process can take the port between its choice and
    the probes' connect (a port found free and closed again could be). The probes join it as clients."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(host, 0, is_master=True, timeout=datetime.timedelta(seconds=120), wait_for_workers=False)


def fabric(expected: list[str], ray_port: int) -> int:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # The head's GCS by its address: "auto" would take whichever cluster this machine started last.
    ray.init(address=f"{expected[0]}:{ray_port}", logging_level="ERROR", log_to_driver=False)
    by_ip = {n["NodeManagerAddress"]: n for n in ray.nodes() if n["Alive"]}
    gpus = all(by_ip[ip]["Resources"].get("GPU", 0) >= 1 for ip in expected)
    store = rendezvous_store(expected[0])
    port = store.port
    size = int(os.environ.get("CLOUDRL_FABRIC_BYTES", str(256 << 20 if gpus else 8 << 20)))
    remote = ray.remote(probe)
    refs = [
        remote.options(
            num_cpus=0,
            num_gpus=1 if gpus else 0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(by_ip[ip]["NodeID"], soft=False),
            runtime_env={"env_vars": {"CLOUDRL_NODE_IP": ip}},
        ).remote(rank, len(expected), expected[0], port, size)
        for rank, ip in enumerate(expected)
    ]
    try:
        results = ray.get(refs, timeout=float(os.environ.get("CLOUDRL_FABRIC_TIMEOUT", "300")))
    except Exception as e:
        say(
            f"error: fabric check failed: the all-reduce across {len(expected)} nodes did not complete "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Check that the nodes reach each "
            "other on every port (NCCL_SOCKET_IFNAME, firewalls); CLOUDRL_FABRIC_CHECK=0 skips the check"
        )
        return 1
    transports = sorted({r["transport"] for r in results})
    line = (
        f"fabric check: {results[0]['backend']} over {'/'.join(transports)}, {len(results)} nodes, bus bandwidth "
        f"{min(r['bus_gbs'] for r in results):.2f} GB/s ({size >> 20} MB all-reduce), latency "
        f"{max(r['latency_us'] for r in results):.0f} us"
    )
    slow = [r for r in results if r["fast_devices"] and r["transport"] in ("Socket", "tcp")]
    if slow:
        devices = ", ".join(f"{','.join(r['fast_devices'])} on {r['ip']}" for r in slow)
        say(
            f"error: {line}; but InfiniBand/EFA devices exist ({devices}) and the collective ran over TCP "
            "sockets. Use an image with the fabric's NCCL support (aws-ofi-nccl + libfabric for EFA, rdma-core for "
            "IB), check NCCL_IB_DISABLE and NCCL_SOCKET_IFNAME; CLOUDRL_FABRIC_CHECK=0 accepts TCP"
        )
        return 1
    say(line)
    return 0


# --- every node: preemption notices --------------------------------------------------------------

# The instance metadata service: AWS, GCP and Azure all answer on this link-local address (GCP also as
# metadata.google.internal). Tests point it at a server of their own.
METADATA_URL = os.environ.get("CLOUDRL_METADATA_URL", "http://169.254.169.254").rstrip("/")
NOTICE_SOURCES = ("slurm", "aws", "gcp", "azure")
GCP_NOTICE_S = 30.0  # GCP announces a preemption 30 s ahead and gives no time with the flag
NO_ANSWER = "no answer"


class Notice:
    """A cloud's preemption notice: what it said, and the time (Unix seconds) the instance goes away."""

    def __init__(self, text: str, deadline: float):
        self.text, self.deadline = text, deadline


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # the metadata service never redirects: nothing is followed
        return None


def metadata(path: str, headers: dict[str, str], method: str = "GET") -> tuple[int, str]:
    """One request to the metadata service, bounded (2 s per socket operation, no proxy, no redirect, 64 KiB
    read at most): (status, body), or (0, "") when nothing answers."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects)
    request = urllib.request.Request(METADATA_URL + path, headers=headers, method=method)
    try:
        with opener.open(request, timeout=2.0) as answer:
            return answer.status, answer.read(65536).decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (OSError, ValueError):
        return 0, ""


def aws_notice() -> Notice | str | None:
    """AWS (IMDSv2): a session token, then the spot instance-action, 404 until a stop or termination is
    scheduled (two minutes ahead)."""
    status, token = metadata("/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, method="PUT")
    if status != 200 or not token:
        return NO_ANSWER
    status, body = metadata("/latest/meta-data/spot/instance-action", {"X-aws-ec2-metadata-token": token})
    if status == 404:
        return None
    if status != 200:
        return NO_ANSWER
    try:
        action = json.loads(body)
        when = action["time"]
        deadline = datetime.datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()
    except (ValueError, KeyError, TypeError, AttributeError):
        return Notice("AWS spot instance-action (unreadable time: two minutes assumed)", time.time() + 120)
    return Notice(f"AWS spot {action.get('action', 'interruption')} at {when}", deadline)


def gcp_notice() -> Notice | str | None:
    """GCP: the instance's `preempted` flag turns TRUE 30 s before the preemption."""
    status, body = metadata("/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})
    if status != 200:
        return NO_ANSWER
    if body.strip().upper() != "TRUE":
        return None
    return Notice("GCP preemption", time.time() + GCP_NOTICE_S)


def azure_notice() -> Notice | str | None:
    """Azure: Scheduled Events; a `Preempt` (spot eviction) or `Terminate` event names its NotBefore time."""
    status, body = metadata("/metadata/scheduledevents?api-version=2020-07-01", {"Metadata": "true"})
    if status != 200:
        return NO_ANSWER
    try:
        events = json.loads(body).get("Events") or []
    except (ValueError, AttributeError):
        return NO_ANSWER
    for event in events:
        kind = event.get("EventType") if isinstance(event, dict) else None
        if kind in ("Preempt", "Terminate"):
            when = str(event.get("NotBefore") or "")
            try:
                deadline = email.utils.parsedate_to_datetime(when).timestamp()
            except (TypeError, ValueError):
                deadline = time.time() + 30
            return Notice(f"Azure {kind} not before {when or 'an unknown time'}", deadline)
    return None


def slurm_notice() -> Notice | str | None:
    """Slurm: the job's end at its time limit (`squeue -o %e`, re-read each time: a limit can change),
    announced CLOUDRL_SLURM_NOTICE_S (300) seconds ahead, as `sbatch --signal` would warn."""
    job = os.environ.get("SLURM_JOB_ID", "")
    if not job:
        return NO_ANSWER
    try:
        answer = subprocess.run(["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):  # no Slurm client here (inside a container, say)
        return NO_ANSWER
    end = answer.stdout.strip()
    if answer.returncode != 0 or not end:
        return NO_ANSWER
    try:
        deadline = datetime.datetime.fromisoformat(end).timestamp()  # Slurm prints local time
    except ValueError:  # N/A, NONE, Unknown: no time limit
        return None
    if deadline - time.time() > float(os.environ.get("CLOUDRL_SLURM_NOTICE_S", "300")):
        return None
    return Notice(f"Slurm job {job} reaches its time limit at {end}", deadline)


NOTICE_POLLS = {"slurm": slurm_notice, "aws": aws_notice, "gcp": gcp_notice, "azure": azure_notice}


def notice_source(wanted: str) -> str | None:
    """What this node watches: `wanted`, or with `auto` the first that answers: Slurm's queue for this job,
    else the cloud whose metadata service answers (None: nothing does, e.g. on premises without Slurm)."""
    for source in NOTICE_SOURCES if wanted == "auto" else (wanted,):
        if NOTICE_POLLS[source]() != NO_ANSWER:
            return source
    return None


def this_ray_node(gcs: str, node_ip: str, node_manager_port: int | None) -> str | None:
    """The id of the alive Ray node at `node_ip`; where several or none report that address (nodes sharing a
    machine, which Ray may report under its outward address instead of 127.0.0.1), the one whose raylet
    listens on `node_manager_port`. None when that leaves not exactly one."""
    import ray
    from ray.core.generated import gcs_pb2

    client = ray._raylet.GcsClient(address=gcs)
    alive = [i for i in client.get_all_node_info(timeout=10).values() if i.state == gcs_pb2.GcsNodeInfo.ALIVE]
    mine = [info for info in alive if info.node_manager_address == node_ip]
    if len(mine) != 1 and node_manager_port:
        mine = [info for info in mine or alive if info.node_manager_port == node_manager_port]
    return mine[0].node_id.hex() if len(mine) == 1 else None


def drain(gcs: str, node_id: str, notice: Notice) -> tuple[bool, str]:
    """Ask Ray's GCS to drain `node_id` for a preemption: it takes no new work, and the trainer, which reads
    the draining nodes after each step, checkpoints the step and moves its roles off it."""
    import ray
    from ray.core.generated import autoscaler_pb2

    client = ray._raylet.GcsClient(address=gcs)
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    return client.drain_node(node_id, reason, notice.text, int(max(notice.deadline, time.time() + 1) * 1000))


def notices(args: argparse.Namespace) -> int:
    """Watch this node's cloud for a preemption notice; on one, drain this node's Ray node (once) and end."""
    source = notice_source(args.source)
    if source is None:
        say(
            f"preemption notices: no Slurm job and no cloud metadata service answers at {METADATA_URL}: not "
            "watched on this node"
        )
        return 0
    say(f"preemption notices: watching {source} every {args.poll_s:g}s")
    import ray  # noqa: F401  (now, not when a notice leaves 30 s: GCP's whole lead)

    while True:
        notice = NOTICE_POLLS[source]()
        if isinstance(notice, Notice):
            break
        time.sleep(args.poll_s)
    say(f"preemption notice: {notice.text}; draining this Ray node so the trainer checkpoints and leaves it")
    deadline = time.monotonic() + args.find_timeout_s
    while True:  # Ray may still be starting on this node
        try:
            node_id = this_ray_node(args.gcs, args.node_ip, args.node_manager_port)
            reason = f"no alive Ray node at {args.node_ip}"
        except Exception as e:  # the GCS not up yet, or going away: tried again until the bound
            node_id, reason = None, (str(e).splitlines() or [type(e).__name__])[0]
        if node_id is not None:
            break
        if time.monotonic() >= deadline:
            say(f"error: preemption notice not passed on: {reason} (GCS {args.gcs}) after {args.find_timeout_s:g}s")
            return 1
        time.sleep(1)
    accepted, why = drain(args.gcs, node_id, notice)
    if not accepted:
        say(f"error: Ray refused to drain this node ({node_id[:12]}): {why}")
        return 1
    say(f"drained Ray node {node_id[:12]}: it takes no new work; the trainer leaves it after its current step")
    return 0


# --- the command line ---------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(prog="ray_bringup.py", description=__doc__.split("\n\n", 1)[0])
    sub = cli.add_subparsers(dest="command", required=True)
    resources = sub.add_parser("resources", help="this node's share of CLOUDRL_RAY_RESOURCES, as JSON")
    resources.add_argument("raw", help="CLOUDRL_RAY_RESOURCES")
    resources.add_argument("keys", nargs="*", help="this node's names: rank, host name, ... (empty ones skipped)")
    added = sub.add_parser("with-resource", help="Ray start flags with one more custom resource")
    added.add_argument("--start-args", default="", help="CLOUDRL_RAY_START_ARGS (write --start-args=VALUE)")
    added.add_argument("resource", help="NAME=AMOUNT")
    interface = sub.add_parser("interface", help="the interface that holds an IPv4 address")
    interface.add_argument("ip")
    sub.add_parser("object-store", help="object store bytes: half of /dev/shm, at most 30%% of RAM")
    watcher = sub.add_parser("watch", help="the head: wait for every node, fabric check, ready line")
    watcher.add_argument("--ray-pid", type=int, required=True, help="the head's Ray process, stopped on failure")
    watcher.add_argument("--ray-port", type=int, required=True, help="the GCS port")
    watcher.add_argument("--dashboard-port", type=int, required=True)
    watcher.add_argument("--phase-port", type=int, required=True, help="where workers report their phases")
    watcher.add_argument("--timeout", type=float, required=True, help="seconds to wait for every node")
    watcher.add_argument("--boot-start", type=float, required=True, help="epoch seconds: bootstrap began")
    watcher.add_argument("--installed", type=float, required=True, help="epoch seconds: packages installed")
    watcher.add_argument("--ray-started", type=float, required=True, help="epoch seconds: Ray started")
    watcher.add_argument("nodes", nargs="+", help="every node's address, the head's first")
    notice = sub.add_parser("notices", help="every node: drain this Ray node on a cloud's preemption notice")
    notice.add_argument("--gcs", required=True, help="the head's GCS, HOST:PORT")
    notice.add_argument("--node-ip", required=True, help="this node's Ray address")
    notice.add_argument("--node-manager-port", type=int, default=None, help="this node's raylet port")
    notice.add_argument("--source", choices=("auto", *NOTICE_SOURCES), default="auto", help="the cloud to watch")
    notice.add_argument("--poll-s", type=float, default=5.0, help="seconds between two looks at the notice")
    notice.add_argument("--find-timeout-s", type=float, default=60.0, help="bound on finding this Ray node")
    check = sub.add_parser("fabric", help="an all-reduce across the nodes: transport, bandwidth, latency")
    check.add_argument("--ray-port", type=int, required=True, help="the head's GCS port")
    check.add_argument("nodes", nargs="+", help="every node's address, the head's first")
    return cli


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.command == "resources":
        try:
            print(node_resources(args.raw, [key for key in args.keys if key]))
        except ValueError as e:
            print(e)  # the bootstrap stops the node with this line
            return 1
    elif args.command == "with-resource":
        name, _, amount = args.resource.partition("=")
        print(with_resource(args.start_args, name, float(amount) if "." in amount else int(amount)))
    elif args.command == "interface":
        print(interface_of(args.ip))
    elif args.command == "object-store":
        print(object_store_bytes())
    elif args.command == "watch":
        try:
            return watch(args)
        except Exception as e:  # the watcher bounds the bring-up: without it the head would wait forever
            reason = str(e).splitlines()[0] if str(e) else ""
            say(
                f"error: the bring-up watcher failed ({type(e).__name__}: {reason}); stopped the head so the "
                "job fails instead of waiting forever without a ready line: start the cluster again"
            )
            stop_head(args.ray_pid)
            return HEAD_STOPPED
    elif args.command == "notices":
        return notices(args)
    else:
        return fabric(args.nodes, args.ray_port)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
