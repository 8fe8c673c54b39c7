"""What `cloudrl submit` does when the Jobs API says no: Ray's real JobSubmissionClient, no Ray cluster.

The dashboard is a stand-in HTTP server on 127.0.0.1 that speaks the part of Ray's Jobs API a submission
uses (version, package upload, job creation) and answers job creation as scripted. A failure on the
cluster's side (HTTP 500: a job agent that does not listen yet, on a cluster that has just come up) is
asked again within a bound; a verdict on the request (a 4xx, also one Ray wraps in its 500) is not; either
way the error line is the cause at the end of Ray's traceback, never its first line.
"""

from __future__ import annotations

import http.server
import json
from pathlib import Path

import pytest
from cli_helpers import serve
from cloudrl.cli import ray_api
from cloudrl.cli import submit as sub
from cloudrl.cli.errors import CloudrlError

AGENT_DOWN = (
    "Traceback (most recent call last):\n"
    '  File "/ray/dashboard/modules/job/job_head.py", line 416, in submit_job\n'
    "    resp = await job_agent_client.submit_job_internal(submit_request)\n"
    "aiohttp.client_exceptions.ClientConnectorError: Cannot connect to host 127.0.0.1:52365 ssl:default "
    "[Connect call failed ('127.0.0.1', 52365)]\n"
)


def wrapped(agent_status: int, agent_text: str) -> str:
    """The dashboard's 500 body when its job agent answered `agent_status`: the head's traceback around it."""
    return (
        "Traceback (most recent call last):\n"
        '  File "/ray/dashboard/modules/job/job_head.py", line 416, in submit_job\n'
        "    resp = await job_agent_client.submit_job_internal(submit_request)\n"
        f"RuntimeError: Request failed with status code {agent_status}: {agent_text}.\n"
    )


DROP = 0
"""A scripted answer: the connection closes unanswered before the job is created."""
DROP_AFTER_CREATING = 1
"""A scripted answer: the job is created, then the connection closes unanswered."""


class JobsApi:
    """A dashboard whose job creation answers the scripted (status, body) pairs in turn, then creates."""

    def __init__(self, answers: list[tuple[int, str]]):
        self.answers = list(answers)
        self.posts = 0
        self.created: set[str] = set()

    def handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def reply(self, code: int, body: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json" if code == 200 else "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.startswith("/api/version"):
                    version = {"version": "4", "ray_version": "2.60.0", "ray_commit": "x", "session_name": "s"}
                    self.reply(200, json.dumps(version))
                else:  # a package not uploaded yet, or a job never created
                    self.reply(404, "not found")

            def do_PUT(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.reply(200, "")

            def do_POST(self) -> None:  # noqa: N802
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                job = request["submission_id"]
                api.posts += 1
                if job in api.created:
                    self.reply(500, wrapped(400, f"ValueError: Job with submission_id {job} already exists."))
                    return
                if api.answers:
                    status, body = api.answers.pop(0)
                    if status in (DROP, DROP_AFTER_CREATING):  # the connection closes without a reply
                        if status == DROP_AFTER_CREATING:
                            api.created.add(job)
                        self.close_connection = True
                        return
                    if status == 201:  # the job is created, then the answer fails on its way back
                        api.created.add(job)
                        status = 500
                    self.reply(status, body)
                    return
                api.created.add(job)
                self.reply(200, json.dumps({"job_id": job, "submission_id": job}))

            def log_message(self, *args: object) -> None:
                pass

        return Handler


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sub, "SUBMIT_RETRY_S", 3.0)
    monkeypatch.setattr(sub, "SUBMIT_RETRY_EVERY_S", 0.2)
    monkeypatch.setenv("CLOUDRL_CACHE", str(tmp_path / "cache"))
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)


def submit_to(api: JobsApi) -> tuple[str, list[str]]:
    """`submit` of the local default to `api`, and the lines it printed while it waited."""
    said: list[str] = []
    with serve(api.handler()) as url:
        client = ray_api.ClusterClient(ray_api.Address(url, "--address"))
        req = sub.build_request("local", [], "refusal-test", [])
        return sub.submit(client, req, {}, echo=said.append), said


def test_a_cluster_failing_on_its_side_is_asked_again_and_the_job_is_created(quick_retries: None) -> None:
    api = JobsApi([(500, AGENT_DOWN), (500, AGENT_DOWN)])
    job, said = submit_to(api)
    assert job == "refusal-test" and api.posts == 3 and api.created == {job}
    assert said == [
        "the cluster failed on its side (HTTP 500, aiohttp.client_exceptions.ClientConnectorError: Cannot "
        "connect to host 127.0.0.1:52365 ssl:default [Connect call failed ('127.0.0.1', 52365)]); asking "
        "again for up to 3 s"
    ]


def test_a_job_created_by_a_try_whose_answer_failed_is_that_job(quick_retries: None) -> None:
    api = JobsApi([(201, AGENT_DOWN)])
    job, _ = submit_to(api)
    assert job == "refusal-test" and api.posts == 2 and api.created == {job}


def test_a_cluster_failing_past_the_bound_names_its_cause_in_one_line(quick_retries: None) -> None:
    api = JobsApi([(500, AGENT_DOWN)] * 100)
    with pytest.raises(CloudrlError) as err:
        submit_to(api)
    message = str(err.value)
    assert message.startswith("the cluster refused the job (asked ")
    assert "over 3 s): HTTP 500, aiohttp.client_exceptions.ClientConnectorError: Cannot connect" in message
    assert "\n" not in message and "Traceback" not in message
    assert 2 <= api.posts <= 16 and not api.created


def test_a_verdict_on_the_request_is_not_asked_again(quick_retries: None) -> None:
    api = JobsApi([(500, wrapped(400, "Traceback (most recent call last):\nValueError: pip and uv both given"))])
    with pytest.raises(CloudrlError) as err:
        submit_to(api)
    assert str(err.value) == "the cluster refused the job: HTTP 500, ValueError: pip and uv both given"
    assert api.posts == 1


def test_a_name_taken_before_the_first_try_is_refused(quick_retries: None) -> None:
    api = JobsApi([])
    api.created.add("refusal-test")
    with pytest.raises(CloudrlError, match="a job named 'refusal-test' already exists on http://127.0.0.1:"):
        submit_to(api)
    assert api.posts == 1


def test_a_connection_closed_unanswered_is_asked_again_and_the_job_is_created(quick_retries: None) -> None:
    api = JobsApi([(DROP, ""), (DROP, "")])
    job, said = submit_to(api)
    assert job == "refusal-test" and api.posts == 3 and api.created == {job}
    assert len(said) == 1
    assert said[0].startswith("the connection to http://127.0.0.1:")
    assert said[0].endswith(" failed (the connection closed without a reply); asking again for up to 3 s")


def test_a_job_created_by_a_try_whose_connection_closed_is_that_job(quick_retries: None) -> None:
    api = JobsApi([(DROP_AFTER_CREATING, "")])
    job, _ = submit_to(api)
    assert job == "refusal-test" and api.posts == 2 and api.created == {job}


def test_a_connection_failing_past_the_bound_is_one_line(quick_retries: None) -> None:
    api = JobsApi([(DROP, "")] * 100)
    with pytest.raises(CloudrlError) as err:
        submit_to(api)
    message = str(err.value)
    assert message.startswith("submitting to http://127.0.0.1:")
    assert " failed (ConnectionError: the connection closed without a reply); no job was left behind" in message
    assert "\n" not in message and 2 <= api.posts <= 16 and not api.created
