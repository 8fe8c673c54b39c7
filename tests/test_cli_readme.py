"""The documented commands: every `cloudrl ...` line parses, and the marked blocks run exactly as written.

The documents are README.md and docs/*.md. Blocks after a `<!-- cloudrl:test ...-->` line run here with
bash; blocks after `<!-- cloudrl:ci ...-->` (minutes long) run only when CLOUDRL_RUN_DOC_CI=1, which
.ci/run sets. Each run gets its own CLOUDRL_CACHE and a free dashboard port, and whatever cluster it
leaves is stopped by PID.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import typer.main
from cli_helpers import cli_env, local_state, pids_alive, process_tree, run_cli
from cloudrl.cli.app import app

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- cloudrl:(?P<mark>test|ci)\b[^>]*-->\s*\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)


def blocks(kind: str | None = None) -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for i, m in enumerate(BLOCK.finditer(doc.read_text())):
            if m["lang"] == "bash" and (kind is None or m["mark"] == kind):
                found.append((f"{doc.relative_to(REPO).as_posix()}#{i}", m["body"]))
    return found


def cloudrl_lines() -> list[str]:
    return [
        line.split("  #")[0].strip()
        for _, body in blocks()
        for line in body.splitlines()
        if line.strip().startswith("cloudrl ")
    ]


def parse(args: list[str]) -> None:
    """Parse like the real command would, without running it: unknown flags and commands fail."""
    command, name, rest = typer.main.get_command(app), "cloudrl", list(args)
    while hasattr(command, "commands"):  # a group: `cloudrl` itself, `cloudrl local`
        assert rest and rest[0] in command.commands, f"`{name}` has no command {rest[:1]}"
        name, rest = rest[0], rest[1:]
        command = command.commands[name]
    command.make_context(name, rest)


def test_docs_have_runnable_blocks() -> None:
    assert blocks("test"), "README.md and docs/*.md lost their tested quick-start block"


@pytest.mark.parametrize("line", cloudrl_lines())
def test_documented_command_parses(line: str) -> None:
    parse(shlex.split(line)[1:])


@pytest.mark.ray
@pytest.mark.parametrize(
    "name,body",
    blocks("test")
    + [
        pytest.param(
            n,
            b,
            marks=pytest.mark.skipif(
                os.environ.get("CLOUDRL_RUN_DOC_CI") != "1", reason="minutes long: .ci/run sets CLOUDRL_RUN_DOC_CI=1"
            ),
        )
        for n, b in blocks("ci")
    ],
)
def test_documented_block_runs(name: str, body: str, tmp_path: Path) -> None:
    env = cli_env(tmp_path / "cache")
    pids: list[int] = []
    try:
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", body], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900
        )
        assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        if "submit --local --follow" in body:
            assert "starting one" in result.stdout and "SUCCEEDED" in result.stdout
        if name in dict(blocks("ci")):  # the full local default learns (README: chance ~0.1 before, ~0.6 after)
            val = re.search(r"val reward: +([\d.]+) before RL -> ([\d.]+) after", result.stdout)
            assert val, result.stdout[-3000:]
            before, after = map(float, val.groups())
            assert before < 0.15 and after >= 0.35, (before, after)
    finally:
        state = local_state(tmp_path / "cache")
        if state:  # the block left its cluster up (it failed before `local down`)
            pids = [p for node in state["nodes"] for p in process_tree(node["pid"])]
            run_cli(["local", "down"], env, timeout=120)
            for pid in pids_alive(pids):
                subprocess.run(["kill", "-9", str(pid)], check=False)
    assert local_state(tmp_path / "cache") is None
