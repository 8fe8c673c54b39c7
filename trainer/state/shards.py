"""The driver's side of sharded checkpoints and of the HF export: every trained role's ranks write and read
their own shards (torch.distributed.checkpoint) in parallel; the driver only moves the files of nodes that
do not see its directory.

    save_run(roles, cfg, step, driver_state)   # the whole run's checkpoint (and its copy off the instance)
    load_roles(roles, ckpt, 600)   # after launch_roles, before the first step
    export_policy(roles, run_dir / "hf_model", 600)   # save_pretrained, on the driver's disk

A node sees the directory when it is on the driver's disk or a volume both mount (the usual case for
a local cluster, or a run_dir on a shared volume), and its ranks read and write there in place. Otherwise
a rank writes into a scratch directory on its own node, and the driver pulls each file in bounded chunks
(transfer.py), one rank at a time, writing each chunk as it arrives; on resume the driver pushes the
role's files into such ranks' scratch directories the same way. Neither the driver nor Ray's object store
holds more than one chunk of a transfer at a time, however large a rank's shard.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from ..waiting import get_all
from . import checkpoint, storage, transfer


def trained_groups(roles) -> dict:
    return {name: g for name, g in (("actor", roles.actor), ("critic", roles.critic)) if g is not None}


def save_run(roles, cfg, step: int, driver_state: dict) -> Path:
    """The run's checkpoint at `step`: every trained role's shards (`save_roles`), the driver's state and
    the config, written atomically (checkpoint.save); then, with trainer.checkpoint_uri, a copy off the
    instance (storage.upload)."""
    tc = cfg.trainer
    path = checkpoint.save(
        tc.run_dir,
        step,
        {},
        driver_state,
        cfg.to_yaml(),
        tc.keep_last,
        write_shards=lambda tmp: save_roles(roles, tmp, tc.worker_timeout_s),
        key=checkpoint.signing_key(tc.checkpoint_key_env),
    )
    if tc.checkpoint_uri:
        storage.upload(path, tc.checkpoint_uri, tc.keep_last)
    return path


def save_roles(roles, tmp: Path, timeout_s: float) -> None:
    """Every rank of every trained role writes its shards into `tmp/<role>/` (all roles at once); the driver
    then pulls the files of ranks whose node does not see `tmp`."""
    groups = trained_groups(roles)
    calls = {name: [w.save_shards.remote(str(tmp / name)) for w in g.workers] for name, g in groups.items()}
    for name, refs in calls.items():
        group = groups[name]
        (tmp / name).mkdir(exist_ok=True)
        scheduler = None
        for ref, worker, label in zip(refs, group.workers, group.labels()):
            files, sched = get_all([ref], [label], timeout_s, f"saving the {name} shards")[0]
            if files:  # written on its own node: the shards stay there until pulled
                transfer.pull(worker, label, files, tmp / name, timeout_s, f"copying the {name} shards from {label}")
            scheduler = sched if sched is not None else scheduler
        (tmp / f"{name}.json").write_text(json.dumps(scheduler))


def load_roles(roles, ckpt, timeout_s: float) -> None:
    """Every rank reads its part of each sharded role (resharded to this run's world size)."""
    import ray

    refs, labels = [], []
    for name, group in trained_groups(roles).items():
        if name in ckpt.parts:  # the older single-file layout: full state from the driver
            part = ray.put(ckpt.parts[name])
            refs += [w.set_state.remote(part) for w in group.workers]
            labels += group.labels()
        if name not in ckpt.sharded:
            continue
        directory = ckpt.sharded[name]
        scheduler = json.loads((ckpt.path / f"{name}.json").read_text())
        seen = get_all(
            [w.sees.remote(str(directory)) for w in group.workers],
            group.labels(),
            timeout_s,
            f"checking which {name} nodes see {directory}",
        )
        blind = [(w, label) for w, label, ok in zip(group.workers, group.labels(), seen) if not ok]
        if blind:  # the role's files, chunk by chunk, to every rank that needs them at once
            workers, names = [w for w, _ in blind], [label for _, label in blind]
            transfer.push(workers, names, directory, timeout_s, f"sending the {name} shards to {', '.join(names)}")
        refs += [w.load_shards.remote(str(directory), scheduler, not ok) for w, ok in zip(group.workers, seen)]
        labels += group.labels()
    get_all(refs, labels, timeout_s, "loading the checkpoint's shards")


def export_policy(roles, path: Path, timeout_s: float) -> None:
    """The policy's `save_pretrained` directory at `path` on the driver's disk (replacing what is there). It
    is written into a fresh temporary directory beside `path`, then renamed into place: by actor rank 0 in
    place when its node sees that directory (a name no other node can hold by chance, as it could `run_dir`),
    else on rank 0's own node, from which the driver pulls it."""
    group = roles.actor
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp", dir=path.parent))
    try:
        target = tmp / path.name
        refs = [w.export_hf.remote(str(target)) for w in group.workers]
        exported = get_all(refs, group.labels(), timeout_s, "exporting the policy")
        for worker, label, files in zip(group.workers, group.labels(), exported):
            if files:
                transfer.pull(worker, label, files, target, timeout_s, f"copying the exported policy from {label}")
        if path.exists():
            shutil.rmtree(path)
        target.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
