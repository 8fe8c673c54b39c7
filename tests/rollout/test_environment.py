"""The environment interface's episode loop (rollout/environment.py) and chat-template tool calls
(rollout/tool_calls.py), with a scripted engine; one run on the real HF engine with the tiny model. Fast; no cluster."""

from __future__ import annotations

import pickle
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from cloudrl.trainer.config import ConfigError, load_config
from cloudrl.trainer.driver import Trainer
from cloudrl.trainer.errors import DataError, EnvironmentFailed, TrainerError, WorkerTimeout
from cloudrl.trainer.inputs.demo import build_char_tokenizer, build_tiny_model
from cloudrl.trainer.inputs.user_files import load_environment
from cloudrl.trainer.metrics import MetricsLogger
from cloudrl.trainer.rollout.engines import Completion, Completions, HFEngine, SamplingSettings
from cloudrl.trainer.rollout.environment import (
    ENV_REWARD,
    EpisodeLimits,
    EpisodeLoop,
    FailureReport,
    StepResult,
    environment_rewards,
    episode_metrics,
)
from cloudrl.trainer.rollout.tool_calls import (
    ToolEnvironment,
    parse_tool_calls,
    render_prompt,
    tool_response,
    tool_schema,
)

OBS = "[o]"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


class ScriptedEngine:
    """Turn k of a sample is script[k] (the prompt is the context's text up to `|`; k counts the
    observations `[o` or `<tool_response>` seen). Stops like the engines: at a stop string, `<eos>`, or
    max_new_tokens. Log-probs are -1 on every sampled token."""

    def __init__(self, tok, scripts: dict[str, list[str]]):
        self.tok, self.scripts, self.calls = tok, scripts, []

    def generate(self, contexts, settings):
        self.calls.append((len(contexts), settings))
        out = []
        for ctx in contexts:
            text = self.tok.decode(ctx, skip_special_tokens=True)
            prompt, _, rest = text.partition("|")
            turn = rest.count("[o") + rest.count("<tool_response>")
            for _ in range(settings.n):
                out.append(self._turn(self.scripts[prompt + "|"][turn], settings))
        return out

    def _turn(self, script: str, settings) -> Completion:
        eos = script.endswith("<eos>")
        text = script.removesuffix("<eos>")
        cuts = [text.find(s) + len(s) for s in settings.stop if s in text]
        text = text[: min(cuts)] if cuts else text
        ids = self.tok.encode(text, add_special_tokens=False) + ([self.tok.eos_token_id] if eos and not cuts else [])
        reason = "stop" if (cuts or eos) and len(ids) <= settings.max_new_tokens else "length"
        ids = ids[: settings.max_new_tokens]
        return Completion(ids, [-1.0] * len(ids), reason)


LIMITS = EpisodeLimits(4, 300, 64, 5.0)


def _run(tok, scripts, env_class, limits=LIMITS, n=1, samples=None, max_new_tokens=80):
    engine = ScriptedEngine(tok, scripts)
    loop = EpisodeLoop(engine.generate, tok, env_class, limits)
    prompts = [tok.encode(p, add_special_tokens=False) for p in scripts]
    return loop.run(prompts, SamplingSettings(n=n, max_new_tokens=max_new_tokens), samples), engine


class Counting:
    """Per-turn reward 0.5, observation `[o]`, done after the model's second action."""

    stop = ["."]

    def reset(self, sample):
        self.steps, self.sample = 0, sample
        return ""

    def step(self, action_text):
        self.steps += 1
        return StepResult(OBS, reward=0.5, done=self.steps == 2)


def _model_text(tok, c):
    return tok.decode([t for t, m in zip(c.token_ids, c.loss_mask) if m], skip_special_tokens=True)


def test_per_turn_rewards_sum_and_the_mask_covers_exactly_the_models_tokens(tok):
    (c,), engine = _run(tok, {"P|": ["go.", "again.", "never"]}, Counting, samples=[{"ground_truth": "7"}])
    assert tok.decode(c.token_ids) == "go." + OBS + "again."
    obs = len(tok.encode(OBS, add_special_tokens=False))
    assert c.loss_mask == [1] * 3 + [0] * obs + [1] * 6
    assert _model_text(tok, c) == "go.again."
    assert [lp for lp, m in zip(c.logprobs, c.loss_mask) if not m] == [0.0] * obs
    assert c.turns == {"turns": 2, "observation_tokens": obs, ENV_REWARD: 1.0}
    assert environment_rewards([c, Completion([1], [0.0], "stop")]) == [1.0, 0.0]
    assert "." in engine.calls[0][1].stop and c.finish_reason == "stop"


class Greeting(Counting):
    def reset(self, sample):
        super().reset(sample)
        return f"<{sample['ground_truth']}>"


def test_first_observation_is_masked_and_the_sample_reaches_reset(tok):
    (c, d), engine = _run(tok, {"P|": ["a.", "b."]}, Greeting, n=2, samples=[{"ground_truth": "x"}])
    assert tok.decode(c.token_ids).startswith("<x>a.")
    assert c.loss_mask[:3] == [0, 0, 0] and _model_text(tok, c) == "a.b."
    assert [s.n for _, s in engine.calls] == [1, 1]  # contexts differ from the first turn on: one row each
    assert engine.calls[0][0] == 2


class Raising(Counting):
    def step(self, action_text):
        if "boom" in action_text:
            raise ValueError("bad state")
        return super().step(action_text)


def test_an_environment_that_raises_ends_its_episode_only(tok):
    out, _ = _run(tok, {"A|": ["boom.", "x."], "B|": ["ok.", "ok."]}, Raising)
    assert out[0].turns["env_errors"] == 1 and ENV_REWARD not in out[0].turns  # reward: none (0)
    assert out[0].finish_reason == "stop" and tok.decode(out[0].token_ids) == "boom."
    assert out[1].turns[ENV_REWARD] == 1.0 and "env_errors" not in out[1].turns
    metrics = episode_metrics(out)
    assert metrics["env/env_errors_per_sample"] == 0.5 and metrics["env/reward"] == 0.5


class Stuck(Counting):
    def step(self, action_text):
        if "hang" in action_text:
            threading.Event().wait()  # never returns
        return super().step(action_text)


def test_a_step_that_never_returns_is_cut_at_episode_timeout_s(tok):
    start = time.monotonic()
    out, _ = _run(tok, {"A|": ["hang."], "B|": ["ok.", "ok."]}, Stuck, limits=EpisodeLimits(4, 300, 64, 0.5))
    assert time.monotonic() - start < 5
    assert out[0].turns["env_timeouts"] == 1 and out[0].turns["turns"] == 1
    # the turn waited for the stuck step until its deadline, which B's shares: B keeps its first reward
    assert out[1].turns[ENV_REWARD] == 0.5


def test_turns_and_tokens_are_bounded(tok):
    class Forever(Counting):
        def step(self, action_text):
            return StepResult(OBS, reward=1.0)

    (c,), _ = _run(tok, {"P|": ["x."] * 10}, Forever, limits=EpisodeLimits(3, 300, 64, 5.0))
    assert c.turns["turns"] == 3 and c.turns[ENV_REWARD] == 3.0  # the last step is scored, its observation dropped
    assert tok.decode(c.token_ids) == "x." + OBS + "x." + OBS + "x."
    (c,), _ = _run(tok, {"P|": ["x" * 50]}, Forever, limits=EpisodeLimits(3, 20, 64, 5.0))
    assert len(c.token_ids) == 20 and c.finish_reason == "length"


class Adder(ToolEnvironment):
    tools = {
        "add": (
            tool_schema("add", "Adds two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}}),
            lambda a, b: a + b,
        )
    }

    def score(self, sample, answer):
        return float(answer.strip() == sample["ground_truth"])


def test_a_malformed_tool_call_is_answered_and_the_episode_goes_on(tok):
    scripts = {
        "Q|": [
            "<tool_call>{bad json</tool_call>",
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
            "3<eos>",
        ]
    }
    (c,), _ = _run(tok, scripts, Adder, samples=[{"ground_truth": "3"}])
    text = tok.decode(c.token_ids, skip_special_tokens=True)
    assert '<tool_response>{"error": "the call is not JSON' in text
    assert "<tool_response>3</tool_response>" in text and text.endswith("3")
    assert c.turns["tool_calls"] == 2 and c.turns["tool_errors"] == 1 and c.turns["turns"] == 3
    assert c.turns[ENV_REWARD] == 1.0
    assert _model_text(tok, c) == scripts["Q|"][0] + scripts["Q|"][1] + "3"


def test_tool_call_parsing():
    (call,) = parse_tool_calls('think <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert (call.name, call.arguments, call.error) == ("f", {"x": 1}, "")
    (call,) = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert call.arguments == {"x": 2}
    assert [
        c.name for c in parse_tool_calls('<tool_call>{"name":"a"}</tool_call><tool_call>{"name":"b"}</tool_call>')
    ] == [
        "a",
        "b",
    ]
    assert parse_tool_calls('<tool_call>{"name": "f"').pop().error.startswith("a <tool_call> without")
    assert parse_tool_calls("<tool_call>[1]</tool_call>")[0].error
    assert parse_tool_calls("no call") == []
    assert tool_response({"error": "x"}) == '<tool_response>{"error": "x"}</tool_response>'
    env = Adder()
    env.reset({})
    assert (
        "unknown tool"
        in env.call(parse_tool_calls('<tool_call>{"name": "mul", "arguments": {}}</tool_call>')[0])["error"]
    )
    assert (
        "TypeError"
        in env.call(parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')[0])["error"]
    )


READ_PATHS: list[str] = []


def _read(name: str = "", path: str = "/safe") -> str:
    READ_PATHS.append(path)
    return f"{path}/{name}"


class Reader(ToolEnvironment):
    """A tool whose function has a parameter its schema leaves out (a default the model must not set)."""

    tools = {"read": (tool_schema("read", "Reads a note.", {"name": {"type": "string"}}), _read)}


def test_a_tool_gets_only_the_arguments_its_schema_declares():
    READ_PATHS.clear()
    env = Reader()
    env.reset({})
    step = env.step('<tool_call>{"name": "read", "arguments": {"name": "a", "path": "/etc/shadow"}}</tool_call>')
    assert READ_PATHS == []  # the function never ran
    assert step.info == {"tool_calls": 1, "tool_errors": 1}
    assert "read takes no argument 'path'; its arguments are name" in step.observation
    step = env.step('<tool_call>{"name": "read", "arguments": {"name": "a"}}</tool_call>')
    assert step.info["tool_errors"] == 0 and "<tool_response>/safe/a</tool_response>" in step.observation
    adder = Adder()
    adder.reset({})
    extra = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}</tool_call>')[0]
    assert adder.call(extra) == {"error": "add takes no argument 'c'; its arguments are a, b"}


def test_a_deeply_nested_call_is_a_tool_error_and_the_episode_goes_on(tok):
    deep = "<tool_call>" + "[" * 5000 + "</tool_call>"
    (call,) = parse_tool_calls(deep)
    assert call.error.startswith("the call nests too deep")
    as_string = '<tool_call>{"name": "add", "arguments": "' + "[" * 5000 + '"}</tool_call>'
    assert parse_tool_calls(as_string)[0].error.startswith("the call nests too deep")
    scripts = {"Q|": [deep, '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', "3<eos>"]}
    (c,), _ = _run(
        tok,
        scripts,
        Adder,
        limits=EpisodeLimits(4, 12000, 64, 5.0),
        samples=[{"ground_truth": "3"}],
        max_new_tokens=6000,
    )
    assert c.turns["tool_errors"] == 1 and c.turns["tool_calls"] == 2 and "env_errors" not in c.turns
    assert c.turns[ENV_REWARD] == 1.0
    assert episode_metrics([c])["env/tool_errors_per_sample"] == 1.0


def test_tools_render_with_the_template_or_a_plain_block(tok):
    tools = Adder().schemas()
    plain = render_prompt(tok, [{"role": "user", "content": "1+2?"}], tools)  # the char tokenizer has no template
    assert plain.startswith("system: You may call") and '"name": "add"' in plain and plain.endswith("assistant: ")
    tok2 = build_char_tokenizer()
    tok2.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
        "{% for m in messages %}{{ m.role }}={{ m.content }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    assert render_prompt(tok2, [{"role": "user", "content": "hi"}], tools) == "TOOLS:add;user=hi\nA:"
    tok2.chat_template = "{% for m in messages %}{{ m.role }}={{ m.content }}\n{% endfor %}"  # ignores tools
    assert render_prompt(tok2, [{"role": "user", "content": "hi"}], tools).startswith("system=You may call")


def test_load_environment_from_a_file_and_its_errors(tmp_path, monkeypatch):
    (tmp_path / "helper.py").write_text("DONE = True\n")
    (tmp_path / "env.py").write_text(
        "from helper import DONE\nfrom cloudrl.trainer.rollout.environment import StepResult\n"
        "class MyEnv:\n    def reset(self, sample):\n        return ''\n"
        "    def step(self, action_text):\n        return StepResult(done=DONE)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert load_environment("env.py:MyEnv")().step("x").done
    with pytest.raises(DataError, match="has no class 'MyEnf' \\(did you mean MyEnv\\?\\)"):
        load_environment("env.py:MyEnf")
    with pytest.raises(DataError, match="environment file not found"):
        load_environment("nope.py:MyEnv")
    with pytest.raises(DataError, match="not FILE.py:CLASS"):
        load_environment("env.py")
    with pytest.raises(ConfigError, match="two multi-turn protocols"):
        load_config("local", ["rollout.environment=env.py:MyEnv", "search.enabled=true"])
    # shipped with the job as reward files are, with what it imports from beside it
    from cloudrl.cli.shipping import plan_upload

    upload = plan_upload(load_config("local", ["rollout.environment=env.py:MyEnv"]), tmp_path)
    assert {"env.py", "helper.py"} <= set(upload.files)


def test_episodes_on_the_hf_engine_with_the_tiny_model(tok):
    """The real engine's `generate` under the loop: every model token sampled (log-prob < 0), every
    observation token masked with log-prob 0."""
    engine = HFEngine(build_tiny_model(tok).eval(), tok)
    loop = EpisodeLoop(engine.generate, tok, Counting, EpisodeLimits(2, 60, 8, 30.0))
    out = loop.run([tok.encode("1+2=", add_special_tokens=False)], SamplingSettings(n=3, max_new_tokens=6, seed=1))
    assert len(out) == 3
    for c in out:
        assert len(c.token_ids) == len(c.logprobs) == len(c.loss_mask) <= 60
        assert all((lp < 0) if m else (lp == 0.0) for lp, m in zip(c.logprobs, c.loss_mask))
        obs_ids = tok.encode(OBS, add_special_tokens=False)
        if c.turns["turns"] == 2:  # the first turn stopped at `.` or the budget and went on
            start = c.loss_mask.index(0)
            assert c.token_ids[start : start + len(obs_ids)] == obs_ids


# ---- failures are loud: each Completion says why its episode failed; the driver prints the first of each
# kind once and stops the run when a whole batch failed ---------------------------------------------------


class GymStyle(Counting):
    def step(self, action_text):
        return OBS, 1.0, False, False, {}  # gym's (observation, reward, terminated, truncated, info)


GYM_LINE = "GymStyle.step returned tuple, not StepResult: return StepResult(observation, reward, done)"


def test_a_gym_style_tuple_is_named_with_its_fix_and_a_batch_of_them_stops_the_run(tok):
    out, _ = _run(tok, {"A|": ["x."], "B|": ["y."]}, GymStyle, n=2)
    assert [c.error for c in out] == [GYM_LINE] * 4
    assert all(c.turns["env_errors"] == 1 and ENV_REWARD not in c.turns for c in out)
    wired = pickle.loads(pickle.dumps(Completions(out)))  # as Ray carries them from the rollout worker
    assert [c.error for c in wired] == [GYM_LINE] * 4
    with pytest.raises(EnvironmentFailed) as err:
        FailureReport().check(wired, step=1)
    message = str(err.value)
    assert message.startswith(f"environment {GYM_LINE}: every episode of the batch at step 1 failed (4 of 4")
    assert "\n" not in message and isinstance(err.value, TrainerError)  # the job prints it as `error: ...`


class Crashy(Counting):
    """Steps fine, except that the episodes of a sample marked `crash` divide by zero on their third step."""

    def reset(self, sample):
        super().reset(sample)
        self.crash = sample["ground_truth"] == "crash"
        return ""

    def step(self, action_text):
        if self.steps == 2 and self.crash:
            return 1 / 0
        self.steps += 1
        return StepResult(OBS, reward=0.5, done=self.steps == 4)


def test_a_step_raising_on_turn_three_is_printed_once_with_its_count_and_the_run_goes_on(tok, capsys):
    scripts = {"A|": ["a."] * 4, "B|": ["b."] * 4, "C|": ["c."] * 4}
    samples = [{"ground_truth": g} for g in ("ok", "crash", "ok")]
    out, _ = _run(tok, scripts, Crashy, n=2, samples=samples)
    failed = [c for c in out if c.error]
    assert len(failed) == 2 and all(c.turns["turns"] == 3 and c.turns[ENV_REWARD] == 1.0 for c in failed)
    assert failed[0].error.startswith("Crashy.step raised ZeroDivisionError: division by zero (test_environment.py:")
    assert all(c.error is None and c.turns[ENV_REWARD] == 2.0 for c in out if c not in failed)
    assert episode_metrics(out)["env/env_errors_per_sample"] == pytest.approx(1 / 3)

    # the driver: one line for the kind, on the first batch that has it; the next batch's only counted
    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.global_step, trainer.env_failures = load_config("local"), 2, FailureReport()
    got = SimpleNamespace(completions=Completions(out), scores=lambda *args: torch.zeros(len(out)))
    assert trainer.score(got).shape == (6,) and trainer.score(got).shape == (6,)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: environment Crashy.step raised ZeroDivisionError")
    assert "(2 of 6 episodes of the batch at step 2 failed this way;" in lines[0]


def test_env_errors_per_sample_shows_on_the_console_line_when_above_zero():
    logger = MetricsLogger.__new__(MetricsLogger)
    logger.total = 4
    metrics = {"rollout/reward_mean": 0.5, "env/env_errors_per_sample": 0.25, "env/env_timeouts_per_sample": 0.0}
    assert "| rollout/reward_mean=0.5 env/env_errors_per_sample=0.25" in logger.console_line(1, metrics)
    assert "env/" not in logger.console_line(1, {**metrics, "env/env_errors_per_sample": 0.0})


class GymReset(Counting):
    def reset(self, sample):
        return "", {}  # gym's (observation, info)


class BrokenInit(Counting):
    def __init__(self):
        raise RuntimeError("no service\nsecond line")


def test_a_batch_where_every_episode_failed_stops_the_run_with_one_line(tok):
    out, _ = _run(tok, {"A|": ["x."], "B|": ["y."]}, GymReset, n=2)
    line = 'GymReset.reset returned tuple, not str: return the first observation\'s text ("" for none)'
    assert [c.error for c in out] == [line] * 4 and all(c.turns["turns"] == 0 for c in out)
    report = FailureReport()
    with pytest.raises(EnvironmentFailed, match="every episode of the batch at step 3 failed \\(4 of 4 this way\\)"):
        report.check(out, step=3)
    with pytest.raises(EnvironmentFailed, match="every episode of a validation batch at step 0 failed"):
        FailureReport().check(out, 0, "a validation batch")  # the driver's validation names its batches so
    out, _ = _run(tok, {"A|": ["x."]}, BrokenInit, n=2)
    assert out[0].error.startswith("BrokenInit.__init__ raised RuntimeError: no service (test_environment.py:")
    # mixed kinds: the commonest one is named, the others counted
    mixed = [Completion([], [], "stop", error=GYM_LINE)] * 3 + [Completion([], [], "stop", error=out[0].error)]
    with pytest.raises(EnvironmentFailed, match="failed \\(3 of 4 this way, 1 others failing otherwise\\)"):
        FailureReport().check(mixed, step=1)
    assert FailureReport().check(mixed[:3] + [Completion([1], [0.0], "stop")], step=1)  # one ok: a warning only


class FatalWrongType(Counting):
    errors_are_fatal = True

    def step(self, action_text):
        return {"observation": OBS, "reward": 1.0}


class FatalWrongMany(Counting):
    errors_are_fatal = True

    @classmethod
    def step_many(cls, envs, actions):
        return [StepResult(done=True)]  # one result for a turn of several episodes


class FatalReset(GymReset):
    errors_are_fatal = True


class FatalRaise(Counting):
    errors_are_fatal = True

    def step(self, action_text):
        raise KeyError("id")


class FatalService(Counting):
    errors_are_fatal = True

    def step(self, action_text):
        raise WorkerTimeout("the service did not answer")


def test_errors_are_fatal_stops_the_run_on_a_wrong_return_type_too(tok):
    scripts = {"A|": ["x."], "B|": ["y."]}
    with pytest.raises(EnvironmentFailed) as err:
        _run(tok, scripts, FatalWrongType)
    assert str(err.value) == (
        "environment FatalWrongType.step returned dict, not StepResult: return StepResult(observation, reward, "
        "done) (FatalWrongType.errors_are_fatal: its first failure stops the run)"
    )
    with pytest.raises(EnvironmentFailed, match="FatalWrongMany.step_many returned a list of 1, not a list of 2"):
        _run(tok, scripts, FatalWrongMany)
    with pytest.raises(EnvironmentFailed, match="FatalReset.reset returned tuple, not str"):
        _run(tok, scripts, FatalReset)
    with pytest.raises(EnvironmentFailed, match="FatalRaise.step raised KeyError: 'id' \\(test_environment.py:"):
        _run(tok, scripts, FatalRaise)
    with pytest.raises(WorkerTimeout, match="the service did not answer"):  # the trainer's own errors as themselves
        _run(tok, scripts, FatalService)
