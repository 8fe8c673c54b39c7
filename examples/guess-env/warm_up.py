"""Teach the built-in tiny model the game's format before RL: made-up episodes of `guess.py`'s game whose guesses
are random digits, each followed by "." and the environment's answer. The model learns to write one digit and
stop, turn after turn; it learns nothing about which digit to guess (the answers it reads are never what it is
trained to write), so RL starts from a policy that ignores them: greedily it hits 1 time in 10.

    python warm_up.py                      # writes runs/guess-model (~15 s on 2 cores)
    python -m cloudrl.trainer --preset guess.yaml
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cloudrl.trainer.inputs.demo import (  # noqa: E402
    build_char_tokenizer,
    build_tiny_model,
    greedy,
    padded_batch,
    train_in_two_phases,
    weighted_loss,
)
from guess import PROMPT, Guess  # noqa: E402

MAX_TURNS = 3  # as guess.yaml's rollout.max_turns


def made_up_episode(tok, rng: random.Random) -> tuple[list[int], list[int], list[float]]:
    """(tokens, labels, weights) of one episode with random guesses: each guess and its "." are targets, the
    prompt and the environment's answers context."""
    env = Guess()
    env.reset({"ground_truth": str(rng.randrange(10))})
    ids = tok.encode(PROMPT, add_special_tokens=False)
    labels = [-100] * len(ids)
    for _ in range(MAX_TURNS):
        action = f"{rng.randrange(10)}."
        piece = tok.encode(action, add_special_tokens=False)
        ids, labels = ids + piece, labels + piece
        result = env.step(action)
        if result.done:
            break
        piece = tok.encode(result.observation, add_special_tokens=False)
        ids, labels = ids + piece, labels + [-100] * len(piece)
    return ids, labels, [1.0] * len(ids)


def format_report(model, tok) -> float:
    """The share of greedy turns, after a first guess and each answer, that are one digit and "."."""
    contexts = (
        [PROMPT]
        + [f"{PROMPT}{d}. higher, {d + 1}-9: " for d in range(9)]
        + [f"{PROMPT}{d}. lower, 0-{d - 1}: " for d in range(1, 10)]
    )
    turns = greedy(model, tok, contexts, max_new_tokens=2)
    return sum(len(t) == 2 and t[0].isdigit() and t[1] == "." for t in turns) / len(turns)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/guess-model", help="where the model goes (guess.yaml's model.path)")
    parser.add_argument("--steps", type=int, default=150, help="warm-up steps of --batch-size episodes")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.lr <= 0:
        parser.error("--steps and --batch-size must be at least 1, --lr above 0")
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, args.seed)
    rng = random.Random(f"guess warm-up {args.seed}")

    def loss_at(step: int, first_phase: bool) -> torch.Tensor:
        rows = [made_up_episode(tok, rng) for _ in range(args.batch_size)]
        return weighted_loss(model, padded_batch(tok, rows))

    def progress(step: int, loss: float) -> None:
        if step % 25 == 0 or step == args.steps:
            print(f"warm-up step {step}/{args.steps}: loss {loss:.3f}", flush=True)

    out = train_in_two_phases(model, tok, loss_at, args.steps, args.lr, args.steps // 2, Path(args.out), progress)
    print(f"warmed-up model in {out}: {format_report(model, tok):.0%} of greedy turns are one digit and '.'")
    return out


if __name__ == "__main__":
    main()
