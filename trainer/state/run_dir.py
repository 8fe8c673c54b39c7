"""The run directory (`trainer.run_dir`): never written over by accident.

Before the job joins a cluster, `check_run_dir` refuses an empty run_dir (it would be the current
directory) and one where checkpoints cannot be written, creating nothing, and `resume_point` refuses one
that holds another run's files which this run does not continue. The run's own config.yaml and
placement.json are written by `record_start` only once every role has started, so a failed start
leaves the directory as it was; so is `timeline.json`, the run id this run saves its checkpoints under
(timeline.py decides it before the roles start). Checkpoints themselves are checkpoint.py's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import RunDirError
from .layout import FRESH_START, check_writable, checkpoint_root, list_checkpoints
from .timeline import resolve_resume, write_timeline

# What a run writes into run_dir besides checkpoints: their presence means another run was here.
RUN_FILES = ("config.yaml", "placement.json", "metrics.jsonl", "summary.json", "hf_model", "tensorboard")


def under_runs_dir(run_dir: str) -> str:
    """A relative trainer.run_dir under $CLOUDRL_RUNS_DIR when the cluster sets it (the dstack bootstrap:
    the /checkpoints volume; `cloudrl local up`: the directory it was started from), so a submitted
    job's run lands on lasting storage, not in the job's temporary working directory."""
    base = os.environ.get("CLOUDRL_RUNS_DIR", "")
    if not base or not run_dir.strip() or Path(run_dir).expanduser().is_absolute():
        return run_dir
    return str(Path(os.path.abspath(base)) / run_dir)  # absolute, so placing it again changes nothing


def check_run_dir(run_dir: str) -> None:
    """What a training run needs of run_dir before anything else, without creating it: not empty (the
    current directory), and checkpoints can be written there (layout.check_writable)."""
    _refuse_empty(run_dir)
    check_writable(run_dir)


def _refuse_empty(run_dir: str) -> None:
    if not run_dir.strip():
        raise RunDirError(
            "trainer.run_dir is empty, so the run would write into the current directory: set it "
            "to a directory of its own, e.g. trainer.run_dir=runs/my-run"
        )


def resume_point(run_dir: str, resume: str) -> Path | None:
    """The checkpoint this run continues from (None: a fresh start), after refusing a run_dir the run
    would write over: an empty one (the current directory), or one holding another run's files that
    this run does not continue."""
    _refuse_empty(run_dir)
    path = resolve_resume(run_dir, resume)
    if path is not None and checkpoint_root(run_dir).resolve() in path.resolve().parents:
        return path  # continuing this run_dir's own run
    found = [name for name in RUN_FILES if (Path(run_dir) / name).exists()]
    found += ["checkpoints"] if list_checkpoints(run_dir) else []
    if found:
        if path is not None:
            fix = f"resuming from {path} here would write over them: {FRESH_START}"
        elif list_checkpoints(run_dir):
            fix = f"{FRESH_START}, or continue that run with trainer.resume=auto"
        else:
            fix = f"it has no checkpoint to resume from: {FRESH_START}, or delete {run_dir} to start it over"
        raise RunDirError(f"trainer.run_dir={run_dir} holds another run's files ({', '.join(found)}); {fix}")
    return path


def record_start(cfg, roles) -> None:
    """Once every role has started: the resolved config as run_dir/config.yaml, the run's timeline (so a
    later resume=auto continues this timeline even before its first save), and where every worker runs
    (printed, and saved as run_dir/placement.json). Never earlier, so a failed start leaves run_dir as
    it was."""
    run_dir = Path(cfg.trainer.run_dir)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    write_timeline(cfg.trainer.run_dir)
    where = {g.name: g.where() for g in roles.groups()}
    (run_dir / "placement.json").write_text(json.dumps(where, indent=1))
    for name, workers in where.items():
        nodes = sorted({w["node_id"][:8] for w in workers})
        print(f"placement: {name}: {len(workers)} worker(s) on node(s) {', '.join(nodes)}", flush=True)
    if roles.rollout_in_actor:
        print("placement: rollout: inside the actor's workers (placement.rollout_in_actor)", flush=True)
