"""`cloudrl status / logs / stop / list`, and the log follower `submit --follow` shares.

All through Ray's Jobs API Python client (`ClusterClient.jobs`), never the `ray` CLI. The trainer prints
one progress line per step (`step 3/40 | rollout/reward_mean=0.53 ... | 1.23 s/step`) and a block
starting with `summary:` at the end; `status` shows the latest of those from the job's logs.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from cloudrl.trainer.errors import first_line

from .errors import CloudrlError
from .ray_api import EXCEPTION_RE, ClusterClient

STEP_RE = re.compile(r"^step \d+/\d+\b[^|]*\|")
STATUS_TAIL_LINES = 2000
"""How much of a job's log `status` reads (the end, through the log API): enough for the last step line
and the summary block, never the whole log of a long, chatty job."""
# Terminal control characters: C0 except tab and newline (and carriage return, which progress bars use),
# DEL, and C1 (U+0080-U+009F, which some terminals take as ESC sequences).
CONTROL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
STATUS_POLL_S = 3.0
# After Ray reports the job ended, give the log stream this long to deliver its last lines.
END_GRACE_S = 10.0
STOP_WAIT_S = 30.0
TRAINER_DEBUG_HINT = "CLOUDRL_DEBUG=1 shows the traceback"
"""What the trainer's one-line errors say about tracebacks: true where the trainer runs in this shell."""
JOB_DEBUG_HINT = "for the job's traceback submit it again with `CLOUDRL_DEBUG=1 cloudrl submit --env CLOUDRL_DEBUG ...`"
"""The same for a job: CLOUDRL_DEBUG must reach the job's processes, which only --env does."""


class Detached(Exception):
    """Ctrl+C while following: the job keeps running."""


# ----------------------------------------------------------------------------------------------
# Reading jobs
# ----------------------------------------------------------------------------------------------


def job_info(client: ClusterClient, job_id: str) -> Any:
    return client.call(lambda: client.jobs.get_job_info(job_id), what=f"read job {job_id}", job_id=job_id)


def job_logs(client: ClusterClient, job_id: str) -> str:
    return client.call(lambda: client.jobs.get_job_logs(job_id), what=f"read the logs of {job_id}", job_id=job_id)


def job_log_tail(client: ClusterClient, info: Any, lines: int = STATUS_TAIL_LINES) -> str | None:
    """The last `lines` lines of the job's driver log (`job-driver-<id>.log` on the node that ran it),
    through the dashboard's log API, which reads them from the end of the file; None when the cluster
    has no such log (a driver not started as a job)."""
    node_id = getattr(info, "driver_node_id", None)
    if not node_id or not info.submission_id:
        return None
    query = urllib.parse.urlencode(
        {"node_id": node_id, "filename": f"job-driver-{info.submission_id}.log", "lines": lines}
    )
    response = client.get(f"/api/v0/logs/file?{query}")
    return response.text if response.status_code == 200 else None


def safe_text(text: str) -> str:
    """`text` with terminal control characters shown as escapes (`\\x1b`) instead of acted on: job output
    (a sample, a dataset's text) must not move the cursor, retitle the terminal or set the clipboard."""
    return CONTROL_RE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def list_jobs(client: ClusterClient) -> list[Any]:
    jobs = client.call(lambda: client.jobs.list_jobs(), what="list jobs")
    return sorted(jobs, key=lambda j: j.start_time or 0)


def job_name(info: Any) -> str:
    """The id users type: the submission id (Ray's own job id only for drivers not submitted as jobs)."""
    return info.submission_id or info.job_id or "?"


def latest_job(client: ClusterClient) -> Any:
    submitted = [j for j in list_jobs(client) if j.submission_id]
    if not submitted:
        raise CloudrlError(f"no jobs on {client.address.url} yet: submit one with `cloudrl submit`")
    return submitted[-1]


def latest_metrics(logs: str) -> tuple[str | None, list[str]]:
    """The last step line and the final summary block (empty while the job runs) from the trainer's logs."""
    lines = logs.splitlines()
    step = next((ln.strip() for ln in reversed(lines) if STEP_RE.match(ln.strip())), None)
    summary: list[str] = []
    starts = [i for i, ln in enumerate(lines) if ln.strip().startswith("summary:")]
    if starts:
        for ln in lines[starts[-1] :]:
            if not ln.strip():
                break
            summary.append(ln.rstrip())
    return step, summary


def last_error_line(logs: str) -> str | None:
    """Why the job failed, in one line: the trainer's own `error: ...` line, else the exception line
    that ends a traceback (`ValueError: ...`), else None."""
    lines = [ln.strip() for ln in logs.splitlines() if ln.strip()]
    own = next((ln for ln in reversed(lines) if ln.startswith("error:")), None)
    return own or next((ln for ln in reversed(lines) if EXCEPTION_RE.match(ln)), None)


def _fmt_time(ms: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) if ms else "-"


def _fmt_duration(info: Any) -> str:
    if not info.start_time:
        return "-"
    end = info.end_time or time.time() * 1000
    s = max(0, int((end - info.start_time) / 1000))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _preset(info: Any) -> str:
    meta = info.metadata or {}
    if "cloudrl_preset" not in meta:
        return "-"
    return " ".join(x for x in (meta["cloudrl_preset"], meta.get("cloudrl_overrides", "")) if x)


# ----------------------------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------------------------


def status_text(client: ClusterClient, job_id: str | None) -> str:
    info = job_info(client, job_id) if job_id else latest_job(client)
    name = job_name(info)
    lines = [
        f"job:       {name}",
        f"status:    {info.status}" + (f" ({info.message})" if info.message and info.status != "RUNNING" else ""),
        f"preset:    {_preset(info)}",
        f"started:   {_fmt_time(info.start_time)} ({_fmt_duration(info)}"
        + (" so far)" if not info.status.is_terminal() else ")"),
        f"dashboard: {client.address.job_url(name)}",
    ]
    try:
        logs = job_log_tail(client, info)
    except CloudrlError:  # drivers started without `submit` have no job logs
        logs = None
    step, summary = latest_metrics(logs) if logs is not None else ("no logs for this job", [])
    lines.append(f"latest:    {step}" if step else "latest:    no step finished yet")
    lines += summary
    if not info.status.is_terminal():
        lines.append(f"follow:    cloudrl logs {name} --follow{client.address.flag}")
    elif info.status == "FAILED":  # last, the job's own one-line reason
        lines.append(f"error:     {job_debug_hint(failure_reason(info, logs or '')).removeprefix('error: ')}")
    return safe_text("\n".join(lines))


def list_text(client: ClusterClient) -> str:
    jobs = list_jobs(client)
    if not jobs:
        return f"no jobs on {client.address.url} yet: submit one with `cloudrl submit`"
    rows = [("ID", "STATUS", "START", "DURATION", "PRESET")]
    rows += [(job_name(j), str(j.status), _fmt_time(j.start_time), _fmt_duration(j), _preset(j)) for j in jobs]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return safe_text(
        "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows).rstrip()
    )


def stop(client: ClusterClient, job_id: str) -> str:
    """Ask Ray to stop the job and wait (bounded) until it reports a final status."""
    info = job_info(client, job_id)
    if info.status.is_terminal():
        return f"job {job_id} had already ended: {info.status}"
    client.call(lambda: client.jobs.stop_job(job_id), what=f"stop {job_id}", job_id=job_id)
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        info = job_info(client, job_id)
        if info.status.is_terminal():
            return f"job {job_id} {'stopped' if info.status == 'STOPPED' else 'ended: ' + str(info.status)}"
        time.sleep(0.5)
    raise CloudrlError(
        f"asked Ray to stop {job_id}, but it still reports {info.status} after {STOP_WAIT_S:g} s: "
        f"check `cloudrl status {job_id}{client.address.flag}`"
    )


def follow(client: ClusterClient, job_id: str, out: Callable[[str], Any] | None = None) -> Any:
    """Stream the job's logs until it ends; returns its final info.

    Raises CloudrlError unless it succeeded, and Detached on Ctrl+C (the job keeps running).
    """
    write = out or _write_stdout
    job_info(client, job_id)  # a clear error for an unknown id before opening the stream
    try:
        asyncio.run(_stream(client, job_id, write))
    except KeyboardInterrupt:
        raise Detached(job_id) from None
    info = job_info(client, job_id)
    deadline = time.monotonic() + END_GRACE_S
    while not info.status.is_terminal() and time.monotonic() < deadline:  # stream closed a little early
        time.sleep(0.5)
        info = job_info(client, job_id)
    if info.status == "SUCCEEDED":
        return info
    if not info.status.is_terminal():
        raise CloudrlError(
            f"the log stream of {job_id} ended while the job is {info.status}: "
            f"follow it again with `cloudrl logs {job_id} --follow{client.address.flag}`"
        )
    reason = failure_reason(info, job_logs(client, job_id))
    logs = f"full logs: cloudrl logs {job_id}{client.address.flag}"
    if reason.startswith("error:"):  # the trainer's own line, without its traceback: say how to get one
        reason = job_debug_hint(reason)
        logs += f"; {JOB_DEBUG_HINT}" if JOB_DEBUG_HINT not in reason else ""
    raise CloudrlError(f"job {job_id} {info.status}: {reason} ({logs})")


def job_debug_hint(reason: str) -> str:
    """A trainer's error line as it reads for a submitted job: its traceback hint made true for a job."""
    return reason.replace(TRAINER_DEBUG_HINT, JOB_DEBUG_HINT)


def failure_reason(info: Any, logs: str) -> str:
    """The job's own one-line error from its logs, else the first line of Ray's message."""
    message = (info.message or "").strip()
    return last_error_line(logs) or first_line(message, "no message")


def _write_stdout(chunk: str) -> None:
    sys.stdout.write(safe_text(chunk))
    sys.stdout.flush()


async def _stream(client: ClusterClient, job_id: str, write: Callable[[str], Any]) -> None:
    jobs = client.jobs

    async def pump() -> None:
        async for chunk in jobs.tail_job_logs(job_id):
            write(chunk)

    tail = asyncio.ensure_future(pump())
    ended_at: float | None = None
    try:
        while True:
            done, _ = await asyncio.wait({tail}, timeout=STATUS_POLL_S)
            if done:
                exc = tail.exception()
                # a cluster going away says so (ClusterUnreachable); a job that ended has nothing more to show
                if exc is not None and not await asyncio.to_thread(_settle, client, job_id):
                    raise CloudrlError(
                        f"the log stream of {job_id} from {client.address.url} broke "
                        f"({_short(exc)}); the job may still run: "
                        f"`cloudrl status {job_id}{client.address.flag}`"
                    )
                return
            # A watchdog beside the stream: a dead tunnel fails this bounded call instead of hanging.
            info = await asyncio.to_thread(job_info, client, job_id)
            if info.status.is_terminal():
                ended_at = ended_at or time.monotonic()
                if time.monotonic() - ended_at > END_GRACE_S:
                    return
    finally:
        if not tail.done():
            tail.cancel()
            try:
                await tail
            except (asyncio.CancelledError, Exception):
                pass
        elif not tail.cancelled():
            tail.exception()  # a stream that broke after the job's end is seen here, not printed at exit


def _settle(client: ClusterClient, job_id: str) -> bool:
    """After the log stream broke: whether the job has ended (within END_GRACE_S); raises ClusterUnreachable if
    the cluster stops answering meanwhile (a cluster going down closes the stream a moment before its dashboard
    stops)."""
    deadline = time.monotonic() + END_GRACE_S
    while True:
        if job_info(client, job_id).status.is_terminal():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(1.0)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
