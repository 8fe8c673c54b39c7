"""Joining the Ray cluster, and the preflight against it.

`driver.train` plans the roles once (`placement.plan`), connects, and runs `preflight` before any
placement group or actor exists, so a cluster too small for the config fails in seconds.
"""

from __future__ import annotations

import math
import os
import socket

from ..config import Config, ConfigError
from ..errors import ClusterUnreachable
from .placement import RoleRequest, check_fits

PROBE_TIMEOUT_S = 3.0
"""How long the GCS port may take to accept a TCP connection before the address counts as dead
(ray.init itself would retry for minutes, printing only its own warnings)."""


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
        try:
            ray.init(address=address, **quiet)
        except ConnectionError as exc:  # something listens there, but Ray gave up on it (after ~20 s)
            raise unreachable(address, source, f"it accepts connections but is no Ray GCS: {exc}") from exc
        return False
    # Logical CPUs: the roles take turns within a step, so a 2-core laptop can host all of them.
    needed = math.ceil(sum(r.total("CPU") for r in requests))
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False, **quiet)
    return True


def probe(address: str, source: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise ClusterUnreachable unless something accepts TCP connections at a `host:port` address
    (`auto` and `ray://` addresses are left to Ray)."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except OSError as exc:
        reason = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or str(exc)).lower()
        raise unreachable(address, source, f"{reason} within {timeout_s:g} s") from None


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


def alive_nodes() -> list[dict[str, float]]:
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def preflight(requests: list[RoleRequest]) -> None:
    """Raise ClusterTooSmall unless the connected cluster can hold every role at once."""
    check_fits(requests, alive_nodes())
