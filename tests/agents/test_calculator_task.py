"""The built-in tool task (trainer/agents/calculator.py): the calculator tool, the environment's scoring and loss
mask with a scripted engine, the task's data and warm-up, its preset, and (on a real local Ray instance) the
policy learning to call the tool through the trainer."""

from __future__ import annotations

import json
import random

import pytest
from cloudrl.trainer.agents.calculator import (
    ENVIRONMENT,
    CalculatorEnvironment,
    calculate,
    calculator,
    call_text,
    main,
    make_problems,
    warm_up_example,
    warm_up_model,
    warm_up_rows,
    write_task,
)
from cloudrl.trainer.config import load_config
from cloudrl.trainer.inputs.demo import WarmUp, build_char_tokenizer
from cloudrl.trainer.inputs.user_files import load_environment
from cloudrl.trainer.rollout.engines import Completion, SamplingSettings
from cloudrl.trainer.rollout.environment import ENV_REWARD, EpisodeLimits, EpisodeLoop
from runs import step_metrics


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.mark.parametrize(
    "expression, value",
    [("37*45+123", 1788), ("(1+2)*3", 9), ("-4/2", -2), ("7/2", 3.5), (" 2 * -3 ", -6), ("1.5+1.5", 3.0)],
)
def test_the_calculator_computes(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression, words",
    [
        ("1/0", "division by zero"),
        ("2*(3", "ends too early"),
        ("2)", "unexpected '\\)'"),
        ('__import__("os").system("true")', "unexpected '_'"),
        ("2**3", "unexpected '\\*'"),
        ("9" * 16 + "*10", "a value beyond"),
        ("1+" * 60 + "1", "longer than 100"),
        ("", "empty expression"),
    ],
)
def test_the_calculator_refuses_what_is_not_arithmetic(expression, words):
    with pytest.raises(ValueError, match=words):
        calculate(expression)


def test_results_are_written_as_the_answer_is():
    assert (calculator("6/3"), calculator("1/3"), calculator("2.5*2")) == ("2", "0.3333333333", "5")


class Scripted:
    """Turn k of every sample is script[k], cut at a stop string like the engines; log-probs -1."""

    def __init__(self, tok, script: list[str]):
        self.tok, self.script = tok, script

    def generate(self, contexts, settings):
        out = []
        for ctx in contexts:
            turn = self.tok.decode(ctx, skip_special_tokens=True).count("<tool_response>")
            text = self.script[turn]
            eos = text.endswith("<eos>")
            text = text.removesuffix("<eos>")
            cut = [text.find(s) + len(s) for s in settings.stop if s in text]
            text = text[: min(cut)] if cut else text
            ids = self.tok.encode(text, add_special_tokens=False) + ([self.tok.eos_token_id] if eos else [])
            out += [Completion(ids, [-1.0] * len(ids), "stop")] * settings.n
        return out


def _episode(tok, script: list[str], truth: str = "1788") -> tuple[Completion, str]:
    loop = EpisodeLoop(Scripted(tok, script).generate, tok, CalculatorEnvironment, EpisodeLimits(2, 256, 96, 10.0))
    settings = SamplingSettings(max_new_tokens=88, n=1)
    (c,) = loop.run([tok.encode("37*45+123=", add_special_tokens=False)], settings, [{"ground_truth": truth}])
    return c, tok.decode(c.token_ids, skip_special_tokens=True)


def test_a_call_then_the_answer_scores_and_only_the_models_tokens_are_trained(tok):
    c, text = _episode(tok, [call_text("37*45+123") + " ignored", "1788<eos>"])
    assert text == call_text("37*45+123") + "\n<tool_response>1788</tool_response>\n1788"
    trained = tok.decode([t for t, m in zip(c.token_ids, c.loss_mask) if m], skip_special_tokens=True)
    assert trained == call_text("37*45+123") + "1788"  # the tool's response is never a target
    assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask) if not m)
    assert (c.turns["tool_calls"], c.turns["tool_errors"], c.turns[ENV_REWARD]) == (1, 0, 1.0)


@pytest.mark.parametrize(
    "script, reward, errors",
    [
        (["1788<eos>"], 1.0, 0),  # right without the tool: scored the same
        (["1789<eos>"], 0.0, 0),
        ([" 1788 <eos>"], 1.0, 0),  # surrounding whitespace aside
        (["1788.0<eos>"], 0.0, 0),  # the digits exactly
        (['<tool_call>{"name":"calculator","arguments":{"expression":"2*("}}</tool_call>', "1788<eos>"], 1.0, 1),
    ],
)
def test_the_answer_scores_one_exact_and_zero_otherwise(tok, script, reward, errors):
    c, text = _episode(tok, script)
    assert c.turns[ENV_REWARD] == reward and c.turns["tool_errors"] == errors, text
    if errors:
        assert '{"error": "ValueError: the expression ends too early"}' in text  # answered, the episode went on


def test_the_task_and_the_warm_up_share_no_problem(tmp_path, tok):
    paths = write_task(tmp_path, size=30, val_size=6, seed=2)
    rows = {k: [json.loads(line) for line in paths[k].read_text().splitlines()] for k in ("prompts", "val")}
    problems = make_problems(36, 2)
    assert [r["prompt"] for r in rows["prompts"] + rows["val"]] == [f"{p}=" for p in problems]
    assert all(r["answer"] == str(calculate(r["prompt"][:-1])) and len(r["answer"]) == 4 for r in rows["prompts"])
    many = make_problems(5000, 0)
    batch = warm_up_rows(tok, random.Random(0), 4000, 0.2, set(many))
    texts = [tok.decode(ids, skip_special_tokens=True) for ids, _, _ in batch]
    assert not {t.split("=")[0] for t in texts} & set(many)
    # The choice (the first token after "=") is taught at the share: "<" (call) against a digit (guess).
    choices = [tok.convert_ids_to_tokens(lab[10]) for _, lab, _ in batch if lab[10] != -100]
    assert abs(choices.count("<") / len(choices) - 0.2) < 0.03


def test_the_warm_up_teaches_the_format_and_never_a_task_answer(tok):
    ids, labels, reads = warm_up_example(tok, "37*45+123", True, random.Random(0), learn_choice=False)
    learned = tok.decode([t for t, lab in zip(ids, labels) if lab != -100], skip_special_tokens=True)
    assert learned == call_text("37*45+123")[1:] + "1788"  # the response is context; the choice is not taught
    ids, labels, _ = warm_up_example(tok, "37*45+123", False, random.Random(0))
    guess = tok.decode(ids, skip_special_tokens=True).split("=")[1]
    assert len(guess) == 4 and guess != "1788"  # without the tool, a random number: the format only


def test_the_preset_names_the_environment_and_loads_it():
    cfg = load_config("calculator")
    assert cfg.rollout.environment == ENVIRONMENT and cfg.reward.function == "none"
    assert load_environment(cfg.rollout.environment) is CalculatorEnvironment
    episode = call_text("37*45+123") + CalculatorEnvironment().wrap(["<tool_response>1788</tool_response>"]) + "1788"
    assert cfg.rollout.max_turns == 2 and cfg.rollout.max_new_tokens >= len(call_text("37*45+123"))
    assert cfg.rollout.max_episode_tokens >= len(episode) + 1  # characters are tokens; + end-of-sequence


def test_the_command_refuses_a_bad_share_in_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["--tool-share", "1.5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert "--tool-share 1.5: give a share strictly between 0 and 1" in err[-1]


# A warm-up shorter than the command's (300 steps of 32 rows), its answers weighted to learn reading sooner,
# and 8 steps of 8 prompts x 8 samples.
SEED, WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR, READ_WEIGHT, STEPS = 0, 220, 16, 2.5e-3, 2.0, 8


@pytest.mark.ray
def test_the_policy_learns_to_call_the_calculator(ray_local, tmp_path):
    """The trainer runs the task on Ray with rollout and reward workers: calls per sample and the reward rise
    from the first steps to the last (the warm-up calls 1 time in 5; a guess is almost never right), and the
    loss mask leaves the tool's responses out (their engine log-prob is 0; trained on, they would differ)."""
    from cloudrl.trainer.driver import train

    paths = write_task(tmp_path / "task", size=1000, val_size=1, seed=SEED)
    exclude = set(make_problems(1001, SEED))
    schedule = WarmUp(steps=WARMUP_STEPS, lr=WARMUP_LR, seed=SEED, batch_size=WARMUP_BATCH)
    model = warm_up_model(tmp_path / "model", exclude, schedule, read_weight=READ_WEIGHT)
    overrides = {
        "model.path": model,
        "data.train_files": paths["prompts"],
        "data.val_files": "",
        "trainer.run_dir": tmp_path / "run",
        "trainer.total_steps": STEPS,
        "trainer.loggers": "[jsonl]",
        "trainer.export_hf": "false",
        "trainer.seed": SEED,
        "data.train_batch_size": 8,
        "actor.mini_batch_size": 64,
        "actor.micro_batch_size": 64,
        "critic.mini_batch_size": 64,
        "critic.micro_batch_size": 64,
    }
    train(load_config("calculator", [f"{k}={v}" for k, v in overrides.items()]))
    steps = step_metrics(tmp_path / "run")
    assert len(steps) == STEPS
    mean = lambda block, key: sum(r[key] for r in block) / len(block)  # noqa: E731
    first, last = steps[:3], steps[-3:]
    trace = [(round(r["rollout/reward_mean"], 2), round(r["env/tool_calls_per_sample"], 2)) for r in steps]
    assert mean(last, "env/tool_calls_per_sample") > mean(first, "env/tool_calls_per_sample") + 0.25, trace
    assert mean(last, "rollout/reward_mean") > mean(first, "rollout/reward_mean") + 0.1, trace
    assert all(r["env/observation_tokens_per_sample"] > 0 for r in steps)
    assert max(r["rollout/logprob_diff"] for r in steps) < 0.01
