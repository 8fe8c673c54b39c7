"""Keeping a run alive: a stop request (SIGTERM) checkpoints the last step before exiting, and a lost
worker, engine or node restarts the roles from the latest checkpoint inside the same driver.

    with StopRequest(stop_grace_s(cfg)) as stop:  # SIGTERM/SIGINT: finish the step in flight, save it, stop
        summary = run_with_restarts(cfg, requests, inputs, launch, run)   # run(roles, restarts) -> summary

`run_with_restarts` starts the roles and trains; when Ray reports a dead actor or node (or a collective
fails because its peer is gone) it prints one line naming the role, rank, node and Ray's reason, shuts
every role down, waits up to `trainer.restart_wait_s` for the cluster to hold the config again (a
replacement node joining), starts the roles again and resumes from the latest checkpoint; at most
`trainer.max_restarts` times, each counted in the `trainer/restarts` metric. What it cannot recover
from ends with one line saying why and how to resume by hand.
"""

from __future__ import annotations

import os
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


def stop_grace_s(cfg) -> float:
    """How long after the first SIGTERM/SIGINT the step in flight and its checkpoint may take before the
    process stops without them: twice trainer.worker_timeout_s, the bound of each of a step's slowest
    legitimate waits (a weight sync, a checkpoint save)."""
    return 2 * cfg.trainer.worker_timeout_s


class StopRequest:
    """While active, SIGTERM and SIGINT (Ctrl+C) ask the run to stop instead of killing it: the step in
    flight finishes, `Trainer.fit` saves it and raises `Stopped` (exit 1 after SIGTERM, 130 after SIGINT).
    A second SIGTERM or SIGINT, or `grace_s` seconds without the step finishing, end the process at once
    with one line; the latest checkpoint is kept as it is. Only the main thread can take signals;
    elsewhere this does nothing."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, grace_s: float = 1200.0):
        self.requested = False
        self.signal_name = ""
        """SIGTERM or SIGINT: the signal that asked the run to stop."""
        self.grace_s = grace_s
        self._previous: dict = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    @property
    def exit_code(self) -> int:
        """The exit status after a stop: 130 after SIGINT (as a shell reports Ctrl+C), 1 after SIGTERM."""
        return 130 if self.signal_name == "SIGINT" else 1

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            _say(
                f"error: received {name} again: stopped at once, without saving the step in flight; the "
                f"latest checkpoint is kept: {RESUME_BY_HAND}"
            )
            os._exit(128 + signum)
        self.requested = True
        self.signal_name = name
        self._timer = threading.Timer(self.grace_s, self._grace_over)
        self._timer.daemon = True
        self._timer.start()
        _say(
            f"received {name}: finishing the step in flight, then checkpointing it and stopping (a second "
            f"Ctrl+C or SIGTERM stops at once; so does a step not done within {self.grace_s:g}s)"
        )

    def _grace_over(self) -> None:
        _say(
            f"error: the step in flight did not finish within {self.grace_s:g}s of {self.signal_name} "
            f"(twice trainer.worker_timeout_s): stopped without saving it; the latest checkpoint is kept: "
            f"{RESUME_BY_HAND}"
        )
        os._exit(128 + getattr(signal, self.signal_name, signal.SIGTERM))

    def checkpoint_and_stop(self, trainer, last_ckpt) -> None:
        """After a completed step: save it (unless just saved) and end the run with one line."""
        if last_ckpt is None or last_ckpt.name != f"{checkpoint.PREFIX}{trainer.global_step:06d}":
            last_ckpt = trainer.save_checkpoint()
        stopped = Stopped(
            f"stopped by {self.signal_name or 'SIGTERM'} after step {trainer.global_step}, checkpointed in "
            f"{last_ckpt}: {RESUME_BY_HAND}"
        )
        stopped.exit_code = self.exit_code  # what `python -m cloudrl.trainer` exits with
        raise stopped


def _say(line: str) -> None:
    """Print one line from a signal handler or timer: straight to the file descriptor, so that it never
    meets a print the main thread is in the middle of (a reentrant write would raise there)."""
    fd = 2 if line.startswith("error:") else 1
    try:
        os.write(fd, (line + "\n").encode())
    except OSError:  # no terminal or log left to write to: the stop goes on regardless
        pass


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
