"""Atomic checkpoints in `run_dir/checkpoints/step_NNNNNN/`.

A checkpoint is written into a hidden temporary directory, flushed to disk, then renamed into place,
so a crash mid-save (even a SIGKILL) leaves the previous checkpoint as the latest one. Each trained
role is a sharded torch.distributed.checkpoint (DCP) directory: every rank writes its own shard of the
weights and optimizer state in parallel, straight into the temporary directory when its node sees it
(the driver's node, a shared volume), else through Ray to the driver (shards.py). No process ever holds
more than its own shard, and the shards load into any number of ranks (resharded on load).

    step_000010/
      actor/           DCP: .metadata and one __<rank>_0.distcp file per writing rank
      actor.json       LR-scheduler state
      critic/, critic.json   the same for the value model (PPO only)
      trainer.json     step, data position, KL coefficient, metrics history
      rng.pt           the driver's RNG states
      config.yaml      the resolved config of the run
      manifest.json    every file's size in bytes, written last

Checkpoints of the older single-file layout (`actor.pt`: full state from rank 0) still resume.
Before a resume starts any actor, the checkpoint is checked: each file's size against the manifest (a
truncated copy), every file readable (tensors are memory-mapped or only their metadata read), the
algorithm it was saved by, and its parameter names and shapes against the models this run loads.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import CheckpointError

PREFIX = "step_"
MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"
FRESH_START = "pick a new trainer.run_dir"


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
    return sorted(done, key=lambda p: int(p.name[len(PREFIX) :]))


def latest(run_dir: str) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save(
    run_dir: str,
    step: int,
    parts: dict[str, dict],
    trainer_state: dict,
    config_yaml: str,
    keep_last: int,
    write_shards: Callable[[Path], None] | None = None,
) -> Path:
    """Write a checkpoint atomically. `write_shards(tmp)` has the workers write their sharded roles
    into the temporary directory (shards.save_roles); `parts` are full states saved as `<role>.pt`."""
    root = checkpoint_root(run_dir)
    final = root / f"{PREFIX}{step:06d}"
    for stale in root.glob(f".{PREFIX}*.tmp*"):  # left by a process killed mid-save
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".{final.name}.tmp{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir(parents=True)
    try:
        if write_shards is not None:
            write_shards(tmp)
        for name, state in parts.items():
            torch.save(state, tmp / f"{name}.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "config.yaml").write_text(config_yaml)
        (tmp / "trainer.json").write_text(json.dumps(trainer_state, indent=1))
        sizes = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"files": sizes}, indent=1))
        _fsync_dir(tmp)
        if final.exists():  # a re-run of the same step replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"saving checkpoint {final} failed ({exc}): check the disk under trainer.run_dir"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


@dataclass
class Checkpoint:
    path: Path
    parts: dict[str, dict]
    """Roles saved in the single-file layout: {"model", "optimizer", "scheduler"} state, memory-mapped."""
    state: dict
    """trainer.json: step, data position, KL coefficient, history."""
    rng: dict
    """The driver's RNG states."""
    saved_config: dict
    """The config.yaml it was saved with ({} when absent)."""
    sharded: dict[str, Path] = field(default_factory=dict)
    """Roles saved as DCP directories: role -> directory."""
    shapes: dict[str, dict[str, tuple]] = field(default_factory=dict)
    """Per saved role, its parameter shapes (from the DCP metadata or the memory-mapped file)."""

    def has(self, role: str) -> bool:
        return role in self.parts or role in self.sharded


def load(path: Path, names: list[str]) -> Checkpoint:
    """Read a checkpoint after checking its files against the manifest; CheckpointError names the file.
    Sharded roles are only described here (their metadata read); the workers read their own shards."""
    import yaml

    _check_sizes(path)
    parts = {name: _read(path / f"{name}.pt") for name in names if (path / f"{name}.pt").exists()}
    sharded = {name: path / name for name in names if (path / name / DCP_METADATA).exists()}
    shapes = {name: {k: tuple(v.shape) for k, v in part.get("model", {}).items()} for name, part in parts.items()}
    for name, directory in sharded.items():
        shapes[name] = _read(directory / DCP_METADATA, model_shapes, text=False)
    state = _read(path / "trainer.json", json.loads)
    saved = _read(path / "config.yaml", yaml.safe_load) if (path / "config.yaml").exists() else {}
    return Checkpoint(path, parts, state, _read(path / "rng.pt"), saved or {}, sharded, shapes)


def model_shapes(metadata: Path) -> dict[str, tuple]:
    """Parameter shapes of a DCP role directory, from its `.metadata` file alone (no tensor read)."""
    from torch.distributed.checkpoint import FileSystemReader

    entries = FileSystemReader(str(metadata.parent)).read_metadata().state_dict_metadata
    return {
        k[len("model.") :]: tuple(v.size) for k, v in entries.items() if k.startswith("model.") and hasattr(v, "size")
    }


def read_full(path: Path, role: str) -> dict:
    """A role's whole state ({"model", "optimizer", "scheduler"}) in this process, from either layout.
    For tests, tools and inspection: training never gathers it."""
    if (path / f"{role}.pt").exists():
        return torch.load(path / f"{role}.pt", map_location="cpu", weights_only=False)
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(
        state, storage_reader=FileSystemReader(str(path / role)), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    state["scheduler"] = json.loads((path / f"{role}.json").read_text())
    return state


def _check_sizes(path: Path) -> None:
    if not (path / MANIFEST).exists():  # saved before manifests existed: the reads below still check
        return
    sizes = _read(path / MANIFEST, json.loads).get("files", {})
    for name, size in sizes.items():
        actual = (path / name).stat().st_size if (path / name).exists() else None
        if actual != size:
            found = "is missing" if actual is None else f"has {actual} bytes"
            raise CheckpointError(
                f"checkpoint file {path / name} {found} but was saved with {size} (a truncated or "
                f"incomplete copy): {_other_checkpoint(path)}"
            )


def _read(file: Path, parse=None, text: bool = True):
    """A checkpoint file: tensors memory-mapped (the driver reads them only when sending them), text
    parsed, other files handed to `parse` by path (text=False)."""
    try:
        if not text:
            return parse(file)
        if parse is None:
            if not zipfile.is_zipfile(file):  # else torch blames the mmap option
                raise ValueError("not a torch.save archive")
            return torch.load(file, map_location="cpu", weights_only=False, mmap=True)
        return parse(file.read_text())
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(
            f"cannot read checkpoint file {file} ({type(exc).__name__}: {reason}), it is "
            f"corrupted: {_other_checkpoint(file.parent)}"
        ) from None


def _other_checkpoint(path: Path) -> str:
    return (
        f"resume from an earlier checkpoint (trainer.resume=<another {PREFIX}NNNNNN directory beside "
        f"{path.name}>), or start over with trainer.resume=never in a new trainer.run_dir"
    )


def check_matches(ckpt: Checkpoint, cfg, shapes: dict[str, dict[str, tuple]]) -> None:
    """Refuse a checkpoint of another algorithm or other models. `shapes[role]` is the parameter shapes
    of the model this run loads for that role (`expected_shapes`)."""
    saved_alg = ckpt.saved_config.get("algorithm", {}).get("name")
    alg = cfg.algorithm.name
    if saved_alg and saved_alg != alg:
        raise CheckpointError(
            f"checkpoint {ckpt.path} was saved by an algorithm.name={saved_alg} run and this "
            f"run sets algorithm.name={alg}: resume it with algorithm.name={saved_alg}, or "
            f"{FRESH_START} (trainer.resume=never)"
        )
    if cfg.uses_critic and not ckpt.has("critic"):
        raise CheckpointError(
            f"checkpoint {ckpt.path} has no critic.pt (it was saved without a critic) but "
            f"algorithm.name={alg} trains one: resume it with a critic-less algorithm, or "
            f"{FRESH_START} (trainer.resume=never)"
        )
    for role, expected in shapes.items():
        if role in ckpt.shapes:
            diff = shape_difference(ckpt.shapes[role], expected)
            if diff:
                source = (
                    f"critic.model_path={cfg.critic.model_path}"
                    if role == "critic" and cfg.critic.model_path
                    else f"model.path={cfg.model.path}"
                )
                where = ckpt.sharded.get(role, ckpt.path / f"{role}.pt")
                raise CheckpointError(
                    f"checkpoint {where} does not fit the {role} model of "
                    f"{source}: {diff} (another model size?): resume with the model it was "
                    f"trained from, or {FRESH_START} (trainer.resume=never)"
                )


def shape_difference(saved: dict[str, tuple], expected: dict[str, tuple]) -> str | None:
    """The first difference between two {parameter name: shape} maps, in words; None when they agree."""
    missing = [k for k in expected if k not in saved]
    extra = [k for k in saved if k not in expected]
    differ = [k for k in expected if k in saved and tuple(saved[k]) != tuple(expected[k])]
    if differ:
        k = differ[0]
        more = f" ({len(differ) - 1} more tensors differ)" if len(differ) > 1 else ""
        return f"{k} is {list(saved[k])} in the checkpoint and {list(expected[k])} in the model{more}"
    if missing or extra:
        first = f"the checkpoint lacks {missing[0]}" if missing else f"the model has no {extra[0]}"
        return f"{first} ({len(missing)} missing, {len(extra)} unexpected tensors)"
    return None


def expected_shapes(model_path: str, role: str, trust_remote_code: bool = False) -> dict[str, tuple] | None:
    """Parameter shapes of the model a role loads, built on the meta device (no weights read); None
    when its config cannot be read: the role's workers then report that, naming their node."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    cls = AutoModelForTokenClassification if role == "critic" else AutoModelForCausalLM
    extra = {"num_labels": 1} if role == "critic" else {}
    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code, **extra)
        with torch.device("meta"):
            model = cls.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:
        return None
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


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


def rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir() if path.is_dir() else []:
        if f.is_dir():
            _fsync_dir(f)
        elif f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
