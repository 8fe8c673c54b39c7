"""The one place the CLI relies on Typer's (and Click's) internals (typer pinned to 0.29 in pyproject).

`OneLineErrors` is the command group every `cloudrl` command runs under. It overrides Click's
`Group.make_context` and `Group.invoke` to turn an expected failure into one red line on stderr (exit
1) and a usage error into one line naming the command's --help (exit 2), instead of Typer's boxed
panel. Typer 0.29 bundles its own Click, so usage errors arrive as `typer.TyperException`, not as
`click.UsageError`.

It is the group, not `main()` calling the app with Click's `standalone_mode=False`, because whatever
runs the app's Click command directly (typer.testing.CliRunner in the tests, a program embedding the
app) never passes through `main()`. tests/cli/test_bad_input_parse.py sends every kind of error through the
app and fails when a Typer upgrade changes what this relies on.
"""

from __future__ import annotations

import os
from typing import Any, NoReturn

import typer
from cloudrl.trainer.errors import TrainerError
from typer.core import TyperGroup


class OneLineErrors(TyperGroup):
    """Turns expected failures into one red line: exit status 1, or 2 for a usage error."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: typer.Context | None = None, **extra: Any
    ) -> typer.Context:
        # The top-level group parses its own options here, before `invoke` (e.g. `cloudrl --bogus`).
        try:
            return super().make_context(info_name, args, parent, **extra)
        except typer.TyperException as exc:
            _usage_error(exc, " ".join(filter(None, [parent.command_path if parent else None, info_name])))

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except typer.TyperException as exc:  # a sub-command's options and arguments are parsed in here
            _usage_error(exc, " ".join(filter(None, [ctx.command_path, ctx.invoked_subcommand])))
        except TrainerError as exc:  # CloudrlError and the trainer's config errors alike
            if os.environ.get("CLOUDRL_DEBUG"):
                raise
            _red_line(str(exc))
            raise typer.Exit(1) from None


def _usage_error(exc: typer.TyperException, command: str) -> NoReturn:
    """Typer's usage errors (unknown option, missing argument, bad value) as one line, not its boxed panel."""
    # NoArgsIsHelpError carries the help text that `no_args_is_help` shows; Typer tells it by name too.
    if type(exc).__name__ == "NoArgsIsHelpError" or os.environ.get("CLOUDRL_DEBUG"):
        raise exc
    message = exc.format_message().strip().rstrip(".")
    ctx = getattr(exc, "ctx", None)
    _red_line(f"{message[:1].lower()}{message[1:]}: see `{ctx.command_path if ctx else command or 'cloudrl'} --help`")
    raise typer.Exit(exc.exit_code)


def _red_line(message: str) -> None:
    typer.secho(f"error: {' '.join(message.split())}", fg=typer.colors.RED, err=True)
