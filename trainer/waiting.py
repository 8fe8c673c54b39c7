"""Bounded waits on Ray calls: a worker that never answers ends the run with one line, not a hang.

    results = get_all(refs, ["actor rank 0 on node 10.0.0.1", ...], timeout_s=600,
                      what="joining the actor's process group", setting="trainer.worker_timeout_s")
"""

from __future__ import annotations

from .errors import WorkerTimeout


def get_all(refs: list, labels: list[str], timeout_s: float, what: str,
            setting: str = "trainer.worker_timeout_s") -> list:
    """`ray.get(refs)`, or WorkerTimeout naming every call still running after `timeout_s` seconds."""
    import ray

    if not refs:
        return []
    _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    if pending:
        late = [label for ref, label in zip(refs, labels) if ref in pending]
        raise WorkerTimeout(
            f"{what}: no answer from {', '.join(late)} within {setting}={timeout_s:g}s; the process may "
            f"be stuck on the network (NCCL_SOCKET_IFNAME, firewalled ports) or dead: read its log "
            f"(`ray logs` or the dashboard), fix that, or raise {setting}")
    return ray.get(list(refs))
