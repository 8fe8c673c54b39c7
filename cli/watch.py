"""`cloudrl submit --follow` through a cluster restart.

When the whole cluster goes away while a job is followed (a dstack run restarted after an interruption,
a `dstack apply` of a new run, a `cloudrl local` cluster brought down and up again), the CLI keeps
watching instead of failing: it waits up to `--reconnect-wait` seconds for the dashboard to answer at
the same address, then

- follows the same job again if the cluster still has it (the tunnel, not the cluster, went away);
- otherwise submits the same job again, with `trainer.resume=auto` and an `-rN` suffix on its id, so
  the trainer continues from the run's latest checkpoint, and follows that one.

The run must keep its checkpoints where the new cluster finds them: the `/checkpoints` volume (the
dstack task's default), a `trainer.checkpoint_uri` bucket, or this machine's disk for a local cluster.
The CLI, not the cluster, remembers the job: a restart while nothing follows it is resumed by
submitting the same command again (`trainer.resume=auto` is the default).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from .errors import CloudrlError, ClusterUnreachable, NoSuchJob
from .jobs import Detached, follow, job_info
from .ray_api import ClusterClient

MAX_RESUBMITS = 3
POLL_S = 5.0

Echo = Callable[[str], Any]


def follow_through_restarts(
    client: ClusterClient, job_id: str, resubmit: Callable[[ClusterClient, str], str], wait_s: float, echo: Echo
) -> Any:
    """Follow `job_id` to its end (jobs.follow), across cluster restarts; `resubmit(client, new_id)`
    submits the job again under a new id. Returns the final job info."""
    base, resubmits = job_id, 0
    while True:
        try:
            return follow(client, job_id)
        except ClusterUnreachable as exc:
            if wait_s <= 0:
                raise
            echo(f"\ncloudrl: {exc}")
            echo(
                f"cloudrl: waiting up to {wait_s:g} s for the cluster to answer again at {client.address.url} "
                f"(Ctrl+C stops watching; the run's checkpoints stay where they are)"
            )
            try:
                client = wait_for_cluster(client, wait_s)
            except KeyboardInterrupt:
                raise Detached(job_id) from None
        try:
            job_info(client, job_id)
            echo(f"cloudrl: the cluster answers and still has {job_id}: following it again")
        except NoSuchJob:
            resubmits += 1
            if resubmits > MAX_RESUBMITS:
                raise CloudrlError(
                    f"the cluster came back without {job_id} a {resubmits}th time: stopped after "
                    f"{MAX_RESUBMITS} resubmissions; submit it again yourself (trainer.resume=auto "
                    f"continues from its latest checkpoint)"
                ) from None
            job_id = resubmit(client, f"{base}-r{resubmits}")
            echo(
                f"cloudrl: the cluster came back without the job: submitted it again as {job_id}, which "
                f"continues from the run's latest checkpoint (trainer.resume=auto)"
            )


def wait_for_cluster(client: ClusterClient, wait_s: float) -> ClusterClient:
    """A fresh client once the dashboard at the same address answers, or CloudrlError after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        fresh = ClusterClient(client.address)  # new sessions: the old ones belong to the cluster that left
        try:
            fresh.check_version()
            return fresh
        except CloudrlError as exc:
            if time.monotonic() + POLL_S > deadline:
                raise CloudrlError(
                    f"no cluster answered at {client.address.url} within {wait_s:g} s ({exc}); once it "
                    f"is back, submit the job again: trainer.resume=auto continues from its latest "
                    f"checkpoint"
                ) from None
        time.sleep(POLL_S)


def resubmitter(sub: Any, req: Any, env_values: dict, files_zip: Any) -> Callable[[ClusterClient, str], str]:
    """Submits `req` again under a new id, resuming from its run's latest checkpoint."""

    def resubmit(client: ClusterClient, new_id: str) -> str:
        again = dataclasses.replace(req, submission_id=new_id, overrides=[*req.overrides, "trainer.resume=auto"])
        return sub.submit(client, again, env_values, files_zip)

    return resubmit
