"""Run the trainer: `python -m cloudrl.trainer [--preset NAME|FILE.yaml] [key=value ...]`.

On a Ray cluster (a job submitted with `cloudrl submit`) it joins that cluster; run on its own it
starts a local Ray instance. Examples:

    python -m cloudrl.trainer                                   # the local default (tiny model, CPU)
    python -m cloudrl.trainer --preset local algorithm.name=grpo trainer.total_steps=5
    python -m cloudrl.trainer --preset local --help-config      # every key, its value and meaning
    python -m cloudrl.trainer --preset local --eval-only        # score the latest checkpoint, no training

A job's log starts with the keys the command line changed from the preset, as KEY=VALUE lines (the whole
resolved config goes to run_dir/config.yaml). Expected failures (bad config, missing model, cluster too
small) print one line and exit 1; set CLOUDRL_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import Config


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """A usage error is one line naming the fix, like every other expected failure."""
        self.exit(2, f"error: {message}: see python -m cloudrl.trainer --help\n")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(
        prog="python -m cloudrl.trainer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", "-p", default="local", help="preset name in trainer/presets, or a YAML file")
    parser.add_argument(
        "--help-config",
        action="store_true",
        help="list every config key with its value in the preset (and the overrides), then exit",
    )
    parser.add_argument(
        "--eval-only",
        action="store_true",
        help="score the run's latest checkpoint (or model.path) on the validation sets, no training "
        "(trainer.eval_only=true)",
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. actor.lr=1e-6")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from .config import describe_keys, load_config
    from .errors import TrainerError

    try:
        cfg = load_config(args.preset, [*args.overrides, *(["trainer.eval_only=true"] if args.eval_only else [])])
        if args.help_config:  # the preset's values (and the overrides'), not the code's defaults
            print(describe_keys(cfg))
            return 0
        print(config_changes(args.preset, cfg, preset_alone(args.preset)), flush=True)
        hint = debugger_hint(os.environ)
        if hint:  # the job runs on a cluster started with a debugger: say how to attach to a breakpoint()
            print(hint, flush=True)
        from .driver import train

        train(cfg)
    except TrainerError as exc:
        if os.environ.get("CLOUDRL_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)  # a stop by SIGINT exits 130, as a shell reports Ctrl+C
    except KeyboardInterrupt:  # Ctrl+C before training started (afterwards it stops after a step)
        if os.environ.get("CLOUDRL_DEBUG"):
            raise
        print("error: interrupted (SIGINT) before training started; nothing was saved", file=sys.stderr)
        return 130
    return 0


def preset_alone(preset: str) -> Config | None:
    """The preset's config without the overrides, what a job's changes are counted from; None when the
    preset is only valid with them (then they are counted from the code's defaults)."""
    from .config import load_config
    from .errors import ConfigError

    try:
        return load_config(preset)
    except ConfigError:
        return None


def config_changes(preset: str, cfg: Config, base: Config | None = None) -> str:
    """What the job log shows of the config: the preset's name and the keys where `cfg` differs from
    `base` (the preset alone; None: the code's defaults), as KEY=VALUE lines. The whole resolved config
    is the run directory's config.yaml (written once the roles start)."""
    from .config import Config

    base_values = (base if base is not None else Config()).to_dict()
    lines = [
        f"  {section}.{key}={_as_override(value)}"
        for section, values in cfg.to_dict().items()
        for key, value in values.items()
        if value != base_values[section][key]
    ]
    against = f"the preset {preset}" if base is not None else f"the defaults (the preset {preset} alone is not valid)"
    # An eval-only run leaves run_dir's config.yaml as it is (it belongs to the run that trained there).
    saved = "" if cfg.trainer.eval_only else f"; the whole config: {cfg.trainer.run_dir}/config.yaml"
    head = (
        f"cloudrl trainer: {len(lines)} config key(s) differ from {against} (every key with its value: "
        f"python -m cloudrl.trainer --preset {preset} --help-config{saved})"
    )
    return "\n".join([head + (":" if lines else ""), *lines])


def _as_override(value) -> str:
    """A config value as it is written on the command line (`trainer.loggers=[console,jsonl]`)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_as_override(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_as_override(v)}" for k, v in value.items()) + "}"
    return "" if value is None else str(value)


def debugger_hint(env) -> str | None:
    """One line for the job log when the cluster's workers run with a debugger (`cloudrl local up
    --debugger`, which also puts the attach command in CLOUDRL_DEBUGGER_ATTACH), else None."""
    debugger = env.get("CLOUDRL_DEBUGGER")
    if not debugger or not env.get("RAY_DEBUG"):  # set in a shell, not by the cluster: no debugger runs
        return None
    attach = env.get("CLOUDRL_DEBUGGER_ATTACH") or "docs/debugging.md"
    return (
        f"debugger: {debugger}: a breakpoint() in a worker pauses it until you attach (reward.timeout_s=0 keeps "
        f"a paused reward call from stopping the run): {attach}"
    )


if __name__ == "__main__":
    sys.exit(main())
