"""`cloudrl validate` warns (and still passes) when a task turns Ray's token auth off, turns a debugger on
(its ports take no token), or sends a cluster token weaker than 128 bits."""

from __future__ import annotations

from pathlib import Path

import pytest
from cloudrl.cli.app import app
from cloudrl.cli.validate import validate_bundle
from test_bundle_mutations import copy_bundle
from typer.testing import CliRunner

TASK = "tasks/ray-cluster.dstack.yml"


def _with_env(root: Path, *lines: str) -> None:
    """The bundle at `root`, its main task's env list given `lines` in place of `- RAY_AUTH_TOKEN`."""
    copy_bundle(root)
    task = root / TASK
    text = task.read_text()
    assert "\n  - RAY_AUTH_TOKEN\n" in text
    task.write_text(text.replace("\n  - RAY_AUTH_TOKEN\n", "".join(f"\n  - {line}" for line in lines) + "\n"))


def _warnings(root: Path) -> list[str]:
    found = validate_bundle(root)
    assert not [p for p in found if not p.warning and p.path == TASK], found
    return [str(p) for p in found if p.warning and p.path == TASK]


@pytest.mark.parametrize(
    "lines, env, words",
    [
        (["CLOUDRL_RAY_AUTH=off"], {}, "env.CLOUDRL_RAY_AUTH: is off: anyone who reaches the cluster's Ray ports"),
        (["RAY_AUTH_TOKEN", "CLOUDRL_DEBUGGER=legacy"], {"RAY_AUTH_TOKEN": "ab" * 16}, "turns on Ray's debugger"),
        (
            ["RAY_AUTH_TOKEN", "CLOUDRL_DEBUGGER"],
            {"RAY_AUTH_TOKEN": "ab" * 16, "CLOUDRL_DEBUGGER": "post-mortem"},
            "turns on Ray's debugger (post-mortem)",
        ),
        (["RAY_AUTH_TOKEN"], {"RAY_AUTH_TOKEN": "changeme"}, "holds at most 48 random bits, fewer than 128"),
        (["RAY_AUTH_TOKEN"], {"RAY_AUTH_TOKEN": "ab" * 15}, "holds at most 120 random bits"),
    ],
)
def test_an_open_door_is_one_warning_line(tmp_path, monkeypatch, lines, env, words):
    for name in ("RAY_AUTH_TOKEN", "CLOUDRL_DEBUGGER", "CLOUDRL_RAY_AUTH"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _with_env(tmp_path, *lines)
    warnings = _warnings(tmp_path)
    assert len(warnings) == 1 and words in warnings[0], warnings
    assert warnings[0].startswith(f"warning: {TASK}: env.")
    result = CliRunner().invoke(app, ["validate", str(tmp_path)])
    assert result.exit_code == 0, result.output  # a warning, not a failure
    assert words in result.stderr


def test_a_strong_token_from_the_shell_gets_no_warning(tmp_path, monkeypatch):
    monkeypatch.delenv("CLOUDRL_DEBUGGER", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "0123456789abcdef" * 4)  # `openssl rand -hex 32`: 256 bits
    _with_env(tmp_path, "RAY_AUTH_TOKEN")
    assert _warnings(tmp_path) == []
