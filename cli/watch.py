"""`cloudrl submit --follow` through a cluster restart.

When the cluster stops answering while a job is followed (a dropped tunnel, a head restarted with its
session, a `cloudrl local` cluster brought down and up again), the CLI keeps watching instead of failing: it waits up to `--reconnect-wait` seconds for the dashboard to answer at
the same address, then

- follows the same job again if the cluster still has it (the tunnel, not the cluster, went away);
- otherwise submits the same job again, with `trainer.resume=auto` and an `-rN` suffix on its id, so
  the trainer continues from the run's latest checkpoint, and follows that one.

Only the same cluster counts: the Ray session the CLI first talked to (for --local, the cluster that
`cloudrl local up` started again here, whose token and session the state file records). A different
cluster answering at the address (another process took the forwarded port) is refused with one line, and
the job and its --env values are not sent to it; a dstack run restarted as a new Ray cluster is such a
cluster too: submit again yourself (`trainer.resume=auto` continues from the latest checkpoint).

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

from cloudrl.trainer.errors import ClusterUnreachable

from .errors import CloudrlError, NoSuchJob
from .jobs import Detached, follow, job_info
from .local_cluster import Echo
from .ray_api import ClusterChanged, ClusterClient

MAX_RESUBMITS = 3
POLL_S = 5.0


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
    """A fresh client once the same cluster answers at the same address, or CloudrlError after `wait_s`.

    The same cluster: the Ray session first contacted, or for --local the cluster the state file names
    now (`cloudrl local up` started it here, with a token of its own). Any other cluster answering at the
    address is refused at once (ClusterChanged): the job and its --env values are never sent to it.
    """
    deadline = time.monotonic() + wait_s
    while True:
        # New sessions: the old ones belong to the cluster that left.
        if client.address.source == "local":
            fresh = ClusterClient(client.address, insecure_http=client.insecure_http)
        else:
            fresh = ClusterClient(
                client.address,
                insecure_http=client.insecure_http,
                expected_session=client.expected_session or client.session,
            )
        try:
            fresh.check_version()
            return fresh
        except ClusterChanged:
            raise
        except (ClusterUnreachable, CloudrlError) as exc:  # not answering yet, or not yet a Ray dashboard
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
