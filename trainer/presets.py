"""From what the user wrote to a filled config: a preset file and `key=value` overrides.

Each way the text can be unusable ends in one ConfigError that names the file (or the override) and
the fix: a path that is a directory or unreadable, bytes that are not UTF-8, YAML that does not parse,
a key written twice (PyYAML would keep the last one silently), an empty preset, a preset that is not a
mapping, a `base:` that names no built-in preset. A preset file may start from a built-in preset
(`base: local`): its keys first, then the file's. The values then go onto the config's dataclasses by dotted key (`actor.lr`), each through
`config_checks.coerce`; the config as a whole is checked afterwards by `config_checks.validate`. The
config arrives as an argument: this module does not import config.py.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from .config_checks import KEYS_SET, coerce, unknown_key_error
from .errors import ConfigError

PRESET_DIR = Path(__file__).parent / "presets"
EXAMPLE = "actor.lr=1e-6"


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_path(preset: str) -> Path:
    """A preset name in trainer/presets, or a path to a YAML file (`~` expanded: no shell does it after `=`)."""
    path = Path(preset).expanduser()
    if path.suffix in (".yaml", ".yml"):
        if path.exists():
            return path
        raise ConfigError(
            f"preset file {preset} does not exist: check the path, or use a preset name "
            f"({', '.join(available_presets())})"
        )
    candidate = PRESET_DIR / f"{preset}.yaml"
    if candidate.is_file():
        return candidate
    raise ConfigError(
        f"unknown preset {preset!r}: use one of {', '.join(available_presets())} or a path to a YAML file"
    )


def read_preset(path: Path) -> dict[str, Any]:
    """The preset file's top-level mapping."""
    data = parse_yaml(_read_text(path), where=str(path), fix="fix the file")
    if data is None:
        raise ConfigError(
            f"{path}: the preset is empty: add sections like `actor:` with keys under them, or use --preset local"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: a preset must be a mapping of sections like `actor:`; this one is a {type(data).__name__}"
        )
    return data


def preset_layers(path: Path) -> list[tuple[dict[str, Any], str]]:
    """The mappings a preset file stands for, applied in order, each with the source errors name: the
    built-in preset its `base:` names first (its `trainer.run_dir` left out: a run of this file never
    lands in the base's directory), then the file itself. A built-in preset names no base."""
    data = read_preset(path)
    base = data.pop("base", None)
    if base is None:
        return [(data, str(path))]
    if not isinstance(base, str) or base not in available_presets():
        raise ConfigError(
            f"{path}: `base: {base}` names no built-in preset: use one of {', '.join(available_presets())}, "
            f"e.g. `base: local`, and set your own keys below it"
        )
    base_path = PRESET_DIR / f"{base}.yaml"
    inherited = read_preset(base_path)
    trainer = inherited.get("trainer")
    if isinstance(trainer, dict):
        inherited["trainer"] = {k: v for k, v in trainer.items() if k != "run_dir"}
    return [(inherited, f"{base_path} (the base of {path})"), (data, str(path))]


def parse_override(item: str) -> tuple[str, Any]:
    """`section.key=value` as (key, the value read as YAML); the empty value is the empty string."""
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not KEY=VALUE: write it like {EXAMPLE}")
    if value.startswith("="):  # `key==1`: a typo far more often than a value that starts with '='
        raise ConfigError(
            f"override {item!r} has '==': write KEY=VALUE with one '=', like {EXAMPLE} "
            f"(quote a value that starts with '=': {key}='={value[1:]}')"
        )
    if not value.strip():
        return key, ""
    return key, parse_yaml(value, where=f"override {item!r}", fix=f"quote the value, e.g. {key}='...'")


def parse_yaml(text: str, where: str, fix: str) -> Any:
    """One YAML document, or a ConfigError naming `where`, the line and `fix`."""
    try:
        return load_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML{yaml_error_text(exc)}: {fix}") from None


def load_yaml(text: str) -> Any:
    """One YAML document (None when empty) like `yaml.safe_load`, but strict where PyYAML is lax: a key
    written twice in one mapping is an error (YAML says keys are unique; PyYAML keeps the last one, so a
    preset that sets `actor:` twice would silently lose half of it). Every problem is a yaml.YAMLError."""
    try:
        loader = yaml.SafeLoader(text)  # rejects control characters (binary files) already here
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_unique_keys(node, prefix="", seen=set())
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None
    except ValueError as exc:  # a scalar YAML types but cannot build: a date like 2024-13-45, a huge integer
        raise yaml.YAMLError(f"a value YAML cannot read: {exc}") from None


def _check_unique_keys(node: yaml.Node, prefix: str, seen: set[int]) -> None:
    """`seen` visits a node that aliases reach many times only once (no exponential walk)."""
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_unique_keys(item, prefix, seen)
    if not isinstance(node, yaml.MappingNode):
        return
    first_line: dict[str, int] = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<:` merges are YAML's own way to override keys
        key, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
        if key in first_line:
            raise yaml.MarkedYAMLError(
                problem=f"{key!r} is written twice, first at line {first_line[key]}", problem_mark=key_node.start_mark
            )
        first_line[key] = line
        _check_unique_keys(value_node, f"{key}.", seen)


def yaml_error_text(exc: yaml.YAMLError) -> str:
    """` at line L, column C (what PyYAML found)`, on one line."""
    mark = getattr(exc, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    text = getattr(exc, "problem", None) or str(exc)
    if text.startswith("but ") and getattr(exc, "context", None):  # "expected a single document ..., but found"
        text = f"{exc.context}, {text}"  # type: ignore[attr-defined]
    return f"{at} ({' '.join(text.split())})"  # PyYAML's messages span lines; ours is one


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except IsADirectoryError:
        raise ConfigError(
            f"{path} is a directory, not a preset: pass a .yaml file, or a preset name "
            f"({', '.join(available_presets())})"
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}): "
            f"pass a YAML preset saved as UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read ({exc.strerror or exc}): check its permissions") from None


# ----------------------------------------------------------------------------------------------
# Dotted keys on the config's dataclasses
# ----------------------------------------------------------------------------------------------


def all_keys(obj: Any, prefix: str = "") -> list[str]:
    """Every settable key of a config (or of one section), e.g. `actor.lr`."""
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys += all_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def key_type(cfg: Any, key: str) -> Any:
    """The type annotated on `key`; KeyError when no such key."""
    owner, f = _resolve(cfg, key)
    return typing.get_type_hints(type(owner))[f.name]


def apply_mapping(cfg: Any, data: dict, source: str, prefix: str = "") -> None:
    """Set every key of a nested mapping (a preset, a saved config); `source` names it in errors."""
    for name, value in data.items():
        key = f"{prefix}{name}"
        if _is_section(cfg, key) and not isinstance(value, dict):
            if value is None:  # `actor:` with nothing under it
                continue
            first = all_keys(_lookup(cfg, key))[0]
            raise ConfigError(
                f"`{key}:` is a section ({source}) and takes keys, not {value!r}: "
                f"indent them under it, e.g. `{key}: {{{first}: ...}}`"
            )
        if isinstance(value, dict) and not _is_dict_field(cfg, key):
            apply_mapping(cfg, value, source, f"{key}.")
        else:
            set_key(cfg, key, value, source)


# Keys whose default depends on another key: setting that key gives each of them its default for the new
# value, unless the preset or an override set it already (and a key set later wins as usual), so the result
# does not depend on the order of the keys. GRPO and REINFORCE++-baseline scale each prompt's scores by a
# standard deviation, so a KL penalty folded into the scores turns into full-size noise in the groups whose
# answers all score the same: they take KL in the loss. There the estimator is GRPO's k3 (Shao et al.
# 2024): the gradient of k1 as a loss is 0 in expectation, so k1 serves the reward only.
DEPENDENT_DEFAULTS: dict[str, dict[Any, dict[str, Any]]] = {
    "algorithm.name": {
        "ppo": {"algorithm.kl_mode": "reward"},
        "reinforce_pp": {"algorithm.kl_mode": "reward"},
        "rloo": {"algorithm.kl_mode": "reward"},
        "grpo": {"algorithm.kl_mode": "loss"},
        "reinforce_pp_baseline": {"algorithm.kl_mode": "loss"},
    },
    "algorithm.kl_mode": {
        "reward": {"algorithm.kl_estimator": "k1"},
        "loss": {"algorithm.kl_estimator": "k3"},
    },
    # GSPO clips a sequence ratio, the geometric mean of its token ratios, which rarely leaves 1 +- 0.01: the
    # paper's range is 3e-4/4e-4, over the mean of each response's token mean (Zheng et al. 2025).
    "actor.policy_loss": {
        "gspo": {"actor.loss_agg_mode": "seq-mean-token-mean", "actor.clip_low": 3e-4, "actor.clip_high": 4e-4},
    },
    # vLLM engines on GPUs of their own take most of them; beside the trainers, half.
    "placement.colocate_all": {
        True: {"rollout.gpu_memory_utilization": 0.5},
        False: {"rollout.gpu_memory_utilization": 0.85},
    },
}


# Keys under their older names, accepted wherever a key is set (presets, overrides, the configs saved in
# checkpoints): older name -> (the key now, the value there from the older one's, if it differs).
MOVED: dict[str, tuple[str, Callable[[Any], Any] | None]] = {
    "rollout.policy_lag": ("rollout.max_staleness", None),
    # the search protocol's bounds are the multi-turn ones; search.max_turns counted the answered calls, and
    # one last turn followed them
    "search.max_turns": ("rollout.max_turns", lambda calls: calls + 1),
    "search.max_response_tokens": ("rollout.max_episode_tokens", None),
    "search.max_obs_tokens": ("rollout.max_obs_tokens", None),
}


def set_key(cfg: Any, key: str, value: Any, source: str, explicit: bool = True) -> None:
    if key in MOVED:  # checked under its name now, and an error names the one the user wrote too
        old, (key, convert) = key, MOVED[key]
        try:
            value = coerce(key, value, key_type(cfg, key))
        except ConfigError as exc:
            raise ConfigError(f"{old} is now {key}: {exc}") from None
        if convert is not None:
            value = convert(value)
    try:
        owner, f = _resolve(cfg, key)
    except KeyError:
        raise unknown_key_error(key, all_keys(cfg), source) from None
    value = coerce(key, value, key_type(cfg, key))
    setattr(owner, f.name, value)
    keys_set = vars(cfg).setdefault(KEYS_SET, set())
    if explicit:
        keys_set.add(key)
    defaults = DEPENDENT_DEFAULTS[key].get(value, {}) if key in DEPENDENT_DEFAULTS else {}
    for dependent, default in defaults.items():
        if dependent not in keys_set:
            set_key(cfg, dependent, default, source, explicit=False)


def _lookup(cfg: Any, key: str) -> Any:
    """The section or value at a dotted key; KeyError when there is none."""
    obj = cfg
    for part in key.split("."):
        if not dataclasses.is_dataclass(obj) or part not in {f.name for f in dataclasses.fields(obj)}:
            raise KeyError(key)
        obj = getattr(obj, part)
    return obj


def _is_section(cfg: Any, key: str) -> bool:
    try:
        return dataclasses.is_dataclass(_lookup(cfg, key))
    except KeyError:
        return False


def _is_dict_field(cfg: Any, key: str) -> bool:
    try:
        return typing.get_origin(key_type(cfg, key)) is dict
    except KeyError:
        return False


def _resolve(cfg: Any, key: str) -> tuple[Any, dataclasses.Field]:
    """The section holding `key` and its field; KeyError for an unknown key or a whole section."""
    parent, _, name = key.rpartition(".")
    owner = _lookup(cfg, parent) if parent else cfg
    fields = {f.name: f for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else {}
    if name not in fields or dataclasses.is_dataclass(getattr(owner, name)):
        raise KeyError(key)
    return owner, fields[name]
