"""Dynamic sampling (rollout/dynamic_sampling.py `refill`, driver `Trainer.refill`) with a stand-in generator and
reward: groups whose samples all score the same are dropped, the batch is refilled to size from new
prompts, the bound on rounds keeps a too-hard task from looping, and with rollout.max_staleness=1 the
next batch starts only after the refill, from where the loader then stands."""

from __future__ import annotations

import pytest
import torch
from cloudrl.trainer.config import load_config
from cloudrl.trainer.driver import Sampled, Trainer
from cloudrl.trainer.errors import ConfigError, TrainerError
from cloudrl.trainer.inputs.data import PromptLoader, PromptRecord
from cloudrl.trainer.rollout.dynamic_sampling import NothingInformative, Round, differing_groups, refill
from cloudrl.trainer.rollout.engines import Completion
from cloudrl.trainer.rollout.queue import Rollouts

N = 4


def _prompts(first: int, count: int) -> list[PromptRecord]:
    return [PromptRecord([first + i], f"p{first + i}", "", "test") for i in range(count)]


def _reward(prompt: PromptRecord, sample: int) -> float:
    """Even prompts: every sample scores 1 (nothing to learn); odd prompts: samples differ."""
    pid = prompt.prompt_ids[0]
    return 1.0 if pid % 2 == 0 else float(sample % 2)


def _round(prompts: list[PromptRecord], reward=_reward) -> Round:
    completions = [Completion([p.prompt_ids[0], j], [0.0, 0.0], "stop") for p in prompts for j in range(N)]
    scores = torch.tensor([reward(p, j) for p in prompts for j in range(N)])
    return Round(prompts, completions, scores, waited_s=0.5)


def test_uniform_groups_are_dropped_and_the_batch_refilled_to_size() -> None:
    assert differing_groups(torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 0]), N).tolist() == [False, True]
    fresh = iter(range(100, 1000, 8))
    drawn = []

    def more() -> Round:
        drawn.append(next(fresh))
        return _round(_prompts(drawn[-1], 8))

    kept, metrics = refill(_round(_prompts(0, 8)), more, size=8, n=N, max_rounds=5)
    ids = [p.prompt_ids[0] for p in kept.prompts]
    assert ids == [1, 3, 5, 7, 101, 103, 105, 107]  # half of each round kept, in order; 2 rounds fill 8
    assert len(drawn) == 1
    assert len(kept.completions) == 8 * N and kept.scores.shape == (8 * N,)
    assert [c.token_ids[0] for c in kept.completions[::N]] == ids  # samples stay with their prompt
    assert not any(g.unique().numel() == 1 for g in kept.scores.view(-1, N))
    assert metrics == {
        "rollout/sampling_rounds": 2.0,
        "rollout/kept_fraction": 0.5,
        "rollout/samples_per_kept": 2.0,
        "rollout/filled_uniform": 0.0,
    }
    assert kept.waited_s == pytest.approx(1.0)


def test_the_bound_on_rounds_trains_on_what_was_kept_or_ends_the_run() -> None:
    rounds = []

    def mostly_uniform() -> Round:
        rounds.append(1)
        return _round(_prompts(1000 + 2 * 8 * len(rounds), 8), reward=lambda p, j: 1.0)

    first = _round(_prompts(0, 8))  # 4 of 8 prompts differ
    kept, metrics = refill(first, mostly_uniform, size=8, n=N, max_rounds=3)
    assert len(rounds) == 2 and metrics["rollout/sampling_rounds"] == 3
    assert len(kept.prompts) == 8  # the batch keeps its size: 4 informative, then 4 equal-score ones
    assert metrics["rollout/filled_uniform"] == 0.5
    assert differing_groups(kept.scores, N).tolist() == [True] * 4 + [False] * 4

    calls = []

    def too_hard() -> Round:
        calls.append(1)
        return _round(_prompts(0, 8), reward=lambda p, j: 0.0)

    with pytest.raises(NothingInformative) as err:
        refill(too_hard(), too_hard, size=8, n=N, max_rounds=4)
    assert len(calls) == 4  # the bound, not a loop
    message = str(err.value)
    assert "\n" not in message and "algorithm.max_sampling_rounds=4" in message
    assert isinstance(err.value, TrainerError)  # python -m cloudrl.trainer prints it as one line


class _Queue:
    """Records the order of the driver's calls to the rollout queue."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, settings, phase="generation", what=""):
        self.calls.append(("generate", [p.prompt_ids[0] for p in prompts], settings.seed))
        return Rollouts(_round(prompts).completions, 0, 0.0, None, [p for p in prompts for _ in range(N)])

    def start(self, step, prompts, settings):
        self.calls.append(("start", step, [p.prompt_ids[0] for p in prompts]))

    def started_through(self, step):
        return step  # the step's own batch was taken, none is in flight


class _Push:
    def release_engines(self):
        pass


def test_trainer_refill_draws_from_the_loader_then_starts_the_next_batch() -> None:
    cfg = load_config(
        "local",
        ["algorithm.name=grpo", "algorithm.dynamic_sampling=true", "rollout.max_staleness=1", "rollout.n=4"]
        + ["data.train_batch_size=8", "actor.mini_batch_size=32", "actor.micro_batch_size=32"],
    )
    trainer = Trainer.__new__(Trainer)
    trainer.cfg = cfg
    trainer.global_step = 3
    trainer.loader = PromptLoader(_prompts(0, 64), batch_size=8, shuffle=False)
    trainer.rollouts = _Queue()
    trainer.push_weights = _Push()
    trainer.stop = None
    trainer.score = lambda got: _round(got.records[::N]).scores
    first_prompts = trainer.loader.next_batch()  # what fit hands the step: prompts 0..7
    first = _round(first_prompts)
    got = Rollouts(first.completions, 1, 0.25, None)
    out = trainer.refill(Sampled(got, [], first.scores, first.scores, {}), first_prompts, sees_weights=False)

    assert [r.prompt_ids[0] for r in out.records[::N]] == [1, 3, 5, 7, 9, 11, 13, 15]
    assert out.rollouts.lag == 1 and len(out.rollouts.completions) == 8 * N
    assert out.generated.numel() == 16 * N  # rollout/reward_mean covers every sample generated
    assert out.metrics["rollout/samples_per_kept"] == 2.0
    generate, start = trainer.rollouts.calls
    assert generate[:2] == ("generate", list(range(8, 16)))
    # The next step's batch starts after the refill, with the prompts the loader gives next: a resumed
    # run (whose loader state was saved after this step) starts from the same place.
    assert start == ("start", 4, list(range(16, 24)))
    assert trainer.loader.state_dict() == {"epoch": 0, "index": 16}


def test_dynamic_sampling_needs_a_group_algorithm() -> None:
    with pytest.raises(ConfigError) as err:
        load_config("local", ["algorithm.dynamic_sampling=true"])
    assert "algorithm.dynamic_sampling=true" in str(err.value) and "grpo" in str(err.value)
    with pytest.raises(ConfigError, match="algorithm.max_sampling_rounds must be >= 1"):
        load_config("local", ["algorithm.name=grpo", "algorithm.max_sampling_rounds=0"])
