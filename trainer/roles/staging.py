"""Models on every node: before the roles start, each node that will load a model has it on its own disk.

    staged = stage_models([model_path, critic_path], node_ids, timeout_s=600)   # {path: NodePaths}
    # in a worker on any node:
    path = on_this_node(staged[model_path])

A model is named by one of:
- a directory on the driver's disk (`builtin:tiny` is materialised into one). It is fingerprinted by its
  content: every file's name and SHA-256, so two fine-tunes of one architecture (same names, same sizes)
  never pass for each other. A large file's hash is computed once per machine and cached keyed by its
  path, size, mtime, ctime and inode (`$CLOUDRL_CACHE/fingerprints/`). A node where the same path holds
  the same fingerprint
  (a shared volume, an image, the job's working directory) uses it as is; any other node gets the
  directory once through Ray's object store, unpacked into its cache (`$CLOUDRL_CACHE/models/`).
  Directories over SHIP_LIMIT_BYTES are not shipped: a node that lacks one fails here, in one line.
- a hub id (`Qwen/Qwen2.5-7B-Instruct`): every node downloads it once into its Hugging Face cache
  (`HF_HOME`; the dstack tasks put it on the run volume, so nodes that share the volume share the cache).

Nothing here runs on import; Ray is imported inside the functions that use it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError, first_line
from ..paths import cache_dir

SHIP_LIMIT_BYTES = 2 * 1024**3
"""Largest model directory the driver sends to nodes that lack it (through Ray's object store)."""
SMALL_FILE_BYTES = 1024**2
"""Files up to this size (configs, tokenizers) are hashed on every fingerprint; larger ones (weights)
once, their SHA-256 then cached (see `file_sha256`)."""
RACY_SECONDS = 2.0
"""A file modified this recently may change again within the same mtime tick: its hash is not cached."""
# What a hub download fetches: weights, configs, tokenizers, chat templates, remote code.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.py", "*.tiktoken", "*.jinja"]


@dataclass(frozen=True)
class NodePaths:
    """Where one model lives on each node of the run (node id -> local directory)."""

    source: str
    by_node: dict[str, str]
    hub: bool = False
    """A hub id: a node not in `by_node` downloads it into its own Hugging Face cache."""
    fingerprint: str = ""
    """A directory's fingerprint, where `shipped` is set."""
    shipped: object = None
    """An object ref to the packed directory (`for_new_nodes`), for a worker that starts later on a node not
    in `by_node` (a rollout engine in place of a lost one, or one added on capacity that joined): it uses the
    same directory at the same path if the node has it, else unpacks this copy into its cache."""


def on_this_node(path: str | NodePaths) -> str:
    """The local directory of `path` on the node this process runs on (plain strings pass through)."""
    if isinstance(path, str):
        return path
    import ray

    node = ray.get_runtime_context().get_node_id()
    if node in path.by_node:
        return path.by_node[node]
    if path.hub:
        return download(path.source)[0]
    if path.shipped is not None:
        return check_local(path.source, path.fingerprint) or unpack(
            path.source, path.fingerprint, ray.get(path.shipped)
        )
    raise ModelLoadError(
        f"{path.source} was not staged on node {node[:8]} ({socket.gethostname()}): "
        f"this worker runs outside the run's placement groups"
    )


def for_new_nodes(path: NodePaths) -> NodePaths:
    """`path`, reachable from a node that was not in the run when it started: a hub id as it is (such a node
    downloads it), a directory with a packed copy in the object store (kept while `path` is referenced; not
    for directories over SHIP_LIMIT_BYTES, which a new node must already have, at the same path)."""
    import dataclasses

    import ray

    if path.hub or path.shipped is not None or directory_size(path.source) > SHIP_LIMIT_BYTES:
        return path
    return dataclasses.replace(path, fingerprint=fingerprint(path.source), shipped=ray.put(pack(path.source)))


def is_hub_id(path: str) -> bool:
    """`org/name` or `name` that is not a directory here: what from_pretrained would fetch from the hub."""
    return not Path(path).exists() and not path.startswith((".", "/", "~")) and path.count("/") <= 1


def fingerprint(directory: str | Path) -> str:
    """A digest of a model directory's content: every file's relative name and SHA-256 (hidden files,
    such as a shipped copy's `.complete`, are not the model)."""
    root = Path(directory)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")):
        digest.update(f"{file.relative_to(root)}\0{file_sha256(file)}\0".encode())
    return digest.hexdigest()[:16]


def file_sha256(file: Path) -> str:
    """A file's SHA-256; for files over SMALL_FILE_BYTES cached on this machine keyed by path, size,
    mtime, ctime and inode, so the weights of a model are read once, not at every stage."""
    st = file.stat()
    if st.st_size <= SMALL_FILE_BYTES:
        return hashlib.sha256(file.read_bytes()).hexdigest()
    resolved = str(file.resolve())
    key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    cache = cache_dir() / "fingerprints" / f"{hashlib.sha256(resolved.encode()).hexdigest()[:32]}.json"
    try:
        entry = json.loads(cache.read_text())
        if entry.get("path") == resolved and entry.get("key") == key and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
    except (OSError, ValueError, AttributeError):
        pass
    value = read_sha256(file)
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_SECONDS * 1e9:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
            tmp.write_text(json.dumps({"path": resolved, "key": key, "sha256": value}))
            os.replace(tmp, cache)
        except OSError:  # a read-only cache costs time, not correctness
            pass
    return value


def read_sha256(file: Path) -> str:
    """A file's SHA-256, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(file, "rb") as fh:
        for block in iter(lambda: fh.read(1024**2), b""):
            digest.update(block)
    return digest.hexdigest()


def directory_size(directory: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


def pack(directory: str | Path) -> bytes:
    """The directory as an uncompressed tar (weights do not compress; speed matters more)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for file in sorted(p for p in Path(directory).rglob("*") if p.is_file() and not p.name.startswith(".")):
            tar.add(file, arcname=str(file.relative_to(directory)))
    return buffer.getvalue()


def cache_root() -> Path:
    return cache_dir() / "models"


# ----------------------------------------------------------------------------------------------
# What runs on each node
# ----------------------------------------------------------------------------------------------


def check_local(path: str, expected: str) -> str | None:
    """This node's directory for `path` with fingerprint `expected`: the path itself, or an earlier
    shipped copy in the cache; None when the node has neither."""
    here = Path(path)
    if here.is_dir() and fingerprint(here) == expected:
        return str(here.resolve())
    copy = cache_root() / f"{here.name or 'model'}-{expected}"
    if _complete(copy, expected):
        return str(copy)
    return None


def _complete(copy: Path, expected: str) -> bool:
    """A shipped copy that finished unpacking and still holds the model it was shipped as."""
    try:
        marked = (copy / ".complete").read_text().strip() == expected
    except OSError:
        return False
    return marked and fingerprint(copy) == expected


def unpack(path: str, expected: str, blob: bytes) -> str:
    """Write a shipped directory into this node's cache (atomically: a crash leaves no half copy)."""
    copy = cache_root() / f"{Path(path).name or 'model'}-{expected}"
    if _complete(copy, expected):
        return str(copy)
    tmp = copy.with_name(f"{copy.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
        tar.extractall(tmp, filter="data")
    got = fingerprint(tmp)
    if got != expected:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelLoadError(
            f"the copy of {path} shipped to node {socket.gethostname()} has fingerprint {got}, not {expected}: "
            f"the directory changed on the driver while the run started; start the run again once it is final"
        )
    (tmp / ".complete").write_text(expected)
    try:
        if copy.exists() and not _complete(copy, expected):  # a stale or damaged earlier copy
            shutil.rmtree(copy, ignore_errors=True)
        os.replace(tmp, copy)
    except OSError:  # another worker of this node finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(copy)


def download(repo_id: str) -> tuple[str, float]:
    """Fetch a hub model into this node's Hugging Face cache; (local directory, seconds)."""
    from huggingface_hub import snapshot_download

    started = time.monotonic()
    try:
        local = snapshot_download(repo_id, allow_patterns=HUB_PATTERNS)
    except Exception as exc:  # network, auth, missing repo: all end the run here, in one line
        reason = first_line(exc, type(exc).__name__)
        raise ModelLoadError(
            f"downloading {repo_id} on node {socket.gethostname()} failed ({type(exc).__name__}: {reason}): "
            f"check the id, pass the token with --env HF_TOKEN for gated models, or put the model on a "
            f"volume every node mounts and use its path"
        ) from None
    return local, time.monotonic() - started


def _node_label() -> str:
    import ray

    return f"{ray.util.get_node_ip_address()} ({socket.gethostname()})"


def _probe(path: str, expected: str) -> tuple[str | None, str]:
    return check_local(path, expected), _node_label()


def _receive(path: str, expected: str, blob: bytes) -> tuple[str, str]:
    return unpack(path, expected, blob), _node_label()


def _fetch(repo_id: str) -> tuple[str, float, str]:
    local, seconds = download(repo_id)
    return local, seconds, _node_label()


# ----------------------------------------------------------------------------------------------
# The driver's side
# ----------------------------------------------------------------------------------------------


def stage_models(paths: list[str], node_ids: list[str], timeout_s: float, echo=print) -> dict[str, NodePaths]:
    """Make every model in `paths` available on every node in `node_ids`; returns where it is on each."""
    staged = {}
    for path in dict.fromkeys(paths):
        if Path(path).is_dir():
            staged[path] = _stage_directory(path, node_ids, timeout_s, echo)
        elif is_hub_id(path):
            staged[path] = _stage_hub(path, node_ids, timeout_s, echo)
        else:
            raise ModelLoadError(
                f"model directory not found on the driver: {path} (relative to {Path.cwd()}): "
                f"check model.path / critic.model_path / reward.model_path"
            )
    return staged


def _on(node_id: str, fn):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # No CPU asked: the roles' placement groups may hold every CPU of the node already.
    return ray.remote(fn).options(
        num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    )


def _stage_directory(path: str, node_ids: list[str], timeout_s: float, echo) -> NodePaths:
    import ray

    from ..waiting import get_all

    expected = fingerprint(path)
    labels = [f"node {n[:8]}" for n in node_ids]
    found = get_all(
        [_on(n, _probe).remote(path, expected) for n in node_ids],
        labels,
        timeout_s,
        f"looking for {path} on every node",
    )
    by_node = {n: local for n, (local, _) in zip(node_ids, found) if local}
    missing = [(n, label) for n, (local, label) in zip(node_ids, found) if not local]
    if missing:
        size = directory_size(path)
        if size > SHIP_LIMIT_BYTES:
            raise ModelLoadError(
                f"{path} ({size / 1024**3:.1f} GiB) is on the driver's disk only and node "
                f"{', '.join(label for _, label in missing)} lacks it; directories over "
                f"{SHIP_LIMIT_BYTES / 1024**3:.0f} GiB are not shipped: put the model on a volume every node "
                f"mounts (e.g. /checkpoints) or use a hub id"
            )
        started = time.monotonic()
        blob = ray.put(pack(path))
        got = get_all(
            [_on(n, _receive).remote(path, expected, blob) for n, _ in missing],
            [label for _, label in missing],
            timeout_s,
            f"copying {path} to the nodes that lack it",
        )
        for (n, _), (local, _) in zip(missing, got):
            by_node[n] = local
        echo(
            f"model: {path}: copied to {len(missing)} node(s) that lacked it ({size / 1024**2:.1f} MiB in "
            f"{time.monotonic() - started:.1f}s); {len(node_ids) - len(missing)} node(s) already had it"
        )
    else:
        echo(f"model: {path}: present on all {len(node_ids)} node(s)")
    return NodePaths(path, by_node)


def _stage_hub(repo_id: str, node_ids: list[str], timeout_s: float, echo) -> NodePaths:
    from ..waiting import get_all

    got = get_all(
        [_on(n, _fetch).remote(repo_id) for n in node_ids],
        [f"node {n[:8]}" for n in node_ids],
        timeout_s,
        f"downloading {repo_id} on every node",
    )
    slowest = max(seconds for _, seconds, _ in got)
    echo(
        f"model: {repo_id}: in the Hugging Face cache of all {len(node_ids)} node(s) "
        f"(slowest node {slowest:.1f}s; HF_HOME={os.environ.get('HF_HOME', '~/.cache/huggingface')})"
    )
    return NodePaths(repo_id, {n: local for n, (local, _, _) in zip(node_ids, got)}, hub=True)
