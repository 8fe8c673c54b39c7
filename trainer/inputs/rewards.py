"""Rule-based rewards: plain functions `fn(completions, **columns) -> list[float]`.

The trainer calls a reward function once per batch with the decoded responses (special tokens
removed) and, as keyword lists aligned with them, `prompts`, `ground_truth`, `data_source` and
every extra dataset column. Pick one with `reward.function=`:

    reward.function=gsm8k                       # a built-in: answer_em, arithmetic, auto, code_tests,
                                                # exact_match, gsm8k, none
    reward.function=my_rewards:format_bonus     # an importable module
    reward.function=rewards/mine.py:score_fn    # a file, relative to the current directory

Your function must accept `**kwargs`, since new columns may be passed at any time.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import math
import numbers
import re
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from ..errors import DataError, RewardError
from .code_tests import code_tests
from .data import RESERVED_COLUMNS, PromptRecord, _short
from .user_files import load_user_file

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


def none(completions: list[str], **kwargs) -> list[float]:
    """0.0 for every completion: with reward.url (or reward.model_path), that score alone."""
    return [0.0] * len(completions)


BUILTINS: dict[str, RewardFn] = {
    "answer_em": answer_em,
    "arithmetic": arithmetic,
    "auto": auto,
    "code_tests": code_tests,
    "exact_match": exact_match,
    "gsm8k": gsm8k,
    "none": none,
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
        module, where = load_user_file(location, "reward", "reward.function", spec), location
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


def check_reward_runs(fn: RewardFn) -> None:
    """Before a process scores with `fn`: a reward that runs model-written code (`code_tests`) needs the sandbox,
    so a node that cannot isolate code fails here, at start, in one line."""
    if fn is code_tests:
        from .sandbox import check_available

        check_available()


def resolve_reward(reward) -> RewardFn:
    """The reward of `Config.reward`: `reward.function`, plus `reward.url_weight` times the HTTP scorer's
    score when `reward.url` is set (`reward.function=none`: the scorer's alone)."""
    fn = resolve_reward_fn(reward.function)
    if not reward.url:
        return fn
    from .remote_reward import RemoteReward

    remote = RemoteReward.from_config(reward)
    weight = reward.url_weight
    if fn is none:
        return lambda completions, **columns: [weight * v for v in remote(completions, **columns)]

    def with_url(completions: list[str], **columns) -> list[float]:
        local = fn(completions, **columns)
        if hasattr(local, "tolist") and not isinstance(local, (list, tuple)):
            local = local.tolist()  # numpy arrays and torch tensors
        if not isinstance(local, (list, tuple)) or len(local) != len(completions):
            raise RewardError(
                f"reward.function={reward.function} returned {_short(local)}: it must return a list of "
                f"{len(completions)} numbers, one per completion"
            )
        return [a + weight * b for a, b in zip(local, remote(completions, **columns))]

    return with_url


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


def too_slow(name: str, timeout_s: float, count: int | None = None, where: str = "") -> RewardError:
    """The one line for a reward call still running after reward.timeout_s; `name` names the function
    (`reward.function=...`)."""
    batch = f" on a batch of {count} completions" if count is not None else ""
    return RewardError(
        f"{name} did not return within reward.timeout_s={timeout_s:g}s{batch}{where}: make it return sooner "
        f"(give its network calls a timeout of their own) or raise reward.timeout_s (0 = no limit)"
    )


def _call(fn: RewardFn, completions: list[str], columns: dict, timeout_s: float, name: str):
    """`fn(completions, **columns)`, in a thread of its own when `timeout_s` > 0 so that a call that never
    returns ends after `timeout_s` seconds (the thread is left behind: Python cannot stop it, and the run
    ends anyway)."""
    if timeout_s <= 0:
        return fn(completions, **columns)
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = fn(completions, **columns)
        except BaseException as exc:  # handed to the caller, which raises it as its own
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"reward {name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise too_slow(name, timeout_s, len(completions))
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def score(
    fn: RewardFn, completions: list[str], records: list[PromptRecord], spec: str = "", timeout_s: float = 0.0
) -> list[float]:
    """Call `fn` on completions aligned with `records` (repeat a prompt's record for each of its
    samples) and check it returned one finite number per completion. `spec` is the
    `reward.function` value, for messages; `timeout_s` bounds the call (reward.timeout_s; 0: no limit). Whatever goes wrong is a RewardError of one line."""
    if len(completions) != len(records):
        raise ValueError(f"score: {len(completions)} completions but {len(records)} records; align them")
    name = (
        f"reward.function={spec}"
        if spec
        else f"reward function {getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    )
    limit = timeout_s
    try:
        result = _call(fn, list(completions), reward_columns(records), limit, name)
    except RewardError:
        raise
    except Exception as exc:
        raise RewardError(_raised(name, fn, exc, completions, records, limit)) from exc
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


def _raised(
    name: str, fn: RewardFn, exc: Exception, completions: list[str], records: list[PromptRecord], limit: float = 0.0
) -> str:
    """The one line for a reward function that raised: the exception, where, and the first sample
    that raises on its own (found by calling the function once per sample, only on this error path,
    within the same time limit)."""
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    text = str(exc).strip().splitlines()
    where = f"{type(exc).__name__}{': ' + text[0][:200] if text else ''} at {Path(frame.filename).name}:{frame.lineno}"
    if limit > 0 and "main thread" in str(exc):  # signal-based timeouts inside it need the main thread
        where += " (under reward.timeout_s the function runs in a thread of its own; reward.timeout_s=0 runs it inline)"
    deadline = time.monotonic() + limit

    def fails_alone(i: int) -> bool:
        left = deadline - time.monotonic()
        return (limit <= 0 or left > 0) and _fails_alone(fn, completions[i], records[i], left if limit > 0 else 0.0)

    first = next((i for i in range(len(completions)) if fails_alone(i)), None)
    sample = (
        f"first on sample index {first} of {len(completions)} ({_sample(completions, records, first)})"
        if first is not None
        else f"on the batch of {len(completions)} (each sample alone passes)"
    )
    return f"{name} raised {where}, {sample}: fix the function (CLOUDRL_DEBUG=1 shows the traceback)"


def _fails_alone(fn: RewardFn, completion: str, record: PromptRecord, limit: float = 0.0) -> bool:
    try:
        _call(fn, [completion], reward_columns([record]), limit, "")
    except RewardError:  # too slow alone: not the sample that raises
        return False
    except Exception:
        return True
    return False


def _sample(completions: list[str], records: list[PromptRecord], i: int) -> str:
    return f"completion {_short(completions[i], 40)}, ground truth {_short(records[i].ground_truth, 40)}"


def score_responses(
    fn: RewardFn,
    tokenizer,
    responses: list[list[int]],
    records: list[PromptRecord],
    spec: str = "",
    timeout_s: float = 0.0,
) -> tuple[list[str], list[float]]:
    """Decode generated token ids and score them: what a reward worker and `reward.in_driver` share."""
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    return texts, score(fn, texts, records, spec, timeout_s)
