"""The CLI trusts nothing that answers at an address: hostile dashboards on 127.0.0.1, no Ray.

Each test plays the attacker with a real HTTP server on loopback and shows the attack now does no harm:
the Ray token never reaches a host it does not belong to, a different cluster at a known address is
refused, secrets never enter Ray's runtime env, `--workdir` ships what git would, and job output cannot
drive the terminal. A host name that does not look like this machine is reached through an HTTP proxy
(requests honours HTTP_PROXY): the proxy is the hostile server, and it sees every header the CLI sends.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer.testing
from cli_helpers import serve
from cloudrl.cli import jobs, ray_api, shipping, watch
from cloudrl.cli import submit as sub
from cloudrl.cli.app import app
from cloudrl.cli.errors import CloudrlError
from cloudrl.cli.local_state import save_state
from cloudrl.trainer.errors import ClusterUnreachable, DataError

runner = typer.testing.CliRunner()
REMOTE = "http://ray-head.cluster.example:8265"


class Dashboard:
    """What a fake dashboard answers (a Ray session name; the token it accepts, if any) and what it saw."""

    def __init__(self, session: str = "session_A", token: str | None = None, always_401: bool = False):
        self.session, self.token, self.always_401 = session, token, always_401
        self.authorizations: list[str] = []
        self.posts = 0

    def handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        dash = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self) -> None:
                auth = self.headers.get("Authorization")
                if auth:
                    dash.authorizations.append(auth)
                if self.command == "POST":
                    dash.posts += 1
                if dash.always_401 or (dash.token and auth != f"Bearer {dash.token}"):
                    code, body = (403 if auth else 401), b"Unauthorized"
                elif self.path.split("?")[0].endswith("/api/version"):
                    code = 200
                    body = json.dumps(
                        {"version": "4", "ray_version": "2.60.0", "ray_commit": "x", "session_name": dash.session}
                    ).encode()
                else:
                    code, body = 404, b"{}"
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = answer

            def log_message(self, *args: object) -> None:
                pass

        return Handler


@pytest.fixture
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No token anywhere, an empty HOME and CLI state dir, no proxy: each test adds what it plays."""
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", "CLOUDRL_DEBUG", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("CLOUDRL_CACHE", str(tmp_path / "cache"))
    return home


@pytest.fixture
def hostile() -> Iterator[tuple[str, Dashboard]]:
    """A server on 127.0.0.1 that answers 401 to everything and records the tokens it is sent."""
    dash = Dashboard(always_401=True)
    with serve(dash.handler()) as url:
        yield url, dash


# ----------------------------------------------------------------------------------------------
# The token goes only where it belongs
# ----------------------------------------------------------------------------------------------


def test_plain_http_to_another_host_never_carries_the_token(
    clean_env: Path, hostile: tuple[str, Dashboard], monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy, dash = hostile
    canary = f"CANARY-TOKEN-{uuid.uuid4().hex}"
    monkeypatch.setenv("RAY_AUTH_TOKEN", canary)
    monkeypatch.setenv("HTTP_PROXY", proxy)  # every http:// request lands on the hostile server
    refused = runner.invoke(app, ["list", "--address", REMOTE])
    assert refused.exit_code == 1
    assert len(refused.stderr.strip().splitlines()) == 1
    assert "plain http://" in refused.stderr and "--insecure-http" in refused.stderr
    assert "cloudrl dashboard" in refused.stderr
    assert dash.authorizations == []
    # The server was reached (the refusal followed its 401), and the opt-in is what would send the token.
    opted_in = runner.invoke(app, ["list", "--address", REMOTE, "--insecure-http"])
    assert opted_in.exit_code == 1 and "rejected" in opted_in.stderr
    assert dash.authorizations == [f"Bearer {canary}"]


def test_the_token_file_is_never_sent_to_another_host(
    clean_env: Path, hostile: tuple[str, Dashboard], monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy, dash = hostile
    canary = f"CANARY-FILE-{uuid.uuid4().hex}"
    (clean_env / ".ray").mkdir()
    (clean_env / ".ray" / "auth_token").write_text(canary)
    monkeypatch.setenv("HTTP_PROXY", proxy)
    remote = runner.invoke(app, ["status", "--address", REMOTE, "--insecure-http"])
    assert remote.exit_code == 1 and "no token is set here" in remote.stderr
    assert dash.authorizations == []
    # On this machine the file is what Ray itself would use: it is read, so the refusal above is the rule.
    monkeypatch.delenv("HTTP_PROXY")
    here = runner.invoke(app, ["status", "--address", proxy])
    assert here.exit_code == 1
    assert dash.authorizations == [f"Bearer {canary}"]


def test_the_local_clusters_token_goes_to_that_cluster_only(clean_env: Path, tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    token_file = tmp_path / "cache" / "local-cluster.token"
    token_file.parent.mkdir(parents=True)
    token_file.write_text(token)
    squatter = Dashboard(always_401=True)
    local = Dashboard(session="session_L", token=token)
    with serve(squatter.handler()) as squatter_url, serve(local.handler()) as local_url:
        # This process plays the cluster's head node: the dashboard it serves is the cluster's own.
        save_state({"nodes": [this_process()], "dashboard_url": local_url, "token_file": str(token_file)})
        # Another loopback port (the default 8265 taken by someone else, say): it never gets the token.
        other = runner.invoke(app, ["list", "--address", squatter_url])
        assert other.exit_code == 1 and "no token is set here" in other.stderr
        assert squatter.authorizations == []
        # The local cluster's own dashboard gets it, whichever way it is named.
        client = ray_api.ClusterClient(ray_api.Address(local_url, "--address"))
        assert client.ray_version() == "2.60.0"
        assert local.authorizations[-1] == f"Bearer {token}"


def this_process() -> dict:
    """This test process as a node record of the state file (`node_processes.spawn`'s shape)."""
    import psutil

    return {"pid": os.getpid(), "create_time": psutil.Process().create_time(), "log": os.devnull}


def test_a_squatter_on_the_local_clusters_port_never_gets_its_token(clean_env: Path, tmp_path: Path) -> None:
    """The local cluster's dashboard died and another process took its port: it answers 401 to learn the
    token; the CLI sees the listener is no process of the cluster's head node and sends nothing."""
    token = uuid.uuid4().hex
    token_file = tmp_path / "token"
    token_file.write_text(token)
    head = subprocess.Popen(["sleep", "60"])  # the cluster's head node, alive, but not what listens
    try:
        import psutil

        record = {"pid": head.pid, "create_time": psutil.Process(head.pid).create_time(), "log": os.devnull}
        squatter = Dashboard(always_401=True)
        with serve(squatter.handler()) as url:
            save_state({"nodes": [record], "dashboard_url": url, "token_file": str(token_file)})
            result = runner.invoke(app, ["list", "--local"])
    finally:
        head.kill()
        head.wait()
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1
    assert f"{url} is answered by pid {os.getpid()} (" in result.stderr
    assert "not by the local cluster's dashboard: the local cluster's token is not sent to it" in result.stderr
    assert squatter.authorizations == [] and token not in result.output


# ----------------------------------------------------------------------------------------------
# A different cluster at a known address is refused
# ----------------------------------------------------------------------------------------------


def test_a_different_cluster_at_the_same_address_gets_no_resubmission(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dash = Dashboard(session="session_first")
    with serve(dash.handler()) as url:
        client = ray_api.ClusterClient(ray_api.Address(url, "--address"))
        client.check_version()  # first contact: the session is recorded
        assert client.session == "session_first"
        dash.session = "session_squatter"  # the tunnel dropped and another cluster took the port

        def lost(client: object, job_id: str) -> None:
            raise ClusterUnreachable("no Ray dashboard answers")

        resubmitted: list[str] = []
        monkeypatch.setattr(watch, "follow", lost)
        with pytest.raises(CloudrlError, match="a different Ray cluster now answers at") as err:
            watch.follow_through_restarts(
                client, "job-1", lambda c, new_id: resubmitted.append(new_id) or new_id, 30, lambda line: None
            )
        assert "session_squatter, not session_first" in str(err.value)
        assert resubmitted == [] and dash.posts == 0


def test_the_local_cluster_is_known_by_the_session_it_started_with(clean_env: Path, tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    token_file = tmp_path / "token"
    token_file.write_text(token)
    impostor = Dashboard(session="session_other", token=token)
    with serve(impostor.handler()) as url:
        state = {"nodes": [this_process()], "dashboard_url": url, "token_file": str(token_file)}
        save_state({**state, "session_name": "session_up"})
        with pytest.raises(ray_api.ClusterChanged, match="session_other, not session_up"):
            ray_api.ClusterClient(ray_api.Address(url, "local")).check_version()


# ----------------------------------------------------------------------------------------------
# Secrets travel in the package, never in the runtime env
# ----------------------------------------------------------------------------------------------


def test_env_values_travel_in_the_package_not_the_runtime_env(tmp_path: Path) -> None:
    canary = f"CANARY-{uuid.uuid4().hex}"
    req = sub.build_request("local", [], "x", ["CANARY_SECRET"])
    package = sub.stage_package(tmp_path / "stage", None, {"CANARY_SECRET": canary})
    assert canary not in json.dumps(req.runtime_env(package))
    env_file = package / sub.JOB_ENV_FILE
    assert env_file.stat().st_mode & 0o777 == 0o600
    # Two submissions of the same values are two distinct packages (never one unpacked copy shared).
    again = sub.stage_package(tmp_path / "again", None, {"CANARY_SECRET": canary})
    assert env_file.read_bytes() != (again / sub.JOB_ENV_FILE).read_bytes()
    # A process of the job that imports the shipped cloudrl has the value in its environment.
    probe = "import os, cloudrl.trainer; print(os.environ['CANARY_SECRET'])"
    env = {k: v for k, v in os.environ.items() if k != "CANARY_SECRET"}
    env["PYTHONPATH"] = str(tmp_path / "stage")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == canary


def test_dry_run_names_env_values_only_as_shipped_in_the_package(clean_env: Path, monkeypatch) -> None:
    monkeypatch.setenv("MY_SECRET", "hunter2")
    result = runner.invoke(app, ["submit", "--dry-run", "--env", "MY_SECRET"])
    assert result.exit_code == 0, result.output
    request = result.stdout.split("# job request")[1]
    env_vars = request.split("env_vars:")[1].split("metadata:")[0]
    assert "MY_SECRET" not in env_vars
    assert "env_in_package:\n  MY_SECRET: <from this shell, not shown>" in request
    assert "hunter2" not in result.output


def test_submit_notes_a_key_the_config_reads_that_no_env_passes(clean_env: Path, monkeypatch) -> None:
    monkeypatch.setenv("CKPT_KEY", "c" * 64)
    args = ["submit", "--dry-run", "trainer.checkpoint_key_env=CKPT_KEY"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (
        "note: trainer.checkpoint_key_env=CKPT_KEY is not passed with --env CKPT_KEY: the job reads it from the "
        "cluster nodes' own environment, and the run fails if they lack it"
    ) in result.stderr
    passed = runner.invoke(app, [*args, "--env", "CKPT_KEY"])
    assert passed.exit_code == 0 and "note: trainer.checkpoint_key_env" not in passed.stderr
    assert "c" * 64 not in passed.output + result.output


# ----------------------------------------------------------------------------------------------
# --workdir ships what git would
# ----------------------------------------------------------------------------------------------

CANARY_FILES = {
    ".env": "API_KEY=CANARY",
    ".aws/credentials": "[default]\naws_secret_access_key = CANARY\n",
    "deploy.pem": "CANARY",
    "src/sub/secrets.json": '{"k": "CANARY"}',
}


def make_project(root: Path, outside: Path) -> None:
    """Code to ship, and the things a careless user keeps beside it."""
    (root / "src" / "sub").mkdir(parents=True)
    (root / "src" / "train.py").write_text("print('code')\n")
    (root / "src" / "sub" / "util.py").write_text("X = 1\n")
    (root / "src" / "sub" / ".gitignore").write_text("secrets.json\n")
    for rel, text in CANARY_FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (outside / "id_rsa").write_text("CANARY private key")
    (root / "src" / "key_link").symlink_to(outside / "id_rsa")
    (root / "src" / "inside_link.py").symlink_to(root / "src" / "train.py")


def shipped_bytes(upload: shipping.Upload, tmp: Path) -> bytes:
    target = tmp / "ship.zip"
    shipping.write_zip(upload, target)
    with zipfile.ZipFile(target) as zf:
        return b"".join(zf.read(name) for name in zf.namelist())


@pytest.mark.parametrize("in_git", [True, False], ids=["git-work-tree", "plain-directory"])
def test_workdir_ships_neither_secrets_nor_links_out(tmp_path: Path, in_git: bool) -> None:
    root, outside = tmp_path / "proj", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    make_project(root, outside)
    if in_git:
        subprocess.run(["git", "init", "-q", str(root)], check=True)
        subprocess.run(["git", "-C", str(root), "add", "src/train.py"], check=True)  # the rest untracked
    excluded: list[tuple[str, str]] = []
    files = shipping.walk(root, excluded)
    assert {"src/train.py", "src/sub/util.py", "src/inside_link.py"} <= set(files)
    for rel in [*CANARY_FILES, "src/key_link"]:
        assert rel not in files
    why = dict(excluded)
    assert "credentials" in why[".env"] and "credentials" in why["deploy.pem"]
    assert "outside the directory: not followed" in why["src/key_link"]
    assert "src/sub/secrets.json" in why  # the nested .gitignore
    upload = shipping.Upload(files=files)
    assert b"CANARY" not in shipped_bytes(upload, tmp_path)


def test_dry_run_shows_what_was_left_out_and_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, outside = tmp_path / "proj", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    make_project(root, outside)
    monkeypatch.chdir(root)
    result = runner.invoke(app, ["submit", "--dry-run", "--workdir", str(root)])
    assert result.exit_code == 0, result.output
    left_out = result.stdout.split("# left out of the job's files (why)\n")[1].split("# job request")[0]
    assert "  .env  (.env (may hold credentials; `!PATTERN` in .cloudrlignore ships it))" in left_out
    assert "src/sub/secrets.json  (secrets.json (src/sub/.gitignore))" in left_out
    assert "src/key_link  (a symlink to" in left_out
    # A pattern in .cloudrlignore re-includes a file the defaults leave out, on purpose.
    (root / ".cloudrlignore").write_text("!deploy.pem\n")
    assert "deploy.pem" in shipping.walk(root)


# ----------------------------------------------------------------------------------------------
# Smaller items
# ----------------------------------------------------------------------------------------------


def test_an_ssh_host_that_is_an_option_is_refused(clean_env: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    result = runner.invoke(app, ["dashboard", "--ssh", f"-oProxyCommand=touch {marker}", "--port", "0"])
    assert result.exit_code == 1
    assert "is not a host name" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not marker.exists()


def test_an_ssh_host_that_does_not_resolve_names_the_fix(clean_env: Path) -> None:
    result = runner.invoke(app, ["dashboard", "--ssh", "no-such-head.invalid", "--port", "0", "-o", "ConnectTimeout=5"])
    assert result.exit_code == 1
    assert "Could not resolve hostname" in result.stderr
    assert "~/.ssh/config" in result.stderr and "IP address" in result.stderr


def test_job_output_cannot_drive_the_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    hostile = "step 1/2 | ok\x1b]52;c;Y3VybCBldmlsLnNo\x07\x1b[2J\x9b31m done\n"
    jobs._write_stdout(hostile)
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\x9b")
    assert "\\x1b]52;c;Y3VybCBldmlsLnNo\\x07" in out and out.endswith(" done\n")


def test_a_data_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    from cloudrl.trainer.inputs.data import load_prompts

    good = json.dumps({"prompt": "caf\u00e9", "ground_truth": "1"}, ensure_ascii=False) + "\n"
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(good.encode() + good.encode("latin-1"))
    offset = len(good.encode()) + good.encode("latin-1").index(b"\xe9")
    with pytest.raises(DataError) as err:
        load_prompts(str(bad), None)
    message = str(err.value)
    assert len(message.splitlines()) == 1
    assert str(bad) in message and f"byte offset {offset}" in message and "UTF-8" in message and "iconv" in message
