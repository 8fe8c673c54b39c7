"""Run the trainer: `python -m cloudrl.trainer [--preset NAME|FILE.yaml] [key=value ...]`.

On a Ray cluster (a job submitted with `cloudrl submit`) it joins that cluster; run on its own it
starts a local Ray instance. Examples:

    python -m cloudrl.trainer                                   # the local default (tiny model, CPU)
    python -m cloudrl.trainer --preset local algorithm.name=grpo trainer.total_steps=5
    python -m cloudrl.trainer --preset local --help-config      # every key, its value and meaning
    python -m cloudrl.trainer --preset local --eval-only        # score the latest checkpoint, no training

Expected failures (bad config, missing model, cluster too small) print one line and exit 1; set
CLOUDRL_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys


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


if __name__ == "__main__":
    sys.exit(main())
