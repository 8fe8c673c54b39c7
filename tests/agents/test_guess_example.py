"""examples/guess-env, docs/agents.md's environment example: the game's rules, its tool variant's calls and
score through the episode loop, the warm-up's rows, the preset composed on `base: local`, and (on a real local
Ray instance) the warmed-up tiny model learning to use the answers through the trainer."""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import pytest
from cloudrl.trainer.config import load_config
from cloudrl.trainer.inputs.demo import build_char_tokenizer
from cloudrl.trainer.inputs.user_files import load_environment
from cloudrl.trainer.rollout.engines import Completion, SamplingSettings
from cloudrl.trainer.rollout.environment import ENV_REWARD, EpisodeLimits, EpisodeLoop
from runs import first_and_last_means, metric_rows, step_metrics

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "guess-env"
sys.path.insert(0, str(EXAMPLE))

from guess import PROMPT, Guess  # noqa: E402
from guess_tool import GuessWithTool  # noqa: E402
from warm_up import call_text, made_up_episode, made_up_tool_episode  # noqa: E402
from warm_up import main as warm_up  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def play(env, target: int, guesses: list[str]) -> list:
    env.reset({"ground_truth": str(target)})
    return [env.step(g) for g in guesses]


def test_each_miss_is_answered_with_the_direction_and_the_range_left():
    results = play(Guess(), 3, ["5.", "1.", "8.", "3."])
    assert [r.observation for r in results[:3]] == [" lower, 0-4: ", " higher, 2-4: ", " lower, 2-4: "]
    assert [r.reward for r in results] == [None, None, None, 1.0] and results[-1].done
    assert play(Guess(), 7, [" x.", "77."])[1].observation == " one digit, 0-9: "  # not a digit: asked again


def test_the_docs_show_the_example_as_it_is():
    block = re.search(r"```python\n(# examples/guess-env/guess\.py.*?)```", (REPO / "docs/agents.md").read_text(), re.S)
    assert block is not None, "docs/agents.md shows examples/guess-env/guess.py in a python block"
    shown = block.group(1).split("\n", 1)[1]
    assert shown in (EXAMPLE / "guess.py").read_text()


class Scripted:
    """Turn k of every episode is script[k], cut after a stop string as the engines cut it; log-probs -1."""

    def __init__(self, tok, script: list[str]):
        self.tok, self.script, self.turn = tok, script, 0

    def generate(self, contexts, settings):
        text = self.script[self.turn]
        self.turn += 1
        cut = [text.find(s) + len(s) for s in settings.stop if s in text]
        text = text[: min(cut)] if cut else text
        ids = self.tok.encode(text, add_special_tokens=False)
        return [Completion(ids, [-1.0] * len(ids), "stop") for _ in contexts]


def episode(tok, env_class, script: list[str], target: int = 6, max_new_tokens: int = 96) -> tuple[Completion, str]:
    loop = EpisodeLoop(Scripted(tok, script).generate, tok, env_class, EpisodeLimits(3, 400, 64, 10.0))
    settings = SamplingSettings(max_new_tokens=max_new_tokens, n=1)
    (c,) = loop.run([tok.encode(PROMPT, add_special_tokens=False)], settings, [{"ground_truth": str(target)}])
    return c, tok.decode(c.token_ids, skip_special_tokens=True)


def test_the_game_plays_through_the_episode_loop_and_trains_only_the_guesses(tok):
    c, text = episode(tok, Guess, ["4. and more", "7.", "6."], max_new_tokens=3)
    assert text == "4. higher, 5-9: 7. lower, 5-6: 6."
    trained = tok.decode([t for t, m in zip(c.token_ids, c.loss_mask) if m], skip_special_tokens=True)
    assert trained == "4.7.6."
    assert (c.turns["turns"], c.turns[ENV_REWARD]) == (3, 1.0)


@pytest.mark.parametrize(
    "script, reward, calls, turns",
    [
        ([call_text(4), call_text(6)], 1.0, 2, 2),  # a miss, then the digit: the call ends the episode
        ([call_text(6), "ignored"], 1.0, 1, 1),
        (["pass"], 0.0, 0, 1),  # a turn without a call gives up
        ([call_text(4), "pass"], 0.0, 1, 2),
        ([call_text(4), call_text(5)], 0.0, 2, 2),  # two misses: max_turns
    ],
)
def test_the_tool_variant_answers_each_call_and_a_right_one_ends_the_episode(tok, script, reward, calls, turns):
    loop = EpisodeLoop(Scripted(tok, script).generate, tok, GuessWithTool, EpisodeLimits(2, 192, 64, 10.0))
    settings = SamplingSettings(max_new_tokens=64, n=1)
    (c,) = loop.run([tok.encode(PROMPT, add_special_tokens=False)], settings, [{"ground_truth": "6"}])
    text = tok.decode(c.token_ids, skip_special_tokens=True)
    assert (c.turns.get(ENV_REWARD, 0.0), c.turns["tool_calls"], c.turns["turns"]) == (reward, calls, turns), text
    if script[0] == call_text(4):
        assert "<tool_response>higher</tool_response>" in text


def test_a_call_with_a_bad_argument_is_answered_with_its_error():
    env = GuessWithTool()
    env.reset({"ground_truth": "6"})
    result = env.step('<tool_call>{"name":"guess","arguments":{"digit":"six"}}</tool_call>')
    assert "ValueError" in result.observation and not result.done and result.info["tool_errors"] == 1


def test_each_tool_episode_has_its_own_tool():
    a, b = GuessWithTool(), GuessWithTool()
    a.reset({"ground_truth": "2"})
    b.reset({"ground_truth": "8"})
    assert (a.guess(5), b.guess(5)) == ("lower", "higher")
    assert (a.guess(2), b.guess(2)) == ("right", "higher") and a.found and not b.found


def test_the_warm_up_teaches_the_format_never_the_answers(tok):
    rng = random.Random(0)
    rows = [made_up_episode(tok, rng) for _ in range(400)]
    for ids, labels, _ in rows[:50]:
        trained = tok.decode([t for t, lab in zip(ids, labels) if lab != -100])
        assert re.fullmatch(r"(\d\.){1,3}", trained), trained
    # The second guess is uniform whatever the first answer said: inside the range left as often as by chance.
    inside, by_chance = 0, 0.0
    for ids, _, _ in rows:
        found = re.match(r"Guess my digit, 0-9: \d\. \w+, (\d)-(\d): (\d)\.", tok.decode(ids))
        if found:
            low, high, guess = map(int, found.groups())
            inside += low <= guess <= high
            by_chance += (high - low + 1) / 10
    assert by_chance > 100 and abs(inside - by_chance) < 0.15 * by_chance


def test_the_tool_warm_up_teaches_the_call_and_giving_up_at_its_share(tok):
    rng = random.Random(0)
    rows = [made_up_tool_episode(tok, rng, 0.3) for _ in range(2000)]
    first = [tok.decode(ids, skip_special_tokens=True)[len(PROMPT)] for ids, _, _ in rows]
    assert abs(first.count("<") / len(first) - 0.3) < 0.03  # the first turn calls at the share; "p"ass otherwise
    for ids, labels, _ in rows[:50]:
        trained = tok.decode([t for t, lab in zip(ids, labels) if lab != -100], skip_special_tokens=True)
        assert re.fullmatch(r"(<tool_call>.*?</tool_call>){0,2}(pass)?", trained), trained  # never a response
        assert len(ids) <= load_config(str(EXAMPLE / "guess_tool.yaml")).rollout.max_episode_tokens + len(PROMPT)


def test_the_preset_is_local_plus_its_own_keys():
    cfg = load_config(str(EXAMPLE / "guess.yaml"))
    local = load_config("local")
    assert cfg.rollout.environment == "guess.py:Guess" and cfg.reward.function == "none"
    assert (cfg.algorithm.name, cfg.algorithm.kl_coef, cfg.critic.lr) == (
        local.algorithm.name,
        local.algorithm.kl_coef,
        local.critic.lr,
    )
    assert cfg.trainer.run_dir != local.trainer.run_dir  # a directory of its own


def test_the_environment_loads_from_the_presets_folder(monkeypatch):
    monkeypatch.chdir(EXAMPLE)
    assert load_environment("guess.py:Guess").__name__ == "Guess"


@pytest.mark.ray
def test_the_warmed_up_model_learns_to_use_the_answers(ray_local, tmp_path, monkeypatch):
    """The example as docs/agents.md runs it, from its folder: warm_up.py, then the trainer on guess.yaml, for
    the first 125 of its 200 steps. The warmed-up model ignores the answers (greedy val reward 0.1: one digit in
    ten); by then it uses them: the greedy val reward and the rollout reward rise."""
    from cloudrl.trainer.driver import train

    monkeypatch.chdir(EXAMPLE)
    model = warm_up(["--out", str(tmp_path / "model")])
    overrides = {  # the preset's paths made absolute: the session's Ray workers start in another directory
        "model.path": model,
        "rollout.environment": f"{EXAMPLE / 'guess.py'}:Guess",
        "data.train_files": EXAMPLE / "train.jsonl",
        "data.val_files": EXAMPLE / "val.jsonl",
        "trainer.run_dir": tmp_path / "run",
        "trainer.loggers": "[jsonl]",
        "trainer.export_hf": "false",
        "trainer.sample_every": 0,
        "trainer.total_steps": 125,  # measured with the preset's 200: val 0.1 -> 0.4 at step 125, 0.5 at 150
    }
    train(load_config(str(EXAMPLE / "guess.yaml"), [f"{k}={v}" for k, v in overrides.items()]))
    val = [r["val/reward_mean"] for r in metric_rows(tmp_path / "run") if "val/reward_mean" in r]
    first, last = first_and_last_means([r["rollout/reward_mean"] for r in step_metrics(tmp_path / "run")], 10)
    assert val[0] <= 0.15 and val[-1] >= 0.35, val  # 1 digit in 10, then 4: 0.1 -> 0.4 measured
    assert last > first + 0.05, (round(first, 3), round(last, 3))  # 0.29 -> 0.39 measured


@pytest.mark.ray
def test_the_tool_variant_learns_to_call_more(ray_local, tmp_path, monkeypatch):
    """The tool variant as docs/agents.md runs it: warm_up.py --tool, then the trainer on guess_tool.yaml for 15
    of its 20 steps. The warmed-up model calls about 1 turn in 4 and gives up otherwise; calling is the only way
    to find the digit, so the calls per sample and the digits found rise."""
    from cloudrl.trainer.driver import train

    monkeypatch.chdir(EXAMPLE)
    model = warm_up(["--tool", "--out", str(tmp_path / "model")])
    overrides = {
        "model.path": model,
        "rollout.environment": f"{EXAMPLE / 'guess_tool.py'}:GuessWithTool",
        "data.train_files": EXAMPLE / "train.jsonl",
        "data.val_files": "",
        "trainer.run_dir": tmp_path / "run",
        "trainer.loggers": "[jsonl]",
        "trainer.export_hf": "false",
        "trainer.sample_every": 0,
        "trainer.total_steps": 15,
    }
    train(load_config(str(EXAMPLE / "guess_tool.yaml"), [f"{k}={v}" for k, v in overrides.items()]))
    steps = step_metrics(tmp_path / "run")
    trace = [(round(r["env/tool_calls_per_sample"], 2), round(r["rollout/reward_mean"], 2)) for r in steps]
    first, last = first_and_last_means([r["env/tool_calls_per_sample"] for r in steps], 3)
    assert last > first + 0.4, trace
    first, last = first_and_last_means([r["rollout/reward_mean"] for r in steps], 5)
    assert last > first + 0.03, trace
