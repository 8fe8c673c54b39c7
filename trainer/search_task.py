"""A local search task for the built-in tiny model: facts that only the retriever knows.

Each fact gives a made-up name a one-digit code ("zabo code is 7"); the corpus holds the facts, the
prompts ask for the code of a name ("zabo?"), and `answer_em` scores `<answer>7</answer>`. Without a
search the policy can only guess (chance 0.1); with one, the code is in the observation.

`write_task` writes the corpus and the prompts (the trainer's JSONL schema: prompt, answer);
`warm_up_model` makes a copy of the tiny model that knows the format and how to read an observation,
and searches in only half of its examples: those search for the name and answer with the code they
found, the others answer at once with a random digit (right one time in ten). RL has to discover that searching
pays: the reward and the searches per sample rise together.
bench/search_r1.py runs the whole thing (retriever, trainer, table).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from .multiturn import ANSWER_CLOSE, ANSWER_OPEN, INFO_CLOSE, INFO_OPEN, SEARCH_CLOSE, SEARCH_OPEN, format_passages

_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"


def make_facts(size: int, seed: int = 0) -> list[tuple[str, int]]:
    """`size` distinct four-letter names, each with a code 0..9."""
    rng, names = random.Random(seed), set()
    while len(names) < size:
        names.add("".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(2)))
    return [(name, rng.randrange(10)) for name in sorted(names)]


def fact_text(name: str, code: int) -> str:
    return f"{name} code is {code}"


def write_task(out: Path, size: int = 64, seed: int = 0) -> dict[str, Path]:
    """corpus.jsonl (for the retriever) and prompts.jsonl (for the trainer) under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    facts = make_facts(size, seed)
    paths = {"corpus": out / "corpus.jsonl", "prompts": out / "prompts.jsonl"}
    paths["corpus"].write_text("".join(json.dumps({"id": str(i), "contents": fact_text(n, c)}) + "\n"
                                       for i, (n, c) in enumerate(facts)))
    paths["prompts"].write_text("".join(json.dumps({"prompt": f"{n}?", "answer": str(c)}) + "\n" for n, c in facts))
    return paths


def _example(tok, name: str, code: int, search: bool, rng: random.Random) -> tuple[list[int], list[int]]:
    """(tokens, labels) of one warm-up sequence: the prompt and the observation are not learned."""
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    ids, labels = enc(f"{name}?"), []
    labels += [-100] * len(ids)
    parts = []
    if search:
        parts += [(f"{SEARCH_OPEN}{name}{SEARCH_CLOSE}", True),
                  (INFO_OPEN + format_passages([fact_text(name, code)]) + INFO_CLOSE, False)]
    parts.append((f"{ANSWER_OPEN}{code if search else rng.randrange(10)}{ANSWER_CLOSE}", True))
    for text, learned in parts:
        piece = enc(text)
        ids += piece
        labels += piece if learned else [-100] * len(piece)
    return ids + [tok.eos_token_id], labels + [tok.eos_token_id]


def warm_up_model(out: Path, facts: list[tuple[str, int]], steps: int = 150, lr: float = 3e-3,
                  search_share: float = 0.5, seed: int = 0, batch_size: int = 32) -> str:
    """Save the tiny model after a format warm-up on `facts` into `out`; returns its path."""
    from .demo import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        rows = [_example(tok, *rng.choice(facts), rng.random() < search_share, rng) for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((batch_size, width), tok.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for i, (ids, lab) in enumerate(rows):
            input_ids[i, :len(ids)], labels[i, :len(ids)], mask[i, :len(ids)] = torch.tensor(ids), torch.tensor(lab), 1
        model(input_ids=input_ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)
