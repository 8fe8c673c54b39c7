"""Bounded waits on Ray calls, and the errors they bring back: a worker that never answers, or
one that fails in an expected way, ends the run with one line, not a hang or Ray's traceback.

    results = get_all(refs, ["actor rank 0 on node 10.0.0.1", ...], timeout_s=600,
                      what="joining the actor's process group", setting="trainer.worker_timeout_s")
    with worker_errors():   # a TrainerError raised in a worker is raised here as itself
        ray.get(refs)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from .errors import TrainerError, WorkerTimeout

EXPLAINERS: list[Callable[[list[str], str], str]] = []
"""What can say where late workers are stuck, asked for the line a WorkerTimeout adds: `explain(late_labels,
what)` -> text or ''. The driver's hang watch (hangs.py) registers itself when imported."""


def get_all(
    refs: list,
    labels: list[str],
    timeout_s: float,
    what: str,
    setting: str = "trainer.worker_timeout_s",
    started: float | None = None,
    fetch: bool = True,
    on_done: Callable[[int], None] | None = None,
) -> list:
    """`ray.get(refs)`, or WorkerTimeout naming every call still running after `timeout_s` seconds (and, for
    the workers an EXPLAINER knows, where each is stuck: the driver's hang watch, hangs.py).
    A call that failed raises as soon as it ends, without waiting for the others (a critic that
    cannot load does not wait for a large policy to finish loading elsewhere). `started`: the monotonic time
    the calls were sent, when the bound counts from then; `fetch=False` only waits for them to finish (their
    results, and failures, stay for a later `ray.get`); `on_done(i)` as call i answers."""
    import ray

    deadline = (time.monotonic() if started is None else started) + timeout_s
    pending, results = list(refs), {}
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            break
        if on_done is not None:
            on_done(refs.index(done[0]))  # which call answered, as it does (the straggler check times each)
        if fetch:
            results[done[0]] = ray.get(done[0])  # raises now if that call failed
    if pending:
        late = [label for ref, label in zip(refs, labels) if ref in pending]
        stuck = "; ".join(filter(None, (explain(late, what) for explain in EXPLAINERS)))  # where each one sits
        raise WorkerTimeout(
            f"{what}: no answer from {', '.join(late)} within {setting}={timeout_s:g}s"
            f"{'; ' + stuck if stuck else ''}; the process may be stuck on the network (NCCL_SOCKET_IFNAME, "
            f"firewalled ports), in user code, or dead: read its log (`ray logs` or the dashboard), fix that, "
            f"or raise {setting}",
            late,
            stuck,
        )
    return [results[ref] for ref in refs] if fetch else []


@contextlib.contextmanager
def worker_errors() -> Iterator[None]:
    """Re-raise a TrainerError that a worker raised as itself (CLOUDRL_DEBUG=1 still shows Ray's
    traceback as its cause); anything else passes unchanged."""
    try:
        yield
    except Exception as exc:
        cause = trainer_error_in(exc)
        if cause is None:
            raise
        raise cause from exc


def trainer_error_in(exc: BaseException) -> TrainerError | None:
    """The TrainerError a worker raised, out of Ray's RayTaskError around it; None for anything else.
    (Workers raise their start errors from their first call, not their constructor: workers.py.)"""
    from ray.exceptions import RayTaskError

    if isinstance(exc, RayTaskError) and isinstance(exc.cause, TrainerError):
        return exc.cause
    return None
