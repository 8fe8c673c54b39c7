"""Environments: multi-turn episodes against your own Python code, on any rollout engine.

An environment is a class in one Python file, named with `rollout.environment=path/to/env.py:MyEnv`
(or `module:MyEnv`). The trainer makes one instance per episode (rollout.n per prompt) and calls:

    reset(sample) -> str             the first observation, appended to the prompt ("" for none); `sample`
                                     is the dataset row: prompt, ground_truth, data_source and its other columns
    step(action_text) -> StepResult  the model's turn (special tokens removed) -> the observation to append,
                                     a reward (None: none this turn) and whether the episode is done

Optional class attributes: `stop` (strings that end a model turn, besides rollout.stop and the
end-of-sequence token), `counts` (names of `info` counts every episode reports, 0 unless a step adds to
them), `step_many(envs, actions) -> list[StepResult]`, a classmethod that answers all live episodes'
turns at once (one request to a batched service instead of one per episode), and `errors_are_fatal`
(a `reset`, `step` or `step_many` that raises or returns the wrong type stops the run instead of ending
the episode: for a shared service whose failure is the run's).

The loop is batched: every turn sends all live episodes to the engine in one `generate` call, then
runs their `step` calls concurrently, each in a thread of its own. An episode ends when `step` says
done, when the model's turn ends with the end-of-sequence token (its `step` still runs, so the last
action can be scored, but its observation is dropped), after `rollout.max_turns` model turns (likewise),
when a turn runs out of tokens (`length`; no `step`), or when an observation would leave no room in
`rollout.max_episode_tokens`. Observations are cut to `rollout.max_obs_tokens`.

Failures end the one episode, never the batch: a `reset` or `step` that raises or returns the wrong
type (a `step` anything but a `StepResult`, a `reset` anything but text) ends it with the rewards returned
so far (counted in `env/env_errors_per_sample`; its `Completion.error` says which call and why, in one
line); one still running `rollout.episode_timeout_s` after its episode started is abandoned (its daemon
thread is left to finish alone) and ends it the same way (counted in `env/env_timeouts_per_sample`). An
episode whose time is up before a turn ends before generating it. A turn waits for its slowest step, so
one stuck step holds the batch up to its episode's deadline. The driver prints the first failure of each
kind in a run as one line with how many episodes of that batch failed so (`FailureReport`), and a batch
in which every episode failed stops the run with that line. With `errors_are_fatal` the first failure
stops it (a timeout is never fatal).

Rewards: the per-turn rewards of an episode are summed and added to `reward.function`'s score of the
sample; they are not placed on the turns' own tokens (the advantage sees one score per sample).

Each episode comes back as one `Completion` whose `loss_mask` is 1 on the model's own tokens and 0 on
every observation token (the first one included; log-prob 0 there), and whose `turns` holds its counts
(turns, observation_tokens, env_errors and env_timeouts where any, the `info` counts its steps returned,
and `env_reward`, the summed rewards, where any step returned one).
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import EnvironmentFailed, TrainerError, first_line
from .engines import Completion, SamplingSettings

ENV_REWARD = "env_reward"
"""The key of a Completion's `turns` that holds its episode's summed environment rewards."""


@dataclass
class StepResult:
    observation: str | list[int] = ""
    """Text (or token ids) appended after the model's turn, masked out of the loss; "" for none."""
    reward: float | None = None
    """This turn's reward; None: none. An episode's rewards are summed into its sample's score."""
    done: bool = False
    """The episode ends here (its observation is then dropped)."""
    info: dict[str, int] = field(default_factory=dict)
    """Counts added to the episode's `turns` (e.g. {"searches": 1}), when the step's result is used."""


class Environment(Protocol):
    def reset(self, sample: dict[str, Any]) -> str: ...

    def step(self, action_text: str) -> StepResult: ...


@dataclass
class EpisodeLimits:
    """An episode's bounds: rollout.max_turns, max_episode_tokens, max_obs_tokens and episode_timeout_s
    (`from_config`), which hold their defaults and meanings; the search protocol takes the same keys, with no
    wall-time bound of its own (multiturn.search_limits)."""

    max_turns: int
    """Model turns per episode at most."""
    max_episode_tokens: int
    """Generated plus observation tokens per episode."""
    max_obs_tokens: int
    """Tokens per observation; longer ones are cut."""
    episode_timeout_s: float
    """Wall time per episode, from its reset."""

    @classmethod
    def from_config(cls, rollout_cfg) -> EpisodeLimits:
        r = rollout_cfg
        return cls(r.max_turns, r.max_episode_tokens, r.max_obs_tokens, r.episode_timeout_s)


# ----------------------------------------------------------------------------------------------
# Calls into the environment: their failures and deadlines
# ----------------------------------------------------------------------------------------------


class _Failed(Exception):
    """A call that raised, returned the wrong type (kind `env_errors`) or ran past its episode's deadline
    (`env_timeouts`). Its text follows the method's name: `raised ValueError: ...`, `returned tuple, ...`."""

    def __init__(self, kind: str, detail: str, cause: BaseException | None = None):
        super().__init__(detail)
        self.kind, self.cause = kind, cause


def _raised(exc: BaseException) -> str:
    """`raised ValueError: its message's first line (env.py:42)`: the exception and where it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    message = first_line(exc, default="")[:300]
    return f"raised {type(exc).__name__}" + (f": {message}" if message else "") + where


def _wrong_step(result: Any) -> str | None:
    """What is wrong with a step's return value, naming the fix; None when it is a usable StepResult."""
    if not isinstance(result, StepResult):
        return f"returned {type(result).__name__}, not StepResult: return StepResult(observation, reward, done)"
    if result.reward is not None and not _number(result.reward):
        return f"returned a StepResult whose reward is {type(result.reward).__name__}: give a number or None"
    obs = result.observation
    if not (obs is None or isinstance(obs, str) or isinstance(obs, list) and _token_ids(obs)):
        return (
            f"returned a StepResult whose observation is {type(result.observation).__name__}: "
            "give its text (or a list of token ids)"
        )
    if not isinstance(result.info, dict) or not all(isinstance(v, numbers.Real) for v in result.info.values()):
        return "returned a StepResult whose info is not a dict of counts: give info={name: number}"
    return None


def call_with_deadlines(calls: list[Callable[[], Any]], deadlines: list[float]) -> list[Any]:
    """Run `calls` concurrently, each in a daemon thread, and wait for each until its deadline
    (time.monotonic()). A result is the call's return value or a `_Failed` (error or timeout). A call
    still running at its deadline is abandoned: Python cannot stop a thread, and a daemon one does not
    keep the process alive."""
    results: list[Any] = [None] * len(calls)
    done = [False] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as exc:  # an environment's own bug ends its episode, not the batch
            results[i] = _Failed("env_errors", _raised(exc), exc)
        done[i] = True

    threads = [threading.Thread(target=run, args=(i,), daemon=True, name=f"env step {i}") for i in range(len(calls))]
    for t in threads:
        t.start()
    for i, t in enumerate(threads):
        t.join(max(0.0, deadlines[i] - time.monotonic()))
        if not done[i]:
            results[i] = _Failed("env_timeouts", "still running at rollout.episode_timeout_s")
    return results


@dataclass
class _Episode:
    prompt: list[int]
    env: Any = None
    deadline: float = 0.0
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {"turns": 0, "observation_tokens": 0})
    rewards: list[float] = field(default_factory=list)
    finish_reason: str = ""
    error: str | None = None
    """The call that raised or returned the wrong type: `Class.method raised ...` (Completion.error)."""
    action: str = ""
    """The last model turn's text (special tokens removed)."""
    last_eos: bool = False
    """The last model turn ended with the end-of-sequence token."""

    def add(self, ids: list[int], logprobs: list[float], generated: bool) -> None:
        self.ids += ids
        self.logprobs += logprobs if generated else [0.0] * len(ids)
        self.mask += [int(generated)] * len(ids)
        if not generated:
            self.counts["observation_tokens"] += len(ids)

    def fail(self, failure: _Failed, where: str) -> None:
        """End the episode; `where` names the call (`Class.method`). A timeout is only counted."""
        self.counts[failure.kind] = self.counts.get(failure.kind, 0) + 1
        if failure.kind == "env_errors":
            self.error = f"{where} {failure}"
        self.finish_reason = "stop"

    def completion(self) -> Completion:
        turns: dict = dict(self.counts)
        if self.rewards:
            turns[ENV_REWARD] = float(sum(self.rewards))
        return Completion(self.ids, self.logprobs, self.finish_reason, self.mask, turns, self.error)


class EpisodeLoop:
    """Runs the episodes of one batch of prompts with `generate` (an engine's) against instances of an
    environment class, made by `make_env()` (one per episode)."""

    def __init__(
        self,
        generate: Callable[[list[list[int]], SamplingSettings], list[Completion]],
        tokenizer,
        make_env: Callable[[], Any],
        limits: EpisodeLimits,
        env_class: type | None = None,
    ):
        self.generate, self.tokenizer, self.make_env, self.limits = generate, tokenizer, make_env, limits
        self.env_class = env_class or (make_env if isinstance(make_env, type) else None)
        self.eos = tokenizer.eos_token_id
        self.stop = list(getattr(self.env_class, "stop", ()) or ())
        self.step_many = getattr(self.env_class, "step_many", None)
        self.errors_are_fatal = bool(getattr(self.env_class, "errors_are_fatal", False))

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def _observation(self, obs: str | list[int]) -> list[int]:
        ids = list(obs) if isinstance(obs, list) else self._encode(str(obs or ""))
        return ids[: self.limits.max_obs_tokens]

    def run(
        self, prompts: list[list[int]], settings: SamplingSettings, samples: list[dict] | None = None
    ) -> list[Completion]:
        n = settings.n
        samples = samples or [{} for _ in prompts]
        episodes = [_Episode(p) for p in prompts for _ in range(n)]
        for e in episodes:
            e.counts.update(dict.fromkeys(getattr(self.env_class, "counts", ()), 0))
        self._reset(episodes, [s for s in samples for _ in range(n)])
        fresh = all(not e.ids for e in episodes) and not any(e.finish_reason for e in episodes)
        stop = list(dict.fromkeys([*settings.stop, *self.stop]))
        active = [i for i, e in enumerate(episodes) if not e.finish_reason]
        turn = 0
        while active:
            now = time.monotonic()
            for i in [i for i in active if episodes[i].deadline <= now]:
                late = _Failed("env_timeouts", "rollout.episode_timeout_s passed before its turn")
                self._fail(episodes[i], late, "step")
            active = [i for i in active if not episodes[i].finish_reason]
            if not active:
                break
            limit = self.limits.max_episode_tokens
            # One budget per engine call (the longest any episode may take); each episode's turn is then
            # cut to its own room, which keeps the tokens a sampled prefix.
            budget = min(settings.max_new_tokens, max(limit - len(episodes[i].ids) for i in active))
            first = turn == 0 and fresh  # the same context n times: sample them in one request
            turn_settings = dataclasses.replace(
                settings, stop=stop, max_new_tokens=budget, n=n if first else 1, seed=settings.seed + 7919 * turn
            )
            contexts = prompts if first else [episodes[i].prompt + episodes[i].ids for i in active]
            outs = self.generate(contexts, turn_settings)
            acting = []
            for i, out in zip(active, outs):
                if self._take_turn(episodes[i], out, min(budget, limit - len(episodes[i].ids))):
                    acting.append(i)
            active = self._step(episodes, acting)
            turn += 1
        return [e.completion() for e in episodes]

    def _fail(self, e: _Episode, failure: _Failed, method: str) -> None:
        """End `e` with `failure` of its `method` call; with `errors_are_fatal` an error (not a timeout)
        stops the run instead: as itself where it is a TrainerError (a retriever's), else as one line."""
        name = (self.env_class or type(e.env)).__name__ if self.env_class or e.env is not None else "environment"
        if e.env is None and method == "reset":
            method = "__init__"  # making the instance failed
        if failure.kind == "env_errors" and self.errors_are_fatal:
            if isinstance(failure.cause, TrainerError):
                raise failure.cause
            raise EnvironmentFailed(
                f"environment {name}.{method} {failure} ({name}.errors_are_fatal: its first failure stops the run)"
            ) from failure.cause
        e.fail(failure, f"{name}.{method}")

    def _reset(self, episodes: list[_Episode], samples: list[dict]) -> None:
        start = time.monotonic()
        for e in episodes:
            e.deadline = start + self.limits.episode_timeout_s

        def reset(e: _Episode, sample: dict) -> str:
            e.env = self.make_env()
            return e.env.reset(dict(sample))

        calls = [lambda e=e, s=s: reset(e, s) for e, s in zip(episodes, samples)]
        for e, obs in zip(episodes, call_with_deadlines(calls, [e.deadline for e in episodes])):
            if isinstance(obs, _Failed):
                self._fail(e, obs, "reset")
                continue
            if not (obs is None or isinstance(obs, str) or isinstance(obs, list) and _token_ids(obs)):
                wrong = f'returned {type(obs).__name__}, not str: return the first observation\'s text ("" for none)'
                self._fail(e, _Failed("env_errors", wrong), "reset")
                continue
            ids = self._observation(obs)
            if len(ids) + 1 > self.limits.max_episode_tokens:
                e.finish_reason = "length"
                continue
            e.add(ids, [], generated=False)

    def _take_turn(self, e: _Episode, out: Completion, room: int) -> bool:
        """Record one turn's tokens (at most `room`); False when the episode ends without a step."""
        cut = len(out.token_ids) > room
        ids, lps = list(out.token_ids[:room]), list(out.logprobs[:room])
        e.counts["turns"] += 1
        e.add(ids, lps, generated=True)
        e.last_eos = bool(ids) and ids[-1] == self.eos
        if not e.last_eos and (cut or out.finish_reason == "length"):
            e.finish_reason = "length"  # ran out of tokens mid-turn: nothing complete to act on
            return False
        e.action = self.tokenizer.decode(ids, skip_special_tokens=True)
        return True

    def _step(self, episodes: list[_Episode], acting: list[int]) -> list[int]:
        """Step every acting episode's environment; append the observations; returns the episodes that go on."""
        results = self._step_results([episodes[i] for i in acting])
        method = "step_many" if self.step_many is not None else "step"
        going_on = []
        for i, result in zip(acting, results):
            e = episodes[i]
            wrong = None if isinstance(result, _Failed) else _wrong_step(result)
            if wrong is not None:
                result = _Failed("env_errors", wrong)
            if isinstance(result, _Failed):
                self._fail(e, result, method)
                continue
            if result.reward is not None:
                e.rewards.append(float(result.reward))
            last = result.done or e.last_eos or e.counts["turns"] >= self.limits.max_turns
            obs = [] if last else self._observation(result.observation)
            if not last and len(e.ids) + len(obs) + 1 > self.limits.max_episode_tokens:
                e.finish_reason = "length"  # no room to read the observation and go on
                continue
            for k, v in result.info.items():
                e.counts[k] = e.counts.get(k, 0) + v
            if last:
                e.finish_reason = "stop"
                continue
            e.add(obs, [], generated=False)
            going_on.append(i)
        return going_on

    def _step_results(self, eps: list[_Episode]) -> list[Any]:
        if not eps:
            return []
        if self.step_many is not None:  # one call for the batch, bounded by the earliest deadline
            deadline = min(e.deadline for e in eps)
            (got,) = call_with_deadlines(
                [lambda: self.step_many([e.env for e in eps], [e.action for e in eps])], [deadline]
            )
            return got if isinstance(got, list) and len(got) == len(eps) else [_as_failure(got, len(eps))] * len(eps)
        calls = [lambda e=e: e.env.step(e.action) for e in eps]
        return call_with_deadlines(calls, [e.deadline for e in eps])


def _as_failure(got: Any, count: int) -> _Failed:
    if isinstance(got, _Failed):
        return got
    what = f"a list of {len(got)}" if isinstance(got, list) else type(got).__name__
    return _Failed(
        "env_errors", f"returned {what}, not a list of {count} StepResults: return one per environment, in order"
    )


def _number(x: Any) -> bool:
    """A reward the loop can sum: a number (numpy's and one-element tensors' too), not text."""
    if isinstance(x, numbers.Real):
        return True
    try:
        return not isinstance(x, (str, bytes)) and isinstance(float(x), float)
    except (TypeError, ValueError, RuntimeError):
        return False


def _token_ids(obs: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in obs)


def environment_rewards(completions: list) -> list[float]:
    """Each sample's summed environment rewards (0 for a sample without any): added to its score."""
    return [float((c.turns or {}).get(ENV_REWARD, 0.0)) for c in completions]


def episode_metrics(completions: list) -> dict[str, float]:
    """Per-step averages over an environment's episodes: turns, observation tokens, errors, timeouts,
    environment reward, and each `info` count, per sample."""
    counts = [c.turns for c in completions if c.turns is not None]
    if not counts:
        return {}
    keys = dict.fromkeys(k for c in counts for k in c)
    keys.update(dict.fromkeys(["env_errors", "env_timeouts"]))
    return {
        f"env/{k}_per_sample" if k != ENV_REWARD else "env/reward": sum(c.get(k, 0) for c in counts) / len(counts)
        for k in keys
    }


def failure_kind(error: str) -> str:
    """What a `Completion.error` counts as one kind of failure: its text before the first ": "
    (`Guess.step raised ZeroDivisionError`, `Guess.step returned tuple, not StepResult`)."""
    return error.partition(": ")[0]


class FailureReport:
    """The driver's account of the environment failures of a run (each `Completion.error`): `check`
    returns a line for the first failure of each kind (later ones are only counted, in
    env/env_errors_per_sample) and stops the run when every episode of a batch failed."""

    def __init__(self):
        self.seen: set[str] = set()
        """The kinds (`failure_kind`) reported so far."""

    def check(self, completions: list, step: int, batch: str = "the batch") -> list[str]:
        """The lines to print for the failures in `completions` (`batch` at `step`: "the batch", "a
        validation batch") that are of a kind not reported before. Raises EnvironmentFailed, one line, when
        every episode failed."""
        errors = [error for c in completions if (error := getattr(c, "error", None))]
        if not errors:
            return []
        first: dict[str, str] = {}
        count: dict[str, int] = {}
        for error in errors:
            kind = failure_kind(error)
            first.setdefault(kind, error)
            count[kind] = count.get(kind, 0) + 1
        total = len(completions)
        if len(errors) == total:
            kind = max(count, key=count.get)
            others = f", {total - count[kind]} others failing otherwise" if count[kind] < total else ""
            self.seen.update(count)
            raise EnvironmentFailed(
                f"environment {first[kind]}: every episode of {batch} at step {step} failed ({count[kind]} of "
                f"{total} this way{others}), so there is nothing to train on: fix the environment"
            )
        lines = [
            f"environment {first[kind]} ({count[kind]} of {total} episodes of {batch} at step {step} failed "
            f"this way; later failures of this kind are only counted, in env/env_errors_per_sample)"
            for kind in count
            if kind not in self.seen
        ]
        self.seen.update(count)
        return lines
