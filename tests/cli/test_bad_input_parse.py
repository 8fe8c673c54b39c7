"""Every bad input known before Ray starts ends in one line: the problem, the key or flag, the fix.

A corpus of hostile-but-realistic inputs, each checked in milliseconds: presets and `key=value`
overrides through `load_config` (one-line ConfigError naming the key), the CLI through CliRunner (one
`error:` line, no traceback; exit 2 for a usage error, 1 otherwise), `cloudrl validate` on files that
are not dstack YAMLs, and a few real subprocesses of `python -m cloudrl.trainer` and `cloudrl` that
must exit 1 with one line and leave nothing behind.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import typer.testing
from cli_helpers import CLOUDRL, cli_env
from cloudrl.cli.app import app
from cloudrl.trainer.config import Config, ConfigError, load_config
from cloudrl.trainer.config_checks import RANGES, Range
from cloudrl.trainer.presets import all_keys, key_type

runner = typer.testing.CliRunner()


@pytest.fixture(autouse=True)
def _no_debug_no_ray_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CLOUDRL_DEBUG", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def config_error(overrides: list[str], preset: str = "local") -> str:
    with pytest.raises(ConfigError) as err:
        load_config(preset, overrides)
    message = str(err.value)
    assert "\n" not in message, message
    return message


def assert_names(message: str, *parts: str) -> None:
    missing = [p for p in parts if p not in message]
    assert not missing, f"{missing} not in: {message}"


# ----------------------------------------------------------------------------------------------
# key=value overrides: (override, parts the one-line message must contain)
# ----------------------------------------------------------------------------------------------

OVERRIDES = [
    # not KEY=VALUE
    ("actor.lr", ["override 'actor.lr' is not KEY=VALUE", "actor.lr=1e-6"]),
    ("=3", ["override '=3' is not KEY=VALUE"]),
    (" =3", ["is not KEY=VALUE"]),
    ("actor.lr==1", ["override 'actor.lr==1' has '=='", "one '='"]),
    # values YAML cannot read
    ("a=[1,", ["override 'a=[1,'", "not valid YAML at line 1, column 4", "quote the value"]),
    ("actor.lr={a: [}", ["override 'actor.lr={a: [}'", "not valid YAML"]),
    ("actor.lr=*x", ["override 'actor.lr=*x'", "undefined alias"]),
    ("actor.lr=!!python/object:os.system x", ["override 'actor.lr=!!python/object:os.system x'", "constructor"]),
    ("actor.resources={a: 1, a: 2}", ["'a' is written twice"]),
    ("trainer.run_dir=2024-13-45", ["override 'trainer.run_dir=2024-13-45'", "a value YAML cannot read"]),
    ("trainer.seed=" + "1" * 5000, ["override 'trainer.seed=111", "a value YAML cannot read"]),
    ("actor.lr=" + "1" * 400, ["actor.lr must be a finite number", "too large"]),
    # numbers that cannot work
    ("actor.lr=.nan", ["actor.lr must be a finite number > 0; got nan"]),
    ("actor.lr=.inf", ["actor.lr must be a finite number > 0; got inf"]),
    ("actor.lr=1e400", ["actor.lr must be a finite number > 0; got inf"]),
    ("actor.lr=-1e-6", ["actor.lr must be > 0; got -1e-06"]),
    ("rollout.temperature=0", ["rollout.temperature must be > 0; got 0.0", "small value such as 0.01"]),
    ("rollout.top_p=1.5", ["rollout.top_p must be in (0, 1]; got 1.5"]),
    ("rollout.top_k=0", ["rollout.top_k must be >= 1 (or -1 to turn it off); got 0"]),
    ("data.train_batch_size=0", ["data.train_batch_size must be >= 1; got 0"]),
    ("critic.mini_batch_size=0", ["critic.mini_batch_size must be >= 1"]),  # was a ZeroDivisionError
    ("critic.micro_batch_size=0", ["critic.micro_batch_size must be >= 1"]),
    ("reward.nodes=0", ["reward.nodes must be >= 1; got 0"]),
    ("rollout.gpu_memory_utilization=0", ["rollout.gpu_memory_utilization must be in (0, 1]"]),
    ("rollout.logprob_correction_cap=0.5", ["rollout.logprob_correction_cap must be >= 1", "on-policy"]),
    ("algorithm.gamma=1.5", ["algorithm.gamma must be in [0, 1]; got 1.5"]),
    ("actor.clip_low=1.5", ["actor.clip_low must be in (0, 1]", "1 - clip_low"]),
    ("actor.dual_clip=0.5", ["actor.dual_clip must be > 1 (or 0 to turn it off); got 0.5"]),
    ("reward.model_weight=.nan", ["reward.model_weight must be a finite number; got nan"]),
    ("actor.resources={h100: -1}", ["actor.resources.h100 must be >= 0; got -1.0"]),
    ("rollout.resources={h100: .inf}", ["rollout.resources.h100 must be a finite number >= 0; got inf"]),
    ("trainer.worker_timeout_s=.inf", ["trainer.worker_timeout_s must be a finite number > 0"]),
    ("trainer.seed=-1", ["trainer.seed must be in [0, 4294967295]; got -1"]),
    ("trainer.seed=4294967296", ["trainer.seed must be in [0, 4294967295]"]),
    # wrong types
    ("trainer.total_steps=1e3", ["trainer.total_steps must be an integer; got '1e3'"]),
    ("actor.lr=fast", ["actor.lr must be a number; got 'fast'"]),
    ("rollout.stop=[a, [b]]", ["rollout.stop must be a string; got ['b']"]),
]


@pytest.mark.parametrize("override, parts", OVERRIDES, ids=[o[:40] for o, _ in OVERRIDES])
def test_a_bad_override_is_one_line_naming_it(override: str, parts: list[str]) -> None:
    assert_names(config_error([override]), *parts)


# (overrides, parts): one value depends on another; the message names both keys.
CROSS_KEY = [
    (["actor.mini_batch_size=100"], ["actor.mini_batch_size=100", "data.train_batch_size=32", "rollout.n=8"]),
    (["critic.nodes=3", "critic.gpus_per_node=1"], ["critic.mini_batch_size=256", "critic.nodes=3"]),
    (["rollout.num_engines=3"], ["data.train_batch_size=32", "rollout.num_engines=3"]),
    (["algorithm.kl_coef=0", "algorithm.kl_target=0.1"], ["algorithm.kl_target=0.1", "algorithm.kl_coef"]),
    (["algorithm.name=grpo", "rollout.n=1"], ["algorithm.name=grpo", "rollout.n>=2"]),
]


@pytest.mark.parametrize("overrides, parts", CROSS_KEY, ids=[" ".join(o) for o, _ in CROSS_KEY])
def test_a_value_that_depends_on_another_names_both(overrides: list[str], parts: list[str]) -> None:
    assert_names(config_error(overrides), *parts)


# ----------------------------------------------------------------------------------------------
# Every numeric key has a range rule, and a value outside it is refused with the key
# ----------------------------------------------------------------------------------------------


def _numeric_keys() -> dict[str, typing.Any]:
    cfg = Config()
    found = {}
    for key in all_keys(cfg):
        want = key_type(cfg, key)
        if want in (int, float) or (typing.get_origin(want) is dict and typing.get_args(want)[1] in (int, float)):
            found[key] = want
    return found


NUMERIC_KEYS = _numeric_keys()


def test_every_numeric_key_has_a_range_rule() -> None:
    """A new int or float key needs an entry in config_checks.RANGES (what values can work?)."""
    assert len(NUMERIC_KEYS) > 50
    assert sorted(set(NUMERIC_KEYS) - set(RANGES)) == [], "numeric keys without a rule in config_checks.RANGES"
    assert sorted(set(RANGES) - set(NUMERIC_KEYS)) == [], "rules for keys that are gone or not numeric"


def _outside(rule: Range) -> str:
    """A value just outside the rule's range, as YAML (NaN for a rule that only asks for a finite number)."""
    if rule.low > -math.inf:
        return str(rule.low if rule.low_open else rule.low - 1)
    if rule.high < math.inf:
        return str(rule.high + 1)
    return ".nan"


@pytest.mark.parametrize("key", sorted(RANGES))
def test_a_value_outside_the_range_names_the_key(key: str) -> None:
    value = _outside(RANGES[key])
    if typing.get_origin(NUMERIC_KEYS[key]) is dict:
        assert config_error([f"{key}={{custom: {value}}}"]).startswith(f"{key}.custom must be ")
    else:
        assert config_error([f"{key}={value}"]).startswith(f"{key} must be ")


@pytest.mark.parametrize("key", sorted(k for k, t in NUMERIC_KEYS.items() if t is float))
def test_every_float_key_refuses_infinity(key: str) -> None:
    assert config_error([f"{key}=.inf"]).startswith(f"{key} must be a finite number")


def test_the_defaults_and_the_presets_are_in_range() -> None:
    for preset in ("local", "gsm8k-7b"):
        load_config(preset)


# ----------------------------------------------------------------------------------------------
# Preset files
# ----------------------------------------------------------------------------------------------

# (id, file content as bytes, parts of the message besides the path)
PRESETS = [
    (
        "section-twice",
        b"actor:\n  lr: 1.0e-3\ncritic:\n  lr: 1.0e-3\nactor:\n  ppo_epochs: 2\n",
        ["not valid YAML at line 5, column 1", "'actor' is written twice, first at line 1"],
    ),
    ("key-twice", b"actor:\n  lr: 1.0e-3\n  lr: 2.0e-3\n", ["line 3", "'actor.lr' is written twice, first at line 2"]),
    ("empty", b"", ["the preset is empty", "--preset local"]),
    ("only-comments", b"# nothing yet\n", ["the preset is empty"]),
    ("a-list", b"- actor\n- critic\n", ["a preset must be a mapping", "this one is a list"]),
    ("a-scalar", b"actor\n", ["a preset must be a mapping", "this one is a str"]),
    ("bad-yaml", b"actor: [\n", ["not valid YAML at line 2", "fix the file"]),
    ("two-documents", b"actor: {}\n---\ncritic: {}\n", ["not valid YAML", "expected a single document"]),
    (
        "not-utf8",
        "actor:\n  lr: 1\n# caf\u00e9\n".encode("latin-1"),
        ["is not UTF-8 text (byte 0xe9 at offset 20)", "saved as UTF-8"],
    ),
    ("binary", bytes(range(256)), ["is not UTF-8 text"]),
    ("nul-byte", b"actor:\x00\n", ["not valid YAML", "unacceptable character #x0000"]),
    ("section-is-a-value", b"actor: 3\n", ["`actor:` is a section", "takes keys, not 3"]),
    ("unknown-section", b"actr:\n  lr: 1\n", ["unknown config key 'actr.lr'", "did you mean actor.lr?"]),
    ("value-out-of-range", b"rollout:\n  temperature: 0\n", ["rollout.temperature must be > 0"]),
]


@pytest.mark.parametrize("content, parts", [c[1:] for c in PRESETS], ids=[c[0] for c in PRESETS])
def test_a_bad_preset_file_is_one_line(tmp_path: Path, content: bytes, parts: list[str]) -> None:
    preset = tmp_path / "mine.yaml"
    preset.write_bytes(content)
    message = config_error([], str(preset))
    if "unknown config key" not in message and "must be" not in message:
        assert str(preset) in message
    assert_names(message, *parts)


def test_a_preset_that_is_a_directory(tmp_path: Path) -> None:
    folder = tmp_path / "mine.yaml"
    folder.mkdir()
    assert_names(config_error([], str(folder)), f"{folder} is a directory, not a preset", "local")


def test_a_preset_path_that_does_not_exist(tmp_path: Path) -> None:
    assert_names(config_error([], str(tmp_path / "nope.yaml")), "preset file", "does not exist", "local")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_preset(tmp_path: Path) -> None:
    preset = tmp_path / "mine.yaml"
    preset.write_text("actor: {}\n")
    preset.chmod(0)
    assert_names(config_error([], str(preset)), "cannot be read", "permission")


def test_yaml_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    preset = tmp_path / "mine.yaml"
    preset.write_text("actor: &b\n  lr: 1.0e-3\n  ppo_epochs: 2\ncritic:\n  <<: *b\n  lr: 2.0e-3\n")
    cfg = load_config(str(preset))
    assert (cfg.critic.lr, cfg.critic.ppo_epochs, cfg.actor.lr) == (2e-3, 2, 1e-3)


# ----------------------------------------------------------------------------------------------
# The CLI: one `error:` line, no traceback, no box
# ----------------------------------------------------------------------------------------------


def assert_one_error_line(result: typer.testing.Result, code: int, *parts: str) -> str:
    assert result.exit_code == code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output and "╭" not in result.output
    assert_names(lines[0], *parts)
    return lines[0]


# (args, parts): usage errors keep click's exit status 2 but are one line naming the command's --help.
USAGE = [
    (["submit", "--bogus"], ["no such option: --bogus", "submit --help"]),
    (["submit", "--preset"], ["option '--preset' requires an argument", "submit --help"]),
    (["logs", "--node"], ["option '--node' requires an argument", "logs --help"]),
    (["logs", "a", "b"], ["unexpected extra argument", "logs --help"]),
    (["local", "up", "--nodes", "x"], ["'--nodes'", "integer", "local up --help"]),
    (["local", "up", "--nodes", "0"], ["'--nodes'", "local up --help"]),
    (["local", "up", "--nodes"], ["option '--nodes' requires an argument", "local up --help"]),
    (["local", "nosuch"], ["no such command 'nosuch'", "local --help"]),
    (["nosuch"], ["no such command 'nosuch'", "--help"]),
    (["--bogus"], ["no such option: --bogus", "--help"]),
    (["dashboard", "--port", "x"], ["'--port'", "dashboard --help"]),
    (["status", "--address"], ["option '--address' requires an argument", "status --help"]),
]


@pytest.mark.parametrize("args, parts", USAGE, ids=[" ".join(a) for a, _ in USAGE])
def test_a_usage_error_is_one_line(args: list[str], parts: list[str]) -> None:
    assert_one_error_line(runner.invoke(app, args), 2, *parts)


def test_a_usage_error_with_the_debug_variable_is_clicks_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUDRL_DEBUG", "1")
    result = runner.invoke(app, ["submit", "--bogus"])
    assert result.exit_code == 2 and "--bogus" in result.output


def test_no_arguments_still_show_the_help() -> None:
    for args in ([], ["local"]):
        result = runner.invoke(app, args)
        assert "Usage" in result.output and "error:" not in result.output


# (args, parts): expected failures before any cluster is contacted, exit status 1.
FAILURES = [
    (["submit", "--dry-run", "a=[1,"], ["override 'a=[1,'", "not valid YAML"]),
    (["submit", "--dry-run", "actor.lr==1"], ["override 'actor.lr==1'"]),
    (["submit", "--dry-run", "actor.lr"], ["is not KEY=VALUE"]),
    (["submit", "--dry-run", "rollout.temperature=0"], ["rollout.temperature must be > 0"]),
    (["submit", "--dry-run", "critic.mini_batch_size=0"], ["critic.mini_batch_size must be >= 1"]),
    (["submit", "--dry-run", "--preset", "nope"], ["unknown preset 'nope'"]),
    (["list", "--address", "http://h:99999"], ["--address=http://h:99999 is not a dashboard URL", "port"]),
    (["status", "--address", "http://[::1"], ["is not a dashboard URL", "ipv6"]),
    (["stop", "job", "--address", "http://"], ["is not a dashboard URL (no host)"]),
    (["logs", "job", "--address", "ray://h:10001"], ["ray:// is not http:// or https://"]),
    (["list", "--address", "h:abc"], ["is not a dashboard URL", "'abc'"]),
    (["list", "--address", "http://h:0"], ["is not a dashboard URL (port 0)"]),
    (["dashboard", "--port", "70000"], ["--port 70000 is not a TCP port", "0..65535"]),
    (["dashboard", "--port", "-1"], ["--port -1 is not a TCP port"]),
    (["dashboard", "--remote-port", "0", "--ssh", "host"], ["--remote-port 0 is not a TCP port", "1..65535"]),
]


@pytest.mark.parametrize("args, parts", FAILURES, ids=[" ".join(a)[:50] for a, _ in FAILURES])
def test_an_expected_failure_is_one_line(args: list[str], parts: list[str]) -> None:
    assert_one_error_line(runner.invoke(app, args), 1, *parts)


def test_a_bad_ray_address_variable_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "http://head:port")
    assert_one_error_line(runner.invoke(app, ["list"]), 1, "RAY_ADDRESS=http://head:port is not a dashboard URL")


@pytest.mark.parametrize(
    "preset", [c for c in PRESETS if c[0] in ("section-twice", "empty", "binary")], ids=lambda c: c[0]
)
def test_submit_with_a_bad_preset_file_is_one_line(tmp_path: Path, preset: tuple) -> None:
    path = tmp_path / "mine.yaml"
    path.write_bytes(preset[1])
    assert_one_error_line(runner.invoke(app, ["submit", "--dry-run", "--preset", str(path)]), 1, str(path))


# ----------------------------------------------------------------------------------------------
# cloudrl validate on files that are not dstack YAMLs
# ----------------------------------------------------------------------------------------------

# (file under tasks/, its bytes (None: a dangling symlink), the problem its line names)
ODD_FILES = [
    ("empty.yml", b"", "is empty"),
    ("list.yml", b"- a\n- b\n", "is a YAML list, not a mapping"),
    ("scalar.yml", b"hello\n", "is a YAML str, not a mapping"),
    ("binary.yml", b"\xff\xfe\x00\x01", "is not UTF-8 text (byte 0xff at offset 0)"),
    ("nul.yml", b"type: task\x00\n", "is not valid YAML"),
    ("twice.yml", b"type: task\ncommands: [echo]\ntype: fleet\n", "'type' is written twice, first at line 1"),
    ("type-list.yml", b"type: [task]\ncommands: [echo]\n", "type: is ['task'], not a configuration type"),
    ("shapes.yml", b"type: task\ncommands: 1\nfiles: 2\ngroups: 3\nresources: [4]\n", "dstack"),
    ("dangling.yml", None, "is a symlink that leads to no file"),
]


def test_odd_files_are_one_line_each(tmp_path: Path) -> None:
    (tmp_path / "tasks" / "folder.yml").mkdir(parents=True)  # a directory named like a YAML is not a file
    for name, content, _ in ODD_FILES:
        if content is None:
            (tmp_path / "tasks" / name).symlink_to("missing.yml")
        else:
            (tmp_path / "tasks" / name).write_bytes(content)
    result = runner.invoke(app, ["validate", str(tmp_path)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = result.stdout.splitlines()
    for name, _, problem in ODD_FILES:
        assert any(line.startswith(f"tasks/{name}: ") and problem in line for line in lines), (name, lines)
    assert result.stderr.strip().endswith("fix them before `dstack apply`")


def test_a_bundle_without_yaml_files_fails(tmp_path: Path) -> None:
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "notes.txt").write_text("nothing to see\n")
    assert_one_error_line(runner.invoke(app, ["validate", str(tmp_path)]), 1, "no *.yml or *.yaml files")


def test_validate_given_a_file_says_to_pass_the_directory(tmp_path: Path) -> None:
    task = tmp_path / "task.dstack.yml"
    task.write_text("type: task\n")
    assert_one_error_line(runner.invoke(app, ["validate", str(task)]), 1, "is a file; pass the checkout's directory")


# ----------------------------------------------------------------------------------------------
# Real processes: exit 1, one line on stderr, no traceback, nothing written
# ----------------------------------------------------------------------------------------------


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = cli_env(cwd / ".cache")
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _one_line(proc: subprocess.CompletedProcess, code: int, *parts: str) -> None:
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert_names(lines[0], *parts)


TRAINER = [
    (["--preset", "twice.yaml"], ["'actor' is written twice"]),
    (["--preset", "folder.yaml"], ["is a directory, not a preset"]),
    (["a=[1,"], ["override 'a=[1,'"]),
    (["rollout.temperature=0"], ["rollout.temperature must be > 0"]),
    (["critic.mini_batch_size=0"], ["critic.mini_batch_size must be >= 1"]),
]


@pytest.mark.parametrize("args, parts", TRAINER, ids=[" ".join(a) for a, _ in TRAINER])
def test_the_trainer_process_prints_one_line_and_writes_nothing(
    tmp_path: Path, args: list[str], parts: list[str]
) -> None:
    (tmp_path / "twice.yaml").write_text("actor:\n  lr: 1.0e-3\nactor:\n  lr: 2.0e-3\n")
    (tmp_path / "folder.yaml").mkdir()
    before = sorted(tmp_path.iterdir())
    run_dir = tmp_path / "run"
    proc = _run([sys.executable, "-m", "cloudrl.trainer", *args, f"trainer.run_dir={run_dir}"], tmp_path)
    _one_line(proc, 1, *parts)
    assert sorted(p for p in tmp_path.iterdir() if p.name != ".cache") == before  # no run dir, no config.yaml


CLI = [
    (["submit", "--bogus"], 2, ["no such option: --bogus", "cloudrl submit --help"]),
    (["submit", "--dry-run", "actor.lr=[1,"], 1, ["override 'actor.lr=[1,'"]),
    (["list", "--address", "http://h:99999"], 1, ["is not a dashboard URL"]),
    (["validate", "."], 1, ["no fleets/ or tasks/"]),
]


@pytest.mark.parametrize("args, code, parts", CLI, ids=[" ".join(a) for a, _, _ in CLI])
def test_the_cloudrl_process_prints_one_line(tmp_path: Path, args: list[str], code: int, parts: list[str]) -> None:
    _one_line(_run([CLOUDRL, *args], tmp_path), code, *parts)
