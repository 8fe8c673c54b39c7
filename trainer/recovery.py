"""Keeping a run alive: a stop request (SIGTERM) checkpoints the last step before exiting, and a lost
worker, engine or node restarts the roles from the latest checkpoint inside the same driver.

    with StopRequest() as stop:                  # SIGTERM: finish the step in flight, save it, stop
        summary = run_with_restarts(cfg, requests, inputs, launch, run)   # run(roles, restarts) -> summary

`run_with_restarts` starts the roles and trains; when Ray reports a dead actor or node (or a collective
fails because its peer is gone) it prints one line naming the role, rank, node and Ray's reason, shuts
every role down, waits up to `trainer.restart_wait_s` for the cluster to hold the config again (a
replacement node joining), starts the roles again and resumes from the latest checkpoint; at most
`trainer.max_restarts` times, each counted in the `trainer/restarts` metric. What it cannot recover
from ends with one line saying why and how to resume by hand.
"""

from __future__ import annotations

import re
import signal
import threading
import time

from .errors import RecoveryFailed, Stopped, first_line
from .state import checkpoint

# A collective whose peer process died: gloo and NCCL report it in these words.
PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "remote process exited or there was a network error",
)
WORKER_ROLES = {
    "PolicyWorker": "actor",
    "CriticWorker": "critic",
    "ReferenceWorker": "reference",
    "RewardWorker": "reward",
    "RolloutWorker": "rollout",
}
RESUME_BY_HAND = "resubmit the same config with trainer.resume=auto to continue from the latest checkpoint"


class StopRequest:
    """While active, SIGTERM asks the run to stop instead of killing it: the step in flight finishes,
    `Trainer.fit` saves it and raises `Stopped`. A second SIGTERM kills at once. Only the main thread
    can take signals; elsewhere this does nothing."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _on_signal(self, signum, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process
        print("received SIGTERM: finishing the step in flight, then checkpointing it and stopping", flush=True)

    def checkpoint_and_stop(self, trainer, last_ckpt) -> None:
        """After a completed step: save it (unless just saved) and end the run with one line."""
        if last_ckpt is None or last_ckpt.name != f"{checkpoint.PREFIX}{trainer.global_step:06d}":
            last_ckpt = trainer.save_checkpoint()
        raise Stopped(
            f"stopped by SIGTERM after step {trainer.global_step}, checkpointed in {last_ckpt}: {RESUME_BY_HAND}"
        )


def lost_component(exc: BaseException, roles) -> str | None:
    """`actor rank 1 on 10.0.0.2: <Ray's reason>` when `exc` says a worker, engine or node is gone;
    None for any other error (those end the run as before)."""
    from ray.exceptions import NodeDiedError, RayActorError, RayTaskError

    if isinstance(exc, NodeDiedError):
        return f"a node: {_first_line(exc)}"
    if isinstance(exc, RayActorError):
        return describe_dead_actor(exc, roles)
    if isinstance(exc, RayTaskError) and any(text in f"{exc} {exc.cause}" for text in PEER_GONE):
        dead = find_dead_worker(roles)
        return dead or f"a peer of a collective ({_first_line(exc.cause) if exc.cause else 'connection closed'})"
    return None


def describe_dead_actor(exc: BaseException, roles) -> str:
    """Which of our workers the RayActorError is about, where it ran, and why Ray says it died."""
    text = str(exc)
    actor_id = getattr(exc, "actor_id", None)
    label = None
    if roles is not None and actor_id:
        for group in roles.groups():
            for w, name in zip(group.workers, group.labels()):
                if w._actor_id.hex() == actor_id:
                    label = name
    if label is None:
        cls = re.search(r"class_name: (\w+)", text)
        ip = re.search(r"\bip: ([\w.:]+)", text)
        label = (WORKER_ROLES.get(cls.group(1), cls.group(1)) if cls else "a worker") + (
            f" on {ip.group(1)}" if ip else ""
        )
    dead = re.search(r"The actor is dead because ([^\n]*)", text)
    unreachable = re.search(r"is unavailable.*?RPC error: (.*?)(?: rpc_code|\. The task|\n|$)", text)
    if dead:
        reason = f"dead because {dead.group(1).strip()}"
    elif unreachable:
        reason = f"unreachable ({unreachable.group(1).strip()})"
    else:
        reason = _first_line(exc)
    return f"{label}: {reason}"


def find_dead_worker(roles, timeout_s: float = 30.0) -> str | None:
    """After a collective failed: ask every worker where it runs; the first one Ray reports dead."""
    import ray
    from ray.exceptions import RayActorError

    if roles is None:
        return None
    calls = [(w.where.remote(), w) for g in roles.groups() for w in g.workers]
    deadline = time.monotonic() + timeout_s
    for ref, _worker in calls:
        try:
            ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
        except RayActorError as exc:
            return describe_dead_actor(exc, roles)
        except Exception:  # a slow or busy worker: not the dead one we are looking for
            continue
    return None


def wait_for_capacity(requests, wait_s: float) -> None:
    """Until the cluster can hold every role request again (a replacement node has joined), or
    RecoveryFailed after `wait_s` seconds with the placement check's own words."""
    from .roles.cluster import preflight
    from .roles.placement import ClusterTooSmall

    deadline = time.monotonic() + wait_s
    while True:
        try:
            preflight(requests)
            return
        except ClusterTooSmall as exc:
            if time.monotonic() >= deadline:
                raise RecoveryFailed(
                    f"the cluster did not get back the capacity the run needs within "
                    f"trainer.restart_wait_s={wait_s:g}s ({exc}); once it has, "
                    f"{RESUME_BY_HAND}"
                ) from None
        time.sleep(2.0)


def run_with_restarts(cfg, requests, inputs, launch, run) -> dict:
    """Start the roles (`launch()`), train (`run(roles, restarts)`), always shut the roles down, and
    after a lost worker or node start again from the latest checkpoint, up to trainer.max_restarts times."""
    from .inputs.prepare import open_resume

    restarts = 0
    while True:
        roles = None
        try:
            roles = launch()
            return run(roles, restarts)
        except Exception as exc:
            lost = lost_component(exc, roles)
            if lost is None:
                raise
            if restarts >= cfg.trainer.max_restarts:
                raise RecoveryFailed(
                    f"lost {lost}; no restart left (trainer.max_restarts={cfg.trainer.max_restarts}): "
                    f"fix the cluster, then {RESUME_BY_HAND}"
                ) from exc
            restarts += 1
            print(
                f"lost {lost}; restarting the roles from the latest checkpoint "
                f"(restart {restarts} of trainer.max_restarts={cfg.trainer.max_restarts})",
                flush=True,
            )
        finally:
            if roles is not None:
                roles.shutdown()
        wait_for_capacity(requests, cfg.trainer.restart_wait_s)
        latest = checkpoint.latest(cfg.trainer.run_dir)
        inputs.resume = open_resume(cfg, latest, inputs.model_path, inputs.critic_path) if latest else None


def _first_line(exc: BaseException) -> str:
    return first_line(exc, type(exc).__name__)[:300]
