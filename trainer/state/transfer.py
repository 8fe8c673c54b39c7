"""Files between a worker's node and the driver, one bounded chunk per Ray call: the way checkpoint shards
and the HF export travel when the worker's node does not see the driver's directory (no shared disk).

The worker keeps the files in a scratch directory of its own (TrainableWorker.open_scratch); the driver
pulls them chunk by chunk, writing each chunk as it arrives, or pushes its own files the same way:

    pull(worker, "actor rank 1 on node 10.0.0.2", {"__1_0.distcp": 5_000_000}, Path("ckpt/actor"), 600, "saving")
    push([worker], ["actor rank 1 on node 10.0.0.2"], Path("ckpt/actor"), 600, "loading")

So neither the driver nor Ray's object store ever holds more than `CHUNK_BYTES` of one transfer at a time,
whatever the size of a rank's shard (tens of GB for a 7B critic with its optimizer state). Every call is
bounded by the caller's timeout (waiting.get_all). The worker's side (`listing`, `read_chunk`, `write_chunk`)
is plain file I/O on its scratch directory; names are relative paths checked on both sides to stay inside
their directory, and every chunk's size is checked against the file's listed size.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError
from ..waiting import get_all

CHUNK_BYTES = 64 << 20
"""The most bytes one call moves. A constant rather than a key: large enough that the per-call latency is
small against the transfer, small enough to be nothing beside a node's memory; tests set it far smaller."""


def checked_name(name: object) -> str:
    """`name` when it is a relative path (`/`-separated, as `listing` writes them) that stays inside its
    directory; CheckpointError otherwise (a worker's listing is data, not a path to trust)."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        raise CheckpointError(f"file name {name!r} from a worker is not a plain relative path: refused")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise CheckpointError(f"file name {name!r} from a worker leaves its directory: refused")
    return name


def checked_listing(files: object) -> dict[str, int]:
    """A worker's {relative name: size in bytes}, every name checked and every size a non-negative int."""
    if not isinstance(files, dict):
        raise CheckpointError(f"a worker listed its files as {type(files).__name__}, not a dict: refused")
    for name, size in files.items():
        checked_name(name)
        if type(size) is not int or size < 0:
            raise CheckpointError(f"a worker listed {name!r} with size {size!r}: refused")
    return files


# The worker's side: plain file I/O in its scratch directory.
def listing(root: str) -> dict[str, int]:
    """Every regular file under `root` (symbolic links left out), by `/`-separated relative name, with its size."""
    files = {}
    for directory, _, names in os.walk(root):
        for name in sorted(names):
            path = os.path.join(directory, name)
            if os.path.isfile(path) and not os.path.islink(path):
                files[os.path.relpath(path, root).replace(os.sep, "/")] = os.path.getsize(path)
    return files


def read_chunk(root: str, name: str, offset: int, size: int) -> bytes:
    """Up to `size` bytes of `root/name` from `offset`."""
    with open(os.path.join(root, checked_name(name)), "rb") as f:
        f.seek(offset)
        return f.read(size)


def write_chunk(root: str, name: str, offset: int, data: bytes) -> None:
    """Append `data` to `root/name` (created, with its directories, by the chunk at offset 0). Chunks come
    in order: one at any other offset than the file's end is refused, so a lost chunk cannot go unseen."""
    path = os.path.join(root, checked_name(name))
    if offset == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb" if offset == 0 else "ab") as f:
        if f.tell() != offset:
            raise CheckpointError(f"chunk of {name!r} at offset {offset}, but {f.tell()} bytes are written: refused")
        f.write(data)


# The driver's side.
def pull(worker, label: str, files: dict, target: Path, timeout_s: float, what: str) -> None:
    """Copy the worker's scratch files (`files`: its listing) into `target`, one chunk per call, then drop
    the worker's scratch directory. A chunk of another size than the listing implies is refused."""
    files = checked_listing(files)
    try:
        for name, size in files.items():
            path = target / name
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                for offset in range(0, size, CHUNK_BYTES):
                    want = min(CHUNK_BYTES, size - offset)
                    ref = worker.read_chunk.remote(name, offset, want)
                    data = get_all([ref], [label], timeout_s, what)[0]
                    del ref  # the object store lets go of the chunk once the driver has it
                    if not isinstance(data, bytes) or len(data) != want:
                        got = len(data) if isinstance(data, bytes) else type(data).__name__
                        raise CheckpointError(
                            f"{what}: {label} sent {got} bytes of {name!r} at offset {offset}, where its listing "
                            f"({size} bytes) gives {want}: the file changed on its node during the transfer"
                        )
                    f.write(data)
                    del data
    except BaseException:
        worker.drop_scratch.remote()  # not waited for: the worker may be the reason this failed
        raise
    get_all([worker.drop_scratch.remote()], [label], timeout_s, what)


def push(workers: list, labels: list[str], source: Path, timeout_s: float, what: str) -> None:
    """Copy every file under `source` into each worker's fresh scratch directory, one chunk at a time (read
    once and put into the object store once for all of them), then check each worker's listing against
    the driver's. The workers keep the files until their next call consumes them (load_shards)."""
    import ray

    files = listing(str(source))
    get_all([w.open_scratch.remote() for w in workers], labels, timeout_s, what)
    try:
        for name, size in files.items():
            with open(source / name, "rb") as f:
                for offset in range(0, max(size, 1), CHUNK_BYTES):  # an empty file still gets its one call
                    chunk = ray.put(f.read(CHUNK_BYTES))
                    get_all([w.write_chunk.remote(name, offset, chunk) for w in workers], labels, timeout_s, what)
                    del chunk
        received = get_all([w.scratch_files.remote() for w in workers], labels, timeout_s, what)
        for label, theirs in zip(labels, received):
            if theirs != files:
                raise CheckpointError(f"{what}: {label} received {theirs}, not the {files} sent")
    except BaseException:
        for w in workers:
            w.drop_scratch.remote()
        raise
