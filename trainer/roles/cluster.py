"""Joining the Ray cluster, and the preflight against it.

`driver.train` plans the roles once (`placement.plan`), connects, and runs `preflight` before any
placement group or actor exists, so a cluster too small for the config fails in seconds.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
import tempfile

from ..config import Config, ConfigError
from ..errors import ClusterUnreachable
from .placement import RoleRequest, check_fits

PROBE_TIMEOUT_S = 3.0
"""How long the GCS port may take to accept a TCP connection, and then to answer as a gRPC server,
before the address counts as dead (ray.init itself would retry for minutes, printing only its own
warnings)."""


def cluster_address(cfg: Config) -> str:
    """The GCS address to join: trainer.ray_address, else RAY_ADDRESS (set by Ray for job drivers)."""
    address = cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS", "")
    if address.startswith("http"):
        raise ConfigError(
            f"RAY_ADDRESS={address} is a dashboard address (what `cloudrl submit` uses); the "
            f"trainer joins a cluster by its GCS address (host:6379): unset RAY_ADDRESS to run "
            f"locally, or submit the job with `cloudrl submit`"
        )
    return address


def connect(cfg: Config, requests: list[RoleRequest]) -> bool:
    """Join the cluster this job runs on, or start a local Ray instance sized for `requests` (the
    placement plan). True if we started one."""
    import ray

    if ray.is_initialized():
        return False
    address = cluster_address(cfg)
    quiet = dict(logging_level="WARNING", log_to_driver=True, configure_logging=True)
    if address:
        source = "trainer.ray_address" if cfg.trainer.ray_address else "RAY_ADDRESS"
        probe(address, source)
        _use_local_cluster_token(address)
        try:
            ray.init(address=address, **quiet)
        except ConnectionError as exc:  # something listens there, but Ray gave up on it (after ~20 s)
            raise unreachable(address, source, f"it accepts connections but is no Ray GCS: {exc}") from exc
        return False
    # Logical CPUs: the roles take turns within a step, so a 2-core laptop can host all of them.
    needed = math.ceil(sum(r.total("CPU") for r in requests))
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, needed),
        include_dashboard=False,
        _temp_dir=private_temp_dir(),
        **quiet,
    )
    return True


def private_temp_dir() -> str:
    """A root for the private Ray instance's sessions inside a 0700 directory, and its token auth set up
    for this process.

    Ray's default root, /tmp/ray, is shared by every user of the machine (its session dirs are 0777).
    Without RAY_AUTH_MODE Ray turns token auth on and writes a token to ~/.ray/auth_token with the
    default umask, readable by every user whose home is traversable: instead the instance gets a random
    token of its own, kept in this process's environment (its child processes inherit it) and never
    written. An explicit RAY_AUTH_MODE (or RAY_AUTH_TOKEN) is left as it is.
    """
    if os.environ.get("RAY_AUTH_MODE") in (None, "", "token"):
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
        _reload_ray_auth()
    # Ray makes the directory it is given (and its sessions) mode 0777: it gets one inside a 0700 one.
    private = tempfile.mkdtemp(prefix="cloudrl-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
    return os.path.join(private, "ray")


def _use_local_cluster_token(address: str) -> None:
    """Joining the `cloudrl local up` cluster by its GCS address: use its token (Ray token auth), which
    the CLI keeps in a 0600 file next to its state. Any other address is left to RAY_AUTH_TOKEN."""
    from ..paths import cache_dir

    try:
        state = json.loads((cache_dir() / "local-cluster.json").read_text())
        if state.get("gcs_address") != address or not state.get("token_file"):
            return
        token = open(state["token_file"]).read().strip()
    except (OSError, ValueError, AttributeError):
        return
    if token:  # this cluster's own token wins over one in the environment, which is for another
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN"] = token
        _reload_ray_auth()


def _reload_ray_auth() -> None:
    """Make this process's Ray read RAY_AUTH_MODE/RAY_AUTH_TOKEN again: it caches both when first
    imported (as Ray's own `_enable_token_auth` does after changing the mode)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def probe(address: str, source: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise ClusterUnreachable unless a gRPC server (a Ray GCS) answers at a `host:port` address, within
    seconds (`auto` and `ray://` addresses are left to Ray)."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return
    try:
        conn = socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s)
    except OSError as exc:
        reason = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or str(exc)).lower()
        raise unreachable(address, source, f"{reason} within {timeout_s:g} s") from None
    with conn:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):  # TLS first: no plain HTTP/2 to look at
            return
        problem = speaks_grpc(conn, timeout_s)
    if problem:
        raise unreachable(address, source, f"it accepts connections but is no Ray GCS: {problem}")


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # length 0, type SETTINGS, no flags, stream 0


def speaks_grpc(conn: socket.socket, timeout_s: float) -> str:
    """Empty when the peer of `conn` answers as a gRPC server does (Ray's GCS is one): the HTTP/2 client
    preface gets the server's SETTINGS frame back at once, before any call or token check. Otherwise what
    it did instead: a port forward whose far end is gone, a stuck process or another service. Ray's own
    connect would retry such a peer for minutes, printing only its C++ warnings."""
    conn.settimeout(timeout_s)
    try:
        conn.sendall(HTTP2_PREFACE + EMPTY_SETTINGS)
        header = b""
        while len(header) < 9:
            chunk = conn.recv(9 - len(header))
            if not chunk:
                return "it closed the connection without a word"
            header += chunk
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except (ConnectionResetError, BrokenPipeError):
        return "it closed the connection without a word"
    except OSError as exc:
        return f"the connection broke ({(exc.strerror or str(exc)).lower()})"
    if header[3] != 0x04:  # an HTTP/2 server's first frame is its SETTINGS
        return f"it answered {header[:9]!r}, not HTTP/2 (gRPC)"
    return ""


def unreachable(address: str, source: str, reason: str) -> ClusterUnreachable:
    fix = (
        "unset RAY_ADDRESS to start a local Ray instance"
        if source == "RAY_ADDRESS"
        else "set trainer.ray_address= (empty) to start a local Ray instance"
    )
    return ClusterUnreachable(
        f"{source}={address}: no Ray cluster answers there ({reason}): {fix}, or start "
        f"the cluster first (`cloudrl local up`, or `ray start --head` on that host)"
    )


def alive_nodes(exclude: frozenset[str] = frozenset()) -> list[dict[str, float]]:
    """The resources of every node new roles can be placed on: alive and not being drained (a node with a
    preemption notice is drained by its watcher, tasks/ray_bringup.py `notices`, and takes no new work), nor
    in `exclude` (node ids a restart leaves out)."""
    import ray

    left_out = exclude | set(draining_nodes())
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in left_out]


def draining_nodes() -> dict[str, float]:
    """The nodes Ray is draining, by id: the time (Unix seconds) by which each goes away, 0 when none was
    given. Ray's GCS keeps this set (`ray drain-node`, which a node's preemption-notice watcher calls)."""
    from ray._private.state import state

    return {node_id: deadline_ms / 1000 for node_id, deadline_ms in state.get_draining_nodes().items()}


def preflight(requests: list[RoleRequest], exclude: frozenset[str] = frozenset()) -> None:
    """Raise ClusterTooSmall unless the connected cluster (without the nodes in `exclude`) can hold every
    role at once."""
    check_fits(requests, alive_nodes(exclude))
