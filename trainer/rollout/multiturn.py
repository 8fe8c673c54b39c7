"""Multi-turn rollouts with a search tool (Search-R1's protocol), for any rollout engine.

The policy writes `<search>query</search>` to call the retriever and `<answer>...</answer>` to finish.
Each turn generates until one of those closing tags, the end-of-sequence token or the turn's token
budget. After a search call the retriever's passages are appended as an observation,
`<information>...</information>`, and the sample goes on from there; after `max_turns` observations a
sample gets one last turn, whose search call is not answered. The whole response (generated and
observation tokens) stays within `max_response_tokens`: an observation that would not leave room for
at least one more generated token ends the sample instead (finish reason `length`).

A search call whose query is empty, too long, or has no opening `<search>` is invalid: it is counted
and answered with a short error observation, so the policy can try again within its budget.

The loop is batched: every turn sends all still-running samples to the engine in one `generate` call
and all their queries to the retriever in one request; samples finish at different turns.

Each sample comes back as one `Completion` whose `loss_mask` is 1 on generated tokens and 0 on
observation tokens (whose log-probs are 0: the engine did not sample them), and whose `turns` holds
its counts. `turn_metrics` averages those counts over a step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from .engines import Completion, SamplingSettings

SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
INFO_OPEN, INFO_CLOSE = "\n<information>", "</information>\n"
INVALID_CALL = "invalid search call: write <search>your query</search> or <answer>...</answer>"
MAX_QUERY_CHARS = 512

Search = Callable[[list[str]], list[list[str]]]
"""queries -> for each query, its passages' texts (best first)."""


@dataclass
class TurnSettings:
    max_turns: int = 4
    """Observations per sample at most (a last turn follows the last one)."""
    max_response_tokens: int = 256
    """Generated plus observation tokens per sample."""
    max_obs_tokens: int = 128
    """Tokens per observation, tags included; longer passages are cut."""

    @classmethod
    def from_config(cls, search_cfg) -> TurnSettings:
        return cls(search_cfg.max_turns, search_cfg.max_response_tokens, search_cfg.max_obs_tokens)


@dataclass
class _Sample:
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    searches: int = 0
    invalid_calls: int = 0
    observation_tokens: int = 0
    finish_reason: str = ""

    def add(self, ids: list[int], logprobs: list[float], generated: bool) -> None:
        self.ids += ids
        self.logprobs += logprobs if generated else [0.0] * len(ids)
        self.mask += [int(generated)] * len(ids)
        if not generated:
            self.observation_tokens += len(ids)

    def completion(self) -> Completion:
        counts = dict(
            turns=self.turns,
            searches=self.searches,
            invalid_calls=self.invalid_calls,
            observation_tokens=self.observation_tokens,
        )
        return Completion(self.ids, self.logprobs, self.finish_reason, self.mask, counts)


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


class TurnLoop:
    """Runs the turns for one batch of prompts with `generate` (an engine's) and `search`."""

    def __init__(
        self,
        generate: Callable[[list[list[int]], SamplingSettings], list[Completion]],
        tokenizer,
        search: Search,
        turn: TurnSettings,
    ):
        self.generate, self.tokenizer, self.search, self.turn = generate, tokenizer, search, turn
        self.eos = tokenizer.eos_token_id
        self._open = self._encode(INFO_OPEN)
        self._close = self._encode(INFO_CLOSE)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def observation(self, body: str) -> list[int]:
        room = max(self.turn.max_obs_tokens - len(self._open) - len(self._close), 0)
        return self._open + self._encode(body)[:room] + self._close

    def run(self, prompts: list[list[int]], settings: SamplingSettings) -> list[Completion]:
        stop = list(dict.fromkeys([*settings.stop, SEARCH_CLOSE, ANSWER_CLOSE]))
        n = settings.n
        samples = [_Sample(p) for p in prompts for _ in range(n)]
        active = list(range(len(samples)))
        turn = 0
        while active:
            # One budget per engine call (the longest any sample may take); each sample's turn is then
            # cut to its own room, which keeps the tokens a sampled prefix.
            budget = min(
                settings.max_new_tokens, max(self.turn.max_response_tokens - len(samples[i].ids) for i in active)
            )
            first = turn == 0
            turn_settings = dataclasses.replace(
                settings, stop=stop, max_new_tokens=budget, n=n if first else 1, seed=settings.seed + 7919 * turn
            )
            contexts = prompts if first else [samples[i].prompt + samples[i].ids for i in active]
            outs = self.generate(contexts, turn_settings)
            calls: list[tuple[int, str | None]] = []
            for i, out in zip(active, outs):
                room = min(budget, self.turn.max_response_tokens - len(samples[i].ids))
                calls.append((i, self._take_turn(samples[i], out, room)))
            active = self._answer_calls(samples, [(i, q) for i, q in calls if q != ""])
            turn += 1
        return [s.completion() for s in samples]

    def _take_turn(self, s: _Sample, out: Completion, room: int) -> str | None:
        """Record one turn's tokens (at most `room`). Returns "" when the sample is done, else its
        query (None: an invalid call)."""
        cut = len(out.token_ids) > room
        ids, lps = list(out.token_ids[:room]), list(out.logprobs[:room])
        s.turns += 1
        s.add(ids, lps, generated=True)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if (ids and ids[-1] == self.eos) or ANSWER_CLOSE in text:
            s.finish_reason = "stop"
            return ""
        if SEARCH_CLOSE not in text:  # ran out of tokens mid-turn
            s.finish_reason = "length" if cut or out.finish_reason == "length" else "stop"
            return ""
        if s.searches + s.invalid_calls >= self.turn.max_turns:  # the last turn's call goes unanswered
            s.finish_reason = "stop"
            return ""
        query = search_call(text)
        if query is None:
            s.invalid_calls += 1
        return query

    def _answer_calls(self, samples: list[_Sample], calls: list[tuple[int, str | None]]) -> list[int]:
        """Append each call's observation; returns the samples that go on to another turn."""
        queries = [q for _, q in calls if q is not None]
        results = iter(self.search(queries) if queries else [])
        going_on = []
        for i, query in calls:
            s = samples[i]
            body = format_passages(next(results)) if query is not None else INVALID_CALL
            obs = self.observation(body)
            if len(s.ids) + len(obs) + 1 > self.turn.max_response_tokens:
                s.finish_reason = "length"  # no room to read the answer and go on
                continue
            s.searches += query is not None
            s.add(obs, [], generated=False)
            going_on.append(i)
        return going_on


def turn_metrics(completions: list[Completion]) -> dict[str, float]:
    """Per-step averages over samples: turns, searches, valid-call rate, observation tokens."""
    counts = [c.turns for c in completions if c.turns is not None]
    if not counts:
        return {}
    total = {k: sum(c[k] for c in counts) for k in counts[0]}
    calls = total["searches"] + total["invalid_calls"]
    return {
        "search/turns_per_sample": total["turns"] / len(counts),
        "search/searches_per_sample": total["searches"] / len(counts),
        "search/valid_call_rate": total["searches"] / calls if calls else 1.0,
        "search/observation_tokens": total["observation_tokens"] / len(counts),
    }
