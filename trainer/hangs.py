"""Hangs named: when the loop has waited too long on a worker, where that worker is stuck.

Every worker process arms a stack dump at start (`arm_stack_dump`): on SIGUSR1, Python's faulthandler writes
the stack of each of its threads to a file of its own on its node. It runs in the signal handler, without
the interpreter's lock, so it answers while the worker sits in C: a collective, a socket read, a sleep.

The driver keeps one `Watch`. It knows each worker's node and process (`register`, from the placement), and
bounds the loop's waits on the workers (`wait`): generation, rewards, log-probs, values and updates each get
the larger of `trainer.hang_timeout_s` and 5x the median time that phase took so far, and times each call
for the straggler check (stragglers.py). When a wait runs out, `explain` signals each worker that has not
answered, through a task on its node, keeps every stack in `run_dir/hangs/<time>-<what>/`, and names the
innermost frame of the call that is stuck; user code (a reward, an environment, a tool) by its file and line
when it is theirs. The run then ends that attempt (`WorkerHung`), and recovery restarts the roles from the
latest checkpoint, like after a lost node.

    arm_stack_dump()                                  # in a worker, once
    with WATCH.watching(run_dir, hang_timeout_s=600):  # in the driver, per attempt
        WATCH.register(group.labels(), group.places)  # (launch.py, as each role starts)
        results = WATCH.wait("generation", refs, labels, "generating step 3's samples")
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import statistics
import sysconfig
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import WorkerHung, WorkerTimeout
from .stragglers import Stragglers
from .waiting import EXPLAINERS, get_all

STACK_SIGNAL = signal.SIGUSR1
"""What a worker dumps its stacks on."""
MEDIAN_FACTOR = 5.0
"""A watched phase may take this many times its median so far before it counts as hung."""
DUMP_WAIT_S = 5.0
"""How long the task on the worker's node waits for the dump to be written."""
EXPLAIN_TIMEOUT_S = 30.0
"""How long the driver waits for all the dumps together."""
MAX_DUMP_BYTES = 256 * 1024
PACKAGE = Path(__file__).resolve().parent
"""cloudrl's trainer package: its frames are the call the worker was asked to run, not where it is stuck."""
_FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+) in (?P<function>.+?)\s*$')
_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+ ")
_armed = None  # the open file faulthandler writes to: it must outlive the process's calls


def stack_file(pid: int) -> Path:
    """Where process `pid` writes its stacks on its node."""
    return Path(tempfile.gettempdir()) / f"cloudrl-stacks-{os.getuid()}" / f"{pid}.txt"


def arm_stack_dump() -> None:
    """In a worker process: SIGUSR1 writes every thread's Python stack to stack_file(its pid). Idempotent."""
    global _armed
    if _armed is not None:
        return
    path = stack_file(os.getpid())
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        _armed = open(path, "a")  # noqa: SIM115 (kept open for the life of the process)
    except OSError:  # no writable temp dir: the worker runs on, a hang of it is named without its stack
        return
    faulthandler.register(STACK_SIGNAL, file=_armed, all_threads=True, chain=False)


def dump_stack(pid: int, wait_s: float = DUMP_WAIT_S) -> str:
    """On the node of process `pid`: signal it and return the stacks it wrote ("" when it is not armed,
    gone, or wrote nothing within `wait_s`)."""
    path = stack_file(pid)
    if not path.is_file():
        return ""
    before = path.stat().st_size
    try:
        os.kill(pid, STACK_SIGNAL)
    except OSError:
        return ""
    deadline = time.monotonic() + wait_s
    size = before
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = path.stat().st_size
        if now > before and now == size:  # written, and no longer growing
            break
        size = now
    with open(path, "rb") as f:
        f.seek(before)
        return f.read(MAX_DUMP_BYTES).decode("utf-8", "replace")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


def threads(dump: str) -> list[list[Frame]]:
    """Each thread's frames, innermost first, as faulthandler lists them."""
    found: list[list[Frame]] = []
    for text in dump.splitlines():
        if _THREAD.match(text):
            found.append([])
        elif (m := _FRAME.match(text)) and found:
            found[-1].append(Frame(m["file"], int(m["line"]), m["function"]))
    return found


def _installed_prefixes() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths})


def is_users(frame: Frame, installed: tuple[str, ...] | None = None) -> bool:
    """A frame of the user's own code: neither Python's, an installed package's, nor cloudrl's trainer."""
    if frame.file.startswith("<"):
        return False
    path = os.path.realpath(frame.file)
    if path.startswith(str(PACKAGE) + os.sep):
        return False
    return not path.startswith(installed if installed is not None else _installed_prefixes())


def where_stuck(dump: str) -> str:
    """The frame a worker's stuck call sits in: in the thread running a cloudrl call (a reward, an update,
    a generate; else one running user code, else the one running Ray's actor call), the innermost frame of
    user code when there is one, else that thread's innermost frame. "" for an empty dump."""
    installed = _installed_prefixes()
    stacks = [t for t in threads(dump) if t]
    if not stacks:
        return ""
    ours = [t for t in stacks if any(str(PACKAGE) + os.sep in os.path.realpath(f.file) for f in t)]
    users = [t for t in stacks if any(is_users(f, installed) for f in t)]
    ours_calling_users = [t for t in ours if t in users]
    ray_calls = [t for t in stacks if any(f.function == "actor_method_executor" for f in t)]  # Ray runs a call
    stack = (ours_calling_users or ours or users or ray_calls or stacks)[0]
    user = [f for f in stack if is_users(f, installed)]
    return f"in your code at {user[0]}" if user else f"at {stack[0]}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")[:80] or "wait"


class Watch:
    """The driver's watch over its waits on the workers (one per process: `WATCH`)."""

    def __init__(self) -> None:
        self.places: dict[str, tuple[str, int]] = {}
        """label -> (Ray node id, pid) of every registered worker."""
        self.run_dir: Path | None = None
        self.hang_timeout_s = 0.0
        self.durations: dict[str, list[float]] = defaultdict(list)
        self.stragglers = Stragglers()
        """Each watched phase's calls timed one by one: a worker slow for a few steps in a row is named."""

    @contextlib.contextmanager
    def watching(self, run_dir: str | Path | None, hang_timeout_s: float) -> Iterator[None]:
        """One attempt of a run: where dumps go, the bound's floor (0: waits unbounded), no phase history;
        afterwards the waits are unbounded again. The workers stay registered: a restart registers its new
        ones under their labels."""
        self.run_dir = Path(run_dir) if run_dir else None
        self.hang_timeout_s = hang_timeout_s
        self.durations.clear()
        self.stragglers = Stragglers()
        try:
            yield
        finally:
            self.run_dir, self.hang_timeout_s = None, 0.0
            self.durations.clear()

    def straggler_nodes(self) -> set[str]:
        """The Ray node ids of the workers named as stragglers in the latest attempt."""
        return {self.places[label][0] for label in self.stragglers.named if label in self.places}

    def register(self, labels: list[str], places: list[dict]) -> None:
        """The workers behind `labels`: their `where()` answers (node_id, pid)."""
        for label, place in zip(labels, places):
            if "node_id" in place and "pid" in place:  # stand-in workers in tests may report less
                self.places[label] = (place["node_id"], place["pid"])

    def bound(self, phase: str) -> float:
        """How long `phase` may take now: the larger of hang_timeout_s and 5x its median so far."""
        past = self.durations[phase]
        return max(self.hang_timeout_s, MEDIAN_FACTOR * statistics.median(past)) if past else self.hang_timeout_s

    def wait(
        self, phase: str, refs: list, labels: list[str], what: str, started: float | None = None, fetch: bool = True
    ) -> list:
        """`ray.get(refs)` within `bound(phase)` of `started` (the monotonic time they were sent; default now);
        past it, WorkerHung naming the workers and where they are. `fetch=False` only waits for them to
        finish (no results, no failures: a later `ray.get` has them) and records nothing."""
        if not refs:
            return []
        labels = list(labels) + [f"{phase} call {i}" for i in range(len(labels), len(refs))]
        if self.hang_timeout_s <= 0:
            import ray

            if not fetch:
                ray.wait(refs, num_returns=len(refs))
                return []
            return ray.get(refs)
        bound = self.bound(phase)
        started = time.monotonic() if started is None else started
        answered: dict[int, float] = {}
        try:
            results = get_all(
                refs,
                labels,
                bound,
                what,
                "trainer.hang_timeout_s",
                started,
                fetch,
                lambda i: answered.setdefault(i, time.monotonic()),
            )
        except WorkerTimeout as exc:
            lost = f"{', '.join(exc.late)}: hung ({what}: no answer within {bound:.0f}s)"
            lost += f"; {exc.stuck}" if exc.stuck else ""
            raise WorkerHung(str(exc), exc.late, exc.stuck, lost) from exc
        if fetch:
            self.durations[phase].append(time.monotonic() - started)
            took = {labels[i]: at - started for i, at in answered.items()}
            for line in self.stragglers.observe(phase, took):
                print(line, flush=True)
        return results

    def explain(self, late: list[str], what: str) -> str:
        """Dump the stacks of the registered workers among `late`; '' when none is registered, else
        `actor rank 0 on 10.0.0.2 is in your code at /x/reward.py:12 in score (every thread's stack: DIR)`."""
        known = [label for label in late if label in self.places]
        if not known:
            return ""
        try:
            dumps = self._dumps(known)
        except Exception as exc:  # the dump explains a hang; it must never hide it
            return f"no stack dump ({type(exc).__name__}: {str(exc)[:120]})"
        folder = self._keep(dumps, what)
        named = [f"{label} is {where_stuck(text)}" for label, text in dumps.items() if where_stuck(text)]
        silent = [label for label, text in dumps.items() if not where_stuck(text)]
        parts = named + ([f"no stack from {', '.join(silent)}"] if silent else [])
        return "; ".join(parts) + (f" (every thread's stack: {folder})" if folder else "")

    def _dumps(self, labels: list[str]) -> dict[str, str]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(dump_stack)
        refs = {
            label: task.options(
                num_cpus=0,
                max_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(self.places[label][0], soft=False),
            ).remote(self.places[label][1])
            for label in labels
        }
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=EXPLAIN_TIMEOUT_S)
        out = {}
        for label, ref in refs.items():
            try:
                out[label] = ray.get(ref) if ref in ready else ""
            except Exception:  # the node is gone too: nothing to read
                out[label] = ""
        return out

    def _keep(self, dumps: dict[str, str], what: str) -> Path | None:
        """Write the non-empty dumps under run_dir/hangs/; the folder, or None where nothing was kept."""
        if self.run_dir is None or not any(dumps.values()):
            return None
        folder = self.run_dir / "hangs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{_slug(what)}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for label, text in dumps.items():
                if text:
                    (folder / f"{_slug(label)}.txt").write_text(text)
        except OSError:
            return None
        return folder


WATCH = Watch()
"""The driver's watch (a worker process never uses it)."""
EXPLAINERS.append(WATCH.explain)  # every bounded wait that runs out names where our late workers are
