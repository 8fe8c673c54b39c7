"""`cloudrl validate`: check the dstack bundle (fleets/, tasks/) before `dstack apply` gets to see it.

Every YAML under fleets/ and tasks/ goes through three layers, and each problem is one line
`path: key: problem — fix`:

1. dstack's own configuration parser, the one `dstack apply` runs first (no server needed): below;
2. rules the dstack server checks only after `dstack apply` has planned, or that fail even later;
3. cloudrl's own (Ray pin, loopback dashboard, placement, GPU vendor, dashboard port, Ray token, secrets,
   the shipped bootstrap, a task against its fleets): 2 and 3 are in bundle_rules.py and bundle_checks.py.

A file that cannot be read as one YAML mapping (binary, not UTF-8, empty, a list, a key written twice, a
dangling symlink) is one such line too, and a bundle without any YAML file fails instead of passing.
dstack is imported inside the functions: `cloudrl --help` stays fast and works without it.
"""

from __future__ import annotations

import difflib
import errno
import re
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from cloudrl.trainer.presets import load_yaml, yaml_error_text

from .bundle_checks import fleet_problems, task_and_fleet_problems
from .bundle_rules import BUNDLE_DIRS, Problem, dstack_models, rel_path, rule_problems
from .errors import CloudrlError

FIX_TYPE = "start the file with `type: task` (tasks/) or `type: fleet` (fleets/)"


def bundle_files(root: Path) -> list[Path]:
    """The dstack YAMLs of the bundle: *.yml and *.yaml under root/fleets and root/tasks (symlinks too,
    dangling ones included, so that they are reported)."""
    dirs = [root / name for name in BUNDLE_DIRS if (root / name).is_dir()]
    if not dirs:
        hint = (
            f"{root} is a file; pass the checkout's directory"
            if root.is_file()
            else "run `cloudrl validate` in the cloudrl checkout or pass its path (cloudrl validate PATH)"
        )
        raise CloudrlError(f"no fleets/ or tasks/ in {root.resolve()}: {hint}")
    files = sorted(
        p for d in dirs for p in d.rglob("*") if p.suffix in (".yml", ".yaml") and (p.is_file() or p.is_symlink())
    )
    if not files:
        raise CloudrlError(
            f"no *.yml or *.yaml files in {' or '.join(str(d) for d in dirs)}: nothing to check; "
            f"run `cloudrl validate` in the cloudrl checkout or pass its path"
        )
    return files


def validate_bundle(root: Path) -> list[Problem]:
    """Every problem in every bundle file, in file order; a script shared by several tasks is reported
    once."""
    problems: list[Problem] = []
    files = bundle_files(root)
    for path in files:
        for problem in validate_file(path, root):
            if problem not in problems:
                problems.append(problem)
    for problem in fleet_problems(files, root):
        if problem not in problems:
            problems.append(problem)
    return problems


def validate_file(path: Path, root: Path) -> list[Problem]:
    """The problems of one dstack YAML; `root` is the bundle root, for the paths in the messages."""
    rel = rel_path(path, root)
    data = _read_yaml(path, rel)
    if isinstance(data, Problem):
        return [data]
    problems = (
        _parser_problems(rel, data)
        + rule_problems(rel, data, path, root)
        + task_and_fleet_problems(rel, data, path, root)
    )
    # One line per key: the parser's message wins over a later rule's on the same key.
    seen: set[tuple[str, str]] = set()
    unique = []
    for problem in problems:
        if (problem.path, problem.key) not in seen or problem.key == "-":
            seen.add((problem.path, problem.key))
            unique.append(problem)
    return unique


def _read_yaml(path: Path, rel: str) -> dict | Problem:
    """The file's top-level mapping, which has a `type:`; else the one Problem that says why not."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        return Problem(
            rel,
            "-",
            f"is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})",
            "save it as UTF-8 YAML, or move it out of fleets/ and tasks/",
        )
    except OSError as e:
        if path.is_symlink() and e.errno in (errno.ENOENT, errno.ELOOP):
            return Problem(rel, "-", "is a symlink that leads to no file", "fix the link or remove it")
        return Problem(rel, "-", f"cannot be read ({e.strerror or e})", "check its permissions")
    try:
        data = load_yaml(text)
    except yaml.YAMLError as e:
        return Problem(rel, "-", f"is not valid YAML{yaml_error_text(e)}", "fix the YAML syntax there")
    if data is None:
        return Problem(rel, "-", "is empty", f"delete it, or {FIX_TYPE}")
    if not isinstance(data, dict):
        return Problem(rel, "-", f"is a YAML {type(data).__name__}, not a mapping of keys", FIX_TYPE)
    if "type" not in data:
        return Problem(rel, "type", "no `type:` at the top", FIX_TYPE)
    if not isinstance(data["type"], str):
        return Problem(rel, "type", f"is {data['type']!r}, not a configuration type", FIX_TYPE)
    return data


# --- 1. dstack's parser --------------------------------------------------------------------------


def _parser_problems(rel: str, data: dict) -> list[Problem]:
    dstack = dstack_models()
    try:
        dstack["parse"](data)
        return []
    except dstack["error"] as e:
        errors = e.args[0].errors() if e.args and hasattr(e.args[0], "errors") else None
        if errors is None:
            return [Problem(rel, "-", f"dstack rejects it: {e}", "fix what dstack names")]
    except Exception as e:  # dstack's validators assume some shapes (e.g. a mapping, met with a list) and crash
        return [
            Problem(
                rel,
                "-",
                f"dstack's parser fails on it ({type(e).__name__}: {e})",
                "a value has a shape dstack does not expect (a list for a mapping or the reverse): "
                "compare the file with dstack's reference",
            )
        ]
    problems = []
    for err in errors:
        key = _key_of(data, err["loc"], names_a_key=err["type"] in ("missing", "extra_forbidden"))
        message, fix = _explain(err, key, data, dstack["fields"])
        problems.append(Problem(rel, key, message, fix))
    # A union (e.g. an SSH host is a string or a mapping) reports every arm; drop the arm errors on a key
    # when a deeper key explains the problem.
    keys = [p.key for p in problems]
    return [p for p in problems if not any(k != p.key and k.startswith(p.key) for k in keys)]


def _key_of(data: dict, loc: tuple, names_a_key: bool) -> str:
    """The YAML key a pydantic error location points at, skipping pydantic's own steps (the `type`
    tag, union arms, the fields a shorthand string such as `gpu: H100:8` is parsed into). When the
    error is about a key itself (missing, unknown), the last step is that key even if absent."""
    loc = list(loc)
    if loc and loc[0] == data.get("type"):
        loc = loc[1:]
    if not loc:
        return "type"
    key, node = "", data
    for i, step in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(node, dict) and isinstance(step, str) and (step in node or (last and names_a_key)):
            key = f"{key}.{step}" if key else step
            node = node.get(step)
        elif isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node):
            key, node = f"{key}[{step}]", node[step]
    return key or "type"


def _explain(err: dict, key: str, data: dict, fields: dict[str, Any]) -> tuple[str, str]:
    kind = err["type"]
    msg = err["msg"].removeprefix("Value error, ")
    last = re.sub(r"\[\d+\]$", "", key.rsplit(".", 1)[-1])
    if kind == "union_tag_invalid":
        return (
            f"dstack has no configuration type {data.get('type')!r}",
            "use `type: task` (in tasks/) or `type: fleet` (in fleets/)",
        )
    if kind == "extra_forbidden":
        parent = [re.sub(r"\[\d+\]$", "", part) for part in key.split(".")[:-1]]
        model = fields.get(parent[-1] if parent else str(data.get("type")))
        close = difflib.get_close_matches(last, list(model.model_fields) if model else [], n=1)
        hint = f" (did you mean `{close[0]}`?)" if close else ""
        return (f"dstack does not know the key `{last}`", f"remove it or fix its spelling{hint}")
    if kind == "missing":
        return (f"`{last}` is required here", f"add `{last}:`")
    if key.endswith("gpu") or ".gpu." in key:
        return (
            f"dstack cannot read this GPU spec ({msg})",
            "write NAME:COUNT or MEMORY:COUNT, e.g. `gpu: H100:8` or `gpu: 80GB..:8`",
        )
    if msg.startswith("Input should be "):
        return (f"dstack does not accept {_value_at(data, key)!r}", "set it to " + msg[len("Input should be ") :])
    return (f"dstack rejects it: {msg}", "fix the value as dstack says; see dstack's reference for this key")


def _value_at(data: Any, key: str) -> Any:
    node = data
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", key):
        if part.startswith("["):
            node = node[int(part[1:-1])] if isinstance(node, list) else None
        else:
            node = node.get(part) if isinstance(node, dict) else None
    return node


# --- the command ---------------------------------------------------------------------------------


def validate(
    root: Annotated[
        Path,
        typer.Argument(
            help="The cloudrl checkout whose fleets/ and tasks/ to check.", show_default="the current directory"
        ),
    ] = Path("."),
) -> None:
    """Check every dstack YAML under fleets/ and tasks/ as `dstack apply` and the dstack server would.

    dstack's own parser (no server needed), then the rules dstack checks only server-side, then cloudrl's (Ray pin, loopback dashboard). One line per problem: file, key, problem, fix; exit 1 if any.
    """
    files = bundle_files(root)
    found = validate_bundle(root)
    problems = [p for p in found if not p.warning]
    for problem in problems:
        typer.echo(str(problem))
    for warning in (p for p in found if p.warning):
        typer.secho(str(warning), fg=typer.colors.YELLOW, err=True)
    if problems:
        typer.secho(
            f"{len(problems)} problem(s) in {len({p.path for p in problems})} file(s); fix them before `dstack apply`",
            fg=typer.colors.RED,
            err=True,
        )
        raise typer.Exit(1)
    typer.echo(
        f"ok: {len(files)} files in fleets/ and tasks/ pass dstack's parser, its server-side rules and cloudrl's"
    )
