"""`cloudrl dashboard` for dstack runs, tested at the boundary of dstack's Python client.

No dstack server or compute can run on this machine, so `dstack.api.Client.from_config` is replaced by
a fake that records what cloudrl asks of it: which run, which local bind address, which port mapping.
Everything on our side of that boundary is real. The `--ssh` form runs against a real sshd in
test_cli_cluster.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import typer.testing
import yaml

dstack_api = pytest.importorskip("dstack.api", reason="dstack is an optional dependency: pip install 'cloudrl[dstack]'")
from cli_helpers import free_port  # noqa: E402
from cloudrl.cli import dashboard  # noqa: E402
from cloudrl.cli.app import app  # noqa: E402
from dstack._internal.core.models.configurations import PortMapping  # noqa: E402

runner = typer.testing.CliRunner()
REPO = Path(__file__).resolve().parents[2]


class FakeRun:
    def __init__(
        self,
        name: str,
        status=dstack_api.RunStatus.RUNNING,
        held: dict[int, int] | None = None,
        attach_error: Exception | None = None,
    ):
        self.name, self.status = name, status
        self.held = held  # ports of a tunnel another dstack process already holds
        self.attach_error = attach_error
        self.attach_calls: list[dict] = []
        self.detached = 0
        self.ports: dict[int, int] | None = None

    def attach(self, **kwargs):
        self.attach_calls.append(kwargs)
        if self.attach_error:
            raise self.attach_error
        if self.held is not None:
            self.ports = dict(self.held)
        else:
            self.ports = {m.container_port: m.local_port for m in kwargs["ports_overrides"]}
        return True

    def detach(self):
        self.detached += 1


class FakeClient:
    project = "main"

    def __init__(self, runs: dict[str, FakeRun]):
        self._runs = runs
        self.asked: list[str] = []
        self.runs = self

    def get(self, name: str):
        self.asked.append(name)
        return self._runs.get(name)


@pytest.fixture
def fake_dstack(monkeypatch: pytest.MonkeyPatch):
    def install(*runs: FakeRun) -> FakeClient:
        client = FakeClient({r.name: r for r in runs})
        monkeypatch.setattr(dstack_api.Client, "from_config", staticmethod(lambda *a, **k: client))
        return client

    def ctrl_c(forward):
        raise KeyboardInterrupt

    monkeypatch.setattr(dashboard, "_wait_for_interrupt", ctrl_c)
    monkeypatch.chdir(REPO)
    return install


def task_run_name() -> str:
    return yaml.safe_load((REPO / "tasks" / "ray-cluster.dstack.yml").read_text())["name"]


def test_default_run_name_comes_from_the_task_file(fake_dstack, tmp_path: Path, monkeypatch) -> None:
    assert dashboard.default_run_name() == task_run_name()
    monkeypatch.chdir(tmp_path)  # outside the checkout it still finds the checkout's task file
    assert dashboard.default_run_name() == task_run_name()


def test_attaches_to_the_default_run_on_localhost(fake_dstack) -> None:
    run = FakeRun(task_run_name())
    client = fake_dstack(run)
    port = free_port()
    result = runner.invoke(app, ["dashboard", "--port", str(port)])
    assert result.exit_code == 0, result.output
    assert client.asked == [task_run_name()]
    assert run.attach_calls == [
        {"bind_address": "127.0.0.1", "ports_overrides": [PortMapping(local_port=port, container_port=8265)]}
    ]
    assert f"Ray dashboard of dstack run {task_run_name()}: http://127.0.0.1:{port}" in result.output
    assert f"cloudrl submit --address http://127.0.0.1:{port}" in result.output
    assert "forwarding until Ctrl+C" in result.output
    assert run.detached == 1  # Ctrl+C closes the tunnel we opened


def test_port_choice(fake_dstack) -> None:
    run = FakeRun("r")
    fake_dstack(run)
    assert runner.invoke(app, ["dashboard", "r", "--port", "0"]).exit_code == 0
    chosen = run.attach_calls[-1]["ports_overrides"][0].local_port
    assert chosen and chosen != 0  # 0 means: any free port, picked by us so we can print it
    assert dashboard.pick_local_port(None) in ((8265,) if dashboard.port_free(8265) else range(1024, 65536))


def test_busy_port_is_refused(fake_dstack) -> None:
    import socket

    run = FakeRun("r")
    fake_dstack(run)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        result = runner.invoke(app, ["dashboard", "r", "--port", str(busy)])
    assert result.exit_code == 1 and f"--port {busy} is in use" in result.stderr
    assert run.attach_calls == []


def test_reuses_the_tunnel_dstack_apply_holds(fake_dstack) -> None:
    run = FakeRun("cloudrl-ray", held={8265: 18265, 10999: 10999})
    fake_dstack(run)
    result = runner.invoke(app, ["dashboard", "cloudrl-ray", "--port", str(free_port())])
    assert result.exit_code == 0, result.output
    assert "http://127.0.0.1:18265" in result.output
    assert "belongs to the `dstack apply` or `dstack attach`" in result.output
    assert run.detached == 0  # not ours to close


def test_missing_run_says_how_to_start_it(fake_dstack) -> None:
    fake_dstack()
    result = runner.invoke(app, ["dashboard", "nope"])
    assert result.exit_code == 1
    assert "no dstack run named 'nope' in project 'main'" in result.stderr
    assert "dstack apply -f tasks/ray-cluster.dstack.yml" in result.stderr


def test_provisioning_run_is_not_waited_on(fake_dstack) -> None:
    run = FakeRun("r", status=dstack_api.RunStatus.PROVISIONING)
    fake_dstack(run)
    result = runner.invoke(app, ["dashboard", "r"])
    assert result.exit_code == 1 and "is provisioning, not running" in result.stderr
    assert run.attach_calls == []  # dstack's attach would poll until it runs


def test_run_without_the_dashboard_port(fake_dstack) -> None:
    error = dstack_api.ClientError("Cannot override port 8265 not exposed by the run")
    fake_dstack(FakeRun("r", attach_error=error))
    result = runner.invoke(app, ["dashboard", "r"])
    assert result.exit_code == 1
    assert "does not expose port 8265: list it under `ports:`" in result.stderr


def test_dstack_not_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    from dstack._internal.core.errors import ConfigurationError

    def not_configured(*a, **k):
        raise ConfigurationError("No default project, specify project name")

    monkeypatch.setattr(dstack_api.Client, "from_config", staticmethod(not_configured))
    result = runner.invoke(app, ["dashboard", "r"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: dstack could not reach the dstack server")
    assert "No default project" in result.stderr
