"""The driver's side of sharded checkpoints: every trained role's ranks write and read their own shards
(torch.distributed.checkpoint) in parallel; the driver only moves the files of nodes that do not see
the checkpoint directory.

    checkpoint.save(run_dir, step, {}, state, yaml, keep, write_shards=lambda tmp: save_roles(roles, tmp, 600))
    load_roles(roles, ckpt, 600)   # after launch_roles, before the first step

A node sees the directory when it is on the driver's disk or a volume both mount (the usual case for
a local cluster, or a run_dir on a shared volume); otherwise its ranks write into a scratch directory and
return their own files, which the driver writes one rank at a time (so it holds one rank's shard at most),
and on resume each such rank receives the role's files through Ray's object store.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..waiting import get_all


def trained_groups(roles) -> dict:
    return {name: g for name, g in (("actor", roles.actor), ("critic", roles.critic)) if g is not None}


def save_roles(roles, tmp: Path, timeout_s: float) -> None:
    """Every rank of every trained role writes its shards into `tmp/<role>/` (all roles at once)."""
    calls = {
        name: [w.save_shards.remote(str(tmp / name)) for w in g.workers] for name, g in trained_groups(roles).items()
    }
    for name, refs in calls.items():
        group = trained_groups(roles)[name]
        (tmp / name).mkdir(exist_ok=True)
        scheduler = None
        for ref, label in zip(refs, group.labels()):
            files, sched = get_all([ref], [label], timeout_s, f"saving the {name} shards")[0]
            for file, data in files.items():
                (tmp / name / file).write_bytes(data)
            del files
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
        shipped = None
        if not all(seen):  # put each file into the object store once, for the ranks that need it
            shipped = {f.name: ray.put(f.read_bytes()) for f in sorted(directory.iterdir()) if f.is_file()}
        refs += [
            w.load_shards.remote(str(directory), scheduler, None if ok else shipped)
            for w, ok in zip(group.workers, seen)
        ]
        labels += group.labels()
    get_all(refs, labels, timeout_s, "loading the checkpoint's shards")
