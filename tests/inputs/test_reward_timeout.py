"""A reward function that never returns (an HTTP judge without a timeout) ends the step after
reward.timeout_s with one line naming the function and the key, on the reward workers and with
reward.in_driver; a function that returns in time is unaffected."""

from __future__ import annotations

import os
import time

import pytest
from cloudrl.trainer.errors import RewardError
from cloudrl.trainer.inputs.data import PromptRecord
from cloudrl.trainer.inputs.rewards import score
from runs import ROLLOUT_IN_ACTOR, WITHOUT_CRITIC, run_trainer, tiny_overrides

SLOW = "import time\n\ndef slow(completions, **columns):\n    time.sleep(10**6)\n    return [0.0] * len(completions)\n"


def _records(n: int) -> list[PromptRecord]:
    return [PromptRecord([1], "1+1=", "2", "arithmetic") for _ in range(n)]


def test_a_hung_reward_call_ends_after_the_timeout_with_one_line():
    def hangs(completions, **columns):
        time.sleep(10**6)

    start = time.monotonic()
    with pytest.raises(RewardError) as err:
        score(hangs, ["2", "3"], _records(2), "judge.py:hangs", timeout_s=0.5)
    assert time.monotonic() - start < 5
    assert str(err.value).startswith(
        "reward.function=judge.py:hangs did not return within reward.timeout_s=0.5s on a batch of 2 completions"
    )
    assert "\n" not in str(err.value)


def test_in_time_and_raising_reward_calls_behave_as_without_a_limit():
    def fine(completions, **columns):
        return [float(c == "2") for c in completions]

    def raises(completions, **columns):
        raise ValueError("judge down")

    assert score(fine, ["2", "3"], _records(2), "f", timeout_s=5) == [1.0, 0.0]
    with pytest.raises(RewardError, match="raised ValueError: judge down"):
        score(raises, ["2"], _records(1), "f", timeout_s=5)


@pytest.mark.ray
@pytest.mark.parametrize("in_driver", ["false", "true"])
def test_a_run_whose_reward_hangs_ends_with_one_line(ray_local, tmp_path, in_driver):
    (tmp_path / "slow.py").write_text(SLOW)
    overrides = tiny_overrides(
        tmp_path / "run",
        **{
            "reward.function": f"{tmp_path / 'slow.py'}:slow",
            "reward.timeout_s": 3,
            "reward.in_driver": in_driver,
            "model.sft_warmup_steps": 0,
            "trainer.export_hf": "false",
            **WITHOUT_CRITIC,
            **ROLLOUT_IN_ACTOR,  # the actor, and the reward worker unless the driver scores
        },
    )
    start = time.monotonic()
    # On the session's Ray instance: the run's roles, the hung reward worker's included, end with the run.
    result = run_trainer(
        *overrides, env={"CLOUDRL_CACHE": os.environ["CLOUDRL_CACHE"], "RAY_ADDRESS": ray_local}, timeout=300
    )
    took = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert errors[0].startswith(
        f"error: reward.function={tmp_path / 'slow.py'}:slow did not return within reward.timeout_s=3s"
    ), errors
    assert took < 200, took
