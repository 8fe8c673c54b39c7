"""The CLI without a cluster: help, errors, address resolution, the job request, fast failures."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import typer.main
import typer.testing
from cli_helpers import cli_env, free_port, local_state, processes_with_env, run_cli, silent_server
from cloudrl.cli import jobs, local_cluster, node_processes, ray_api
from cloudrl.cli import submit as sub
from cloudrl.cli.app import app
from cloudrl.cli.errors import CloudrlError

runner = typer.testing.CliRunner()


def _commands(group, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = []
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):  # a sub-group, e.g. `local`
            found += _commands(cmd, path + (name,))
        else:
            found.append(path + (name,))
    return found


COMMANDS = _commands(typer.main.get_command(app))


def test_every_command_is_registered() -> None:
    names = {" ".join(c) for c in COMMANDS}
    assert {"submit", "status", "logs", "stop", "list", "dashboard", "local up", "local down"} <= names
    assert "validate" in names  # the bundle's command lives in the same app


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_has_an_example(command: tuple[str, ...]) -> None:
    result = runner.invoke(app, [*command, "--help"])
    assert result.exit_code == 0
    assert "Example" in result.output


def test_help_is_fast_and_imports_no_ray() -> None:
    code = "import sys, cloudrl.cli.app; print(sorted(m for m in ('ray', 'dstack', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_config_error_is_one_red_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CLOUDRL_DEBUG", raising=False)
    result = runner.invoke(app, ["submit", "--dry-run", "actor.lrr=1"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        "error: unknown config key 'actor.lrr' (command line): did you mean actor.lr?"
    ]
    assert "Traceback" not in result.output


def test_debug_variable_gives_the_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUDRL_DEBUG", "1")
    result = runner.invoke(app, ["submit", "--dry-run", "actor.lrr=1"])
    assert result.exit_code == 1
    assert isinstance(result.exception, CloudrlError)


def test_address_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_api.resolve_address(None) == ray_api.Address("http://127.0.0.1:8265", "default")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:8265")
    assert ray_api.resolve_address(None) == ray_api.Address("http://10.0.0.5:8265", "RAY_ADDRESS")
    assert ray_api.resolve_address("https://x.example/") == ray_api.Address("https://x.example", "--address")
    assert ray_api.resolve_address("http://h:1").flag == " --address http://h:1"
    with pytest.raises(CloudrlError, match="not a dashboard URL"):
        ray_api.resolve_address("ray://h:10001")
    with pytest.raises(CloudrlError, match="either --local or --address"):
        ray_api.resolve_address("http://h:1", local=True)


def test_local_without_a_cluster_says_how_to_start_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUDRL_CACHE", str(tmp_path))
    result = runner.invoke(app, ["status", "--local"])
    assert result.exit_code == 1 and "cloudrl local up" in result.stderr
    down = runner.invoke(app, ["local", "down"])
    assert down.exit_code == 0 and "no local cluster is running" in down.output


@pytest.mark.ray
def test_failed_local_up_leaves_nothing_running(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    env = cli_env(tmp_path, CLOUDRL_TEST_MARK=mark)
    result = run_cli(["local", "up", "--timeout", "1"], env, timeout=90)
    assert result.returncode == 1
    assert "timed out after 1 s waiting for the head's dashboard to answer" in result.stderr
    assert local_state(tmp_path) is None
    assert (tmp_path / "local-up-failed" / "n0.log").exists()
    assert processes_with_env("CLOUDRL_TEST_MARK", mark) == []


def test_stopping_a_node_also_stops_what_it_starts_while_it_stops(tmp_path: Path) -> None:
    """A node still starting spawns daemons during the grace: one stays in its process group after its
    parent exits, one leaves it (setsid). A single look before the signal sees neither; both must go."""
    import os

    mark = uuid.uuid4().hex
    script = "trap 'setsid sleep 300 & sleep 300 & exit 0' TERM; while true; do sleep 0.1; done"
    node = node_processes.spawn(["bash", "-c", script], tmp_path / "n0.log", {**os.environ, "CLOUDRL_TEST_MARK": mark})
    try:
        time.sleep(0.5)  # the trap is set
        assert len(processes_with_env("CLOUDRL_TEST_MARK", mark)) >= 1
        assert node_processes.stop_node(node, grace_s=3.0) >= 3  # bash, and the two sleeps it started on SIGTERM
        assert processes_with_env("CLOUDRL_TEST_MARK", mark) == []
    finally:
        for pid in processes_with_env("CLOUDRL_TEST_MARK", mark):
            os.kill(pid, 9)


def test_default_local_cluster_fits_the_local_preset() -> None:
    need = local_cluster.local_preset_cpus()
    for nodes in (1, 2, 3):
        cpus = local_cluster.default_cpus_per_node(nodes)
        assert cpus >= 2 and cpus * nodes >= need


def test_unreachable_dashboard_fails_fast_with_the_fix() -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    with silent_server() as silent:
        for address, reason in ((closed, "connection refused"), (silent, "no reply within 5 s")):
            start = time.monotonic()
            result = runner.invoke(app, ["submit", "--address", address])
            assert time.monotonic() - start < 10
            assert result.exit_code == 1
            assert f"no Ray dashboard answers at {address}" in result.stderr and reason in result.stderr
            assert "cloudrl dashboard" in result.stderr and "dstack attach" in result.stderr


def test_a_silent_cluster_is_one_sentence_and_the_waiting_loops_catch_it() -> None:
    """The dashboard client raises the trainer's ClusterUnreachable (a ConnectionError, not a
    CloudrlError): the Jobs API wrapper must not wrap it a second time, and every loop that waits for a
    cluster must treat it as "not yet"."""
    from cloudrl.cli.dashboard import Forward, describe
    from cloudrl.cli.watch import wait_for_cluster

    closed = f"http://127.0.0.1:{free_port()}"
    result = runner.invoke(app, ["list", "--address", closed])
    assert result.exit_code == 1 and result.stderr.count("no Ray dashboard answers") == 1, result.stderr
    with pytest.raises(CloudrlError, match=f"no cluster answered at {closed} within 0 s"):
        wait_for_cluster(ray_api.ClusterClient(ray_api.Address(closed, "--address")), 0)
    assert local_cluster._alive_nodes(closed) == 0
    assert "the dashboard does not answer yet" in describe(Forward(closed, owned=True, close=lambda: None), "it")


def test_dry_run_prints_config_and_request_without_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_SECRET", "hunter2")
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens: --dry-run must not try
    result = runner.invoke(
        app, ["submit", "--dry-run", "--address", closed, "--name", "dry", "--env", "MY_SECRET", "algorithm.name=grpo"]
    )
    assert result.exit_code == 0, result.output
    assert "  name: grpo" in result.output  # the resolved config
    assert "entrypoint: python3 -m cloudrl.trainer --preset local algorithm.name=grpo" in result.output
    assert f"address: {closed}" in result.output and "submission_id: dry" in result.output
    assert "MY_SECRET: <from this shell, not shown>" in result.output
    assert "hunter2" not in result.output


def test_env_names_only(monkeypatch: pytest.MonkeyPatch) -> None:
    result = runner.invoke(app, ["submit", "--dry-run", "--env", "TOKEN=abc"])
    assert result.exit_code == 1
    assert "--env 'TOKEN=abc'" in result.stderr and "export TOKEN=" in result.stderr
    assert "abc" not in result.stderr.replace("'TOKEN=abc'", "")
    monkeypatch.delenv("SURELY_UNSET_VAR", raising=False)
    result = runner.invoke(app, ["submit", "--dry-run", "--env", "SURELY_UNSET_VAR"])
    assert result.exit_code == 1 and "--env SURELY_UNSET_VAR: not set in this shell" in result.stderr


def test_bad_name_is_refused() -> None:
    result = runner.invoke(app, ["submit", "--dry-run", "--name", "a b/c"])
    assert result.exit_code == 1 and "--name 'a b/c'" in result.stderr


def test_file_preset_is_shipped_under_its_stem(tmp_path: Path) -> None:
    preset = tmp_path / "mine.yaml"
    preset.write_text("trainer:\n  total_steps: 3\n")
    req = sub.build_request(str(preset), ["actor.lr=1e-5"], None, [])
    assert req.preset_file == preset
    assert req.entrypoint == "python3 -m cloudrl.trainer --preset mine actor.lr=1e-5"
    assert req.submission_id.startswith("mine-")
    assert req.metadata["cloudrl_preset"] == str(preset)
    package = sub.stage_package(tmp_path / "stage", req.preset_file)
    assert (package / "__init__.py").read_text() == sub.PACKAGE_INIT
    assert not (package / sub.JOB_ENV_FILE).exists()  # no --env values: no file
    assert (package / "trainer" / "__main__.py").exists()
    assert (package / "trainer" / "presets" / "mine.yaml").read_text() == preset.read_text()
    assert not list(package.rglob("__pycache__"))
    builtin = sub.build_request("local", [], "x", [])
    assert builtin.preset_file is None and builtin.preset_arg == "local"
    from cloudrl.trainer.config import PRESET_DIR

    by_path = sub.build_request(str(PRESET_DIR / "local.yaml"), [], "x", [])
    assert by_path.preset_file is None and by_path.entrypoint == "python3 -m cloudrl.trainer --preset local"


def test_runtime_env_ships_the_package_and_never_the_env_values() -> None:
    req = sub.build_request("local", [], "x", ["A"])
    env = req.runtime_env("/tmp/stage/cloudrl")
    assert env == {"py_modules": ["/tmp/stage/cloudrl"], "env_vars": {"PYTHONUNBUFFERED": "1"}}


def test_latest_metrics_reads_the_trainer_lines() -> None:
    logs = (
        "cloudrl trainer, resolved config:\nstep 0/2 [..........] | val/reward_mean=0\n"
        "step 1/2 [#####.....] | rollout/reward_mean=0.1 | 0.7 s/step\n"
        "step 2/2 [##########] | rollout/reward_mean=0.2 | 0.4 s/step\n"
        "summary:\n  steps:            2\n  metrics:          /x/metrics.jsonl\n\nbye\n"
    )
    step, summary = jobs.latest_metrics(logs)
    assert step == "step 2/2 [##########] | rollout/reward_mean=0.2 | 0.4 s/step"
    assert summary == ["summary:", "  steps:            2", "  metrics:          /x/metrics.jsonl"]
    assert jobs.latest_metrics("Running entrypoint\n") == (None, [])
    assert (
        jobs.last_error_line("x\nerror: the model is missing: fix it\ntrace") == "error: the model is missing: fix it"
    )


def test_console_script_prints_red_line_and_exits_1(tmp_path: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    result = run_cli(["list", "--address", closed], cli_env(tmp_path), timeout=60)
    assert result.returncode == 1
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("error: no Ray dashboard")


def test_no_import_cycle_among_cli_modules() -> None:
    """Every cloudrl.cli module imports, and none reaches itself through imports of its siblings: the
    ones inside functions count too, since a circle there still ties two modules' jobs together."""
    import ast
    import graphlib
    import importlib

    import cloudrl.cli

    cli_dir = Path(cloudrl.cli.__file__).parent
    modules = {p.stem for p in cli_dir.glob("*.py")} - {"__init__"}
    graph: dict[str, set[str]] = {}
    for name in sorted(modules):
        importlib.import_module(f"cloudrl.cli.{name}")
        imported: set[str] = set()
        for node in ast.walk(ast.parse((cli_dir / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:  # from .x import y / from . import x
                imported |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cloudrl.cli"):
                rest = node.module.removeprefix("cloudrl.cli").lstrip(".")
                imported |= {rest.split(".")[0]} if rest else {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                imported |= {a.name.split(".")[2] for a in node.names if a.name.startswith("cloudrl.cli.")}
        graph[name] = (imported & modules) - {name}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle among cloudrl.cli modules: {' -> '.join(exc.args[1])}")


def test_the_private_ray_hook_is_where_ray_compat_expects_it():
    """cli/ray_compat.py overrides Ray's private request method: an upgrade that moves it fails here."""
    import importlib
    import inspect

    from cloudrl.cli.ray_compat import PRIVATE_HOOK

    module, cls, method = PRIVATE_HOOK
    hook = getattr(getattr(importlib.import_module(module), cls), method)
    params = list(inspect.signature(hook).parameters)
    assert params[:3] == ["self", "method", "endpoint"], params
    assert inspect.Parameter.VAR_KEYWORD in [p.kind for p in inspect.signature(hook).parameters.values()]
    from ray.job_submission import JobSubmissionClient

    assert issubclass(JobSubmissionClient, getattr(importlib.import_module(module), cls))


def test_the_cli_catches_one_error_class():
    from cloudrl.cli.errors import CloudrlError
    from cloudrl.trainer.errors import ConfigError, TrainerError

    assert issubclass(CloudrlError, TrainerError) and issubclass(ConfigError, TrainerError)


def test_the_bootstrap_installs_what_the_trainer_needs_beyond_the_image():
    """pyproject.toml lists the trainer's dependencies; the bootstrap installs those a CUDA torch +
    vLLM image lacks. A dependency added to one and not the other fails here."""
    import re

    import tomllib

    repo = Path(__file__).resolve().parents[2]
    deps = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=\[ ;]", d, maxsplit=1)[0].lower() for d in deps}
    in_image = {"torch", "transformers", "tokenizers"}  # the vLLM images ship them
    cli_only = {"typer", "psutil"}  # the user's machine, not the cluster
    line = re.search(r'^TRAINER_PACKAGES="([^"]*)"', (repo / "tasks" / "ray-bootstrap.sh").read_text(), re.M)
    installed = {pair.split("=", 1)[1].lower() for pair in line.group(1).split()} | {"ray"}
    assert names - in_image - cli_only == installed, (sorted(names), sorted(installed))


def test_local_nodes_export_no_metrics_unless_the_shell_asks(monkeypatch):
    """A local node's metrics agent would serve Prometheus metrics on the machine's interfaces without a token
    (tests/bundle/test_bundle_cluster.py shows the variable closes that port); the shell's own choice wins."""
    from cloudrl.cli import local_cluster

    monkeypatch.delenv("RAY_enable_metrics_collection", raising=False)
    assert local_cluster._node_env("tok")["RAY_enable_metrics_collection"] == "0"
    monkeypatch.setenv("RAY_enable_metrics_collection", "1")
    assert local_cluster._node_env("tok")["RAY_enable_metrics_collection"] == "1"
