"""Atomic checkpoints in `run_dir/checkpoints/step_NNNNNN/`.

A checkpoint is written into a hidden temporary directory, flushed to disk, then renamed into place,
so a crash mid-save leaves the previous checkpoint as the latest one. The driver writes everything
(workers hand their full, unsharded state over Ray), so only the driver's disk needs to persist, and
a checkpoint loads into any number of workers.

    step_000010/
      actor.pt         policy weights, optimizer and LR-scheduler state
      critic.pt        the same for the value model (PPO only)
      trainer.json     step, data position, KL coefficient, metrics history
      rng.pt           the driver's RNG states
      config.yaml      the resolved config of the run
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch

from .errors import CheckpointError

PREFIX = "step_"


def checkpoint_root(run_dir: str) -> Path:
    return Path(run_dir) / "checkpoints"


def check_writable(run_dir: str) -> None:
    """Fail before training starts, not at the first save."""
    root = checkpoint_root(run_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(
            f"cannot write checkpoints to {root} ({exc.strerror or exc}): set trainer.run_dir to a writable "
            f"directory (a local disk or a mounted volume)"
        ) from None


def list_checkpoints(run_dir: str) -> list[Path]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "trainer.json").exists()]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX):]))


def latest(run_dir: str) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save(run_dir: str, step: int, parts: dict[str, dict], trainer_state: dict, config_yaml: str,
         keep_last: int) -> Path:
    root = checkpoint_root(run_dir)
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f".{final.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name, state in parts.items():
            torch.save(state, tmp / f"{name}.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "config.yaml").write_text(config_yaml)
        (tmp / "trainer.json").write_text(json.dumps(trainer_state, indent=1))
        _fsync_dir(tmp)
        if final.exists():  # a re-run of the same step replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"saving checkpoint {final} failed ({exc}): check the disk under trainer.run_dir") from None
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load(path: Path, names: list[str]) -> tuple[dict[str, dict], dict]:
    try:
        trainer_state = json.loads((path / "trainer.json").read_text())
        parts = {name: torch.load(path / f"{name}.pt", map_location="cpu", weights_only=False)
                 for name in names if (path / f"{name}.pt").exists()}
        set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path} ({exc}): pass trainer.resume=never or another "
                              f"checkpoint directory") from None
    return parts, trainer_state


def resolve_resume(run_dir: str, resume: str) -> Path | None:
    if resume == "never":
        return None
    if resume == "auto":
        return latest(run_dir)
    path = Path(resume)
    if not (path / "trainer.json").exists():
        raise CheckpointError(f"trainer.resume={resume!r} is not a checkpoint directory (no trainer.json): "
                              f"use auto, never, or a path like {checkpoint_root(run_dir)}/step_000010")
    return path


def rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir() if path.is_dir() else []:
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
