"""Where a run's checkpoints live and how they are named: `run_dir/checkpoints/step_NNNNNN/`, each directory
one step's state, its manifest written last (checkpoint.py writes and reads them; timeline.py chooses
among them).

    step_000010/
      actor/           DCP: .metadata and one __<rank>_0.distcp file per writing rank
      actor.json       LR-scheduler state
      critic/, critic.json   the same for the value model (PPO only)
      trainer.json     step, data position, KL coefficient, metrics history
      rng.json         the driver's RNG states
      config.yaml      the resolved config of the run
      manifest.json    written last: the run id, every file's size and SHA-256 (and a signature, with
                       trainer.checkpoint_key_env)
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path

from ..errors import CheckpointError

PREFIX = "step_"
MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"
RNG = "rng.json"
FORMAT = 2
TIMELINE = "timeline.json"
"""run_dir/timeline.json: the run id this run_dir's run saves under, and where it branched from."""
ASIDE = "timeline-"
"""checkpoints/timeline-<run id>/step_N: another run's checkpoint moved out of the way of a save of the
same step (kept, never pruned, never picked by resume=auto)."""
FRESH_START = "pick a new trainer.run_dir"
NO_HASHES_FIX = "start over with trainer.resume=never in a new trainer.run_dir (the old checkpoint stays where it is)"


def checkpoint_root(run_dir: str) -> Path:
    return Path(run_dir) / "checkpoints"


def step_of(path: Path | str) -> int:
    return int(str(path).rstrip("/").rsplit("/", 1)[-1][len(PREFIX) :])


def check_writable(run_dir: str) -> None:
    """Fail before training starts, not at the first save, and create nothing: a probe file is written
    and removed in run_dir/checkpoints, or in the nearest of its parents that exists (`make_root` creates
    the directories once every check has passed, so a refused run leaves no empty run_dir behind)."""
    root = checkpoint_root(run_dir)
    try:
        there = root
        while not there.exists() and there.parent != there:
            there = there.parent
        if not there.is_dir():  # a file where a directory would be created
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        fd, probe = tempfile.mkstemp(prefix=".probe", dir=there)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise _unwritable(root, exc) from None


def make_root(run_dir: str) -> None:
    """Create run_dir/checkpoints (and run_dir): once the run's checks have passed."""
    root = checkpoint_root(run_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _unwritable(root, exc) from None


def _unwritable(root: Path, exc: OSError) -> CheckpointError:
    return CheckpointError(
        f"cannot write checkpoints to {root} ({exc.strerror or exc}): set trainer.run_dir to a writable "
        f"directory (a local disk or a mounted volume)"
    )


def list_checkpoints(run_dir: str) -> list[Path]:
    """Every finished checkpoint directly under run_dir/checkpoints, lowest step first (all runs)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    done = [
        p
        for p in root.iterdir()
        if p.is_dir()
        and p.name.startswith(PREFIX)
        and p.name[len(PREFIX) :].isdigit()
        and (p / "trainer.json").exists()
    ]
    return sorted(done, key=step_of)


def read_manifest(path: Path) -> dict:
    """A checkpoint's manifest.json ({} when absent or unreadable: such a checkpoint belongs to no run)."""
    try:
        data = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
