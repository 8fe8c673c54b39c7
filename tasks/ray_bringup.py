"""The Ray head's side of a bring-up, run by tasks/ray-bootstrap.sh on rank 0 (shipped with it by the
task's `files:`). Standard library only, plus Ray and torch, which the image has.

`watch`: beside the head's Ray process (in the foreground of the bootstrap). Listens for the workers' phase reports (`RANK PHASE EPOCH`
lines: `started` when a worker's bootstrap begins, so its image is pulled; `installed` once it has
cloudrl's Ray), polls Ray's state API until every node of DSTACK_NODES_IPS is alive, runs the fabric check,
then prints the one ready line with how long each phase took. On timeout it names each missing node and what
it last reported, and stops the head.

`fabric`: a Ray driver that runs one process per node and an all-reduce across them with torch.distributed
(NCCL on GPUs, Gloo on CPUs). Prints `fabric check: <backend> over <transport>, N nodes, bus bandwidth
X GB/s, latency Y us`, and fails when a node has InfiniBand/EFA devices but the collective ran over TCP
sockets.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import threading
import time

PHASES = ("started", "installed")
RANK_LOG = f"[cloudrl rank {os.environ.get('DSTACK_NODE_RANK', '0')}]"
# Where a node's InfiniBand and EFA devices appear (EFA devices are RDMA devices too). Tests point it at a
# directory of their own to fake a device.
IB_DIR = os.environ.get("CLOUDRL_FABRIC_IB_DIR", "/sys/class/infiniband")


def say(line: str) -> None:
    print(f"{RANK_LOG} {line}", flush=True)


# --- watch ---------------------------------------------------------------------------------------


class PhaseListener(threading.Thread):
    """Collects {rank: {phase: epoch seconds}} from the workers' one-line TCP reports."""

    def __init__(self, host: str, port: int, size: int):
        super().__init__(daemon=True)
        self.size, self.phases = size, {}
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.sock.settimeout(0.5)
        self.closed = False

    def run(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(2)
                try:
                    rank, phase, epoch = conn.recv(200).decode("ascii", "replace").split()
                    if phase in PHASES and 0 < int(rank) < self.size:
                        self.phases.setdefault(int(rank), {})[phase] = float(epoch)
                except (ValueError, OSError):
                    continue  # not a phase report: ignored

    def close(self) -> None:
        self.closed = True
        self.sock.close()


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


def watch(argv: list[str]) -> int:
    ray_pid, port, timeout, phase_port = int(argv[0]), argv[1], float(argv[2]), int(argv[3])
    boot_start, installed, ray_started = (float(v) for v in argv[4:7])
    expected = argv[7:]
    start = time.monotonic()
    listener = PhaseListener(expected[0], phase_port, len(expected))
    listener.start()
    from ray.util.state import list_nodes  # imported after `start`: the import counts against the timeout

    alive, last_report, error, joined_at = {}, -1.0, "dashboard not answering yet", {}
    while True:
        elapsed = time.monotonic() - start
        try:
            os.kill(ray_pid, 0)
        except ProcessLookupError:
            say("error: the Ray head exited before the cluster was ready")
            return 1
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
            os.kill(ray_pid, signal.SIGTERM)
            return 1
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
        check = subprocess.run([sys.executable, __file__, "fabric", *expected], timeout=None)
        if check.returncode != 0:
            os.kill(ray_pid, signal.SIGTERM)
            return 1
        fabric_s = time.time() - fabric_start
    gpus = sum(int(n.resources_total.get("GPU", 0)) for n in alive.values())
    say(
        f"cluster ready: {len(alive)} nodes, {gpus} GPUs, dashboard on :{port} "
        f"({timings(boot_start, installed, ray_started, all_joined, listener.phases, fabric_s)})"
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


# --- fabric --------------------------------------------------------------------------------------


def probe(rank: int, world: int, master: str, port: int, size: int) -> dict:
    """One node's side of the collective (runs in a Ray worker process on that node)."""
    import datetime

    import torch
    import torch.distributed as dist

    on_gpu = torch.cuda.is_available()
    nccl_log = f"/tmp/cloudrl-fabric-nccl.{os.getpid()}.log"
    if on_gpu:
        os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=nccl_log)
    dist.init_process_group(
        "nccl" if on_gpu else "gloo",
        init_method=f"tcp://{master}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
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


def fabric(expected: list[str]) -> int:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    by_ip = {n["NodeManagerAddress"]: n for n in ray.nodes() if n["Alive"]}
    gpus = all(by_ip[ip]["Resources"].get("GPU", 0) >= 1 for ip in expected)
    with socket.socket() as s:  # a free port on the head for torch.distributed's rendezvous
        s.bind((expected[0], 0))
        port = s.getsockname()[1]
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


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    sys.exit(watch(args) if mode == "watch" else fabric(args))
