"""Rule-based rewards: plain functions `fn(completions, **columns) -> list[float]`.

The trainer calls a reward function once per batch with the decoded responses (special tokens
removed) and, as keyword lists aligned with them, `prompts`, `ground_truth`, `data_source` and
every extra dataset column. Pick one with `reward.function=`:

    reward.function=gsm8k                       # a built-in: answer_em, arithmetic, auto, exact_match, gsm8k
    reward.function=my_rewards:format_bonus     # an importable module
    reward.function=rewards/mine.py:score_fn    # a file, relative to the current directory

Your function must accept `**kwargs`, since new columns may be passed at any time.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import math
import numbers
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from ..errors import DataError, RewardError
from .data import RESERVED_COLUMNS, PromptRecord, _short

RewardFn = Callable[..., list[float]]

_LEADING_INT = re.compile(r"-?\d+")
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")


# ----------------------------------------------------------------------------------------------
# Built-ins
# ----------------------------------------------------------------------------------------------


def exact_match(completions: list[str], ground_truth: list[str], **kwargs) -> list[float]:
    """1.0 when the completion equals the ground truth, ignoring surrounding whitespace."""
    return [float(c.strip() == g.strip()) for c, g in zip(completions, ground_truth)]


def _number_after_marker(text: str) -> float | None:
    """The number right after the last `####` (commas and `$` ignored), or None."""
    _, marker, rest = text.rpartition("####")
    if not marker:
        return None
    match = _NUMBER.match(rest.replace(",", "").replace("$", "").strip())
    return float(match.group()) if match else None


def gsm8k(completions: list[str], ground_truth: list[str], **kwargs) -> list[float]:
    """GSM8K's strict format: 1.0 when the number after the completion's last `####` equals the
    ground truth's number (the ground truth may be a bare number or a full `... #### 72` solution)."""
    scores = []
    for completion, truth in zip(completions, ground_truth):
        want = _number_after_marker(truth) if "####" in truth else _number_after_marker("####" + truth)
        got = _number_after_marker(completion)
        scores.append(float(want is not None and got is not None and math.isclose(got, want, abs_tol=1e-6)))
    return scores


def arithmetic(completions: list[str], ground_truth: list[str], **kwargs) -> list[float]:
    """The built-in task's checker: 1.0 when the completion starts with the right integer."""
    scores = []
    for completion, truth in zip(completions, ground_truth):
        got = _LEADING_INT.match(completion.strip())
        want = truth.strip()
        ok = got is not None and _LEADING_INT.fullmatch(want) is not None and int(got.group()) == int(want)
        scores.append(float(ok))
    return scores


def auto(completions: list[str], ground_truth: list[str], data_source: list[str], **kwargs) -> list[float]:
    """Per sample by `data_source`: `arithmetic` -> arithmetic, names containing gsm8k -> gsm8k,
    anything else -> exact_match."""
    scores = []
    for completion, truth, source in zip(completions, ground_truth, data_source):
        fn = arithmetic if source == "arithmetic" else gsm8k if "gsm8k" in source.lower() else exact_match
        scores += fn([completion], [truth])
    return scores


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def _normalized(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD-style answer normalisation)."""
    text = "".join(ch for ch in text.lower() if ch.isalnum() or ch.isspace())
    return " ".join(_ARTICLES.sub(" ", text).split())


def answer_em(completions: list[str], ground_truth: list[str], **kwargs) -> list[float]:
    """Search-R1's outcome reward: 1.0 when the last `<answer>...</answer>` of the completion equals one
    of the ground-truth answers after normalisation. A ground truth may be one answer, a JSON list of
    answers, or Search-R1's `{"target": [...]}`."""
    import json

    scores = []
    for completion, truth in zip(completions, ground_truth):
        found = _ANSWER.findall(completion)
        try:
            answers = json.loads(truth) if truth.lstrip()[:1] in ("[", "{") else [truth]
        except ValueError:
            answers = [truth]
        if isinstance(answers, dict):
            answers = answers.get("target", [])
        answers = answers if isinstance(answers, list) else [answers]
        scores.append(float(bool(found) and _normalized(found[-1]) in {_normalized(str(a)) for a in answers}))
    return scores


BUILTINS: dict[str, RewardFn] = {
    "answer_em": answer_em,
    "arithmetic": arithmetic,
    "auto": auto,
    "exact_match": exact_match,
    "gsm8k": gsm8k,
}


# ----------------------------------------------------------------------------------------------
# Resolving `reward.function`
# ----------------------------------------------------------------------------------------------


def resolve_reward_fn(spec: str) -> RewardFn:
    """A built-in name, `package.module:function` or `path/to/file.py:function` -> the function."""
    spec = spec.strip()
    if spec in BUILTINS:
        return BUILTINS[spec]
    if ":" not in spec:
        close = difflib.get_close_matches(spec, list(BUILTINS), n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise DataError(
            f"unknown reward function {spec!r}{hint}: built-ins are {', '.join(BUILTINS)}; "
            f"for your own use reward.function=my_module:my_fn or reward.function=path/to/file.py:my_fn"
        )
    location, _, name = spec.rpartition(":")
    if not location or not name.isidentifier():
        raise DataError(
            f"reward.function={spec!r} is not MODULE:FUNCTION or FILE.py:FUNCTION: "
            f"write it like my_rewards:score or rewards/mine.py:score"
        )
    if location.endswith(".py") or "/" in location or "\\" in location or Path(location).is_file():
        module, where = _load_file(location, spec), location
    else:
        module, where = _import_module(location), f"module {location}"
    if not hasattr(module, name):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        close = difflib.get_close_matches(name, defined, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise DataError(
            f"{where} has no function {name!r}{hint}: it defines {', '.join(defined) or 'no functions'}; "
            f"fix reward.function={spec!r}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise DataError(
            f"{where}:{name} is a {type(fn).__name__}, not a function: "
            f"point reward.function at a function fn(completions, **columns)"
        )
    return fn


def _import_module(location: str):
    try:
        return importlib.import_module(location)
    except ModuleNotFoundError as exc:
        # Tell "your module is missing" apart from "your module imports something missing".
        if exc.name and (location == exc.name or location.startswith(exc.name + ".")):
            raise DataError(
                f"reward module {location!r} not found: install it or add its folder to "
                f"PYTHONPATH, or give a file path (reward.function=path/to/file.py:fn)"
            ) from None
        raise DataError(f"importing reward module {location!r} failed ({exc}): install what it needs") from exc
    except Exception as exc:
        raise DataError(
            f"importing reward module {location!r} failed ({type(exc).__name__}: {exc}): fix the module"
        ) from exc


def _load_file(location: str, spec: str):
    path = Path(location)
    if not path.is_absolute():
        path = Path.cwd() / path
    if path.suffix != ".py":
        raise DataError(f"reward file {location!r} must be a .py file: fix reward.function={spec!r}")
    if not path.is_file():
        raise DataError(
            f"reward file not found: {path} (relative paths start at {Path.cwd()}): fix reward.function={spec!r}"
        )
    # A unique module name per file, registered in sys.modules so the module behaves like an
    # imported one (dataclasses and pickling look it up there).
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:10]
    mod_name = f"cloudrl_reward_{path.stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[mod_name]
        raise DataError(f"loading reward file {path} failed ({type(exc).__name__}: {exc}): fix the file") from exc
    return module


# ----------------------------------------------------------------------------------------------
# Calling
# ----------------------------------------------------------------------------------------------


def reward_columns(records: list[PromptRecord]) -> dict[str, list]:
    """The keyword lists a reward function gets, aligned with `records` (None where a row lacks a column)."""
    columns: dict[str, list] = {
        "prompts": [r.prompt_text for r in records],
        "ground_truth": [r.ground_truth for r in records],
        "data_source": [r.data_source for r in records],
    }
    extra_names = dict.fromkeys(k for r in records for k in r.extra if k not in RESERVED_COLUMNS)
    for name in extra_names:
        columns[name] = [r.extra.get(name) for r in records]
    return columns


def score(fn: RewardFn, completions: list[str], records: list[PromptRecord], spec: str = "") -> list[float]:
    """Call `fn` on completions aligned with `records` (repeat a prompt's record for each of its
    samples) and check it returned one finite number per completion. `spec` is the
    `reward.function` value, for messages. Whatever goes wrong is a RewardError of one line."""
    if len(completions) != len(records):
        raise ValueError(f"score: {len(completions)} completions but {len(records)} records; align them")
    name = (
        f"reward.function={spec}"
        if spec
        else f"reward function {getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    )
    try:
        result = fn(list(completions), **reward_columns(records))
    except Exception as exc:
        raise RewardError(_raised(name, fn, exc, completions, records)) from exc
    want = f"it must return a list of {len(completions)} numbers, one per completion"
    if hasattr(result, "tolist") and not isinstance(result, (list, tuple)):
        result = result.tolist()  # numpy arrays and torch tensors
    if not isinstance(result, (list, tuple)):
        raise RewardError(f"{name} returned {_short(result)} ({type(result).__name__}): {want}")
    if len(result) != len(completions):
        raise RewardError(f"{name} returned {len(result)} values for {len(completions)} completions: {want}")
    for i, value in enumerate(result):
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(
                f"{name} returned {_short(value)} at index {i} ({_sample(completions, records, i)}): "
                f"{want}, each finite"
            )
    return [float(v) for v in result]


def _raised(name: str, fn: RewardFn, exc: Exception, completions: list[str], records: list[PromptRecord]) -> str:
    """The one line for a reward function that raised: the exception, where, and the first sample
    that raises on its own (found by calling the function once per sample, only on this error path)."""
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    text = str(exc).strip().splitlines()
    where = f"{type(exc).__name__}{': ' + text[0][:200] if text else ''} at {Path(frame.filename).name}:{frame.lineno}"
    first = next((i for i in range(len(completions)) if _fails_alone(fn, completions[i], records[i])), None)
    sample = (
        f"first on sample index {first} of {len(completions)} ({_sample(completions, records, first)})"
        if first is not None
        else f"on the batch of {len(completions)} (each sample alone passes)"
    )
    return f"{name} raised {where}, {sample}: fix the function (CLOUDRL_DEBUG=1 shows the traceback)"


def _fails_alone(fn: RewardFn, completion: str, record: PromptRecord) -> bool:
    try:
        fn([completion], **reward_columns([record]))
    except Exception:
        return True
    return False


def _sample(completions: list[str], records: list[PromptRecord], i: int) -> str:
    return f"completion {_short(completions[i], 40)}, ground truth {_short(records[i].ground_truth, 40)}"


def score_responses(
    fn: RewardFn, tokenizer, responses: list[list[int]], records: list[PromptRecord], spec: str = ""
) -> tuple[list[str], list[float]]:
    """Decode generated token ids and score them: what a reward worker and `reward.in_driver` share."""
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    return texts, score(fn, texts, records, spec)
