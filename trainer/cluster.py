"""Joining the Ray cluster, and the preflight against it.

Imports nothing heavy (no torch, no transformers), so `python -m cloudrl.trainer` joining a cluster
that is too small for the config fails in seconds, before the model stack is even imported.
"""

from __future__ import annotations

import os

from .config import Config, ConfigError
from .placement import RoleRequest, check_fits


def cluster_address(cfg: Config) -> str:
    """The GCS address to join: trainer.ray_address, else RAY_ADDRESS (set by Ray for job drivers)."""
    address = cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS", "")
    if address.startswith("http"):
        raise ConfigError(f"RAY_ADDRESS={address} is a dashboard address (what `cloudrl submit` uses); the "
                          f"trainer joins a cluster by its GCS address (host:6379): unset RAY_ADDRESS to run "
                          f"locally, or submit the job with `cloudrl submit`")
    return address


def connect(cfg: Config, cpus_needed: float = 0.0) -> bool:
    """Join the cluster this job runs on, or start a local Ray instance. True if we started one."""
    import ray

    if ray.is_initialized():
        return False
    address = cluster_address(cfg)
    quiet = dict(logging_level="WARNING", log_to_driver=True, configure_logging=True)
    if address:
        ray.init(address=address, **quiet)
        return False
    # Logical CPUs: the roles take turns within a step, so a 2-core laptop can host all of them.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(cpus_needed + 0.999)),
             include_dashboard=False, **quiet)
    return True


def alive_nodes() -> list[dict[str, float]]:
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def preflight(cfg: Config) -> list[RoleRequest]:
    """Raise ClusterTooSmall unless the connected cluster can hold every role at once."""
    return check_fits(cfg, alive_nodes())
