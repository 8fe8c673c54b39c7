"""The `code_tests` built-in reward: the share of a dataset row's tests that the completion's program passes,
each run in the sandbox (inputs/sandbox.py), never in the trainer's process.

    code_tests(["```python\ndef add(a, b): return a + b\n```"], [["assert add(1, 2) == 3"]])   # [1.0]
"""

from __future__ import annotations

import ast
import json
import os
import re
import symtable
from concurrent.futures import ThreadPoolExecutor

from ..errors import DataError
from .sandbox import Limits, run_python

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def _completion_code(text: str) -> str:
    """The completion's program: its last ```python (or ```py) block, else its last ``` block, else all of it."""
    blocks = _FENCE.findall(text)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    return python[-1] if python else blocks[-1][1] if blocks else text


def _test_snippets(truth) -> list[str]:
    """A code_tests ground truth as its tests: a list of snippets (or a JSON list of them), each one test;
    or Python source, each top-level statement one test."""
    if isinstance(truth, str) and truth.lstrip().startswith("["):
        try:
            truth = json.loads(truth)
        except ValueError:
            pass
    if isinstance(truth, (list, tuple)):
        return [str(t) for t in truth]
    source = str(truth)
    try:
        return [ast.get_source_segment(source, node) or "" for node in ast.parse(source).body]
    except SyntaxError as exc:
        raise DataError(
            f"code_tests: a ground truth is not Python ({exc.msg}, line {exc.lineno}): fix the dataset"
        ) from exc


# The harness around the completion's code. Its first process runs no code of the completion: for each test i
# it forks a child that runs the code and tests 0..i (earlier tests for their side effects, their failures
# ignored), and counts test i passed only when that child exits with a code drawn at random for it. The pass
# lines are written by that first process alone, to a stdout no child holds; it is made non-dumpable, so a
# child (an unprivileged uid without capabilities) cannot open its /proc/1/fd or ptrace it. The builtins the
# child needs after the code ran are bound before it runs, so replacing them in `builtins` changes nothing.
_HARNESS = """import os as _o, sys as _s, ctypes as _c
def _child(code, tests, last, passed, _exit=_o._exit, exec=exec, compile=compile, range=range,
           BaseException=BaseException, same=None):
    try:
        null = _o.open(_o.devnull, _o.O_RDWR)
        for fd in (0, 1, 2):
            _o.dup2(null, fd)
        _o.closerange(3, 1 << 16)
        g = {{"__name__": "__main__"}}
        try:
            exec(compile(code, "solution.py", "exec"), g)
        except BaseException:
            _exit(1)
        for i in range(last + 1):
            try:
                exec(compile(tests[i], "test_%d.py" % i, "exec"), g)
                test = g.pop({entry!r}, None)
                if test is not None:
                    test(same)
            except BaseException:
                if i == last:
                    _exit(1)
        _exit(passed)
    finally:
        _exit(1)
def _same(expected, got, type=type, len=len, all=all, any=any, zip=zip, DICT=dict, SEQUENCES=(list, tuple),
          SETS=(set, frozenset), NUMBERS=(bool, int, float, complex), PLAIN=(type(None), str, bytes)):
    def among(kind, kinds):
        return any(kind is t for t in kinds)
    def plain(x):
        kind = type(x)
        if among(kind, NUMBERS) or among(kind, PLAIN):
            return True
        return among(kind, SEQUENCES + SETS) and all(plain(v) for v in x)
    def same(e, g):
        kind = type(e)
        if among(kind, NUMBERS) and among(type(g), NUMBERS):
            return e == g
        if type(g) is not kind:
            return False
        if among(kind, PLAIN):
            return e == g
        if among(kind, SEQUENCES):
            return len(e) == len(g) and all(same(a, b) for a, b in zip(e, g))
        if kind is DICT:
            keys = DICT.keys
            return all(plain(k) for k in keys(g)) and keys(e) == keys(g) and all(same(v, g[k]) for k, v in DICT.items(e))
        if among(kind, SETS):
            return all(plain(v) for v in g) and e == g
        return kind.__eq__(e, g) is True
    return same(expected, got)
def _main(code, tests):
    _c.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    out = _s.stdout
    for i in range(len(tests)):
        passed = 2 + int.from_bytes(_o.urandom(2), "big") % 250
        try:
            pid = _o.fork()
        except OSError:
            continue
        if pid == 0:
            _child(code, tests, i, passed, same=_same)
        _, status = _o.waitpid(pid, 0)
        if _o.WIFEXITED(status) and _o.WEXITSTATUS(status) == passed:
            out.write("pass %d\\n" % i)
            out.flush()
_main({code!r}, {tests!r})
"""
_TEST_ENTRY = "__cloudrl_test__"
_SAME = "__cloudrl_same__"


class _StrictEquality(ast.NodeTransformer):
    """`a == b` -> `same(b, a)`, `a != b` -> `not same(b, a)`: builtin numbers compare by value across int, float,
    bool and complex; anything else must be of exactly the expected value's type, lists, tuples and dicts
    compare item by item, and other types by the expected type's own `__eq__`. An object whose `__eq__` always
    answers True therefore equals nothing of another type, in a container or not."""

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if len(node.ops) != 1 or not isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            return node
        call = ast.Call(ast.Name(_SAME, ast.Load()), [node.comparators[0], node.left], [])
        return call if isinstance(node.ops[0], ast.Eq) else ast.UnaryOp(ast.Not(), call)


def _strict_test(snippet: str) -> str:
    """A test as a function of the comparator (`def __cloudrl_test__(__cloudrl_same__)`), so the comparator is a
    local the code under test cannot rebind; the names the test binds stay module globals for later tests.
    A test that cannot be so wrapped (not Python, a star import) is kept as it is."""
    try:
        tree = ast.parse(snippet)
        table = symtable.symtable(snippet, "test", "exec")
    except (SyntaxError, ValueError):
        return snippet
    bound = sorted(s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported())
    body = _StrictEquality().visit(tree).body or [ast.Pass()]
    if bound:
        body.insert(0, ast.Global(bound))
    arguments = ast.arguments([], [ast.arg(_SAME)], None, [], [], None, [])
    function = ast.FunctionDef(_TEST_ENTRY, arguments, body, [], None)
    wrapped = ast.unparse(ast.fix_missing_locations(ast.Module([function], [])))
    try:
        compile(wrapped, "test", "exec")
    except (SyntaxError, ValueError):
        return snippet
    return wrapped


def code_tests(completions: list[str], ground_truth: list, **kwargs) -> list[float]:
    """The fraction of the ground truth's tests the completion's code passes. The code is the last
    ```python block of the completion (else its last ``` block, else the whole text); the ground truth is
    a list of test snippets (or a JSON list of them), or Python source whose top-level statements are each
    one test (e.g. `assert add(1, 2) == 3`). Each completion runs with its tests in the sandbox
    (inputs/sandbox.py: a separate process, no network, 5 s, 512 MB), never in this process, each test in a
    process of its own after the code and the tests before it; `==` and `!=` in a test compare strictly
    (see _StrictEquality); a program that crashes or times out keeps the tests it passed before."""
    tests = [_test_snippets(truth) for truth in ground_truth]
    programs = [
        _HARNESS.format(code=_completion_code(c), tests=[_strict_test(x) for x in t], entry=_TEST_ENTRY)
        for c, t in zip(completions, tests)
    ]
    if not programs:
        return []
    # As many programs at once as this process has CPUs (what sandbox.run_many does).
    with ThreadPoolExecutor(min(len(os.sched_getaffinity(0)), len(programs)), thread_name_prefix="code_tests") as pool:
        results = list(pool.map(lambda p: run_python(p, Limits()), programs))
    scores = []
    for result, cases in zip(results, tests):
        passed = {line.split()[-1] for line in result.stdout.splitlines() if line.startswith("pass ")}
        scores.append(len(passed) / len(cases) if cases else 0.0)
    return scores
