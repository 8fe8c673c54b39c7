"""The built-in tool task: arithmetic the tiny model cannot do alone, with a calculator tool it can call.

Each prompt is `a*b+c=` with two-digit a and b (32..99) and a three-digit c (100..198), e.g. `37*45+123=`;
the answer is a four-digit number (1124..9999), which a guess hits about once in 9,000 tries. With the
`calculator` tool, in the Hermes/Qwen call format of rollout/tool_calls.py, an episode reads:

    37*45+123=<tool_call>{"name":"calculator","arguments":{"expression":"37*45+123"}}</tool_call>
    <tool_response>1788</tool_response>
    1788<eos>

The prompt and the `<tool_response>` line are not the model's (the latter is masked out of the loss); the call
and the answer are. `CalculatorEnvironment` scores the final answer (the turn without a call): 1 when its text,
stripped of surrounding whitespace, is the result's decimal digits exactly, 0 otherwise (no partial credit: a
near miss is as wrong as a guess). Only the widths are fixed so that every copy is at a fixed distance, which a
two-layer model learns in a short warm-up.

`warm_up_model` teaches the format on made-up problems (none of the task's): copying the prompt's expression
into a call, and writing the number in the tool's response as the answer. It also teaches, on other rows,
answering at once with a random four-digit number, and it teaches the choice between the two (the first
token: `<` or a digit) at the schedule's `share` (0.2 by default). So the warmed-up model calls the tool in about one
sample in five and guesses in the others; no row ever shows a task problem's answer. RL then has to
discover that calling pays: the reward and the calls per sample rise together.

    python -m cloudrl.trainer.agents.calculator --out runs/calculator-demo   # task, model, and the line to train
    python -m cloudrl.trainer --preset calculator                            # trainer/presets/calculator.yaml
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
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
from ..rollout.tool_calls import CALL_CLOSE, CALL_OPEN, ToolEnvironment, tool_response, tool_schema

A_RANGE, B_RANGE, C_RANGE = (32, 99), (32, 99), (100, 198)
"""Operand ranges: a*b is 1024..9801 and a*b+c 1124..9999, four digits every time."""
MAX_EXPRESSION = 100
"""Longest expression the calculator reads, in characters."""
MAX_MAGNITUDE = 1e15
"""Largest absolute value the calculator computes; a larger one is an error."""
DEFAULT_OUT = Path("runs/calculator-demo")
"""Where `python -m cloudrl.trainer.agents.calculator` writes by default (the preset's paths point here)."""
ENVIRONMENT = "cloudrl.trainer.agents.calculator:CalculatorEnvironment"


# ----------------------------------------------------------------------------------------------
# The tool
# ----------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|([-+*/()]))")


def calculate(expression: str) -> int | float:
    """The value of `expression`: numbers (`12`, `3.5`), `+ - * /`, unary minus and parentheses, by a small
    recursive-descent parser (nothing is handed to `eval`). A ValueError says what is wrong with it."""
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, not {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
    tokens, pos = [], 0
    text = expression.rstrip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ValueError(f"unexpected {text[pos:].lstrip()[:1]!r} at character {pos}")
        tokens.append(match.group(1) or match.group(2))
        pos = match.end()
    if not tokens:
        raise ValueError("empty expression")
    parser = _Parser(tokens)
    value = parser.sum()
    if parser.at < len(tokens):
        raise ValueError(f"unexpected {tokens[parser.at]!r} after a complete expression")
    return value


class _Parser:
    """sum := product (('+'|'-') product)*; product := unary (('*'|'/') unary)*;
    unary := '-' unary | '+' unary | NUMBER | '(' sum ')'."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.at = tokens, 0

    def peek(self) -> str:
        return self.tokens[self.at] if self.at < len(self.tokens) else ""

    def take(self) -> str:
        token = self.peek()
        if not token:
            raise ValueError("the expression ends too early")
        self.at += 1
        return token

    def sum(self) -> int | float:
        value = self.product()
        while self.peek() in ("+", "-"):
            op = self.take()
            value = _bounded(value + self.product() if op == "+" else value - self.product())
        return value

    def product(self) -> int | float:
        value = self.unary()
        while self.peek() in ("*", "/"):
            op = self.take()
            right = self.unary()
            if op == "*":
                value = _bounded(value * right)
            elif right == 0:
                raise ValueError("division by zero")
            elif isinstance(value, int) and isinstance(right, int) and value % right == 0:
                value = value // right
            else:
                value = _bounded(value / right)
        return value

    def unary(self) -> int | float:
        token = self.take()
        if token == "-":
            return -self.unary()
        if token == "+":
            return self.unary()
        if token == "(":
            value = self.sum()
            if self.take() != ")":
                raise ValueError("a '(' without its ')'")
            return value
        if token[0].isdigit():
            return _bounded(float(token) if "." in token else int(token))
        raise ValueError(f"unexpected {token!r}")


def _bounded(value: int | float) -> int | float:
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"a value beyond {MAX_MAGNITUDE:.0e}")
    return value


def format_number(value: int | float) -> str:
    """An integer (or integral float) as its digits; any other float to 10 significant digits."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.10g}"


def calculator(expression: str) -> str:
    """The `calculator` tool: the value of an arithmetic expression, as text."""
    return format_number(calculate(expression))


CALCULATOR_SCHEMA = tool_schema(
    "calculator",
    "Evaluates an arithmetic expression of numbers with + - * / and parentheses.",
    {"expression": {"type": "string", "description": "the expression, e.g. 37*45+123"}},
)


class CalculatorEnvironment(ToolEnvironment):
    """The built-in tool task's environment: one tool, `calculator`; the final answer (a turn without a call)
    scores 1 when it is the ground truth's digits exactly (surrounding whitespace aside), else 0."""

    tools = {"calculator": (CALCULATOR_SCHEMA, calculator)}

    def score(self, sample: dict, answer: str) -> float:
        return float(answer.strip() == str(sample.get("ground_truth", "")).strip())


# ----------------------------------------------------------------------------------------------
# The task's data
# ----------------------------------------------------------------------------------------------


def make_problem(rng: random.Random) -> str:
    """One expression `a*b+c` drawn from the task's ranges."""
    return f"{rng.randint(*A_RANGE)}*{rng.randint(*B_RANGE)}+{rng.randint(*C_RANGE)}"


def make_problems(size: int, seed: int = 0) -> list[str]:
    """`size` distinct expressions, in a seeded random order."""
    rng, seen = random.Random(seed), {}
    while len(seen) < size:
        seen.setdefault(make_problem(rng), None)
    return list(seen)


def call_text(expression: str) -> str:
    """The model's call of the calculator on `expression`, as the warm-up writes it."""
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}}, separators=(",", ":"))
    return f"{CALL_OPEN}{body}{CALL_CLOSE}"


def _write_prompts(path: Path, problems: list[str]) -> None:
    path.write_text("".join(json.dumps({"prompt": f"{p}=", "answer": calculator(p)}) + "\n" for p in problems))


def write_task(out: Path, size: int = 2000, val_size: int = 128, seed: int = 0) -> dict[str, Path]:
    """prompts.jsonl (`size` problems, for training) and val.jsonl (`val_size` others) under `out`, in the
    trainer's JSONL schema (prompt, answer)."""
    out.mkdir(parents=True, exist_ok=True)
    problems = make_problems(size + val_size, seed)
    paths = {"prompts": out / "prompts.jsonl", "val": out / "val.jsonl"}
    _write_prompts(paths["prompts"], problems[:size])
    _write_prompts(paths["val"], problems[size:])
    return paths


# ----------------------------------------------------------------------------------------------
# The format warm-up
# ----------------------------------------------------------------------------------------------


def warm_up_example(
    tok, expression: str, use_tool: bool, rng: random.Random, learn_choice: bool = True, read_weight: float = 1.0
) -> tuple[list[int], list[int], list[float]]:
    """(tokens, labels, copies) of one warm-up sequence: the prompt and the tool's response are context, never
    targets; the first token (the choice between calling and answering at once) is a target only with
    `learn_choice`. Without the tool the answer is a random four-digit number: the format, not the sum.
    `weights` weighs each token's loss: `read_weight` on the answer read out of the tool's response (and its
    end-of-sequence), 1 elsewhere."""
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    ids = enc(f"{expression}=")
    labels, weights = [-100] * len(ids), [1.0] * len(ids)
    if use_tool:
        result = calculator(expression)
        response = CalculatorEnvironment().wrap([tool_response(result)])
        parts = [(call_text(expression), True, 1.0), (response, False, 1.0), (result, True, read_weight)]
    else:
        parts = [(str(rng.randint(1000, 9999)), True, 1.0)]
    for n, (text, learned, weight) in enumerate(parts):
        piece = enc(text)
        target = list(piece) if learned else [-100] * len(piece)
        if n == 0 and not learn_choice:
            target[0] = -100
        ids += piece
        labels += target
        weights += [weight] * len(piece)
    return ids + [tok.eos_token_id], labels + [tok.eos_token_id], weights + [weights[-1]]


def warm_up_rows(
    tok,
    rng: random.Random,
    batch_size: int,
    tool_share: float,
    exclude: set[str],
    tool_rows: float = 0.5,
    read_weight: float = 1.0,
) -> list[tuple[list[int], list[int], list[float]]]:
    """One warm-up batch of fresh problems (none in `exclude`). A `tool_rows` share of the rows call the
    tool; the others answer at once. The choice is learned on every direct row and on just enough tool
    rows that the model calls with probability `tool_share` (with `tool_rows` 1 it is not learned)."""
    keep = choice_keep(tool_share, tool_rows)

    def example(expression: str, use_tool: bool) -> tuple[list[int], list[int], list[float]]:
        learn_choice = not use_tool or rng.random() < keep
        return warm_up_example(tok, expression, use_tool, rng, learn_choice, read_weight)

    return warm_up_batch(rng, batch_size, tool_rows, make_problem, exclude, example)


def warm_up_model(
    out: Path,
    exclude: set[str] = frozenset(),
    schedule: WarmUp = DEFAULT_WARM_UP,
    read_weight: float = 1.0,
    progress: Callable[[int, float], None] | None = None,
) -> str:
    """Save the tiny model after a format warm-up on made-up problems (none in `exclude`: pass the task's)
    into `out`; returns its path. `progress(step, loss)` is called after every step (1-based).

    In the first phase of `schedule` every row calls the tool, and copying and reading are learned without
    rows that write random numbers pulling the answer digits towards uniform; the second mixes in the
    direct answers and teaches the choice at `schedule.share`. `read_weight` weighs the loss of the answer
    read out of the response: a short warm-up learns both copies with it at 2 (220 steps of 16 rows at lr
    2.5e-3: right calls and reads 1.00 on held-out problems), where without it one of them had often not
    formed (at 3 and more, the call's copy had not)."""
    tok = build_char_tokenizer()
    rng = random.Random(f"calculator warm-up {schedule.seed}")

    def rows_at(tools_only: bool) -> list:
        rows_share = 1.0 if tools_only else 0.5
        return warm_up_rows(tok, rng, schedule.batch_size, schedule.share, exclude, rows_share, read_weight)

    return warm_up_tiny_model(tok, rows_at, schedule, out, progress)


def warm_up_report(path: str, problems: list[str]) -> dict[str, float]:
    """The warmed-up model on `problems` (ones it never saw): `call`, the share of greedy calls after
    `expression=<` that are the right call; `read`, the share of greedy answers after the right call and
    response that are the result; `p_tool`, its mean probability of calling rather than answering at once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    wrap = CalculatorEnvironment().wrap
    calls = greedy(model, tok, [f"{p}={CALL_OPEN[0]}" for p in problems], len(call_text(problems[0])) - 1)
    called = sum(c == call_text(p)[1:] for c, p in zip(calls, problems))
    seen = [f"{p}={call_text(p)}{wrap([tool_response(calculator(p))])}" for p in problems]
    answers = greedy(model, tok, seen, 5)
    read = sum(a.strip() == calculator(p) for a, p in zip(answers, problems))
    enc = tok([f"{p}=" for p in problems], return_tensors="pt", add_special_tokens=False)  # one length: no padding
    with torch.no_grad():
        probs = model(**enc).logits[:, -1].softmax(-1)
    p_tool = probs[:, tok.convert_tokens_to_ids(CALL_OPEN[0])].mean().item()
    return {"call": called / len(problems), "read": read / len(problems), "p_tool": p_tool}


def rl_overrides(prompts: Path, val: Path, model: str) -> list[str]:
    """Config overrides (on the calculator preset, or the local one) that train on this task's files with
    the warmed-up `model`; batch sizes and steps are the caller's."""
    return [f"model.path={model}", f"data.train_files={prompts}", f"data.val_files={val}"]


# ----------------------------------------------------------------------------------------------
# python -m cloudrl.trainer.agents.calculator
# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Path]:
    """Write the task and the warmed-up model under --out and print the line that trains on them."""
    parser = argparse.ArgumentParser(
        prog="python -m cloudrl.trainer.agents.calculator",
        description="Write the built-in calculator task and its warmed-up tiny model, then print how to train.",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"where to write (default {DEFAULT_OUT})")
    parser.add_argument("--size", type=int, default=2000, help="training problems")
    parser.add_argument("--val-size", type=int, default=128, help="held-out problems for validation")
    parser.add_argument("--warmup-steps", type=int, default=300)
    parser.add_argument("--tool-share", type=float, default=0.2, help="warm-up: how often the model calls the tool")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 0 < args.tool_share < 1:
        parser.error(f"--tool-share {args.tool_share}: give a share strictly between 0 and 1, e.g. 0.2")
    if args.size < 1 or args.val_size < 1 or args.warmup_steps < 1:
        parser.error("--size, --val-size and --warmup-steps must be at least 1")
    out = args.out.expanduser().resolve()
    paths = write_task(out / "task", args.size, args.val_size, args.seed)
    problems = make_problems(args.size + args.val_size, args.seed)
    print(f"calculator: wrote {args.size} training and {args.val_size} held-out problems to {out / 'task'}")
    t0 = time.perf_counter()

    def progress(step: int, loss: float) -> None:
        if step % 50 == 0 or step == args.warmup_steps:
            print(
                f"calculator: warm-up step {step}/{args.warmup_steps}, loss {loss:.3f}, {time.perf_counter() - t0:.0f}s"
            )

    schedule = WarmUp(steps=args.warmup_steps, share=args.tool_share, seed=args.seed)
    model = warm_up_model(out / "model", set(problems), schedule, progress=progress)
    report = warm_up_report(model, problems[args.size :])
    print(
        f"calculator: the warmed-up model on {args.val_size} problems it never saw: right calls "
        f"{report['call']:.2f}, reads the result {report['read']:.2f}, calls with p {report['p_tool']:.2f}"
    )
    line = " ".join(
        ["python -m cloudrl.trainer --preset calculator", *rl_overrides(paths["prompts"], paths["val"], model)]
    )
    print(f"calculator: train with\n  {line}")
    return {**paths, "model": Path(model)}


if __name__ == "__main__":
    main()
