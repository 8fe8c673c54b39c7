"""The built-in demo, in one place: what `builtin:tiny` and `builtin:arithmetic` are.

- a character-level tokenizer over printable ASCII, made locally with `tokenizers`;
- a 0.5M-parameter Llama built from a config (head dim 32, so vLLM's CPU attention takes it);
- the arithmetic task: prompts `a+b=` with operands up to `data.arithmetic_max_operand`, scored by the
  `arithmetic` reward (rewards.py);
- the format warm-up (`model.sft_warmup_steps`): supervised steps on random answers, so RL starts from a
  model that answers with a number and stops, at chance level.

`materialize_builtin` saves the model and tokenizer once into the cache directory, so the built-in path
goes through exactly the same `from_pretrained` loading as a real model (models.py). data.py turns the
task's problems into prompt records.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import ModelLoadError
from ..paths import cache_dir

if TYPE_CHECKING:
    from ..config import DataConfig

BUILTIN_PREFIX = "builtin:"
BUILTIN_ARITHMETIC = "builtin:arithmetic"
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"

# Head dim 32 keeps vLLM's CPU attention happy; the rest is as small as learns the built-in task.
TINY_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def build_char_tokenizer():
    """A character-level tokenizer over printable ASCII, built locally with `tokenizers`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"] + ["\n"]
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK] + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        bos_token=None,
        padding_side="left",
        model_max_length=256,
    )


def build_tiny_model(tokenizer, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **TINY_CONFIG,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def materialize_builtin(
    name: str, warmup_steps: int = 0, warmup_lr: float = 3e-3, max_operand: int = 4, seed: int = 0
) -> str:
    """Create (once, under a file lock) the built-in model directory and return its path."""
    if name != "tiny":
        raise ModelLoadError(f"unknown built-in model {BUILTIN_PREFIX}{name!r}: the built-in model is builtin:tiny")
    spec = dict(
        name=name,
        config=TINY_CONFIG,
        warmup_steps=warmup_steps,
        warmup_lr=warmup_lr,
        max_operand=max_operand,
        seed=seed,
        version=1,
    )
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    target = cache_dir() / f"builtin-{name}-{digest}"
    if (target / "config.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            tokenizer = build_char_tokenizer()
            model = build_tiny_model(tokenizer, seed)
            if warmup_steps:
                _format_warmup(
                    model, tokenizer, format_warmup_batches(tokenizer, max_operand, seed), warmup_steps, warmup_lr
                )
            tmp = target.with_name(target.name + f".tmp{os.getpid()}")
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, target)
    return str(target)


def _format_warmup(model, tokenizer, batches, steps: int, lr: float) -> None:
    """Supervised steps on (prompt, answer) pairs whose answers are random: the model learns the
    answer format (a number, then end-of-sequence) but nothing about which number is right."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _, (input_ids, attention_mask, labels) in zip(range(steps), batches):
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()


def train_in_two_phases(
    model,
    tokenizer,
    loss_at: Callable[[int, bool], torch.Tensor],
    steps: int,
    lr: float,
    first_steps: int,
    out,
    progress: Callable[[int, float], None] | None = None,
) -> str:
    """The format warm-up loop of the built-in multi-turn tasks (`warm_up_tiny_model`) and of
    examples/guess-env/warm_up.py: AdamW
    at `lr` for the `first_steps`, then falling linearly to a tenth, gradients clipped at 1; `loss_at(step,
    first_phase)` builds that step's rows and returns their loss. Saves the model and tokenizer into `out` and
    returns its path; `progress(step, loss)` after every step (1-based). Runs on one thread: the tiny model's
    matrices are too small to split, and on a busy 2-core machine a second thread mostly waits (300 steps took
    59 s with one, 86 s with two, under the same load)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    decay = max(steps - first_steps, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: 1.0 if step < first_steps else 1 - 0.9 * (step - first_steps) / decay
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.train()
        for step in range(steps):
            loss = loss_at(step, step < first_steps)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if progress is not None:
                progress(step + 1, loss.item())
    finally:
        torch.set_num_threads(threads)
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


WarmUpRow = tuple[list[int], list[int], list[float]]
"""One warm-up sequence of the built-in multi-turn tasks: (token ids, labels, loss weights); label -100 where
a token is context, not a target."""


def choice_keep(share: float, tool_rows: float) -> float:
    """The share of a warm-up's tool rows whose choice to take the tool is labelled, so that the model ends
    taking it with probability `share` when a `tool_rows` share of the rows take it (labelled tool choices
    per labelled direct choice must be share / (1 - share)); 0 with `tool_rows` 1: the choice is not learned."""
    return min(1.0, share / (1 - share) * (1 - tool_rows) / tool_rows) if tool_rows < 1 else 0.0


def warm_up_batch(
    rng: random.Random,
    batch_size: int,
    tool_rows: float,
    fresh: Callable[[random.Random], str],
    exclude: set[str],
    example: Callable[[str, bool], tuple],
) -> list[tuple]:
    """One warm-up batch of the built-in tool and search tasks: `batch_size` rows, each on a fresh item
    (`fresh(rng)`, never one in `exclude`: the task's own) that takes the tool with probability `tool_rows`;
    `example(item, takes_tool)` makes the row."""
    rows = []
    for _ in range(batch_size):
        item = fresh(rng)
        while item in exclude:
            item = fresh(rng)
        rows.append(example(item, rng.random() < tool_rows))
    return rows


@dataclass(frozen=True)
class WarmUp:
    """The format warm-up of a built-in tool or search task (`warm_up_tiny_model`): `steps` steps of
    `batch_size` fresh rows at `lr`, the tiny model initialised from `seed`. In the first `first` share of
    the steps every row takes the tool, so copying into the call and reading out of its answer are learned
    without rows that answer at once pulling the answer towards uniform; the second mixes those rows in and
    teaches the choice to take the tool at `share`, with the learning rate falling to a tenth so that the
    choice ends near that share."""

    steps: int = 300
    lr: float = 2e-3
    share: float = 0.2
    seed: int = 0
    batch_size: int = 32
    first: float = 2 / 3


DEFAULT_WARM_UP = WarmUp()


def warm_up_tiny_model(
    tokenizer,
    rows_at: Callable[[bool], list[WarmUpRow]],
    schedule: WarmUp,
    out,
    progress: Callable[[int, float], None] | None = None,
) -> str:
    """The built-in tiny model after `train_in_two_phases` on the rows `rows_at(first_phase)` gives each
    step, as `schedule` says, saved into `out`: the warm-up of the built-in tool and search tasks. Returns
    its path."""
    model = build_tiny_model(tokenizer, schedule.seed)

    def loss_at(step: int, first_phase: bool) -> torch.Tensor:
        return weighted_loss(model, padded_batch(tokenizer, rows_at(first_phase)))

    first_steps = int(schedule.steps * schedule.first)
    return train_in_two_phases(model, tokenizer, loss_at, schedule.steps, schedule.lr, first_steps, out, progress)


def padded_batch(tokenizer, rows: list[WarmUpRow]) -> dict[str, torch.Tensor]:
    """`rows` right-padded into one batch: input_ids, attention_mask, labels (-100 on padding), weights."""
    width = max(len(ids) for ids, _, _ in rows)
    batch = {
        "input_ids": torch.full((len(rows), width), tokenizer.pad_token_id),
        "attention_mask": torch.zeros((len(rows), width), dtype=torch.long),
        "labels": torch.full((len(rows), width), -100),
        "weights": torch.zeros((len(rows), width)),
    }
    for i, (ids, labels, weights) in enumerate(rows):
        batch["input_ids"][i, : len(ids)] = torch.tensor(ids)
        batch["attention_mask"][i, : len(ids)] = 1
        batch["labels"][i, : len(ids)] = torch.tensor(labels)
        batch["weights"][i, : len(ids)] = torch.tensor(weights)
    return batch


def weighted_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy over the labelled tokens of a `padded_batch`, weighted by its `weights`."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100, reduction="none"
    )
    weights = (targets != -100).reshape(-1).float() * batch["weights"][:, 1:].reshape(-1)
    return (ce * weights).sum() / weights.sum()


def greedy(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    """The model's greedy continuations of `prompts` (the warm-up reports of the built-in tasks)."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def arithmetic_pairs(max_operand: int) -> list[tuple[int, int]]:
    """Every distinct (a, b) with 0 <= a, b <= max_operand, in a fixed order."""
    return [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]


def arithmetic_problems(cfg: DataConfig, split: str, seed: int) -> list[tuple[int, int]]:
    """The built-in task's (a, b) pairs: `arithmetic_size` seeded draws, or every pair once for "val"."""
    # The task is tiny, so "val" is not disjoint from "train": it is every pair once, in a fixed
    # order, which makes validation accuracy comparable across runs and seeds.
    if split == "val":
        return arithmetic_pairs(cfg.arithmetic_max_operand)
    rng = random.Random(seed)
    top = cfg.arithmetic_max_operand
    return [(rng.randint(0, top), rng.randint(0, top)) for _ in range(cfg.arithmetic_size)]


def format_warmup_batches(
    tokenizer, max_operand: int, seed: int, batch_size: int = 64
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Endless `(input_ids, attention_mask, labels)` batches, each [batch_size, T] int64, for a
    supervised warm-up on the built-in task's answer FORMAT only.

    Each row is `a+b=` then a uniformly random integer in 0..2*max_operand (not a+b) then EOS,
    right-padded. `labels` copy the answer and EOS tokens and are -100 on the prompt and padding,
    so the model learns "a number, then stop" but nothing about which number is right.
    """
    rng = random.Random(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    while True:
        rows = []
        for _ in range(batch_size):
            a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
            answer = rng.randint(0, 2 * max_operand)
            prompt = list(tokenizer(f"{a}+{b}=", add_special_tokens=True)["input_ids"])
            target = list(tokenizer(str(answer), add_special_tokens=False)["input_ids"]) + [eos]
            rows.append((prompt, target))
        width = max(len(p) + len(t) for p, t in rows)
        input_ids = torch.full((batch_size, width), pad, dtype=torch.long)
        attention_mask = torch.zeros((batch_size, width), dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        for i, (prompt, target) in enumerate(rows):
            n, m = len(prompt), len(target)
            input_ids[i, : n + m] = torch.tensor(prompt + target)
            attention_mask[i, : n + m] = 1
            labels[i, n : n + m] = torch.tensor(target)
        yield input_ids, attention_mask, labels
