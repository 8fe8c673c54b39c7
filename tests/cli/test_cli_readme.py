"""The documented commands: every `cloudrl ...` and `python -m cloudrl.trainer ...` line parses, every
`section.key=value` names a real config key, and every `bash` block of README.md and docs/*.md either runs,
asserting what the docs promise, or says in a mark why it cannot run on a CI machine.

The documents are README.md and docs/*.md (bench/README.md too for the `section.key=value` check). A
`python -m cloudrl.trainer` line in a `bash` block goes through the trainer's own argument parser and
`load_config`, the whole config check, without training; a `$ python -m cloudrl.trainer ...` line shown
with its `error: ...` must print exactly that error when the config check is what rejects it. The
overrides of a `cloudrl submit` line, and any `section.key=value` word of another command, must each set a
real key to a value of its type.

The marks: an HTML comment on the line(s) before a `bash` block; every `bash` block has exactly one.

- `<!-- cloudrl:test ATTRS — comment -->` runs the block in every test run; `<!-- cloudrl:ci ATTRS — comment -->`
  only when CLOUDRL_RUN_DOC_CI=1 (which .ci/run sets): the blocks that take minutes, or need a `ci` block's
  state. ATTRS say what the run must show besides each line's exit status: `expect="TEXT"` (repeatable) the
  output holds TEXT, `file="PATH"` the run left PATH (under the checkout), `learns` the summary's greedy val
  reward goes from chance (< 0.15) to >= 0.35, `installed` the block's leading `python3 -m venv ... &&
  . .venv/bin/activate && pip install ... &&` is skipped (the test runs in the installation CI made).
- `<!-- cloudrl:needs WHAT: reason -->` it cannot run on a CI machine, WHAT one of `cloud` (a dstack cluster
  on cloud or on-prem GPUs), `gpu`, `slurm` (a real Slurm cluster), `hub` (the Hugging Face hub: tests have
  no network) or `human` (someone attaches, types, presses Ctrl+C, or writes the files it names).
- `<!-- cloudrl:install: reason -->` an install command CI's own install (.ci/run) performs: each of its
  lines is in .ci/run.
- `<!-- cloudrl:same DOC#N: reason -->` the same commands as the runnable block DOC#N (besides `cloudrl
  local down`), which runs already.
- `<!-- cloudrl:covered tests/PATH.py::test_name: reason -->` a run too long for this test that the named
  test makes (the same path, fewer steps).

A block without a mark, an unknown mark, or a mark with an empty reason fails `test_every_block_is_accounted_for`.

The runnable blocks run in the order a newcomer meets them: README.md, then the docs in the order README
links them (then any other doc, alphabetically), a doc's blocks in document order. Each doc gets one fresh
copy of the checkout, one HOME, one CLOUDRL_CACHE and one dashboard port (exported as RAY_ADDRESS, the
default address, as 8265 is on a machine where it is free), so a cluster one block leaves is there for the
next, as it is for a reader. Each block starts in the checkout's root with bash; each line must exit with
the status its comment documents (`# ... exit 1 ...`), else 0. Whatever cluster the doc leaves is stopped by
PID at its end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import time
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
from servers import free_port

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# A fenced block and the mark comment just before it (a block in a list item is indented).
BLOCK = re.compile(
    r"(?:<!-- cloudrl:(?P<kind>[a-z-]+)(?P<rest>[^\n]*?)\s*-->[ \t]*\n(?:[ \t]*\n)*)?[ \t]*```(?P<lang>\w*)\n(?P<body>.*?)```",
    re.S,
)
MARK_COMMENT = re.compile(r"^[ \t]*<!-- cloudrl:", re.M)  # a mark on a line of its own (not `code` in prose)
RUN_KINDS = ("test", "ci")
NEEDS = ("cloud", "gpu", "slurm", "hub", "human")
# `ATTR` or `ATTR="VALUE"` of a run mark, up to the ` — comment`.
ATTR = re.compile(r'\s+(?P<name>[a-z-]+)(?:="(?P<value>[^"]*)")?(?=\s|$)')
FLAGS = ("learns", "installed")
# A non-run mark: `KIND[ ARG]: reason`.
REASONED = re.compile(r"^(?: (?P<arg>\S+?))?:(?:\s+(?P<reason>.*))?$", re.S)
# The install a `installed` block starts with: CI's own install did it.
INSTALL = re.compile(r"^(?:(?:python3 -m venv \S+|\. \S+/bin/activate|pip install [^&]*?)\s*&&\s*)+")
TRAINER = ["python", "-m", "cloudrl.trainer"]
SECTIONS = {f.name for f in dataclasses.fields(Config)}
# A word that sets a config key: `actor.lr=1e-6`, `data.answer_key=` (environment variables are upper case).
OVERRIDE = re.compile(r"(?P<section>[a-z_]+)\.[a-z_.]+=")
# `$ python -m cloudrl.trainer ...` in a `text` block, and the error line printed under it.
SHOWN_ERROR = re.compile(r"^\$ (?P<line>python -m cloudrl\.trainer\b.*)\n(?P<error>error: .*)$", re.M)
# The exit status a line's comment documents (`# ...; exit 1: ...`).
DOCUMENTED_EXIT = re.compile(r"\bexit (\d+)\b")


@dataclasses.dataclass
class Block:
    where: str  # "docs/cli.md#3": the doc and the block's index among its fenced blocks
    lang: str
    body: str
    kind: str | None  # the mark: test, ci, needs, install, same, covered; None without one
    rest: str  # the mark's text after its kind

    def run_attrs(self) -> list[tuple[str, str | None]]:
        """A run mark's attributes, in order; a ValueError names what does not parse."""
        attrs, pos = [], 0
        while m := ATTR.match(self.rest, pos):
            attrs.append((m["name"], m["value"]))
            pos = m.end()
        tail = self.rest[pos:].strip()
        if tail and not tail.startswith("—"):
            raise ValueError(f"{self.where}: `{tail}` is no attribute (`—` starts the comment)")
        for name, value in attrs:
            if (name in FLAGS) != (value is None) or name not in (*FLAGS, "expect", "file"):
                raise ValueError(f"{self.where}: unknown attribute `{name}` (or a value it does not take)")
        return attrs

    def reasoned(self) -> tuple[str, str]:
        """A non-run mark's (ARG, reason); a ValueError when it has no reason."""
        m = REASONED.match(self.rest)
        if not m or not (m["reason"] or "").strip():
            raise ValueError(f"{self.where}: `cloudrl:{self.kind}{self.rest}` gives no reason after `:`")
        return m["arg"] or "", m["reason"].strip()

    def lines(self) -> list[tuple[str, str, int]]:
        """(line, command, exit status its comment documents) of each line that runs a command; `\\`
        continuations joined, and with `installed` the install CI made dropped."""
        installed = ("installed", None) in self.run_attrs() if self.kind in RUN_KINDS else False
        found = []
        for line in self.body.replace("\\\n", " ").splitlines():
            comment = re.search(r"(?:^|\s)#(?P<text>.*)", line)  # a `#` that starts a word, as bash reads it
            command = (line[: comment.start()] if comment else line).strip()
            if not command:
                continue
            documented = DOCUMENTED_EXIT.search(comment["text"]) if comment else None
            if installed:
                line, command = INSTALL.sub("", line.strip()), INSTALL.sub("", command)
            found.append((line, command, int(documented[1]) if documented else 0))
        return found

    def script(self) -> str:
        """The block as bash runs it here: each line checked against the exit status it documents."""
        out = ["set -uo pipefail"]
        for n, (line, command, want) in enumerate(self.lines(), 1):
            out += [
                line,
                f'rc=$?; if [ "$rc" != {want} ]; then echo "line {n} exited $rc, the docs say {want}:" '
                f"{shlex.quote(command)} >&2; exit 1; fi",
            ]
        return "\n".join(out) + "\n"


def doc_blocks(doc: Path) -> list[Block]:
    where = doc.relative_to(REPO).as_posix()
    return [
        Block(f"{where}#{i}", m["lang"], m["body"], m["kind"], m["rest"] or "")
        for i, m in enumerate(BLOCK.finditer(doc.read_text()))
    ]


def blocks(kind: str | None = None, lang: str = "bash", docs: list[Path] = DOCS) -> list[tuple[str, str]]:
    return [
        (b.where, b.body)
        for doc in docs
        for b in doc_blocks(doc)
        if b.lang == lang and (kind is None or b.kind == kind)
    ]


def newcomer_order() -> list[Path]:
    """README.md, then the docs in the order README first links them, then the others alphabetically."""
    linked = dict.fromkeys(REPO / p for p in re.findall(r"\]\((docs/[\w.-]+\.md)", (REPO / "README.md").read_text()))
    return [REPO / "README.md", *[d for d in linked if d in DOCS], *[d for d in DOCS[1:] if d not in linked]]


def commands(docs: list[Path] = DOCS) -> list[tuple[str, list[str]]]:
    """Every command line of the `bash` blocks as (where, words): `\\` continuations joined, comments (a
    `#` that starts a word, as bash reads it) and leading `NAME=value` environment words dropped."""
    return [(where, words) for where, words, _ in commands_in_dirs(docs)]


def commands_in_dirs(docs: list[Path] = DOCS) -> list[tuple[str, list[str], str]]:
    """`commands`, each with the directory its relative paths start from: the checkout's root ("") until a
    `cd DIR` line of its block moves it (a DIR inside the checkout)."""
    found = []
    for where, body in blocks(docs=docs):
        where_now = ""
        for line in body.replace("\\\n", " ").splitlines():
            line = re.split(r"(?:^|\s)#", line)[0]
            try:
                words = shlex.split(line)
            except ValueError:  # a quote left open for the next line (a heredoc, a multi-line string)
                words = line.split()
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                words = words[1:]
            if len(words) == 2 and words[0] == "cd" and (REPO / where_now / words[1]).is_dir():
                where_now = (Path(where_now) / words[1]).as_posix()
            if words:
                found.append((where, words, where_now))
    return found


def cloudrl_lines() -> list[str]:
    return [shlex.join(words) for _, words in commands() if words[0] == "cloudrl"]


def trainer_lines() -> list[tuple[str, str]]:
    """(line, the directory it runs in) of every documented trainer command."""
    return [(shlex.join(words), where_now) for _, words, where_now in commands_in_dirs() if words[:3] == TRAINER]


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


def account(block: Block) -> None:
    """Fail with one line unless the block's mark is one of the module docstring's, with what it needs."""
    if block.kind is None:
        raise ValueError(
            f"{block.where} has no mark: put `<!-- cloudrl:test -->` or `<!-- cloudrl:ci -->` before it if it runs "
            f"on a CI machine, else `<!-- cloudrl:needs {'|'.join(NEEDS)}: why -->` (see this test's docstring)"
        )
    if block.kind in RUN_KINDS:
        block.run_attrs()
        return
    if block.kind not in ("needs", "install", "same", "covered"):
        raise ValueError(f"{block.where}: unknown mark `cloudrl:{block.kind}`")
    arg, _ = block.reasoned()
    if block.kind == "needs" and arg not in NEEDS:
        raise ValueError(f"{block.where}: `cloudrl:needs {arg}`: needs one of {', '.join(NEEDS)}")
    if block.kind == "install":
        ci_run = (REPO / ".ci" / "run").read_text().splitlines()
        missing = [c for c in block.body.strip().splitlines() if c not in ci_run]
        assert not missing, f"{block.where} is marked as CI's own install, but .ci/run lacks {missing}"
    if block.kind == "same":
        other = next((b for b in doc_blocks(REPO / arg.partition("#")[0]) if b.where == arg), None)
        assert other and other.kind in RUN_KINDS, f"{block.where}: `same {arg}` names no runnable block"
        ours = {command for _, command, _ in block.lines()} - {"cloudrl local down"}
        extra = ours - {command for _, command, _ in other.lines()}
        assert not extra, f"{block.where} runs what {arg} does not: {sorted(extra)}"
    if block.kind == "covered":
        path, _, name = arg.partition("::")
        assert (REPO / path).is_file() and re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), (
            f"{block.where}: `covered {arg}` names no test"
        )


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(REPO).as_posix())
def test_every_block_is_accounted_for(doc: Path) -> None:
    """Every `bash` block runs here or says why it cannot; every mark belongs to a block."""
    found = doc_blocks(doc)
    marks = len(MARK_COMMENT.findall(doc.read_text()))
    assert marks == sum(b.kind is not None for b in found), f"{doc.name}: a `cloudrl:` mark that precedes no block"
    problems = []
    for block in found:
        if block.lang != "bash":
            assert block.kind is None, f"{block.where}: a mark on a `{block.lang}` block (only `bash` blocks run)"
            continue
        try:
            account(block)
        except (ValueError, AssertionError) as exc:
            problems.append(str(exc))
    assert not problems, "\n".join(problems)


def test_a_block_without_a_mark_or_a_reason_fails() -> None:
    """The check above refuses what it must refuse (so a doc cannot slip past it)."""
    for rest, kind in [("", None), (" cloud:", "needs"), (" cloud:   ", "needs"), (" disk: big", "needs")]:
        with pytest.raises(ValueError):
            account(Block("x.md#0", "bash", "true\n", kind, rest))
    with pytest.raises(ValueError):
        account(Block("x.md#0", "bash", "true\n", "maybe", ": reason"))
    with pytest.raises(ValueError):
        account(Block("x.md#0", "bash", "true\n", "test", " expect=unquoted"))
    account(Block("x.md#0", "bash", "true\n", "needs", " gpu: two 80 GiB GPUs"))
    account(Block("x.md#0", "bash", "true\n", "test", ' expect="a b" learns — comment'))


def test_a_block_runs_each_line_against_its_documented_exit_status() -> None:
    script = Block(
        "x.md#0",
        "bash",
        "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[x]' && echo hi  # exit 0 once done\n"
        "false                   # exit 1: one line\n# a comment\n",
        "test",
        " installed",
    ).script()
    assert "venv" not in script and "pip install" not in script
    assert subprocess.run(["bash", "-c", script], capture_output=True).returncode == 0
    wrong = Block("x.md#0", "bash", "false\n", "test", "").script()
    done = subprocess.run(["bash", "-c", wrong], capture_output=True, text=True)
    assert done.returncode == 1 and "line 1 exited 1, the docs say 0: false" in done.stderr


@pytest.mark.parametrize("line", cloudrl_lines())
def test_documented_command_parses(line: str) -> None:
    ctx = parse(shlex.split(line)[1:])
    for item in ctx.params.get("overrides") or ():  # `cloudrl submit KEY=VALUE ...`
        check_override(item)


@pytest.mark.parametrize("line, where_now", trainer_lines())
def test_documented_trainer_command_loads(line: str, where_now: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(REPO / where_now)  # a preset file's relative paths start where the block `cd`s to
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


def runnable(doc: Path) -> list[Block]:
    """The blocks of `doc` this run runs: `test` always, `ci` with CLOUDRL_RUN_DOC_CI=1."""
    kinds = RUN_KINDS if os.environ.get("CLOUDRL_RUN_DOC_CI") == "1" else ("test",)
    return [b for b in doc_blocks(doc) if b.lang == "bash" and b.kind in kinds]


def fresh_checkout(dest: Path) -> Path:
    """A copy of the checkout as a fresh clone of it would be: the files git tracks or would track."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():  # a tracked file deleted in the working tree is not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def check_outcome(block: Block, output: str, checkout: Path) -> None:
    """What the mark says the run shows, besides each line's exit status."""
    for name, value in block.run_attrs():
        if name == "expect":
            assert value in output, f"{block.where}: the output lacks {value!r}:\n{output[-3000:]}"
        if name == "file":
            assert (checkout / value).exists(), f"{block.where}: the run left no {value}"
        if name == "learns":  # README: chance (~0.1) before RL, ~0.6 after
            val = re.search(r"val reward: +([\d.]+) before RL -> ([\d.]+) after", output)
            assert val, f"{block.where}: no `val reward: ... before RL -> ... after` line:\n{output[-3000:]}"
            before, after = map(float, val.groups())
            assert before < 0.15 and after >= 0.35, (block.where, before, after)


def test_a_run_lacking_the_promised_outcome_fails(tmp_path: Path) -> None:
    block = Block("x.md#0", "bash", "true\n", "ci", ' expect="SUCCEEDED" file="runs/x/eval.json" learns — c')
    (tmp_path / "runs" / "x").mkdir(parents=True)
    (tmp_path / "runs" / "x" / "eval.json").write_text("{}")
    good = "val reward:       0.080 before RL -> 0.680 after\njob local-1 SUCCEEDED\n"
    check_outcome(block, good, tmp_path)
    for output in (good.replace("SUCCEEDED", "FAILED"), good.replace("0.680", "0.100"), "job local-1 SUCCEEDED"):
        with pytest.raises(AssertionError):
            check_outcome(block, output, tmp_path)
    (tmp_path / "runs" / "x" / "eval.json").unlink()
    with pytest.raises(AssertionError):
        check_outcome(block, good, tmp_path)


def dashboard_logs(state: dict | None) -> str:
    """The end of the local cluster's dashboard logs, for a failed block's message: they are deleted with it."""
    if not state or not state.get("root"):
        return "(no local cluster was running)"
    logs = Path(state["root"]) / "n0" / "session_latest" / "logs"
    tails = []
    for name in ("dashboard.log", "dashboard.err", "dashboard_JobHead.log", "dashboard_JobHead.err"):
        with contextlib.suppress(OSError):
            tails.append(f"--- {name}\n" + "\n".join((logs / name).read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(tails) or f"(no dashboard log in {logs})"


@pytest.mark.ray
@pytest.mark.timeout(1800)  # README in CI: the full local default, then the user-job walk on its cluster
@pytest.mark.parametrize("doc", newcomer_order(), ids=lambda d: d.relative_to(REPO).as_posix())
def test_documented_blocks_run(doc: Path, tmp_path: Path) -> None:
    """A doc's runnable blocks, in order, in one fresh checkout with one cache, as a reader runs them."""
    todo = runnable(doc)
    if not todo:
        pytest.skip("no block runs here: the `cloudrl:ci` ones run with CLOUDRL_RUN_DOC_CI=1 (.ci/run)")
    checkout = fresh_checkout(tmp_path / "checkout")
    (tmp_path / "home").mkdir()
    cache = tmp_path / "cache"
    port = free_port()
    # The local cluster's dashboard is the default address, as 8265 is on a machine where it is free.
    env = cli_env(cache, HOME=str(tmp_path / "home"), RAY_ADDRESS=f"http://127.0.0.1:{port}")
    env["CLOUDRL_LOCAL_DASHBOARD_PORT"] = str(port)
    pids: set[int] = set()
    try:
        for block in todo:
            started = time.monotonic()
            try:
                result = subprocess.run(
                    ["bash", "-c", block.script()], env=env, cwd=checkout, capture_output=True, text=True, timeout=900
                )
            finally:
                state = local_state(cache)
                pids |= {p for node in (state or {}).get("nodes", []) for p in process_tree(node["pid"])}
            print(f"{block.where}: {time.monotonic() - started:.1f} s")
            output = result.stdout + result.stderr
            assert result.returncode == 0, (
                f"{block.where} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}\n{dashboard_logs(state)}"
            )
            assert "warning: the engines' log-probs" not in output  # trainer.gap_check passes the shipped presets
            check_outcome(block, output, checkout)
    finally:
        if local_state(cache):  # a block left its cluster up (on purpose, for the next, or having failed)
            run_cli(["local", "down"], env, timeout=120)
        for pid in pids_alive(sorted(pids)):
            subprocess.run(["kill", "-9", str(pid)], check=False)
    assert local_state(cache) is None
