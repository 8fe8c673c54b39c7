"""Multi-turn rollouts with a search tool (Search-R1's protocol), for any rollout engine.

The policy writes `<search>query</search>` to call the retriever and `<answer>...</answer>` to finish.
Each turn generates until one of those closing tags, the end-of-sequence token or the turn's token
budget. After a search call the retriever's passages are appended as an observation,
`<information>...</information>`, and the sample goes on from there; its last turn (`rollout.max_turns`)
gets no answer. The whole response (generated and observation tokens) stays within
`rollout.max_episode_tokens`: an observation that would not leave room for at least one more generated
token ends the sample instead (finish reason `length`).

A search call whose query is empty, too long, or has no opening `<search>` is invalid: it is counted
and answered with a short error observation, so the policy can try again within its budget.

The protocol is one environment (`SearchEnvironment`) on the episode loop of environment.py, which is
batched: every turn sends all still-running samples to the engine in one `generate` call, and the
environment sends all their queries to the retriever in one request; samples finish at different turns.

Each sample comes back as one `Completion` whose `loss_mask` is 1 on generated tokens and 0 on
observation tokens (whose log-probs are 0: the engine did not sample them), and whose `turns` holds
its counts. `turn_metrics` averages those counts over a step.
"""

from __future__ import annotations

from collections.abc import Callable

from .engines import Completion, SamplingSettings
from .environment import EpisodeLimits, EpisodeLoop, StepResult, episode_metrics

SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
INFO_OPEN, INFO_CLOSE = "\n<information>", "</information>\n"
INVALID_CALL = "invalid search call: write <search>your query</search> or <answer>...</answer>"
MAX_QUERY_CHARS = 512
SEARCH_EPISODE_S = 24 * 3600.0
"""A search episode's wall-time bound: none of its own (the retrieval client's timeout and retries bound each call)."""

Search = Callable[[list[str]], list[list[str]]]
"""queries -> for each query, its passages' texts (best first)."""


def search_limits(rollout_cfg) -> EpisodeLimits:
    """A search episode's bounds: rollout.max_turns, max_episode_tokens and max_obs_tokens, which every
    multi-turn protocol shares, and no wall-time bound of its own."""
    r = rollout_cfg
    return EpisodeLimits(r.max_turns, r.max_episode_tokens, r.max_obs_tokens, SEARCH_EPISODE_S)


def search_call(text: str) -> str | None:
    """The query of a turn that stopped at `</search>`, or None when the call is invalid. (A subword
    tokenizer's last token may carry a few characters past the tag.)"""
    end = text.rfind(SEARCH_CLOSE)
    if end < 0:
        return None
    body = text[:end]
    start = body.rfind(SEARCH_OPEN)
    if start < 0:
        return None
    query = body[start + len(SEARCH_OPEN) :].strip()
    return query if query and len(query) <= MAX_QUERY_CHARS else None


def format_passages(passages: list[str]) -> str:
    return "".join(f"Doc {i + 1}: {p.strip()}\n" for i, p in enumerate(passages))


class SearchEnvironment:
    """Search-R1's protocol as an environment (environment.py): one instance per sample. Its turns are
    answered together (`step_many`): all queries of a turn go to `search` in one request."""

    stop = [SEARCH_CLOSE, ANSWER_CLOSE]
    counts = ("searches", "invalid_calls")
    errors_are_fatal = True  # the retriever is the run's: its failure (after its retries) stops the run

    def __init__(self, tokenizer, search: Search, limits: EpisodeLimits):
        self.tokenizer, self.search, self.limits = tokenizer, search, limits
        self._open = self._encode(INFO_OPEN)
        self._close = self._encode(INFO_CLOSE)
        self.calls = 0

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def observation(self, body: str) -> list[int]:
        """`body` between the information tags, cut to max_obs_tokens with the tags kept."""
        room = max(self.limits.max_obs_tokens - len(self._open) - len(self._close), 0)
        return self._open + self._encode(body)[:room] + self._close

    def reset(self, sample: dict) -> str:
        self.calls = 0
        return ""

    def step(self, action_text: str) -> StepResult:
        return self.step_many([self], [action_text])[0]

    @classmethod
    def step_many(cls, envs: list[SearchEnvironment], actions: list[str]) -> list[StepResult]:
        """One result per turn; the valid queries are answered with one `search` request."""
        results: list[StepResult] = []
        queries: list[tuple[int, str]] = []
        for k, (env, text) in enumerate(zip(envs, actions)):
            if ANSWER_CLOSE in text or SEARCH_CLOSE not in text or env.calls >= env.limits.max_turns - 1:
                # an answer, a turn without a call, or the last turn, whose call goes unanswered
                results.append(StepResult(done=True))
                continue
            env.calls += 1
            query = search_call(text)
            if query is None:
                results.append(StepResult(env.observation(INVALID_CALL), info={"searches": 0, "invalid_calls": 1}))
                continue
            queries.append((k, query))
            results.append(StepResult(info={"searches": 1, "invalid_calls": 0}))
        if queries:
            found = envs[0].search([q for _, q in queries])
            for (k, _), passages in zip(queries, found):
                results[k].observation = envs[k].observation(format_passages(passages))
        return results


class TurnLoop:
    """Runs the turns for one batch of prompts with `generate` (an engine's) and `search`: the episode
    loop (environment.py) with a `SearchEnvironment` per sample."""

    def __init__(
        self,
        generate: Callable[[list[list[int]], SamplingSettings], list[Completion]],
        tokenizer,
        search: Search,
        limits: EpisodeLimits,
    ):
        make = lambda: SearchEnvironment(tokenizer, search, limits)  # noqa: E731
        self.loop = EpisodeLoop(generate, tokenizer, make, limits, env_class=SearchEnvironment)

    def run(self, prompts: list[list[int]], settings: SamplingSettings) -> list[Completion]:
        return self.loop.run(prompts, settings)


def turn_metrics(completions: list[Completion]) -> dict[str, float]:
    """Per-step averages over samples: turns, searches, valid-call rate, observation tokens (another
    environment's: environment.episode_metrics)."""
    counts = [c.turns for c in completions if c.turns is not None]
    if not counts:
        return {}
    if "searches" not in counts[0]:
        return episode_metrics(completions)
    total = {k: sum(c.get(k, 0) for c in counts) for k in counts[0]}
    calls = total["searches"] + total["invalid_calls"]
    return {
        "search/turns_per_sample": total["turns"] / len(counts),
        "search/searches_per_sample": total["searches"] / len(counts),
        "search/valid_call_rate": total["searches"] / calls if calls else 1.0,
        "search/observation_tokens": total["observation_tokens"] / len(counts),
    }
