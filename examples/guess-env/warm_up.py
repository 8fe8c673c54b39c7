"""Teach the built-in tiny model the game's format before RL: made-up episodes of `guess.py`'s game whose guesses
are random digits, each followed by "." and the environment's answer. The model learns to write one digit and
stop, turn after turn; it learns nothing about which digit to guess (the answers it reads are never what it is
trained to write), so RL starts from a policy that ignores them: greedily it hits 1 time in 10.

With --tool, made-up episodes of `guess_tool.py`'s game instead: each turn either calls `guess` with a random
digit (a share --call-share of the turns) or gives up ("pass"). RL starts from a model that knows the call's
format and calls about 1 turn in 4; it has to learn that calling more finds more digits.

    python warm_up.py                      # writes runs/guess-model (~15 s on 2 cores)
    python -m cloudrl.trainer --preset guess.yaml
    python warm_up.py --tool               # writes runs/guess-tool-model
    python -m cloudrl.trainer --preset guess_tool.yaml
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
from guess_tool import GuessWithTool  # noqa: E402

MAX_TURNS = 3  # as guess.yaml's rollout.max_turns
MAX_CALLS = 2  # as guess_tool.yaml's rollout.max_turns: three calls would not fit the model's 256 positions
GIVE_UP = "pass"


def call_text(digit: int) -> str:
    """The call the warm-up teaches, compact JSON (the model writes each character as a token)."""
    return f'<tool_call>{{"name":"guess","arguments":{{"digit":{digit}}}}}</tool_call>'


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


def made_up_tool_episode(tok, rng: random.Random, call_share: float) -> tuple[list[int], list[int], list[float]]:
    """(tokens, labels, weights) of one episode of the tool game: each turn a call with a random digit (a share
    `call_share` of the turns) or "pass" and end-of-sequence; the model's turns are targets, the prompt and the
    tool's responses context. A right call ends it, as the environment does."""
    env = GuessWithTool()
    env.reset({"ground_truth": str(rng.randrange(10))})
    ids = tok.encode(PROMPT, add_special_tokens=False)
    labels = [-100] * len(ids)
    for turn in range(MAX_CALLS):
        if rng.random() >= call_share:
            piece = tok.encode(GIVE_UP, add_special_tokens=False) + [tok.eos_token_id]
            ids, labels = ids + piece, labels + piece
            break
        action = call_text(rng.randrange(10))
        piece = tok.encode(action, add_special_tokens=False)
        ids, labels = ids + piece, labels + piece
        result = env.step(action)
        if result.done or turn == MAX_CALLS - 1:  # the last turn's response is never read
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


def tool_report(model, tok) -> str:
    """How the model opens a turn, greedily and as sampled: its probability of calling (the first token "<")."""
    contexts = [PROMPT, f"{PROMPT}{call_text(3)}{GuessWithTool().wrap(['<tool_response>higher</tool_response>'])}"]
    opens_call = tok.convert_tokens_to_ids("<")
    with torch.no_grad():
        probs = [
            model(torch.tensor([tok.encode(c, add_special_tokens=False)])).logits[0, -1].softmax(-1)[opens_call]
            for c in contexts
        ]
    first, second = (f"{p:.0%}" for p in probs)
    turn = greedy(model, tok, [PROMPT], max_new_tokens=len(call_text(0)))[0]
    return f"it calls with probability {first} at the first turn, {second} after a miss; greedily: {turn!r}"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split(":")[0])
    parser.add_argument(
        "--out",
        default="",
        help="where the model goes (default: the presets' model.path, runs/guess-model or runs/guess-tool-model)",
    )
    parser.add_argument("--tool", action="store_true", help="the tool game's format (guess_tool.py)")
    parser.add_argument("--call-share", type=float, default=0.3, help="with --tool: the share of turns that call")
    parser.add_argument("--steps", type=int, default=150, help="warm-up steps of --batch-size episodes")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.lr <= 0:
        parser.error("--steps and --batch-size must be at least 1, --lr above 0")
    if not 0 < args.call_share < 1:
        parser.error(f"--call-share {args.call_share}: give a share strictly between 0 and 1")
    out_dir = Path(args.out or ("runs/guess-tool-model" if args.tool else "runs/guess-model"))
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, args.seed)
    rng = random.Random(f"guess warm-up {args.seed}")

    def loss_at(step: int, first_phase: bool) -> torch.Tensor:
        if args.tool:
            rows = [made_up_tool_episode(tok, rng, args.call_share) for _ in range(args.batch_size)]
        else:
            rows = [made_up_episode(tok, rng) for _ in range(args.batch_size)]
        return weighted_loss(model, padded_batch(tok, rows))

    def progress(step: int, loss: float) -> None:
        if step % 25 == 0 or step == args.steps:
            print(f"warm-up step {step}/{args.steps}: loss {loss:.3f}", flush=True)

    out = train_in_two_phases(model, tok, loss_at, args.steps, args.lr, args.steps // 2, out_dir, progress)
    if args.tool:
        print(f"warmed-up model in {out}: {tool_report(model, tok)}")
    else:
        print(f"warmed-up model in {out}: {format_report(model, tok):.0%} of greedy turns are one digit and '.'")
    return out


if __name__ == "__main__":
    main()
