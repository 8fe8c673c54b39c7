"""Keeping a run alive: a stop request (SIGTERM) checkpoints the last step before exiting, and a lost
worker, engine or node restarts the roles from the latest checkpoint inside the same driver.

    with StopRequest(stop_grace_s(cfg)) as stop:  # SIGTERM/SIGINT: finish the step in flight, save it, stop
        summary = run_with_restarts(cfg, requests, inputs, launch, run)   # run(roles, restarts) -> summary

`run_with_restarts` starts the roles and trains; when Ray reports a dead actor or node (or a collective
fails because its peer is gone) it prints one line naming the role, rank, node and Ray's reason, shuts
every role down, waits for the cluster to hold the config again (a replacement node joining), starts
the roles again and resumes from the latest checkpoint; at most `trainer.max_restarts` times, each
counted in the `trainer/restarts` metric. The wait and the placement together get `trainer.restart_wait_s`
from the loss; a node lost for good then ends the run with one line naming it, the roles it held and the
ways on (a replacement node, or fewer nodes). What it cannot recover from ends with one line saying why
and how to resume by hand.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

from .errors import NodePreempted, RecoveryFailed, Stopped, WorkerHung, first_line
from .state import layout, timeline
from .state.resume import open_resume

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
        last_ckpt = save_step(trainer, last_ckpt)
        stopped = Stopped(
            f"stopped by {self.signal_name or 'SIGTERM'} after step {trainer.global_step}, checkpointed in "
            f"{last_ckpt}: {RESUME_BY_HAND}"
        )
        stopped.exit_code = self.exit_code  # what `python -m cloudrl.trainer` exits with
        raise stopped


def save_step(trainer, last_ckpt):
    """The checkpoint of the step `trainer` just finished: `last_ckpt` when it is that step's, else saved now."""
    if last_ckpt is None or last_ckpt.name != f"{layout.PREFIX}{trainer.global_step:06d}":
        last_ckpt = trainer.save_checkpoint()
    return last_ckpt


def preemption_notice(roles) -> tuple[str, str] | None:
    """The first node holding roles that has a preemption notice, as (Ray node id, `node 10.0.0.2 (id ...,
    held actor rank 1)`); None when none has. A node's watcher (tasks/ray_bringup.py `notices`) drains its
    Ray node when the cloud announces the preemption, and Ray's GCS keeps the draining nodes: one question
    to it per step."""
    from .roles.cluster import draining_nodes

    draining = draining_nodes()
    if not draining:
        return None
    held = Loss("", roles=roles).held
    for node_id, deadline in draining.items():
        if node_id in held:
            node = held[node_id]
            left = f"it goes away in {max(0.0, deadline - time.time()):.0f}s" if deadline else "no deadline given"
            where = f"node {node['ip'] + ' ' if node['ip'] else ''}(id {node_id[:12]}, held {', '.join(node['held'])})"
            return node_id, f"{where} to a preemption notice ({left})"
    return None


def leave_preempted_node(trainer, last_ckpt, notice: tuple[str, str]) -> None:
    """After the step that began with a preemption `notice` (`preemption_notice`): save it (unless just
    saved) and raise NodePreempted, so `run_with_restarts` starts the roles again on the nodes that stay
    (and a replacement) from this very step: no finished step is lost."""
    node_id, what = notice
    saved = save_step(trainer, last_ckpt)
    what = f"{what}; step {trainer.global_step} is checkpointed in {saved}"
    raise NodePreempted(f"lost {what}", what, node_id)


def _say(line: str) -> None:
    """Print one line from a signal handler or timer: straight to the file descriptor, so that it never
    meets a print the main thread is in the middle of (a reentrant write would raise there)."""
    fd = 2 if line.startswith("error:") else 1
    try:
        os.write(fd, (line + "\n").encode())
    except OSError:  # no terminal or log left to write to: the stop goes on regardless
        pass


def lost_component(exc: BaseException, roles) -> str | None:
    """`actor rank 1 on 10.0.0.2: <Ray's reason>` when `exc` says a worker, engine or node is gone or hung;
    None for any other error (those end the run as before)."""
    from ray.exceptions import NodeDiedError, RayActorError, RayTaskError

    if isinstance(exc, (WorkerHung, NodePreempted)):  # a watched wait ran out (hangs.py), a preemption notice
        return exc.lost
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


class Loss:
    """What a lost worker or node took with it, kept for the line a run ends with when the cluster does
    not get it back: Ray's words, the nodes the roles ran on (from the places every worker reported when
    it started: no call to a worker, some are gone) and the node ids the error itself names."""

    def __init__(self, what: str, exc: BaseException | None = None, roles=None):
        self.what = what
        self.held: dict[str, dict] = {}
        """node id -> {"ip": ..., "held": ["actor rank 1", ...], "roles": {"actor", ...}}"""
        for group in roles.groups() if roles is not None else []:
            for rank, place in enumerate(getattr(group, "places", None) or []):
                node = self.held.setdefault(place["node_id"], {"ip": place.get("ip", ""), "held": [], "roles": set()})
                node["held"].append(f"{group.name} rank {rank}")
                node["roles"].add(group.name)
        self.named = self._named_nodes(exc, roles) if exc is not None else []

    def _named_nodes(self, exc: BaseException, roles) -> list[str]:
        """The held nodes the error points at: the dead actor's node, or a node id in Ray's text."""
        named = [exc.node_id] if isinstance(exc, NodePreempted) else []
        actor_id = getattr(exc, "actor_id", None)
        for group in roles.groups() if roles is not None and actor_id else []:
            for w, place in zip(group.workers, getattr(group, "places", None) or []):
                if w._actor_id.hex() == actor_id:
                    named.append(place["node_id"])
        named += [n for n in re.findall(r"\b[Nn]ode(?: [Ii]d:?| ID:?)? ([0-9a-f]{16,})", str(exc)) if n in self.held]
        return list(dict.fromkeys(named))

    def gone(self, states: dict[str, bool]) -> list[str]:
        """The held nodes Ray reports dead or no longer knows (`states`: node id -> alive), else, while
        Ray still counts them alive (it notices a vanished node only after its health checks fail), the
        ones the error named (or, with no word from Ray at all, only those)."""
        dead = [n for n in self.held if not states.get(n, False)] if states else []
        return dead or self.named

    def describe(self, nodes: list[str]) -> str:
        if not nodes:
            return f"lost {self.what}"
        parts = []
        for n in nodes:
            ip = self.held[n]["ip"]
            parts.append(f"node {ip + ' ' if ip else ''}(id {n[:12]}, held {', '.join(self.held[n]['held'])})")
        return f"lost {' and '.join(parts)}"


def node_states() -> dict[str, bool]:
    """Every node Ray knows, by id: alive or dead."""
    import ray

    return {n["NodeID"]: bool(n.get("Alive")) for n in ray.nodes()}


def fewer_nodes_keys(cfg, requests, roles: set[str]) -> str:
    """The config keys that size the roles in `roles` (and the roles colocated with them), as they are now:
    what to lower to run the same job on fewer nodes."""
    names = []
    for req in requests:
        if req.role in roles or roles & set(req.guests):
            names += [req.role, *req.guests]
    names = list(dict.fromkeys(names or [req.role for req in requests]))
    keys = []
    for role in names:
        if role == "rollout":
            keys.append(f"rollout.num_engines={cfg.rollout.num_engines}")
        else:
            keys.append(f"{role}.nodes={getattr(cfg, role).nodes}")
    return ", ".join(keys)


def not_back(cfg, requests, loss: Loss) -> RecoveryFailed:
    """The one line a run ends with when the cluster could not hold it again within trainer.restart_wait_s:
    the lost node(s) and what they held, what the cluster has now, and the two ways on."""
    from .roles.cluster import alive_nodes
    from .roles.placement import describe_cluster

    try:
        states = node_states()
        have = describe_cluster(alive_nodes())
    except Exception as exc:  # the cluster itself is going away: the line still names the loss
        states, have = {}, f"unknown ({_first_line(exc)})"
    gone = loss.gone(states)
    lost_roles = {role for n in gone for role in loss.held[n]["roles"]}
    return RecoveryFailed(
        f"{loss.describe(gone)}; no replacement joined within trainer.restart_wait_s="
        f"{cfg.trainer.restart_wait_s:g}s (the cluster now has {have}): add a replacement node and "
        f"{RESUME_BY_HAND}, or run the same job on fewer nodes: lower "
        f"{fewer_nodes_keys(cfg, requests, lost_roles)} and resubmit with trainer.resume=auto (the latest "
        f"checkpoint reshards to the new world size)"
    )


def wait_for_capacity(cfg, requests, loss: Loss, deadline: float, poll_s: float = 2.0) -> None:
    """Until the cluster can hold every role request again (a replacement node has joined), or the
    one-line RecoveryFailed of `not_back` once the monotonic `deadline` has passed."""
    from .roles.cluster import preflight
    from .roles.placement import ClusterTooSmall

    while True:
        try:
            preflight(requests)
            return
        except ClusterTooSmall:
            if time.monotonic() >= deadline:
                raise not_back(cfg, requests, loss) from None
        time.sleep(max(0.05, min(poll_s, deadline - time.monotonic())))


def relaunch(
    cfg, requests, launch, loss: Loss, deadline: float, poll_s: float = 2.0, slow: frozenset[str] = frozenset()
):
    """Start the roles again after a loss, all within the monotonic `deadline` (trainer.restart_wait_s
    after the loss): wait for the capacity, then place the roles with every placement wait cut to the
    time left, off the `slow` nodes when the cluster holds every role without them (`leave_out`). Ray
    counts a vanished node alive until its health checks fail, so the capacity check can pass while the
    groups cannot be placed: a placement that timed out is tried again until the deadline."""
    from .errors import PlacementTimeout
    from .roles import launch as launching

    while True:
        wait_for_capacity(cfg, requests, loss, deadline, poll_s)
        launching.PLACEMENT_DEADLINE = deadline
        launching.AVOIDED_NODES = leave_out(requests, slow)
        try:
            return launch()
        except PlacementTimeout:
            if time.monotonic() >= deadline:
                raise not_back(cfg, requests, loss) from None
        finally:
            launching.PLACEMENT_DEADLINE = None
            launching.AVOIDED_NODES = frozenset()
        time.sleep(max(0.05, min(poll_s, deadline - time.monotonic())))


def leave_out(requests, slow: frozenset[str]) -> frozenset[str]:
    """The straggler nodes (`slow`, trainer.exclude_stragglers) a restart places no role on: all of them when
    the cluster holds every role without them, else none; one line either way."""
    from .roles.cluster import preflight
    from .roles.placement import ClusterTooSmall

    if not slow:
        return frozenset()
    names = ", ".join(node[:12] for node in sorted(slow))
    try:
        preflight(requests, exclude=slow)
    except ClusterTooSmall:
        print(
            f"straggler node(s) {names} kept at this restart: the cluster cannot hold every role without them "
            "(trainer.exclude_stragglers; add a node to leave them out)",
            flush=True,
        )
        return frozenset()
    print(f"straggler node(s) {names} left out at this restart (trainer.exclude_stragglers)", flush=True)
    return slow


def run_with_restarts(cfg, requests, inputs, launch, run) -> dict:
    """Start the roles (`launch()`), train (`run(roles, restarts)`), always shut the roles down, and
    after a lost worker or node start again from the latest checkpoint, up to trainer.max_restarts times.
    Each restart has trainer.restart_wait_s from the loss to get the roles placed again; past it the run
    ends with one line naming the lost node, what it held and the ways on."""
    from .hangs import WATCH

    restarts = 0
    loss: Loss | None = None
    deadline = 0.0
    slow: frozenset[str] = frozenset()  # trainer.exclude_stragglers: every straggler's node named so far
    while True:
        roles = None
        try:
            roles = launch() if loss is None else relaunch(cfg, requests, launch, loss, deadline, slow=slow)
            return run(roles, restarts)
        except Exception as exc:
            lost = lost_component(exc, roles)
            if lost is None:
                raise
            if restarts >= cfg.trainer.max_restarts:
                fix = "fix what it is stuck on (or raise trainer.hang_timeout_s)" if isinstance(exc, WorkerHung) else ""
                raise RecoveryFailed(
                    f"lost {lost}; no restart left (trainer.max_restarts={cfg.trainer.max_restarts}): "
                    f"{fix or 'fix the cluster'}, then {RESUME_BY_HAND}"
                ) from exc
            restarts += 1
            print(
                f"lost {lost}; restarting the roles from the latest checkpoint within trainer.restart_wait_s="
                f"{cfg.trainer.restart_wait_s:g}s (restart {restarts} of trainer.max_restarts="
                f"{cfg.trainer.max_restarts})",
                flush=True,
            )
            found = Loss(lost, exc, roles)
            if loss is not None and not found.held:  # lost again while starting: the first loss says where
                found.held, found.named = loss.held, loss.named
            loss = found
            deadline = time.monotonic() + cfg.trainer.restart_wait_s
            if cfg.trainer.exclude_stragglers:
                slow |= WATCH.straggler_nodes()
        finally:
            if roles is not None:
                roles.shutdown()
        latest = timeline.latest(cfg.trainer.run_dir)
        inputs.resume = open_resume(cfg, latest, inputs.model_path, inputs.critic_path) if latest else None


def _first_line(exc: BaseException) -> str:
    return first_line(exc, type(exc).__name__)[:300]
