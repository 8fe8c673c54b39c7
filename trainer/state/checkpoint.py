"""Atomic checkpoints in `run_dir/checkpoints/step_NNNNNN/`, read back as data, never as code.

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
      rng.json         the driver's RNG states
      config.yaml      the resolved config of the run
      manifest.json    written last: the run id, and every file's size and SHA-256

Nothing read back is unpickled by Python's pickle: tensors load with `torch.load(weights_only=True)`,
the DCP `.metadata` with an unpickler that builds only DCP's own metadata classes (`load_dcp_metadata`),
everything else is JSON or YAML. Before a resume starts any actor, the checkpoint is checked: every file
against the manifest (size, then SHA-256; a file the manifest does not list is refused), the algorithm
it was saved by, and its parameter names and shapes against the models this run loads. A checkpoint
without content hashes (saved by an older cloudrl) is refused.

Runs and timelines: the first save of a run mints a run id, kept in every checkpoint's manifest and in
`run_dir/timeline.json`. `trainer.keep_last` prunes only the current run id's checkpoints; a run that
resumes from a chosen checkpoint (`trainer.resume=<path>`) starts a new run id that records where it
branched from, so the checkpoints it leaves behind are never pruned by it, and `latest` (resume=auto,
restarts) follows the current timeline, not the highest step number.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import io
import json
import os
import pickle
import random
import secrets
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import torch

from ..errors import CheckpointError, ConfigError, TrainerError

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


# ----------------------------------------------------------------------------------------------
# Runs and timelines
# ----------------------------------------------------------------------------------------------


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


def _own_timeline(run_dir: str) -> Timeline:
    timeline = current_timeline(run_dir)
    if timeline is None:
        timeline = Timeline(new_run_id())
    _CURRENT[_key(run_dir)] = timeline
    return timeline


def read_manifest(path: Path) -> dict:
    """A checkpoint's manifest.json ({} when absent or unreadable: such a checkpoint belongs to no run)."""
    try:
        data = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


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


# ----------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------


def save(
    run_dir: str,
    step: int,
    parts: dict[str, dict],
    trainer_state: dict,
    config_yaml: str,
    keep_last: int,
    write_shards: Callable[[Path], None] | None = None,
    key: bytes | None = None,
) -> Path:
    """Write a checkpoint atomically. `write_shards(tmp)` has the workers write their sharded roles
    into the temporary directory (shards.save_roles); `parts` are full states saved as `<role>.pt`.
    With `key` (`signing_key`) the manifest is signed. Then prune this run's own checkpoints beyond the
    newest `keep_last`."""
    root = checkpoint_root(run_dir)
    final = root / f"{PREFIX}{step:06d}"
    timeline = _own_timeline(run_dir)
    clean_stale(root)
    _check_free_space(run_dir, timeline.run_id, final)
    tmp = root / f".{final.name}.tmp{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir(parents=True)
    try:
        if write_shards is not None:
            write_shards(tmp)
        for name, state in parts.items():
            torch.save(state, tmp / f"{name}.pt")
        (tmp / RNG).write_text(json.dumps(rng_state()))
        (tmp / "config.yaml").write_text(config_yaml)
        (tmp / "trainer.json").write_text(json.dumps(trainer_state, indent=1))
        manifest = {
            "format": FORMAT,
            "run_id": timeline.run_id,
            "from": timeline.parent,
            "step": step,
            "saved_at": time.time(),
            "files": file_entries(tmp),
        }
        if key is not None:
            manifest[SIGNATURE] = {"hmac_sha256": manifest_mac(manifest, key)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        fsync_tree(tmp)
        _put_in_place(tmp, final, timeline.run_id)
        fsync_tree(root, files=False)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException, not an Exception
        interrupted = isinstance(exc, KeyboardInterrupt | SystemExit | GeneratorExit)
        problem = None if interrupted else _disk_problem(exc, root)
        shutil.rmtree(tmp, ignore_errors=True)
        if problem is None and (isinstance(exc, TrainerError) or not isinstance(exc, OSError)):
            raise
        previous = own_checkpoints(run_dir, timeline.run_id)
        kept = f"; the previous checkpoint {previous[-1]} is intact" if previous else ""
        if problem is not None:
            raise CheckpointError(
                f"saving checkpoint {final} failed: {problem}{kept}: free space there or set trainer.run_dir "
                f"to a larger volume, then resume with trainer.resume=auto"
            ) from None
        raise CheckpointError(
            f"saving checkpoint {final} failed ({_one_line(exc)}): check the disk under trainer.run_dir{kept}"
        ) from None
    write_timeline(run_dir)
    for old in own_checkpoints(run_dir, timeline.run_id)[:-keep_last]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def file_entries(directory: Path) -> dict[str, dict]:
    """{relative path: {"size", "sha256"}} of every file under `directory` (hashed in parallel: I/O bound)."""
    files = sorted(f for f in directory.rglob("*") if f.is_file() and f.name != MANIFEST)
    with ThreadPoolExecutor(max_workers=min(8, len(files) or 1)) as pool:
        digests = list(pool.map(sha256_file, files))
    return {
        f.relative_to(directory).as_posix(): {"size": f.stat().st_size, "sha256": d} for f, d in zip(files, digests)
    }


def sha256_file(path: Path) -> str:
    """A file's SHA-256, read in 4 MiB blocks (hashlib releases the GIL on them: files hash in parallel)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(4 * 1024**2), b""):
            digest.update(block)
    return digest.hexdigest()


def clean_stale(root: Path) -> None:
    """Remove what a process killed mid-save or mid-download left behind (`.step_*.tmp*`, `.step_*.download*`);
    a checkpoint moved aside for a replacement (`.step_*.old*`) goes back when the replacement never came."""
    if not root.is_dir():
        return
    for aside in root.glob(f".{PREFIX}*.old*"):
        target = root / aside.name[1:].split(".old", 1)[0]
        if not target.exists():
            os.replace(aside, target)
        else:
            shutil.rmtree(aside, ignore_errors=True)
    for pattern in (f".{PREFIX}*.tmp*", f".{PREFIX}*.download*"):
        for stale in root.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def _put_in_place(tmp: Path, final: Path, run_id: str) -> None:
    """Rename `tmp` to `final`. A checkpoint of this run already there (the same step saved again) is
    renamed aside first and deleted after, so a kill in between never loses it; one of another run is
    moved to checkpoints/timeline-<its run id>/ and kept."""
    if not final.exists():
        os.replace(tmp, final)
        return
    owner = read_manifest(final).get("run_id")
    if owner == run_id:
        aside = final.with_name(f".{final.name}.old{os.getpid()}")
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
        return
    move_aside(final, owner)
    os.replace(tmp, final)


def move_aside(path: Path, owner: str | None) -> Path:
    """Move another run's checkpoint out of the way into checkpoints/timeline-<run id>/ (kept)."""
    folder = path.parent / f"{ASIDE}{owner or 'unknown'}"
    folder.mkdir(exist_ok=True)
    target = folder / path.name
    if target.exists():
        target = folder / f"{path.name}-{secrets.token_hex(3)}"
    os.replace(path, target)
    print(f"checkpoint {path} belongs to another run ({owner or 'no run id'}): moved to {target}", flush=True)
    return target


def _check_free_space(run_dir: str, run_id: str, final: Path) -> None:
    """Fail before writing when the disk cannot hold another checkpoint the size of the previous one."""
    previous = own_checkpoints(run_dir, run_id)
    if not previous:
        return
    files = read_manifest(previous[-1]).get("files", {})
    needed = sum(e.get("size", 0) for e in files.values() if isinstance(e, dict))
    free = shutil.disk_usage(checkpoint_root(run_dir)).free
    if needed > free:
        raise CheckpointError(
            f"saving checkpoint {final} needs about {_mib(needed)} (the size of {previous[-1].name}) but the "
            f"disk under trainer.run_dir has {_mib(free)} free; the previous checkpoint {previous[-1]} is intact: "
            f"free space there or set trainer.run_dir to a larger volume, then resume with trainer.resume=auto"
        )


def _disk_problem(exc: BaseException, root: Path) -> str | None:
    """'no space left on device (N MiB free ...)' when `exc` came from a full disk or quota, whatever
    wraps it (torch.save reports ENOSPC as a RuntimeError, DCP as a CheckpointException, Ray as a
    RayTaskError); None otherwise."""
    seen: set[int] = set()
    stack: list[object] = [exc]
    full = False
    while stack and not full:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            full = True
        if isinstance(e, BaseException):
            full = full or "No space left on device" in str(e) or "Disk quota exceeded" in str(e)
            stack += [e.__cause__, e.__context__, getattr(e, "cause", None), getattr(e, "exc", None)]
            failures = getattr(e, "failures", None)
            if isinstance(failures, dict):  # DCP: {rank: (exception, traceback)}
                stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    if not full:
        try:
            full = shutil.disk_usage(root).free < 1024**2
        except OSError:
            return None
        if not full:
            return None
    try:
        free = _mib(shutil.disk_usage(root).free)
    except OSError:
        free = "unknown"
    return f"no space left on device under {root} ({free} free with the partial checkpoint)"


def _mib(n: float) -> str:
    return f"{n / 1024**2:.1f} MiB"


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


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
    run_id: str | None = None
    """The run id in its manifest."""

    def has(self, role: str) -> bool:
        return role in self.parts or role in self.sharded


SIGNATURE = "signature"
"""The manifest's key for its HMAC (`trainer.checkpoint_key_env`), over every other key of it."""
KEY_MIN_CHARS = 32


def signing_key(env_name: str) -> bytes | None:
    """The key `trainer.checkpoint_key_env` names, from this process's environment (None when no name is
    given); ConfigError when it is unset or too short to resist guessing. Its value is never printed."""
    if not env_name:
        return None
    value = os.environ.get(env_name, "").strip()
    if not value:
        raise ConfigError(
            f"trainer.checkpoint_key_env={env_name}, but {env_name} is not set here: export it (`export "
            f"{env_name}=$(openssl rand -hex 32)`, kept for every resume), and pass it to a job with "
            f"`cloudrl submit --env {env_name}`"
        )
    if len(value) < KEY_MIN_CHARS:
        raise ConfigError(
            f"{env_name} (trainer.checkpoint_key_env) holds {len(value)} characters, fewer than {KEY_MIN_CHARS}: "
            f"a short key can be guessed; make one with `openssl rand -hex 32`"
        )
    return value.encode()


def manifest_mac(manifest: dict, key: bytes) -> str:
    """HMAC-SHA256 under `key` of the manifest without its signature, as canonical JSON."""
    body = {k: v for k, v in manifest.items() if k != SIGNATURE}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def check_signature(path: Path, manifest: object, key: bytes) -> None:
    """Refuse a checkpoint whose manifest is not signed with `key`: unsigned, or changed since it was."""
    signature = manifest.get(SIGNATURE) if isinstance(manifest, dict) else None
    mac = signature.get("hmac_sha256") if isinstance(signature, dict) else None
    if not isinstance(mac, str):
        raise CheckpointError(
            f"checkpoint {path} is not signed, and trainer.checkpoint_key_env asks that every checkpoint be: it "
            f"was saved without the key (or its signature was removed); resume from one this run signed, or "
            f"drop trainer.checkpoint_key_env to accept it"
        )
    if not hmac.compare_digest(mac, manifest_mac(manifest, key)):
        raise CheckpointError(
            f"checkpoint {path}'s {MANIFEST} does not match its signature under the key of "
            f"trainer.checkpoint_key_env: it was changed after the save, or signed with another key; it is "
            f"never read: {_other_checkpoint(path)}"
        )


class ContentMismatch(ValueError):
    """A checkpoint file whose SHA-256 is not the one its manifest recorded."""


def load(path: Path, names: list[str], key: bytes | None = None) -> Checkpoint:
    """Read a checkpoint after checking its files against the manifest (and, with `key`, the manifest
    against its signature); CheckpointError names the file. Sharded roles are only described here (their
    metadata read); the workers read their own shards."""
    import yaml

    manifest = verify(path, key)
    parts = {name: _read(path / f"{name}.pt") for name in names if (path / f"{name}.pt").exists()}
    sharded = {name: path / name for name in names if (path / name / DCP_METADATA).exists()}
    shapes = {name: {k: tuple(v.shape) for k, v in part.get("model", {}).items()} for name, part in parts.items()}
    for name, directory in sharded.items():
        shapes[name] = _read(directory / DCP_METADATA, model_shapes, text=False)
    state = _read(path / "trainer.json", _json_object)
    saved = _read(path / "config.yaml", yaml.safe_load) if (path / "config.yaml").exists() else {}
    rng = _read(path / RNG, _parse_rng)
    saved = saved if isinstance(saved, dict) else {}
    return Checkpoint(path, parts, state, rng, saved, sharded, shapes, manifest.get("run_id"))


def _json_object(text: str) -> dict:
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    return data


def verify(path: Path, key: bytes | None = None) -> dict:
    """Check a checkpoint directory against its manifest before anything in it is read: with `key`, the
    manifest is signed with it; every listed file has its size and SHA-256, and nothing unlisted is there.
    Returns the manifest."""
    if not (path / MANIFEST).exists():
        raise CheckpointError(
            f"checkpoint {path} has no {MANIFEST}, so nothing vouches for its files (not saved by cloudrl, or "
            f"an incomplete copy): {_other_checkpoint(path)}"
        )
    manifest = _read(path / MANIFEST, json.loads)
    if key is not None:
        check_signature(path, manifest, key)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(e, dict) and isinstance(e.get("sha256"), str) for e in files.values()
    ):
        raise CheckpointError(
            f"checkpoint {path} was saved without content hashes (by an older cloudrl), so it cannot be "
            f"checked before it is read: {NO_HASHES_FIX}"
        )
    for name in files:
        check_relative(name, f"checkpoint {path}'s {MANIFEST}")
    for name, entry in files.items():
        file = path / name
        actual = file.stat().st_size if file.is_file() else None
        if actual != entry.get("size"):
            found = "is missing" if actual is None else f"has {actual} bytes"
            raise CheckpointError(
                f"checkpoint file {file} {found} but was saved with {entry.get('size')} (a truncated or "
                f"incomplete copy): {_other_checkpoint(path)}"
            )
    present = {f.relative_to(path).as_posix() for f in path.rglob("*") if not f.is_dir()}
    extra = sorted(present - set(files) - {MANIFEST})
    if extra:
        raise CheckpointError(
            f"checkpoint {path} holds {len(extra)} file(s) its manifest does not list ({', '.join(extra[:3])}): "
            f"they were added after the save, and are never read: if you did not put them there, someone else "
            f"can write to trainer.run_dir; delete them, or {_other_checkpoint(path)}"
        )
    names = list(files)
    with ThreadPoolExecutor(max_workers=min(8, len(names) or 1)) as pool:
        digests = list(pool.map(lambda n: sha256_file(path / n), names))
    for name, digest in zip(names, digests):
        if digest != files[name]["sha256"]:
            _read(path / name, _mismatch, text=False)
    return manifest


def _mismatch(file: Path):
    raise ContentMismatch(f"its SHA-256 is not the one in {MANIFEST}: changed after the save")


def check_relative(name: str, where: str) -> PurePosixPath:
    """A file name inside a checkpoint: relative, without `..`, no backslashes; else CheckpointError."""
    rel = PurePosixPath(name)
    if not name or rel.is_absolute() or ".." in rel.parts or "\\" in name or name.startswith("~") or "\0" in name:
        raise CheckpointError(
            f"{where} names a file outside the checkpoint ({name!r}): refused, nothing was written for it; "
            f"someone else can write to where this checkpoint came from: make trainer.checkpoint_uri (and "
            f"trainer.run_dir) writable by this run only, or {FRESH_START} (trainer.resume=never)"
        )
    return rel


# Everything a DCP .metadata file may build: DCP's own metadata classes, torch sizes, dtypes and
# layouts, paths. Anything else (os.system, builtins.eval, ...) is refused before it is called.
_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "Path"),
    ("pathlib._local", "PosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def load_dcp_metadata(stream) -> object:
    """A DCP `.metadata` (a pickle) built with DCP's own classes only; anything else raises
    pickle.UnpicklingError before it runs. Its storage entries must name files of the directory."""
    from torch.distributed.checkpoint.metadata import Metadata

    metadata = _MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"not DCP metadata but a {type(metadata).__name__}")
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", "")
        if not isinstance(rel, str) or not rel or "/" in rel or "\\" in rel or rel in (".", ".."):
            raise pickle.UnpicklingError(f"a shard names a file outside its directory: {rel!r}")
    return metadata


def safe_reader(directory: str):
    """A DCP FileSystemReader whose metadata is read by `load_dcp_metadata` (never plain pickle)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                metadata = load_dcp_metadata(io.BytesIO(stream.read()))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(directory)


def safe_planner(empty: bool = False):
    """A DCP load planner that reads non-tensor items (optimizer hyper-parameters) with
    torch.load(weights_only=True), not DCP's default weights_only=False. `empty`: rebuild the whole
    state from the metadata (read_full)."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    base = _EmptyStateDictLoadPlanner if empty else DefaultLoadPlanner

    class SafePlanner(base):
        def load_bytes(self, read_item, value) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafePlanner()


def model_shapes(metadata: Path) -> dict[str, tuple]:
    """Parameter shapes of a DCP role directory, from its `.metadata` file alone (no tensor read)."""
    with open(metadata, "rb") as stream:
        entries = load_dcp_metadata(io.BytesIO(stream.read())).state_dict_metadata
    return {
        k[len("model.") :]: tuple(v.size) for k, v in entries.items() if k.startswith("model.") and hasattr(v, "size")
    }


def read_full(path: Path, role: str) -> dict:
    """A role's whole state ({"model", "optimizer", "scheduler"}) in this process, from either layout.
    For tests, tools and inspection: training never gathers it."""
    if (path / f"{role}.pt").exists():
        return torch.load(path / f"{role}.pt", map_location="cpu", weights_only=True)
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(
        state, storage_reader=safe_reader(str(path / role)), planner=safe_planner(empty=True), no_dist=True
    )
    state["scheduler"] = json.loads((path / f"{role}.json").read_text())
    return state


def _read(file: Path, parse=None, text: bool = True):
    """A checkpoint file: tensors memory-mapped (the driver reads them only when sending them), text
    parsed, other files handed to `parse` by path (text=False)."""
    try:
        if not text:
            return parse(file)
        if parse is None:
            if not zipfile.is_zipfile(file):  # else torch blames the mmap option
                raise ValueError("not a torch.save archive")
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
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


# Settings that make a run another run: trainer.resume=auto refuses a checkpoint saved with other values.
SAME_RUN_KEYS = ("algorithm.name", "model.path", "critic.model_path", "data.train_files", "reward.function")


def check_same_run(ckpt: Checkpoint, cfg) -> None:
    """resume=auto continues only the same run: refuse a checkpoint saved with other models, data, reward
    or algorithm (another preset writing into the same run_dir or bucket)."""
    for key in SAME_RUN_KEYS:
        section, name = key.split(".")
        saved = ckpt.saved_config.get(section, {})
        if not isinstance(saved, dict) or name not in saved:
            continue
        now = getattr(getattr(cfg, section), name)
        if saved[name] != now:
            raise CheckpointError(
                f"trainer.resume=auto found {ckpt.path}, saved by a run with {key}={saved[name]!r}, but this run "
                f"sets {key}={now!r}: resume=auto continues only the same run: give this run a trainer.run_dir "
                f"(and trainer.checkpoint_uri) of its own, or continue that checkpoint on purpose with "
                f"trainer.resume={ckpt.path}"
            )


def check_matches(ckpt: Checkpoint, cfg, shapes: dict[str, dict[str, tuple]]) -> None:
    """Refuse a checkpoint of another algorithm or other models. `shapes[role]` is the parameter shapes
    of the model this run loads for that role (`expected_shapes`)."""
    check_algorithm(ckpt, cfg)
    check_shapes(ckpt, cfg, shapes)


def check_algorithm(ckpt: Checkpoint, cfg) -> None:
    """Refuse a checkpoint saved by another algorithm, or without the critic this run trains: told from
    its files alone, so the job checks it before it joins the cluster."""
    saved = ckpt.saved_config.get("algorithm")
    saved_alg = saved.get("name") if isinstance(saved, dict) else None
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


def check_shapes(ckpt: Checkpoint, cfg, shapes: dict[str, dict[str, tuple]]) -> None:
    """Refuse a checkpoint of other models: `shapes[role]` is the parameter shapes of the model this run
    loads for that role (`expected_shapes`, which needs the model's config)."""
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


def check_unfinished(ckpt: Checkpoint, total_steps: int) -> None:
    """A checkpoint at or past trainer.total_steps has nothing left to train: resuming it would only
    rewrite the run's config.yaml and summary."""
    step = ckpt.state.get("step", 0)
    if isinstance(step, int) and step >= total_steps:
        raise CheckpointError(
            f"checkpoint {ckpt.path} is at step {step} and trainer.total_steps={total_steps}: that run is "
            f"finished: raise trainer.total_steps to train it further, or {FRESH_START} for a new run"
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
    """The driver's RNG states as JSON-ready values (Python's Mersenne state, torch's byte state in hex)."""
    version, internal, gauss = random.getstate()
    return {"python": [version, list(internal), gauss], "torch": torch.get_rng_state().numpy().tobytes().hex()}


def _parse_rng(text: str) -> dict:
    data = json.loads(text)
    version, internal, gauss = data["python"]
    if not (isinstance(version, int) and all(isinstance(x, int) for x in internal)):
        raise ValueError("the python RNG state is not a list of integers")
    state = bytes.fromhex(data["torch"])
    return {"python": (version, tuple(internal), gauss), "torch": torch.frombuffer(bytearray(state), dtype=torch.uint8)}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])


def fsync_tree(path: Path, files: bool = True) -> None:
    """fsync every file under `path` (unless `files` is False), then the directories themselves."""
    for f in path.iterdir() if files and path.is_dir() else []:
        if f.is_dir():
            fsync_tree(f)
        elif f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
