"""Checkpoints off the instance: `trainer.checkpoint_uri` (`s3://bucket/prefix`, `gs://...`, any fsspec
URL) receives a copy of every checkpoint right after its atomic local save, and a run with
`trainer.resume=auto` first fetches the newest complete copy of its run when the local run_dir has none
as recent (a new instance, a deleted volume).

    check(uri)                              # before the run starts: reachable, else one line
    fetch_newest(uri, run_dir)              # -> the downloaded checkpoint, or None
    upload(path, uri, keep_last)            # after each local save (shards.save_run)

A copy is complete once its `COMPLETE` marker exists; the marker is written after every other file, so
an upload cut short is never resumed from. Nothing in the bucket is trusted: a copy is downloaded file
by file as its manifest lists them (names that leave the checkpoint, `..` or absolute, are refused, and
so is a copy holding objects its manifest does not list), into a hidden directory that becomes a
checkpoint only after every file's SHA-256 matches; the checkpoint is then read like a local one
(checkpoint.py: data, never code). Copies carry their run id: `keep_last` prunes only this run's copies,
another run's copy in the way of an upload is moved to `<uri>/timeline-<run id>/`, and a bucket holding
unrelated runs makes resume=auto refuse and name the copies to choose from (`trainer.resume=<uri>/step_N`
downloads that one).

Credentials come from the storage library's own environment (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL` for S3; Google's application credentials for GCS) and are
never printed or stored. S3 needs `pip install 'cloudrl[s3]'` (s3fs).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

from ..errors import CheckpointError
from . import checkpoint, layout, timeline
from .layout import ASIDE, MANIFEST, PREFIX, checkpoint_root

COMPLETE = "COMPLETE"


def _fs(uri: str):
    import fsspec

    try:
        # A fresh client per use: credentials and endpoints come from the environment as it is now,
        # and no listing cached by an earlier client hides what another writer changed.
        fs, root = fsspec.core.url_to_fs(uri, skip_instance_cache=True)
    except (ImportError, ValueError) as exc:
        raise CheckpointError(
            f"trainer.checkpoint_uri={uri} cannot be used ({_reason(exc)}): for s3:// install "
            f"s3fs (pip install 'cloudrl[s3]'), for gs:// gcsfs"
        ) from None
    return fs, root.rstrip("/")


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


def _failed(uri: str, what: str, exc: BaseException) -> CheckpointError:
    return CheckpointError(
        f"{what} trainer.checkpoint_uri={uri} failed ({_reason(exc)}): check that the bucket "
        f"exists and the credentials in the environment (AWS_* for S3) may write to it"
    )


def _untrusted(where: str, problem: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint copy {where} {problem}: refused, nothing of it was read; someone other than this run "
        f"writes to trainer.checkpoint_uri: make it writable by this run only and delete that copy, or "
        f"{layout.FRESH_START} with a trainer.checkpoint_uri of its own (trainer.resume=never)"
    )


def check(uri: str) -> None:
    """Fail before the run starts when the checkpoint URI's storage cannot be listed."""
    fs, root = _fs(uri)
    try:
        fs.exists(root)
    except Exception as exc:
        raise _failed(uri, "reaching", exc) from None


def remote_steps(fs, root: str) -> list[str]:
    """The complete copies under `root`, oldest first (every run's)."""
    fs.invalidate_cache(root)
    if not fs.exists(root):
        return []
    names = [p.rstrip("/") for p in fs.ls(root, detail=False)]
    steps = [
        p
        for p in names
        if p.rsplit("/", 1)[-1].startswith(PREFIX)
        and p.rsplit("/", 1)[-1][len(PREFIX) :].isdigit()
        and fs.exists(f"{p}/{COMPLETE}")
    ]
    return sorted(steps, key=layout.step_of)


def remote_manifest(fs, copy: str) -> dict:
    """A copy's manifest.json ({} when absent or unreadable: a copy of no known run)."""
    try:
        data = json.loads(fs.cat_file(f"{copy}/{MANIFEST}"))
    except Exception:
        return {}
    return data if isinstance(data, dict) else {}


def remote_copies(fs, root: str) -> list[timeline.Copy]:
    return [timeline.Copy.of(p, remote_manifest(fs, p)) for p in remote_steps(fs, root)]


def upload(step_dir: Path, uri: str, keep_last: int) -> None:
    """Copy a saved checkpoint to `uri/step_NNNNNN/`, the marker last; keep this run's newest `keep_last`
    copies (other runs' copies are never pruned)."""
    fs, root = _fs(uri)
    target = f"{root}/{step_dir.name}"
    manifest = layout.read_manifest(step_dir)
    run_id = manifest.get("run_id")
    if not run_id or not step_dir.is_dir():
        raise CheckpointError(
            f"checkpoint {step_dir} has no run id in its {MANIFEST} (or is gone), so it is not uploaded to "
            f"trainer.checkpoint_uri={uri}: save it again"
        )
    try:
        if fs.exists(target):
            owner = remote_manifest(fs, target).get("run_id")
            if owner == run_id:  # a re-run of the same step replaces it
                fs.rm(target, recursive=True)
            else:  # another run's copy: kept, out of the way
                aside = f"{root}/{ASIDE}{owner or 'unknown'}-{secrets.token_hex(3)}/{step_dir.name}"
                _move(fs, target, aside)
                print(f"checkpoint copy {target} belongs to another run: moved to {aside}", flush=True)
        for f in sorted(step_dir.rglob("*")):
            if f.is_file() and f.name != MANIFEST:
                fs.put_file(str(f), f"{target}/{f.relative_to(step_dir).as_posix()}")
        fs.put_file(str(step_dir / MANIFEST), f"{target}/{MANIFEST}")
        fs.pipe_file(f"{target}/{COMPLETE}", b"complete\n")
        own = [c for c in remote_copies(fs, root) if c.run_id == run_id]
        for old in sorted(own, key=lambda c: c.step)[:-keep_last]:
            if old.where.rstrip("/") != target:
                fs.rm(old.where, recursive=True)
    except Exception as exc:
        raise _failed(uri, f"uploading checkpoint {step_dir.name} to", exc) from None


def _move(fs, source: str, dest: str) -> None:
    """Move a copy within the store, object by object (a server-side copy each), the marker last."""
    keys = sorted(fs.find(source), key=lambda k: k.endswith(f"/{COMPLETE}"))
    for key in keys:
        fs.copy(key, f"{dest}{key[len(source) :]}")
    fs.rm(source, recursive=True)


def downloads_checkpoint(cfg) -> bool:
    """The job downloads the checkpoint it resumes once it has joined the cluster (`fetch_checkpoint`):
    trainer.resume is a URL, or trainer.resume=auto with trainer.checkpoint_uri; its resume point is then
    decided after that download."""
    resume = cfg.trainer.resume
    return "://" in resume or (bool(cfg.trainer.checkpoint_uri) and resume == "auto")


def fetch_checkpoint(cfg) -> None:
    """Once the cluster is known to fit, before the resume point is decided from what it brought (job.py):
    with trainer.checkpoint_uri, check it answers; for resume=auto bring its newest complete copy of this
    run into run_dir when the local ones are older; for resume=never refuse a URI that already holds
    another run's copies; `trainer.resume=<url of a copy>` downloads that copy and resumes from it. run_dir is
    where resume.place_run_dir put it."""
    uri = cfg.trainer.checkpoint_uri
    resume = cfg.trainer.resume
    run_dir = cfg.trainer.run_dir
    timeline.forget(run_dir)
    if uri:
        check(uri)
    if "://" in resume:
        cfg.trainer.resume = str(fetch_copy(resume, run_dir))
    elif not uri:
        return
    elif resume == "auto":
        fetch_newest(uri, run_dir)
    elif resume == "never":
        refuse_taken(uri)


def refuse_taken(uri: str) -> None:
    """A fresh run (resume=never) never shares a URI with another run's copies."""
    fs, root = _fs(uri)
    try:
        found = remote_steps(fs, root)
    except Exception as exc:
        raise _failed(uri, "listing", exc) from None
    if found:
        names = ", ".join(p.rsplit("/", 1)[-1] for p in found[-3:])
        raise CheckpointError(
            f"trainer.checkpoint_uri={uri} already holds another run's checkpoints ({names}) and this run "
            f"starts fresh (trainer.resume=never): give it a prefix of its own (e.g. "
            f"trainer.checkpoint_uri={uri.rstrip('/')}-2), or continue that run with trainer.resume=auto"
        )


def fetch_newest(uri: str, run_dir: str) -> Path | None:
    """Download the newest complete copy of this run_dir's run into run_dir/checkpoints/ (verified, then
    renamed into place) when it is newer than the run's newest local checkpoint; returns its local path,
    or None when there is nothing newer."""
    fs, root = _fs(uri)
    try:
        copies = remote_copies(fs, root)
    except Exception as exc:
        raise _failed(uri, "listing", exc) from None
    current = timeline.current_timeline(run_dir)
    chosen = timeline.pick_resume(copies, current, f"trainer.checkpoint_uri={uri}", lambda c: _url(fs, c.where))
    if chosen is None:
        return None
    local = [
        layout.step_of(p)
        for p in layout.list_checkpoints(run_dir)
        if layout.read_manifest(p).get("run_id") == chosen.run_id
    ]
    if local and max(local) >= chosen.step:
        return None
    return _download(fs, chosen.where, uri, run_dir)


def fetch_copy(url: str, run_dir: str) -> Path:
    """trainer.resume=<url of one copy>: download it (verified) into run_dir/checkpoints/."""
    fs, path = _fs(url)
    name = path.rsplit("/", 1)[-1]
    if not (name.startswith(PREFIX) and name[len(PREFIX) :].isdigit()):
        raise CheckpointError(
            f"trainer.resume={url} is not a checkpoint copy: name one like "
            f"{url.rsplit('/', 1)[0]}/{PREFIX}000010, or use auto or never"
        )
    try:
        complete = fs.exists(f"{path}/{COMPLETE}")
    except Exception as exc:
        raise _failed(url, "reaching", exc) from None
    if not complete:
        raise CheckpointError(
            f"trainer.resume={url} has no {COMPLETE} marker (an upload cut short, or no such copy): "
            f"choose a complete copy, or use trainer.resume=auto"
        )
    return _download(fs, path, url, run_dir)


def _parse_manifest(data: bytes) -> dict:
    try:
        manifest = json.loads(data)
    except ValueError:
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _url(fs, path: str) -> str:
    protocol = fs.protocol[0] if isinstance(fs.protocol, tuple | list) else fs.protocol
    return f"{protocol}://{path}"


def _download(fs, remote: str, uri: str, run_dir: str) -> Path:
    """Download one copy as its manifest lists it into a hidden directory, verify every file, then rename
    it into place; on any failure or interruption nothing is left that a resume could pick."""
    name = remote.rsplit("/", 1)[-1]
    where = _url(fs, remote)
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    checkpoint.clean_stale(root)
    final = root / name
    tmp = root / f".{name}.download{os.getpid()}-{secrets.token_hex(4)}"
    try:
        try:
            listed = list(fs.find(remote))
            manifest_bytes = fs.cat_file(f"{remote}/{MANIFEST}")
        except FileNotFoundError:
            raise _untrusted(where, f"has no {MANIFEST}") from None
        for key in listed:
            if not key.startswith(remote + "/"):
                raise _untrusted(where, f"lists an object outside it ({key!r})")
            checkpoint.check_relative(key[len(remote) + 1 :], f"checkpoint copy {where}")
        manifest = _parse_manifest(manifest_bytes)
        files = manifest.get("files")
        if not isinstance(files, dict) or not all(isinstance(e, dict) and "sha256" in e for e in files.values()):
            raise CheckpointError(
                f"checkpoint copy {where} has no content hashes in its {MANIFEST} (saved by an older cloudrl, "
                f"or not by cloudrl), so it cannot be checked: {layout.NO_HASHES_FIX}"
            )
        rels = {checkpoint.check_relative(n, f"checkpoint copy {where}'s {MANIFEST}").as_posix() for n in files}
        unlisted = sorted({key[len(remote) + 1 :] for key in listed} - rels - {MANIFEST, COMPLETE})
        if unlisted:
            raise _untrusted(where, f"holds objects its {MANIFEST} does not list ({', '.join(unlisted[:3])})")
        tmp.mkdir()
        for rel in sorted(rels):
            dest = tmp / rel
            if tmp.resolve() not in dest.resolve().parents:
                raise _untrusted(where, f"names a file outside the checkpoint ({rel!r})")
            dest.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f"{remote}/{rel}", str(dest))
        (tmp / MANIFEST).write_bytes(manifest_bytes)
        checkpoint.verify(tmp)
        checkpoint.fsync_tree(tmp)
        if final.exists():
            if layout.read_manifest(final) == manifest:
                shutil.rmtree(tmp, ignore_errors=True)
                return final
            checkpoint.move_aside(final, layout.read_manifest(final).get("run_id"))
        os.replace(tmp, final)
    except CheckpointError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        text = str(exc).replace(str(tmp), where).replace(tmp.name, name)  # the copy, not the download directory
        raise CheckpointError(text) from None
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _failed(uri, f"downloading {name} from", exc) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"fetched {where} from trainer.checkpoint_uri into {final}", flush=True)
    return final
