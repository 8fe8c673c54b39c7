"""A local search task for the built-in tiny model: facts that only the retriever knows.

Each fact gives a made-up five-letter name a one-digit code ("zabok code is 7"); the corpus holds the
facts, the prompts ask for the code of a name ("zabok?"), and `answer_em` scores `<answer>7</answer>`.
Without a search the policy can only guess (chance 0.1); with one, the code is in the observation.
There are thousands of facts, more than a short run samples, so remembering codes does not pay: only
searching does. Validation asks about names the training prompts never ask about.

`write_task` writes the corpus, the training prompts and the validation prompts (the trainer's JSONL
schema: prompt, answer). `warm_up_model` makes a copy of the tiny model that knows the format, copies
a name into its query and reads the code from an observation, all learned on freshly made-up names
(not the task's), so what it learns is to copy and to read, not a table of names. It still chooses to
search in only a small share of its samples (the others answer at once with a random digit), so RL
has to discover that searching pays: the reward and the searches per sample rise together.
`warm_up_report` measures the warmed-up model on names it never saw. bench/search_r1.py runs it all.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import torch

from ..inputs.demo import (
    DEFAULT_WARM_UP,
    WarmUp,
    build_char_tokenizer,
    choice_keep,
    greedy,
    warm_up_batch,
    warm_up_tiny_model,
)
from ..rollout.multiturn import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    INFO_CLOSE,
    INFO_OPEN,
    SEARCH_CLOSE,
    SEARCH_OPEN,
    format_passages,
)

_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"
# Five letters, consonant-vowel-consonant-vowel-consonant: 68,600 names, so the task's thousands and
# the warm-up's tens of thousands fit side by side without sharing one.
_PATTERN = (_CONSONANTS, _VOWELS, _CONSONANTS, _VOWELS, _CONSONANTS)


def make_name(rng: random.Random) -> str:
    return "".join(rng.choice(letters) for letters in _PATTERN)


def make_facts(size: int, seed: int = 0) -> list[tuple[str, int]]:
    """`size` distinct names, each with a code 0..9, in a seeded random order."""
    rng, names = random.Random(seed), {}
    while len(names) < size:
        names.setdefault(make_name(rng), rng.randrange(10))
    return list(names.items())


def fact_text(name: str, code: int) -> str:
    return f"{name} code is {code}"


def _write_prompts(path: Path, facts: list[tuple[str, int]]) -> None:
    path.write_text("".join(json.dumps({"prompt": f"{n}?", "answer": str(c)}) + "\n" for n, c in facts))


def write_task(out: Path, size: int = 2000, val_size: int = 128, seed: int = 0) -> dict[str, Path]:
    """corpus.jsonl (all facts, for the retriever), prompts.jsonl (`size` facts, for training) and
    val.jsonl (`val_size` other facts: held-out names) under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    facts = make_facts(size + val_size, seed)
    paths = {"corpus": out / "corpus.jsonl", "prompts": out / "prompts.jsonl", "val": out / "val.jsonl"}
    paths["corpus"].write_text(
        "".join(json.dumps({"id": str(i), "contents": fact_text(n, c)}) + "\n" for i, (n, c) in enumerate(facts))
    )
    _write_prompts(paths["prompts"], facts[:size])
    _write_prompts(paths["val"], facts[size:])
    return paths


def _example(
    tok, name: str, code: int, search: bool, rng: random.Random, learn_choice: bool = True
) -> tuple[list[int], list[int]]:
    """(tokens, labels) of one warm-up sequence: the prompt and the observation are not learned, and
    neither is the choice between searching and answering (the letter after `<`) unless `learn_choice`."""
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    ids, labels = enc(f"{name}?"), []
    labels += [-100] * len(ids)
    parts = []
    if search:
        parts += [
            (f"{SEARCH_OPEN}{name}{SEARCH_CLOSE}", True),
            (INFO_OPEN + format_passages([fact_text(name, code)]) + INFO_CLOSE, False),
        ]
    parts.append((f"{ANSWER_OPEN}{code if search else rng.randrange(10)}{ANSWER_CLOSE}", True))
    for n, (text, learned) in enumerate(parts):
        piece = enc(text)
        target = piece if learned else [-100] * len(piece)
        if n == 0 and not learn_choice:
            target = target[:1] + [-100] + target[2:]  # "<" is learned, "s" or "a" is not
        ids += piece
        labels += target
    return ids + [tok.eos_token_id], labels + [tok.eos_token_id]


def warm_up_rows(
    tok, rng: random.Random, batch_size: int, search_share: float, exclude: set[str], search_rows: float = 0.5
) -> list[tuple[list[int], list[int]]]:
    """One warm-up batch on fresh names (none in `exclude`). A `search_rows` share of the rows search
    (copying and reading are learned on those), the others answer at once. The choice to search is
    learned on every direct row and on just enough search rows that the model searches with
    probability `search_share` (at most `search_rows`); with `search_rows` 1 it is not learned."""
    keep = choice_keep(search_share, search_rows)

    def example(name: str, search: bool) -> tuple[list[int], list[int]]:
        return _example(tok, name, rng.randrange(10), search, rng, learn_choice=not search or rng.random() < keep)

    return warm_up_batch(rng, batch_size, search_rows, make_name, exclude, example)


def warm_up_model(
    out: Path,
    exclude: set[str] = frozenset(),
    schedule: WarmUp = DEFAULT_WARM_UP,
    progress: Callable[[int, float], None] | None = None,
) -> str:
    """Save the tiny model after a format warm-up on made-up names (none in `exclude`: pass the task's)
    into `out`; returns its path. `progress(step, loss)` is called after every step (1-based).

    In the first phase of `schedule` every row searches: reading a code out of the observation is learned
    only while no row teaches "answer a random digit", which pulls every answer towards uniform. The second
    mixes in the rows that answer at once and teaches the choice to search at `schedule.share`. (At lr 5e-3
    the reading had often not formed after 200 steps; at 2e-3 it formed within 150 for seeds 1-3.)"""
    tok = build_char_tokenizer()
    rng = random.Random(f"warm-up {schedule.seed}")

    def rows_at(reading: bool) -> list:
        rows = warm_up_rows(tok, rng, schedule.batch_size, schedule.share, exclude, 1.0 if reading else 0.5)
        return [(ids, labels, [1.0] * len(ids)) for ids, labels in rows]

    return warm_up_tiny_model(tok, rows_at, schedule, out, progress)


def rl_overrides(prompts: Path, val: Path, url: str, model: str) -> list[str]:
    """Config overrides (on the local preset) with which PPO learns to search on this task; batch
    sizes and steps are the caller's. Used by bench/search_r1.py and tests/search/test_search_task.py."""
    return [
        f"model.path={model}",
        "model.sft_warmup_steps=0",
        f"data.train_files={prompts}",
        f"data.val_files={val}",
        "reward.function=answer_em",
        "algorithm.kl_coef=0.01",  # light: the policy has to move far from the warm-up's 1-in-5 searching
        "algorithm.lam=1.0",  # as Search-R1: with lam < 1 the long observation span decays the credit of a search
        "rollout.n=8",
        "rollout.max_new_tokens=24",  # a turn: `<search>` + name + `</search>` is 22 tokens
        "search.enabled=true",
        f"search.url={url}",
        "search.topk=1",
        "rollout.max_turns=2",  # a search, then the answer
        "rollout.max_episode_tokens=112",
        "rollout.max_obs_tokens=64",  # a whole search and answer is ~92
        "actor.lr=2e-4",
        "critic.lr=1e-3",  # 10x below the arithmetic preset's: responses are ~20x longer
    ]


def warm_up_report(path: str, facts: list[tuple[str, int]]) -> dict[str, float]:
    """The warmed-up model on `facts` (names it never saw): `copy`, the share of greedy queries after
    `name?<search>` that are the name; `read`, the share of greedy answers after the right observation
    that are the code; `p_search`, its mean probability of searching rather than answering at once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    names = [n for n, _ in facts]
    queries = greedy(model, tok, [f"{n}?{SEARCH_OPEN}" for n in names], len(names[0]) + len(SEARCH_CLOSE))
    copied = sum(q.startswith(n + SEARCH_CLOSE) for q, n in zip(queries, names))
    seen = [
        f"{n}?{SEARCH_OPEN}{n}{SEARCH_CLOSE}{INFO_OPEN}{format_passages([fact_text(n, c)])}{INFO_CLOSE}"
        for n, c in facts
    ]
    answers = greedy(model, tok, seen, len(ANSWER_OPEN) + 1 + len(ANSWER_CLOSE))
    read = sum(a.startswith(f"{ANSWER_OPEN}{c}{ANSWER_CLOSE}") for a, (_, c) in zip(answers, facts))
    enc = tok([f"{n}?<" for n in names], return_tensors="pt", add_special_tokens=False)  # same length: no padding
    with torch.no_grad():
        probs = model(**enc).logits[:, -1].softmax(-1)
    p_search = probs[:, tok.convert_tokens_to_ids(SEARCH_OPEN[1])].mean().item()
    return {"copy": copied / len(facts), "read": read / len(facts), "p_search": p_search}
