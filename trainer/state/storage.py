"""Checkpoints off the instance: `trainer.checkpoint_uri` (`s3://bucket/prefix`, `gs://...`, any fsspec
URL) receives a copy of every checkpoint right after its atomic local save, and a run with
`trainer.resume=auto` first fetches the newest complete copy when the local run_dir has none as recent
(a new instance, a deleted volume).

    check(uri)                              # before the run starts: reachable, else one line
    fetch_newest(uri, run_dir)              # -> the downloaded checkpoint, or None
    upload_if_configured(path, trainer_cfg) # after each local save

A copy is complete once its `COMPLETE` marker exists; the marker is written after every other file, so
an upload cut short is never resumed from. Credentials come from the storage library's own environment
(`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL` for S3; Google's application
credentials for GCS) and are never printed or stored. S3 needs `pip install 'cloudrl[s3]'` (s3fs).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import CheckpointError
from .checkpoint import PREFIX, checkpoint_root, latest

COMPLETE = "COMPLETE"


def _fs(uri: str):
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(uri)
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


def check(uri: str) -> None:
    """Fail before the run starts when the checkpoint URI's storage cannot be listed."""
    fs, root = _fs(uri)
    try:
        fs.exists(root)
    except Exception as exc:
        raise _failed(uri, "reaching", exc) from None


def remote_steps(fs, root: str) -> list[str]:
    """The complete copies under `root`, oldest first."""
    fs.invalidate_cache(root)
    if not fs.exists(root):
        return []
    names = [p.rstrip("/") for p in fs.ls(root, detail=False)]
    steps = [p for p in names if p.rsplit("/", 1)[-1].startswith(PREFIX) and fs.exists(f"{p}/{COMPLETE}")]
    return sorted(steps, key=lambda p: int(p.rsplit("/", 1)[-1][len(PREFIX) :]))


def upload(step_dir: Path, uri: str, keep_last: int) -> None:
    """Copy a saved checkpoint to `uri/step_NNNNNN/`, the marker last; keep the newest `keep_last` copies."""
    fs, root = _fs(uri)
    target = f"{root}/{step_dir.name}"
    try:
        if fs.exists(target):  # a re-run of the same step replaces it
            fs.rm(target, recursive=True)
        for f in sorted(step_dir.rglob("*")):
            if f.is_file():
                fs.put_file(str(f), f"{target}/{f.relative_to(step_dir).as_posix()}")
        fs.pipe_file(f"{target}/{COMPLETE}", b"complete\n")
        for old in remote_steps(fs, root)[:-keep_last]:
            fs.rm(old, recursive=True)
    except Exception as exc:
        raise _failed(uri, f"uploading checkpoint {step_dir.name} to", exc) from None


def fetch_checkpoint(cfg) -> None:
    """Before the run's checks: with trainer.checkpoint_uri, check it answers, and for resume=auto
    bring its newest complete checkpoint into run_dir when the local ones are older."""
    from .run_dir import under_runs_dir

    uri = cfg.trainer.checkpoint_uri
    if uri:
        check(uri)
        if cfg.trainer.resume == "auto":
            fetch_newest(uri, under_runs_dir(cfg.trainer.run_dir))


def upload_if_configured(step_dir: Path, trainer_cfg) -> Path:
    if trainer_cfg.checkpoint_uri:
        upload(step_dir, trainer_cfg.checkpoint_uri, trainer_cfg.keep_last)
    return step_dir


def fetch_newest(uri: str, run_dir: str) -> Path | None:
    """Download the newest complete copy into run_dir/checkpoints/ (atomically) when it is newer than
    the newest local checkpoint; returns its local path, or None when there is nothing newer."""
    fs, root = _fs(uri)
    tmp = None
    try:
        found = remote_steps(fs, root)
        if not found:
            return None
        newest = found[-1]
        name = newest.rsplit("/", 1)[-1]
        local = latest(run_dir)
        if local is not None and int(local.name[len(PREFIX) :]) >= int(name[len(PREFIX) :]):
            return None
        final = checkpoint_root(run_dir) / name
        tmp = checkpoint_root(run_dir) / f".{name}.download{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        for remote in fs.find(newest):
            rel = remote[len(newest) + 1 :]
            if rel != COMPLETE:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(remote, str(tmp / rel))
    except CheckpointError:
        raise
    except Exception as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _failed(uri, "downloading the newest checkpoint from", exc) from None
    os.replace(tmp, final)
    print(f"fetched {newest} from trainer.checkpoint_uri into {final}", flush=True)
    return final
