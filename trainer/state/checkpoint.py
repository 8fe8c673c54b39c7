"""Atomic checkpoints in `run_dir/checkpoints/step_NNNNNN/`, read back as data, never as code.

A checkpoint is written into a hidden temporary directory, flushed to disk, then renamed into place,
so a crash mid-save (even a SIGKILL) leaves the previous checkpoint as the latest one. Each trained
role is a sharded torch.distributed.checkpoint (DCP) directory: every rank writes its own shard of the
weights and optimizer state in parallel, straight into the temporary directory when its node sees it
(the driver's node, a shared volume), else through Ray to the driver (shards.py). No process ever holds
more than its own shard, and the shards load into any number of ranks (resharded on load).

The directory's files are listed in layout.py.

Nothing read back is unpickled by Python's pickle: tensors load with `torch.load(weights_only=True)`,
the DCP `.metadata` with an unpickler that builds only DCP's own metadata classes (`load_dcp_metadata`),
everything else is JSON or YAML. Before a resume starts any actor, the checkpoint is checked: every file
against the manifest (size, then SHA-256; a file the manifest does not list is refused) and, with
`trainer.checkpoint_key_env`, the manifest against its signature. A checkpoint without content hashes
(saved by an older cloudrl) is refused.

The run id a save writes into the manifest, and which of this run's checkpoints `trainer.keep_last`
prunes, come from timeline.py; whether a checkpoint fits this run is resume_checks.py's.
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
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import torch

from ..errors import CheckpointError, ConfigError, TrainerError
from .layout import (
    ASIDE,
    DCP_METADATA,
    FORMAT,
    FRESH_START,
    MANIFEST,
    NO_HASHES_FIX,
    PREFIX,
    RNG,
    checkpoint_root,
    read_manifest,
)
from .timeline import own_checkpoints, own_timeline, write_timeline

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
    timeline = own_timeline(run_dir)
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
