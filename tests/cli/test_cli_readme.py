"""The documented commands: every `cloudrl ...` and `python -m cloudrl.trainer ...` line parses, every
`section.key=value` names a real config key, and the marked blocks run exactly as written.

The documents are README.md and docs/*.md (bench/README.md too for the `section.key=value` check). A
`python -m cloudrl.trainer` line in a `bash` block goes through the trainer's own argument parser and
`load_config`, the whole config check, without training; a `$ python -m cloudrl.trainer ...` line shown
with its `error: ...` must print exactly that error when the config check is what rejects it. The
overrides of a `cloudrl submit` line, and any `section.key=value` word of another command, must each set a
real key to a value of its type.

Blocks after a `<!-- cloudrl:test ...-->` line run here with bash; blocks after `<!-- cloudrl:ci ...-->`
(minutes long) run only when CLOUDRL_RUN_DOC_CI=1, which .ci/run sets. Each run gets its own CLOUDRL_CACHE
and a free dashboard port, and whatever cluster it leaves is stopped by PID.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
from pathlib import Path

import click
import pytest
import typer.main
from cli_helpers import cli_env, local_state, pids_alive, process_tree, run_cli
from cloudrl.cli.app import app
from cloudrl.trainer.__main__ import parse_args
from cloudrl.trainer.config import Config, load_config
from cloudrl.trainer.config_checks import unknown_key_error
from cloudrl.trainer.errors import ConfigError
from cloudrl.trainer.presets import all_keys, key_type, parse_override, set_key

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- cloudrl:(?P<mark>test|ci)\b[^>]*-->\s*\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)
TRAINER = ["python", "-m", "cloudrl.trainer"]
SECTIONS = {f.name for f in dataclasses.fields(Config)}
# A word that sets a config key: `actor.lr=1e-6`, `data.answer_key=` (environment variables are upper case).
OVERRIDE = re.compile(r"(?P<section>[a-z_]+)\.[a-z_.]+=")
# `$ python -m cloudrl.trainer ...` in a `text` block, and the error line printed under it.
SHOWN_ERROR = re.compile(r"^\$ (?P<line>python -m cloudrl\.trainer\b.*)\n(?P<error>error: .*)$", re.M)


def blocks(kind: str | None = None, lang: str = "bash", docs: list[Path] = DOCS) -> list[tuple[str, str]]:
    found = []
    for doc in docs:
        for i, m in enumerate(BLOCK.finditer(doc.read_text())):
            if m["lang"] == lang and (kind is None or m["mark"] == kind):
                found.append((f"{doc.relative_to(REPO).as_posix()}#{i}", m["body"]))
    return found


def commands(docs: list[Path] = DOCS) -> list[tuple[str, list[str]]]:
    """Every command line of the `bash` blocks as (where, words): `\\` continuations joined, comments (a
    `#` that starts a word, as bash reads it) and leading `NAME=value` environment words dropped."""
    found = []
    for where, body in blocks(docs=docs):
        for line in body.replace("\\\n", " ").splitlines():
            line = re.split(r"(?:^|\s)#", line)[0]
            try:
                words = shlex.split(line)
            except ValueError:  # a quote left open for the next line (a heredoc, a multi-line string)
                words = line.split()
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                words = words[1:]
            if words:
                found.append((where, words))
    return found


def cloudrl_lines() -> list[str]:
    return [shlex.join(words) for _, words in commands() if words[0] == "cloudrl"]


def trainer_lines() -> list[str]:
    return [shlex.join(words) for _, words in commands() if words[:3] == TRAINER]


def shown_errors() -> list[tuple[str, str]]:
    return [(m["line"], m["error"]) for _, body in blocks(lang="text") for m in SHOWN_ERROR.finditer(body)]


def override_words() -> list[str]:
    """The `section.key=value` words of the documented commands the tests below do not parse whole."""
    return sorted(
        {
            word
            for _, words in commands([*DOCS, REPO / "bench" / "README.md"])
            if words[:2] != ["cloudrl", "submit"] and words[: len(TRAINER)] != TRAINER
            for word in words[1:]
            if (m := OVERRIDE.match(word)) and m["section"] in SECTIONS
        }
    )


def parse(args: list[str]) -> click.Context:
    """Parse like the real command would, without running it: unknown flags and commands fail."""
    command, name, rest = typer.main.get_command(app), "cloudrl", list(args)
    while hasattr(command, "commands"):  # a group: `cloudrl` itself, `cloudrl local`
        assert rest and rest[0] in command.commands, f"`{name}` has no command {rest[:1]}"
        name, rest = rest[0], rest[1:]
        command = command.commands[name]
    return command.make_context(name, rest)


def parse_trainer(line: str):
    """The trainer's own argument parser on a documented line; a usage error fails the test with its reason."""
    try:
        return parse_args(shlex.split(line)[len(TRAINER) :])
    except SystemExit:  # argparse printed the reason to stderr, which pytest shows
        pytest.fail(f"`{line}` does not parse: see the captured stderr")


def check_override(item: str) -> None:
    """One `KEY=VALUE` set on a fresh config, the way the trainer sets it: the key exists, the value fits."""
    key, _, raw = item.partition("=")
    if "$" in raw:  # the shell fills the value in (`actor.resources="$pin"`): only the key can be checked
        try:
            key_type(Config(), key)
        except KeyError:
            raise unknown_key_error(key, all_keys(Config()), "documented command") from None
        return
    key, value = parse_override(item)
    set_key(Config(), key, value, source="documented command")


def test_docs_have_runnable_blocks() -> None:
    assert blocks("test"), "README.md and docs/*.md lost their tested quick-start block"


@pytest.mark.parametrize("line", cloudrl_lines())
def test_documented_command_parses(line: str) -> None:
    ctx = parse(shlex.split(line)[1:])
    for item in ctx.params.get("overrides") or ():  # `cloudrl submit KEY=VALUE ...`
        check_override(item)


@pytest.mark.parametrize("line", trainer_lines())
def test_documented_trainer_command_loads(line: str, tmp_path: Path) -> None:
    args = parse_trainer(line)
    # The whole config check of a real start (keys, types, ranges, rules across keys), without training;
    # a run directory of its own first, so that a documented `trainer.run_dir=` still wins.
    load_config(args.preset, [f"trainer.run_dir={tmp_path / 'run'}", *args.overrides])


@pytest.mark.parametrize("line,error", shown_errors())
def test_documented_trainer_error_is_the_real_one(line: str, error: str, tmp_path: Path) -> None:
    args = parse_trainer(line)
    try:
        load_config(args.preset, args.overrides)
    except ConfigError as exc:
        assert f"error: {exc}" == error, f"`{line}` prints a different error than the docs show"
    else:
        pytest.skip("the config is valid: this error comes once the run starts, which this test does not do")


@pytest.mark.parametrize("item", override_words())
def test_documented_override_names_a_config_key(item: str) -> None:
    check_override(item)


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
