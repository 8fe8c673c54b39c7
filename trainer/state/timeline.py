"""Runs and timelines, and which checkpoint a run continues.

The first save of a run mints a run id, kept in every checkpoint's manifest and in
`run_dir/timeline.json`. `trainer.keep_last` prunes only the current run id's checkpoints; a run that
resumes from a chosen checkpoint (`trainer.resume=<path>`) starts a new run id that records where it
branched from, so the checkpoints it leaves behind are never pruned by it, and `latest` (resume=auto,
restarts) follows the current timeline, not the highest step number.

Which checkpoint resume=auto (and a restart) continues is chosen here (`pick_resume`, for local
checkpoints and bucket copies alike); an ambiguous choice is refused, naming each run's newest.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError
from .layout import FRESH_START, TIMELINE, checkpoint_root, list_checkpoints, read_manifest, step_of


@dataclass(frozen=True)
class Timeline:
    """The run id a run saves its checkpoints under, and the checkpoint it branched from (None: it started
    fresh, or continues its own latest checkpoint)."""

    run_id: str
    parent: dict | None = None
    """{"run_id": ..., "step": ...} of the checkpoint this timeline started from."""

    def to_json(self) -> dict:
        return {"run_id": self.run_id, "from": self.parent}


_CURRENT: dict[str, Timeline] = {}
"""This process's timeline per run_dir (resolved): set by the run's start (begin_timeline) or its first
save, and what `latest` follows between saves (a restart after a node loss)."""


def _key(run_dir: str) -> str:
    return str(Path(run_dir).resolve())


def new_run_id() -> str:
    return secrets.token_hex(6)


def current_timeline(run_dir: str) -> Timeline | None:
    """The timeline this run_dir's run saves under: this process's, else run_dir/timeline.json's."""
    known = _CURRENT.get(_key(run_dir))
    if known is not None:
        return known
    try:
        data = json.loads((Path(run_dir) / TIMELINE).read_text())
        parent = data.get("from")
        if not isinstance(data.get("run_id"), str) or not (parent is None or isinstance(parent, dict)):
            return None
        return Timeline(data["run_id"], parent)
    except (OSError, ValueError, AttributeError):
        return None


def begin_timeline(run_dir: str, resume_from: Path | None, continuing: bool) -> Timeline:
    """Decide the run id this run saves under (nothing is written yet): a fresh start gets a new one;
    resume=auto (`continuing`) keeps the one of the checkpoint it continues; a checkpoint chosen by path
    starts a new timeline branched from it, so the checkpoints after it are never pruned by this run."""
    timeline = Timeline(new_run_id())
    if resume_from is not None:
        saved = read_manifest(resume_from)
        saved_id = saved.get("run_id")
        here = current_timeline(run_dir)
        branch_point = {"run_id": saved_id, "step": step_of(resume_from)}
        if continuing and here is not None and (here.run_id == saved_id or here.parent == branch_point):
            timeline = here  # this run_dir's own timeline, before or after its first save
        elif continuing and isinstance(saved_id, str):
            timeline = Timeline(saved_id, saved.get("from") if isinstance(saved.get("from"), dict) else None)
        else:
            timeline = Timeline(new_run_id(), branch_point)
    _CURRENT[_key(run_dir)] = timeline
    return timeline


def forget(run_dir: str) -> None:
    """Drop this process's timeline for `run_dir` (a new run starts: run_dir/timeline.json rules)."""
    _CURRENT.pop(_key(run_dir), None)


def write_timeline(run_dir: str) -> None:
    """Record this process's timeline in run_dir/timeline.json (atomically), so that a later resume=auto
    in another process follows it."""
    timeline = _CURRENT.get(_key(run_dir))
    if timeline is None:
        return
    path = Path(run_dir) / TIMELINE
    text = json.dumps(timeline.to_json(), indent=1)
    try:
        if path.exists() and path.read_text() == text:
            return
        tmp = path.with_name(f".{TIMELINE}.tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        raise CheckpointError(
            f"cannot write {path} ({exc.strerror or exc}): check the disk under trainer.run_dir"
        ) from None


def own_timeline(run_dir: str) -> Timeline:
    """The timeline a save in this process uses: the current one, else a new run id (kept from here on)."""
    timeline = current_timeline(run_dir)
    if timeline is None:
        timeline = Timeline(new_run_id())
    _CURRENT[_key(run_dir)] = timeline
    return timeline


@dataclass(frozen=True)
class Copy:
    """One checkpoint (local or in a bucket) as the choice of what to resume sees it."""

    where: str
    step: int
    run_id: str | None
    parent_run: str | None
    saved_at: float

    @classmethod
    def of(cls, where: str, manifest: dict) -> Copy:
        run_id = manifest.get("run_id") if isinstance(manifest.get("run_id"), str) else None
        parent = manifest.get("from")
        parent_run = parent.get("run_id") if isinstance(parent, dict) else None
        saved_at = manifest.get("saved_at")
        return cls(
            where, step_of(where), run_id, parent_run, float(saved_at) if isinstance(saved_at, int | float) else 0.0
        )


class AmbiguousResume(CheckpointError):
    """Checkpoints of more than one run in one place, and nothing says which one this run continues."""


def pick_resume(copies: list[Copy], current: Timeline | None, where: str, choose: Callable[[Copy], str]) -> Copy | None:
    """What resume=auto continues among `copies`: the current timeline's newest (or the checkpoint it
    branched from, before its first save). Without a current timeline: the newest of the only run there,
    or of the newest branch of one run; checkpoints of unrelated runs are refused (AmbiguousResume names
    each run's newest as `choose(copy)`)."""
    if not copies:
        return None
    if current is not None:
        own = [c for c in copies if c.run_id == current.run_id]
        if own:
            return max(own, key=lambda c: c.step)
        parent = current.parent or {}
        start = [c for c in copies if c.run_id == parent.get("run_id") and c.step == parent.get("step")]
        return start[0] if start else None
    runs: dict[str | None, list[Copy]] = {}
    for c in copies:
        runs.setdefault(c.run_id, []).append(c)
    newest = {run: max(found, key=lambda c: c.step) for run, found in runs.items()}
    if len(runs) == 1:
        return next(iter(newest.values()))
    roots = [run for run, c in newest.items() if c.parent_run is None or c.parent_run not in runs]
    if None not in runs and len(roots) == 1:  # branches of one run: the branch saved last is the live one
        return max(newest.values(), key=lambda c: c.saved_at)
    listed = "; ".join(
        f"run {run or 'without id (an older cloudrl)'}: {Path(c.where).name}"
        for run, c in sorted(newest.items(), key=lambda kv: kv[1].step)
    )
    options = " or ".join(f"trainer.resume={choose(c)}" for c in sorted(newest.values(), key=lambda c: c.step))
    raise AmbiguousResume(
        f"{where} holds checkpoints of {len(runs)} different runs ({listed}), so trainer.resume=auto cannot "
        f"tell which one this run continues: choose one with {options}, or {FRESH_START} (trainer.resume=never)"
    )


def latest(run_dir: str) -> Path | None:
    """The checkpoint resume=auto and restarts continue from: the newest of this run_dir's current timeline
    (not the highest step of any run: an abandoned branch is never picked)."""
    found = list_checkpoints(run_dir)
    copies = [Copy.of(str(p), read_manifest(p)) for p in found]
    chosen = pick_resume(copies, current_timeline(run_dir), f"{checkpoint_root(run_dir)}", lambda c: c.where)
    return Path(chosen.where) if chosen else None


def own_checkpoints(run_dir: str, run_id: str) -> list[Path]:
    return [p for p in list_checkpoints(run_dir) if read_manifest(p).get("run_id") == run_id]


def resolve_resume(run_dir: str, resume: str) -> Path | None:
    if resume == "never":
        return None
    if resume == "auto":
        return latest(run_dir)
    path = Path(resume)
    if not (path / "trainer.json").exists():
        raise CheckpointError(
            f"trainer.resume={resume!r} is not a checkpoint directory (no trainer.json): "
            f"use auto, never, or a path like {checkpoint_root(run_dir)}/step_000010"
        )
    return path
