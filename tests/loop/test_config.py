"""The config's rules, checked directly: every ConfigError names the key and the fix (no Ray, no subprocess)."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest
import yaml
from cloudrl.trainer import config as config_module
from cloudrl.trainer.config import (
    ALGORITHMS,
    GROUP_ALGORITHMS,
    PRESET_DIR,
    Config,
    ConfigError,
    config_from_dict,
    describe_keys,
    load_config,
)
from cloudrl.trainer.config_checks import coerce, validate
from cloudrl.trainer.presets import all_keys

TRAINER_DIR = Path(config_module.__file__).parent
PRESETS = [
    "local",
    "gsm8k-7b",
    "search-r1",
    "dapo",
    "gspo",
    "calculator",
    "engine-2node",
    "sglang-2x8",
    "gsm8k-1gpu",
    "gsm8k-1node",
]  # every shipped preset, each tested below


def error_of(overrides: list[str], preset: str = "local") -> str:
    with pytest.raises(ConfigError) as err:
        load_config(preset, overrides)
    return str(err.value)


def assert_names(message: str, *parts: str) -> None:
    missing = [p for p in parts if p not in message]
    assert not missing, f"{missing} not in: {message}"


# ----------------------------------------------------------------------------------------------
# Keys with a fixed set of values (Literal annotations)
# ----------------------------------------------------------------------------------------------

LITERAL_KEYS = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "rollout.engine": ("hf", "vllm", "sglang"),
    "algorithm.name": ALGORITHMS,
    "algorithm.kl_mode": ("reward", "loss"),
    "algorithm.kl_estimator": ("k1", "k2", "k3"),
    "trainer.loggers": ("console", "jsonl", "tensorboard", "wandb", "mlflow"),
}


@pytest.mark.parametrize(
    "override, key, hint",
    [
        ("model.dtype=bf16", "model.dtype", "did you mean bfloat16?"),
        ("rollout.engine=vlm", "rollout.engine", "did you mean vllm?"),
        ("algorithm.name=grpoo", "algorithm.name", "did you mean grpo?"),
        ("algorithm.kl_mode=losss", "algorithm.kl_mode", "did you mean loss?"),
        ("algorithm.kl_estimator=kk3", "algorithm.kl_estimator", "did you mean k3?"),
        ("trainer.loggers=[console,tensorbord]", "trainer.loggers", "did you mean tensorboard?"),
        ("trainer.loggers=jsonl,wandbb", "trainer.loggers", "did you mean wandb?"),
    ],
)
def test_literal_key_rejects_a_bad_value_with_the_closest_choice(override: str, key: str, hint: str) -> None:
    bad = override.partition("=")[2].strip("[]").split(",")[-1]
    message = error_of([override])
    assert message == f"{key}={bad!r} is not one of {', '.join(LITERAL_KEYS[key])} ({hint})"


def test_literal_key_without_a_close_choice_lists_them_all() -> None:
    assert error_of(["rollout.engine=16"]) == "rollout.engine=16 is not one of hf, vllm, sglang"


def test_literal_key_is_checked_in_a_preset_file_too(tmp_path: Path) -> None:
    preset = tmp_path / "p.yaml"
    preset.write_text("rollout:\n  engine: vlm\n")
    assert error_of([], str(preset)) == "rollout.engine='vlm' is not one of hf, vllm, sglang (did you mean vllm?)"


@pytest.mark.parametrize("key", LITERAL_KEYS)
def test_every_choice_of_a_literal_key_loads(key: str) -> None:
    for value in LITERAL_KEYS[key]:
        n = ["rollout.n=2"] if key == "algorithm.name" else []
        n += ["rollout.gpus_per_engine=1"] if value == "sglang" else []  # SGLang runs on GPUs only
        value_text = f"[{value}]" if key == "trainer.loggers" else value
        cfg = load_config(
            "local",
            [
                f"{key}={value_text}",
                *n,
                "actor.mini_batch_size=64",
                "critic.mini_batch_size=64",
                "actor.micro_batch_size=64",
                "critic.micro_batch_size=64",
            ],
        )
        section, name = key.split(".")
        got = getattr(getattr(cfg, section), name)
        assert got == ([value] if key == "trainer.loggers" else value)


def test_the_choices_live_in_the_annotations() -> None:
    for key, values in LITERAL_KEYS.items():
        section, name = key.split(".")
        want = typing.get_type_hints(type(getattr(Config(), section)))[name]
        if key == "trainer.loggers":
            assert typing.get_origin(want) is list
            (want,) = typing.get_args(want)
        assert typing.get_origin(want) is typing.Literal and typing.get_args(want) == tuple(values), key
    assert set(GROUP_ALGORITHMS) < set(ALGORITHMS) and "ppo" not in GROUP_ALGORITHMS


def test_help_config_lists_the_choices_and_not_the_removed_key() -> None:
    lines = {line.split(" = ")[0].strip(): line for line in describe_keys().splitlines() if " = " in line}
    for key, values in LITERAL_KEYS.items():
        assert f"One of: {', '.join(values)}." in lines[key], lines[key]
    assert "One of" not in lines["actor.lr"]
    assert "placement.strategy" not in lines
    assert set(lines) == set(all_keys(Config()))


def test_help_config_gives_each_key_one_line_however_its_docstring_wraps() -> None:
    text = describe_keys()
    sections = [line for line in text.splitlines() if not line.startswith("  ")]
    assert len(text.splitlines()) == len(sections) + len(all_keys(Config()))
    max_staleness = next(line for line in text.splitlines() if line.startswith("  rollout.max_staleness = "))
    assert "(with the weights before this step's update) while this step trains" in max_staleness


def test_the_older_name_of_max_staleness_sets_it_in_overrides_presets_and_saved_configs(tmp_path: Path) -> None:
    assert load_config("local", ["rollout.policy_lag=2"]).rollout.max_staleness == 2
    preset = tmp_path / "lagging.yaml"
    preset.write_text("base: local\nrollout: {policy_lag: 1}\n")
    assert load_config(str(preset)).rollout.max_staleness == 1
    saved = load_config("local").to_dict()
    saved["rollout"]["policy_lag"] = saved["rollout"].pop("max_staleness") + 3  # a checkpoint's config before the name
    assert config_from_dict(saved).rollout.max_staleness == 3
    with pytest.raises(ConfigError, match="rollout.max_staleness"):  # checked under its name either way
        load_config("local", ["rollout.policy_lag=9"])


def test_the_search_bounds_under_their_older_names_set_the_multi_turn_ones() -> None:
    """search.max_turns counted the answered calls, one last turn after them: rollout.max_turns counts turns."""
    cfg = load_config("local", ["search.max_turns=3", "search.max_response_tokens=300", "search.max_obs_tokens=40"])
    assert (cfg.rollout.max_turns, cfg.rollout.max_episode_tokens, cfg.rollout.max_obs_tokens) == (4, 300, 40)
    assert not any(f.name.startswith("max_") for f in dataclasses.fields(cfg.search))  # one set of bounds
    with pytest.raises(
        ConfigError, match=r"^search.max_turns is now rollout.max_turns: rollout.max_turns must be an integer"
    ):
        load_config("local", ["search.max_turns=abc"])


# ----------------------------------------------------------------------------------------------
# Rules across keys (config_checks.validate)
# ----------------------------------------------------------------------------------------------

POSITIVE_KEYS = [
    "data.train_batch_size",
    "rollout.n",
    "rollout.max_new_tokens",
    "rollout.num_engines",
    "rollout.tensor_parallel_size",
    "actor.mini_batch_size",
    "actor.micro_batch_size",
    "actor.ppo_epochs",
    "trainer.total_steps",
    "trainer.keep_last",
    "data.max_prompt_length",
]


@pytest.mark.parametrize("value", [0, -1])
@pytest.mark.parametrize("key", POSITIVE_KEYS)
def test_positive_keys(key: str, value: int) -> None:
    assert error_of([f"{key}={value}"]) == f"{key} must be >= 1; got {value}"


@pytest.mark.parametrize(
    "value, message", [("0", "> 0; got 0.0"), ("-5", "> 0; got -5.0"), (".nan", "a finite number > 0; got nan")]
)
@pytest.mark.parametrize("key", ["trainer.worker_timeout_s", "placement.timeout_s"])
def test_timeouts_are_positive(key: str, value: str, message: str) -> None:
    """A negative wait would reach Ray as an exception deep in the run; NaN would never time out."""
    assert error_of([f"{key}={value}"]) == f"{key} must be {message}"


@pytest.mark.parametrize("algorithm", GROUP_ALGORITHMS)
def test_group_algorithms_need_two_samples_per_prompt(algorithm: str) -> None:
    assert_names(
        error_of([f"algorithm.name={algorithm}", "rollout.n=1"]),
        f"algorithm.name={algorithm}",
        "set rollout.n>=2 (now 1)",
    )


@pytest.mark.parametrize("algorithm", sorted(set(ALGORITHMS) - set(GROUP_ALGORITHMS)))
def test_other_algorithms_take_one_sample(algorithm: str) -> None:
    cfg = load_config(
        "local",
        [
            f"algorithm.name={algorithm}",
            "rollout.n=1",
            "actor.mini_batch_size=32",
            "actor.micro_batch_size=32",
            "critic.mini_batch_size=32",
            "critic.micro_batch_size=32",
        ],
    )
    assert cfg.rollout_batch_size == 32 and not cfg.uses_groups


# (overrides, parts the message must contain: the key(s) and the fix)
RULES = [
    (["rollout.gpu_memory_utilization=0"], ["rollout.gpu_memory_utilization", "must be in (0, 1]", "got 0"]),
    (["rollout.gpu_memory_utilization=1.5"], ["rollout.gpu_memory_utilization", "must be in (0, 1]", "got 1.5"]),
    (["algorithm.kl_coef=-0.1"], ["algorithm.kl_coef", "must be >= 0"]),
    (["algorithm.kl_target=-1"], ["algorithm.kl_target", "must be >= 0"]),
    (
        ["algorithm.kl_coef=0", "algorithm.kl_target=0.1"],
        ["algorithm.kl_target=0.1", "algorithm.kl_coef, which is 0", "set algorithm.kl_coef > 0"],
    ),
    (["actor.dual_clip=0.5"], ["actor.dual_clip", "must be > 1 (or 0 to turn it off)", "got 0.5"]),
    (["actor.dual_clip=1"], ["actor.dual_clip", "must be > 1 (or 0 to turn it off)", "got 1.0"]),
    (["rollout.tensor_parallel_size=2"], ["rollout.tensor_parallel_size > 1", "needs rollout.engine=vllm"]),
    (
        ["reward.in_driver=true", "reward.model_path=/rm"],
        ["reward.in_driver=true", "reward.model_path is set", "drop one of them"],
    ),
    (
        ["placement.colocate_all=true", "rollout.engine=vllm", "rollout.sleep_between_rollouts=false"],
        ["rollout.sleep_between_rollouts=false", "placement.colocate_all=true", "drop the key"],
    ),
]


def test_colocate_all_turns_the_engines_sleep_on_unless_refused() -> None:
    """Left unset, the key is off and colocate_all makes the engines sleep anyway; set to false it is refused
    above rather than overridden in silence."""
    from cloudrl.trainer.rollout.vllm_engine import engines_sleep

    cfg = load_config("local", ["placement.colocate_all=true", "rollout.engine=vllm"])
    assert not cfg.rollout.sleep_between_rollouts and engines_sleep(cfg)


@pytest.mark.parametrize("overrides, parts", RULES, ids=[" ".join(o) for o, _ in RULES])
def test_rules(overrides: list[str], parts: list[str]) -> None:
    assert_names(error_of(overrides), *parts)


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.gpu_memory_utilization=1"],
        ["actor.dual_clip=3"],
        ["actor.dual_clip=0"],
        ["algorithm.kl_coef=0.01", "algorithm.kl_target=0.1"],
        ["rollout.engine=vllm", "rollout.tensor_parallel_size=2"],
        ["reward.in_driver=true"],
        ["reward.model_path=/rm"],
    ],
)
def test_the_edges_of_those_rules_load(overrides: list[str]) -> None:
    load_config("local", overrides)


# The local preset makes 32 prompts x 8 samples = 256 sequences a step.
BATCHES = [
    (
        ["actor.mini_batch_size=100"],
        [
            "actor.mini_batch_size=100",
            "data.train_batch_size=32",
            "rollout.n=8",
            "set actor.mini_batch_size to a divisor of 256",
        ],
    ),
    (
        ["critic.mini_batch_size=100"],
        [
            "critic.mini_batch_size=100",
            "data.train_batch_size=32",
            "rollout.n=8",
            "set critic.mini_batch_size to a divisor of 256",
        ],
    ),
    (
        ["actor.workers_per_node=3"],
        [
            "actor.mini_batch_size=256",
            "actor.workers_per_node=3",
            "actor.nodes=1",
            "set actor.mini_batch_size to a multiple of 3",
        ],
    ),
    (
        ["critic.nodes=3", "critic.gpus_per_node=1"],
        ["critic.mini_batch_size=256", "critic.nodes=3", "critic.gpus_per_node=1", "multiple of 3"],
    ),
    (
        ["actor.micro_batch_size=100"],
        ["actor.micro_batch_size=100", "actor.mini_batch_size=256", "set actor.micro_batch_size to a divisor of 256"],
    ),
    (
        ["critic.workers_per_node=2", "critic.micro_batch_size=256"],
        ["critic.micro_batch_size=256", "critic.mini_batch_size=256 / 2 workers", "to a divisor of 128"],
    ),
    (["rollout.num_engines=3"], ["data.train_batch_size=32", "rollout.num_engines=3", "use a multiple of it"]),
]


@pytest.mark.parametrize("overrides, parts", BATCHES, ids=[" ".join(o) for o, _ in BATCHES])
def test_batch_messages_name_both_keys(overrides: list[str], parts: list[str]) -> None:
    assert_names(error_of(overrides), *parts)


def test_the_critic_batches_are_not_checked_without_a_critic() -> None:
    cfg = load_config("local", ["algorithm.name=grpo", "critic.mini_batch_size=100"])
    assert not cfg.uses_critic


@pytest.mark.parametrize("role", ["actor", "critic", "reference", "reward"])
@pytest.mark.parametrize(
    "setting, message",
    [
        ("nodes=0", ">= 1; got 0"),
        ("workers_per_node=0", ">= 1; got 0"),
        ("gpus_per_node=-1", ">= 0; got -1"),
        ("cpus_per_worker=-1", ">= 0; got -1.0"),
    ],
)
def test_role_counts(role: str, setting: str, message: str) -> None:
    assert error_of([f"{role}.{setting}"]) == f"{role}.{setting.split('=')[0]} must be {message}"


IN_ACTOR = [
    (
        ["rollout.engine=vllm"],
        ["placement.rollout_in_actor=true", "needs rollout.engine=hf (got vllm)", "placement.colocate_all=true"],
    ),
    (["rollout.num_engines=2"], ["rollout.num_engines", "placement.rollout_in_actor=true", "size the actor instead"]),
    (["rollout.gpus_per_engine=1"], ["rollout.gpus_per_engine", "placement.rollout_in_actor=true", "remove them"]),
    (["rollout.sleep_between_rollouts=true"], ["rollout.sleep_between_rollouts", "remove it"]),
    (
        ["actor.workers_per_node=2", "actor.micro_batch_size=128"],
        ["placement.rollout_in_actor=true", "set actor.fsdp=false"],
    ),
    (["actor.gpus_per_node=1"], ["placement.rollout_in_actor=true", "set actor.fsdp=false"]),
]


@pytest.mark.parametrize("overrides, parts", IN_ACTOR, ids=[" ".join(o) for o, _ in IN_ACTOR])
def test_rollout_in_actor_rules(overrides: list[str], parts: list[str]) -> None:
    assert_names(error_of(["placement.rollout_in_actor=true", *overrides]), *parts)


def test_rollout_in_actor_with_unsharded_actor_workers_loads() -> None:
    load_config(
        "local",
        [
            "placement.rollout_in_actor=true",
            "actor.workers_per_node=2",
            "actor.micro_batch_size=128",
            "actor.fsdp=false",
        ],
    )


# ----------------------------------------------------------------------------------------------
# Keys, types and overrides
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, hint",
    [
        ("actor.lrr", "did you mean actor.lr?"),
        ("trainer.logers", "did you mean trainer.loggers?"),
        ("ppo_epochs", "did you mean actor.ppo_epochs?"),  # a bare name without its section
        ("zzz.qqq", "see `python -m cloudrl.trainer --help-config`"),
        ("actor", "did you mean"),  # a section is not a key
    ],
)
def test_unknown_key_names_the_closest(key: str, hint: str) -> None:
    assert_names(error_of([f"{key}=1"]), f"unknown config key {key!r} (command line)", hint)


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor.ppo_epochs=1.5", "actor.ppo_epochs must be an integer; got 1.5"),
        ("actor.ppo_epochs=true", "actor.ppo_epochs must be an integer; got True"),
        ("actor.ppo_epochs=two", "actor.ppo_epochs must be an integer; got 'two'"),
        ("actor.lr=fast", "actor.lr must be a number; got 'fast'"),
        ("actor.lr=false", "actor.lr must be a number; got False"),
        ("data.shuffle=1", "data.shuffle must be true or false; got 1"),
        ("data.shuffle=maybe", "data.shuffle must be true or false; got 'maybe'"),
        ("rollout.stop={a: 1}", "rollout.stop must be a list, e.g. rollout.stop=[a,b]; got {'a': 1}"),
        ("actor.resources=[1]", "actor.resources must be a mapping, e.g. actor.resources={name: 1}; got [1]"),
        ("actor.resources={h100: lots}", "actor.resources.h100 must be a number; got 'lots'"),
        ("model.path=[a]", "model.path must be a string; got ['a']"),
        ("model.path={a: 1}", "model.path must be a string; got {'a': 1}"),
    ],
)
def test_wrong_types_name_the_key_and_the_type(override: str, message: str) -> None:
    assert error_of([override]) == message


@pytest.mark.parametrize(
    "override, key, value",
    [
        ("actor.lr=1e-6", "actor.lr", 1e-6),  # YAML 1.1 reads this as a string
        ("actor.lr=3", "actor.lr", 3.0),
        ("rollout.stop=a,b", "rollout.stop", ["a", "b"]),
        ("rollout.stop=[x]", "rollout.stop", ["x"]),
        ("actor.resources={h100: 1}", "actor.resources", {"h100": 1.0}),
        ("actor.resources=", "actor.resources", {}),
        ("critic.model_path=", "critic.model_path", ""),
        ("reward.function=123", "reward.function", "123"),
    ],
)
def test_values_are_coerced_to_the_annotated_type(override: str, key: str, value: object) -> None:
    section, name = key.split(".")
    got = getattr(getattr(load_config("local", [override]), section), name)
    assert got == value and type(got) is type(value)


def test_yaml_1_1_exponent_without_a_dot_in_a_preset(tmp_path: Path) -> None:
    preset = tmp_path / "p.yaml"
    preset.write_text("actor:\n  lr: 1e-6\n")
    assert load_config(str(preset)).actor.lr == 1e-6
    assert coerce("actor.lr", "1e-6", float) == 1e-6


@pytest.mark.parametrize("item", ["actor.lr", "=3", ""])
def test_an_override_without_equals(item: str) -> None:
    assert error_of([item]) == f"override {item!r} is not KEY=VALUE: write it like actor.lr=1e-6"


@pytest.mark.parametrize(
    "text, parts",
    [
        ("actor: [", ["not valid YAML", "fix the file"]),
        ("- a\n- b\n", ["a preset must be a mapping of sections like `actor:`"]),
    ],
)
def test_broken_preset_files(tmp_path: Path, text: str, parts: list[str]) -> None:
    preset = tmp_path / "p.yaml"
    preset.write_text(text)
    assert_names(error_of([], str(preset)), str(preset), *parts)


def test_unknown_preset_lists_the_known_ones() -> None:
    assert_names(error_of([], "nope"), "unknown preset 'nope'", "local", "gsm8k-7b", "a path to a YAML file")


# ----------------------------------------------------------------------------------------------
# Presets, defaults, round trip
# ----------------------------------------------------------------------------------------------


def _flat_keys(data: dict, prefix: str = "") -> list[str]:
    keys = []
    for name, value in data.items():
        if isinstance(value, dict) and not name.endswith("resources"):
            keys += _flat_keys(value, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_load_and_use_only_known_keys(preset: str) -> None:
    cfg = load_config(preset)
    validate(cfg)
    known = set(all_keys(cfg))
    used = _flat_keys(yaml.safe_load((PRESET_DIR / f"{preset}.yaml").read_text()))
    assert used and not set(used) - known


def test_every_shipped_preset_is_covered() -> None:
    assert set(config_module.available_presets()) == set(PRESETS)


def test_defaults_validate_and_round_trip() -> None:
    validate(Config())
    cfg = load_config("gsm8k-7b", ["algorithm.name=grpo", "rollout.n=4", "trainer.loggers=[console]"])
    assert config_from_dict(cfg.to_dict()) == cfg


# ----------------------------------------------------------------------------------------------
# Imports: no module-level cycle among trainer/ modules
# ----------------------------------------------------------------------------------------------


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(tree: ast.Module, package: str, modules: set[str]) -> set[str]:
    """The sibling modules a module imports when it is loaded (not under TYPE_CHECKING, not in functions)."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
                for part in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    visit(part)
            elif isinstance(node, ast.With):
                visit(node.body)
            elif isinstance(node, ast.Import):
                found.update(a.name.rsplit(".", 1)[-1] for a in node.names if a.name.startswith(f"{package}."))
            elif isinstance(node, ast.ImportFrom):
                if node.level == 1 and node.module:
                    found.add(node.module.split(".")[0])
                elif node.level == 1:
                    found.update(a.name for a in node.names)
                elif node.level == 0 and node.module and node.module.startswith(f"{package}."):
                    found.add(node.module[len(package) + 1 :].split(".")[0])
                elif node.level == 0 and node.module == package:
                    found.update(a.name for a in node.names)

    visit(tree.body)
    return found & modules


def import_cycles(directory: Path, package: str = "cloudrl.trainer") -> list[list[str]]:
    """Every module-level import cycle among the .py files of `directory`, each as [a, b, ..., a]."""
    files = {p.stem: p for p in directory.glob("*.py")}
    graph = {
        name: sorted(_module_level_imports(ast.parse(p.read_text()), package, set(files)) - {name})
        for name, p in files.items()
    }
    cycles: list[list[str]] = []
    state: dict[str, str] = {}  # "open" while on the current path, then "done"

    def walk(name: str, path: list[str]) -> None:
        state[name] = "open"
        for nxt in graph[name]:
            if state.get(nxt) == "open":  # an edge back into the current path closes a cycle
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[name] = "done"

    for start in sorted(graph):
        if start not in state:
            walk(start, [start])
    return cycles


def test_no_import_cycle_among_trainer_modules() -> None:
    assert import_cycles(TRAINER_DIR) == []


def test_config_checks_does_not_import_config() -> None:
    tree = ast.parse((TRAINER_DIR / "config_checks.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "config" not in imported and "cloudrl.trainer.config" not in imported


def test_the_cycle_check_finds_a_cycle(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("import cloudrl.trainer.c\n")
    (tmp_path / "c.py").write_text(
        "from typing import TYPE_CHECKING\ntry:\n    from . import a\nexcept ImportError:\n    pass\n"
    )
    (tmp_path / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\ndef f():\n    from .a import z\n"
    )
    (tmp_path / "e.py").write_text("from .d import f\n")
    assert import_cycles(tmp_path) == [["a", "b", "c", "a"]]
    (tmp_path / "c.py").write_text("def g():\n    from . import a\n")
    assert import_cycles(tmp_path) == []


def test_each_preset_and_preset_file_gets_a_run_directory_of_its_own(tmp_path):
    """A preset file without trainer.run_dir never lands in the local default's directory (whose
    checkpoint a resume=auto would otherwise pick up)."""
    job = tmp_path / "my-experiment.yaml"
    job.write_text("trainer:\n  total_steps: 3\n")
    assert load_config(str(job)).trainer.run_dir == "runs/my-experiment"
    assert load_config("local").trainer.run_dir == "runs/local"
    assert load_config(str(job), ["trainer.run_dir=elsewhere"]).trainer.run_dir == "elsewhere"


def test_a_preset_file_with_a_base_is_the_base_plus_its_own_keys(tmp_path):
    """`base: local` gives every key of local.yaml, the file's own keys on top, and a run directory of the
    file's own (never the base's, whose checkpoints resume=auto would pick up)."""
    job = tmp_path / "my-job.yaml"
    job.write_text("base: local\nactor:\n  lr: 1.0e-3\ntrainer:\n  total_steps: 4\n")
    cfg, local = load_config(str(job)), load_config("local")
    assert (cfg.actor.lr, cfg.trainer.total_steps, cfg.trainer.run_dir) == (1e-3, 4, "runs/my-job")
    mine = {("actor", "lr"), ("trainer", "total_steps"), ("trainer", "run_dir")}
    for section, values in local.to_dict().items():
        for key, value in values.items():
            if (section, key) not in mine:
                assert cfg.to_dict()[section][key] == value, f"{section}.{key}"
    # An override still wins over both.
    assert load_config(str(job), ["model.sft_warmup_steps=3"]).model.sft_warmup_steps == 3


def test_a_tiny_model_at_a_billion_parameter_learning_rate_is_warned_about(tmp_path):
    """A preset file of one's own starts from the code's defaults (actor.lr=1e-6): with the built-in model the
    run is valid but learns nothing visible, so the start-up says so; with `base: local` it does not."""
    from cloudrl.trainer.config_checks import start_warnings

    bare, based = tmp_path / "bare.yaml", tmp_path / "based.yaml"
    bare.write_text("trainer:\n  total_steps: 3\n")
    based.write_text("base: local\ntrainer:\n  total_steps: 3\n")
    (line,) = start_warnings(load_config(str(bare)))
    assert "actor.lr=1e-06 barely moves the built-in model builtin:tiny" in line and "`base: local`" in line
    assert start_warnings(load_config(str(based))) == []
    assert start_warnings(load_config("local")) == start_warnings(load_config("gsm8k-7b")) == []


def test_packing_through_a_dense_mask_on_gpus_is_warned_about():
    """Packed micro-batches under sdpa attend through a (tokens)^2 mask, which on a GPU costs more than the
    padding saves (bench/mfu.py on an H200), so the start-up names the fix."""
    from cloudrl.trainer.config_checks import start_warnings

    gpu = ["actor.gpus_per_node=1", "model.dtype=bfloat16", "model.pack_sequences=true", "algorithm.name=grpo"]
    (line,) = start_warnings(load_config("local", [*gpu, "actor.max_tokens_per_micro_batch=16384"]))
    assert "dense (tokens)^2 mask (actor on GPUs)" in line and "model.pack_sequences=false" in line
    assert start_warnings(load_config("local", [*gpu, "actor.max_tokens_per_micro_batch=4096"])) == [line]
    flash = [*gpu, "model.attn_implementation=flash_attention_2"]
    assert start_warnings(load_config("local", [*flash, "actor.max_tokens_per_micro_batch=16384"])) == []
    assert start_warnings(load_config("local", ["model.pack_sequences=true"])) == []  # CPU: no GPU kernel


@pytest.mark.parametrize("base", ["nope", "[local]", "./local.yaml"])
def test_a_base_that_is_no_built_in_preset_is_one_line(tmp_path, base):
    job = tmp_path / "job.yaml"
    job.write_text(f"base: {base}\ntrainer:\n  total_steps: 4\n")
    with pytest.raises(ConfigError, match=r"names no built-in preset: use one of .*local.*e\.g\. `base: local`"):
        load_config(str(job))


def test_an_environment_may_be_scored_in_the_driver():
    """The rollout queue adds the environment's rewards on either path (tests/rollout/test_rollout_queue.py)."""
    cfg = load_config("calculator", ["reward.in_driver=true"])
    assert cfg.rollout.environment and cfg.reward.in_driver


def test_the_start_up_says_whether_the_built_in_model_was_warmed_up():
    """A run on the built-in model says whether it learned a format before RL (a run that learns nothing can
    then be told from one that never could); a run on any other model prints no such line."""
    from cloudrl.trainer.inputs.models import builtin_model_line

    warmed = builtin_model_line(load_config("local"))
    assert warmed.startswith("model: builtin:tiny, warmed up for 150 steps") and "model.sft_warmup_steps" in warmed
    bare = builtin_model_line(load_config("local", ["model.sft_warmup_steps=0"]))
    assert "without a format warm-up (model.sft_warmup_steps=0)" in bare
    assert builtin_model_line(load_config("calculator")) == ""
