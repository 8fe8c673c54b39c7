"""Built-in rewards, resolving `reward.function` specs (names, modules, files) and `score` checks."""

import sys

import numpy as np
import pytest
import torch
from cloudrl.trainer.errors import DataError, RewardError
from cloudrl.trainer.inputs.data import PromptRecord
from cloudrl.trainer.inputs.rewards import arithmetic, auto, exact_match, gsm8k, resolve_reward_fn, score

USER_MODULE = """
CALLS = []

def length_bonus(completions, **columns):
    CALLS.append(columns)
    return [float(len(c)) for c in completions]

THRESHOLD = 3

def _helper():
    pass
"""


def records(truths, sources=None, extras=None):
    sources = sources or ["toy"] * len(truths)
    extras = extras or [{} for _ in truths]
    return [PromptRecord([3], f"q{i}", t, s, e) for i, (t, s, e) in enumerate(zip(truths, sources, extras))]


# ----------------------------------------------------------------------------------------------
# Built-ins
# ----------------------------------------------------------------------------------------------


def test_exact_match():
    assert exact_match([" Paris\n", "paris", "Paris!", ""], ground_truth=["Paris", "Paris", "Paris", ""]) == [
        1.0,
        0.0,
        0.0,
        1.0,
    ]


@pytest.mark.parametrize(
    "completion, truth, want",
    [
        ("5 + 3 = 8\n#### 8", "8", 1.0),
        ("#### 8.0", "8", 1.0),
        ("costs $1,250 total\n#### $1,250.", "1250", 1.0),
        ("#### -4", "-4", 1.0),
        ("#### 3.75", "3.75", 1.0),
        ("first #### 7 then #### 9", "9", 1.0),  # the last marker counts
        ("first #### 9 then #### 7", "9", 0.0),
        ("the answer is 8", "8", 0.0),  # no marker, no credit
        ("#### eight", "8", 0.0),
        ("#### 8", "step\n#### 8", 1.0),  # ground truth given as a full solution
        ("#### 8", "step\n#### 1,008", 0.0),
        ("#### 8", "", 0.0),
        ("#### 80", "8", 0.0),
    ],
)
def test_gsm8k(completion, truth, want):
    assert gsm8k([completion], ground_truth=[truth]) == [want]


@pytest.mark.parametrize(
    "completion, truth, want",
    [
        ("7", "7", 1.0),
        (" 7 ", "7", 1.0),
        ("7 is it", "7", 1.0),  # the leading integer counts
        ("77", "7", 0.0),
        ("8", "7", 0.0),
        ("x7", "7", 0.0),
        ("", "7", 0.0),
        ("-2", "-2", 1.0),
        ("7", "seven", 0.0),
    ],
)
def test_arithmetic(completion, truth, want):
    assert arithmetic([completion], ground_truth=[truth]) == [want]


def test_auto_dispatches_by_data_source():
    completions = ["7 apples", "#### 7", "#### 7", "7 apples", "7"]
    truths = ["7", "7", "7", "7", "7"]
    sources = ["arithmetic", "openai/gsm8k", "GSM8K_small", "other", "other"]
    assert auto(completions, ground_truth=truths, data_source=sources) == [1.0, 1.0, 1.0, 0.0, 1.0]


# ----------------------------------------------------------------------------------------------
# resolve_reward_fn
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, fn", [("gsm8k", gsm8k), (" auto ", auto), ("arithmetic", arithmetic), ("exact_match", exact_match)]
)
def test_resolve_builtins(name, fn):
    assert resolve_reward_fn(name) is fn


def test_resolve_module_function(tmp_path, monkeypatch):
    pkg = tmp_path / "myrewards"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bonus.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "myrewards", raising=False)
    fn = resolve_reward_fn("myrewards.bonus:length_bonus")
    assert fn(["ab", "abcd"]) == [2.0, 4.0]


def test_resolve_file_function_relative_to_cwd(tmp_path, monkeypatch):
    (tmp_path / "rw").mkdir()
    (tmp_path / "rw" / "mine.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    fn = resolve_reward_fn("rw/mine.py:length_bonus")
    assert fn(["abc"]) == [3.0]
    assert resolve_reward_fn(f"{tmp_path}/rw/mine.py:length_bonus") is fn  # loaded once per file
    assert fn.__module__ in sys.modules


@pytest.fixture
def user_files(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text(USER_MODULE)
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "needs_dep.py").write_text("import not_installed_dep_xyz\n")
    (tmp_path / "notes.txt").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("mine", "broken", "needs_dep"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "gsm8",
            "unknown reward function 'gsm8' (did you mean gsm8k?): built-ins are answer_em, arithmetic, auto, code_tests, "
            "exact_match, gsm8k, none; for your own use reward.function=my_module:my_fn or reward.function=path/to/file.py:my_fn",
        ),
        ("qqqq", "unknown reward function 'qqqq': built-ins are"),
        ("mine:", "reward.function='mine:' is not MODULE:FUNCTION or FILE.py:FUNCTION"),
        (":length_bonus", "is not MODULE:FUNCTION or FILE.py:FUNCTION"),
        ("no_such_mod_xyz:fn", "reward module 'no_such_mod_xyz' not found: install it or add its folder to PYTHONPATH"),
        ("needs_dep:fn", "importing reward module 'needs_dep' failed (No module named 'not_installed_dep_xyz')"),
        ("broken:f", "importing reward module 'broken' failed (SyntaxError"),
        (
            "mine:lenght_bonus",
            "module mine has no function 'lenght_bonus' (did you mean length_bonus?): "
            "it defines length_bonus; fix reward.function='mine:lenght_bonus'",
        ),
        ("mine:THRESHOLD", "module mine:THRESHOLD is a int, not a function"),
        ("missing.py:fn", "reward file not found: {d}/missing.py (relative paths start at {d})"),
        ("notes.txt:fn", "reward file 'notes.txt' must be a .py file"),
        ("broken.py:f", "loading reward file {d}/broken.py failed (SyntaxError"),
        ("./mine.py:nope", "./mine.py has no function 'nope'"),
        ("mine.py:THRESHOLD", "mine.py:THRESHOLD is a int, not a function: point reward.function at a function"),
    ],
)
def test_resolve_errors(user_files, spec, message):
    with pytest.raises(DataError) as err:
        resolve_reward_fn(spec)
    assert message.format(d=user_files) in str(err.value)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------------------------
# score
# ----------------------------------------------------------------------------------------------


def test_score_passes_columns(user_files):
    fn = resolve_reward_fn("mine:length_bonus")
    module = sys.modules[fn.__module__]
    recs = records(["1", "2"], ["a", "b"], [{"level": 1, "ground_truth": "shadowed"}, {"tag": "x"}])
    assert score(fn, ["xy", "z"], recs) == [2.0, 1.0]
    (columns,) = module.CALLS
    assert columns == {
        "prompts": ["q0", "q1"],
        "ground_truth": ["1", "2"],
        "data_source": ["a", "b"],
        "level": [1, None],
        "tag": [None, "x"],
    }


def test_score_builtin_and_array_results():
    recs = records(["7", "8"], ["arithmetic", "arithmetic"])
    assert score(auto, ["7", "7"], recs) == [1.0, 0.0]
    assert score(lambda completions, **kw: np.array([0.5, 1]), ["a", "b"], recs) == [0.5, 1.0]
    assert score(lambda completions, **kw: torch.tensor([0.25, 1.0]), ["a", "b"], recs) == [0.25, 1.0]
    assert score(lambda completions, **kw: (True, 0), ["a", "b"], recs) == [1.0, 0.0]


def bad_dict(completions, **kw):
    return {"a": 1.0}


def bad_length(completions, **kw):
    return [1.0]


def bad_item(completions, **kw):
    return [1.0, None]


def bad_nan(completions, **kw):
    return [float("nan"), 1.0]


def bad_string(completions, **kw):
    return [1.0, "1"]


@pytest.mark.parametrize(
    "fn, message",
    [
        (
            bad_dict,
            "reward function test_rewards:bad_dict returned {'a': 1.0} (dict): "
            "it must return a list of 2 numbers, one per completion",
        ),
        (bad_length, "reward function test_rewards:bad_length returned 1 values for 2 completions: it must return"),
        (
            bad_item,
            "reward function test_rewards:bad_item returned None at index 1 (completion 'b', ground truth '2'): "
            "it must return a list of 2 numbers, one per completion, each finite",
        ),
        (bad_nan, "returned nan at index 0"),
        (bad_string, "returned '1' at index 1"),
    ],
)
def test_score_rejects_bad_results(fn, message):
    with pytest.raises(RewardError) as err:
        score(fn, ["a", "b"], records(["1", "2"]))
    assert message in str(err.value)


def test_score_needs_aligned_records():
    with pytest.raises(ValueError, match="3 completions but 2 records"):
        score(exact_match, ["a", "b", "c"], records(["1", "2"]))
