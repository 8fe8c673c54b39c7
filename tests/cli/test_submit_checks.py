"""`cloudrl submit` runs the trainer's own check of the code the config names (reward.function,
rollout.environment) before anything is sent, on the files as the job will have them: a wrong class name
fails here in one line, not on the cluster seconds later. No cluster is started or contacted: the address
given names a port nothing listens on, so reaching it would give another error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import typer.testing
from cloudrl.cli.app import app
from servers import free_port

runner = typer.testing.CliRunner()

ENV = """
from cloudrl.trainer.rollout.environment import StepResult


class Guess:
    def reset(self, sample):
        return ""

    def step(self, action_text):
        return StepResult(done=True)
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's directory with envs/guess.py (class Guess), the current directory of the command."""
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "guess.py").write_text(ENV)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CLOUDRL_DEBUG", raising=False)
    return tmp_path


def submit(*args: str):
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens: a submit that got this far would say so
    return runner.invoke(app, ["submit", "--address", closed, *args])


def one_line(result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "submit"])
def test_a_wrong_environment_class_fails_before_anything_is_sent(project: Path, dry_run: bool) -> None:
    result = submit(*(["--dry-run"] if dry_run else []), "rollout.environment=envs/guess.py:Gues")
    assert one_line(result) == (
        "error: envs/guess.py has no class 'Gues' (did you mean Guess?): it defines Guess, StepResult; "
        "fix rollout.environment='envs/guess.py:Gues'"
    )
    assert "job request" not in result.output  # --dry-run printed nothing of a request


def test_the_right_class_passes_and_leaves_no_module_behind(project: Path) -> None:
    result = submit("--dry-run", "rollout.environment=envs/guess.py:Guess")
    assert result.exit_code == 0, result.output
    (project / "my_envs.py").write_text(ENV)
    result = submit("--dry-run", "rollout.environment=my_envs:Guess")
    assert result.exit_code == 0, result.output
    assert "my_envs" not in sys.modules  # imported from the job's files as laid out for the check, then dropped
    assert not [p for p in sys.path if "cloudrl-check-" in p]


def test_a_file_outside_the_directory_is_named_as_the_config_names_it(project: Path, tmp_path_factory) -> None:
    """Shipped as _external/1/guess.py (and the config rewritten): the line still names the user's path."""
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "guess.py").write_text(ENV)
    spec = f"{elsewhere}/guess.py:Gues"
    assert one_line(submit("--dry-run", f"rollout.environment={spec}")) == (
        f"error: {elsewhere}/guess.py has no class 'Gues' (did you mean Guess?): it defines Guess, StepResult; "
        f"fix rollout.environment='{spec}'"
    )


def test_a_reward_function_typo_fails_here(project: Path) -> None:
    (project / "my_reward.py").write_text("def score(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    assert one_line(submit("--dry-run", "reward.function=my_reward.py:scor")).startswith(
        "error: my_reward.py has no function 'scor' (did you mean score?)"
    )
    assert one_line(submit("--dry-run", "reward.function=exact_mtch")).startswith(
        "error: unknown reward function 'exact_mtch' (did you mean exact_match?)"
    )


def test_a_module_missing_here_is_left_to_the_cluster(project: Path) -> None:
    """It may be installed on the cluster, or come with --pip: submit goes on and says so."""
    (project / "envs" / "needs.py").write_text("import surely_not_installed_here\n\nclass E:\n    pass\n")
    result = submit("--dry-run", "--pip", "surely-not-installed-here", "rollout.environment=envs/needs.py:E")
    assert result.exit_code == 0, result.output
    assert "note: module 'surely_not_installed_here': not installed here" in result.stderr
