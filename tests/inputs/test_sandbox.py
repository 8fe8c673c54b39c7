"""The sandbox runs untrusted Python in real subprocesses: each attack below is contained and reported as a
failed execution, while the caller (this test process) is unharmed. Each test fails without its protection."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from cloudrl.trainer.inputs.rewards import code_tests
from cloudrl.trainer.inputs.sandbox import Limits, run_many, run_python

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
QUICK = Limits(timeout_s=3.0, memory_mb=256, output_bytes=4096)


def test_a_good_program_gets_its_stdout_and_stdin():
    result = run_python("import sys\nprint(sum(range(10)), sys.stdin.read().upper())", QUICK, stdin="hi")
    assert result.ok and result.reason == ""
    assert result.stdout == "45 HI\n"


def test_output_is_truncated_to_the_limit():
    result = run_python("print('x' * 100000)", QUICK)
    assert result.ok
    assert len(result.stdout) == QUICK.output_bytes


def test_an_infinite_loop_times_out_and_is_reported():
    start = time.monotonic()
    result = run_python("while True:\n    pass", Limits(timeout_s=1.0))
    assert time.monotonic() - start < 4
    assert not result.ok
    assert result.reason == "timed out after 1s"


def test_unbounded_allocation_is_reported_as_memory():
    result = run_python("chunks = []\nwhile True:\n    chunks.append(b' ' * 2**24)", QUICK)
    assert not result.ok
    assert result.reason == "memory limit 256 MB"


def test_no_socket_reaches_a_server_on_the_callers_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    try:
        result = run_python(code, QUICK)
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
    assert not result.ok and "connected" not in result.stdout
    assert "unreachable" in result.stderr


def test_a_secret_in_the_callers_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("CLOUDRL_TEST_CANARY", "canary-4f1d9e")
    code = (
        "import os\n"
        "print(dict(os.environ))\n"
        f"try:\n    print(open('/proc/{os.getpid()}/environ', 'rb').read())\n"
        "except OSError as e:\n    print('no environ', e)\n"
    )
    result = run_python(code, QUICK)
    assert result.ok, result.stderr
    assert "canary-4f1d9e" not in result.stdout
    assert "no environ" in result.stdout


def test_writing_outside_its_directory_fails_and_leaves_no_file(tmp_path):
    os.chmod(tmp_path, 0o777)  # writable by anyone: only the sandbox's own view stops the write
    target = tmp_path / "escaped.txt"
    code = f"open({str(target)!r}, 'w').write('x')\n"
    result = run_python(code, QUICK)
    assert not result.ok
    assert result.reason == "exit code 1"
    assert not target.exists()
    # Its own scratch directory is writable, and gone afterwards.
    result = run_python("open('scratch.txt', 'w').write('x')\nimport os\nprint(os.getcwd())", QUICK)
    assert result.ok, result.stderr
    assert not (tmp_path / "scratch.txt").exists()


def test_processes_are_bounded_and_a_fork_bomb_ends():
    count = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(100):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(5)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "    except OSError:\n"
        "        break\n"
        "print(n)\n"
    )
    result = run_python(count, QUICK)
    assert result.ok, result.stderr
    assert 0 < int(result.stdout) < 40
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    start = time.monotonic()
    result = run_python(bomb, Limits(timeout_s=1.0))
    assert not result.ok and result.reason == "timed out after 1s"
    assert time.monotonic() - start < 5


def test_run_many_keeps_order_and_bounds_parallelism():
    code = "import time\nstart = time.time()\ntime.sleep(0.6)\nprint({i}, start, time.time())"
    results = run_many([code.format(i=i) for i in range(4)], QUICK, max_parallel=2)
    assert [int(r.stdout.split()[0]) for r in results] == [0, 1, 2, 3]
    spans = [tuple(map(float, r.stdout.split()[1:])) for r in results]
    overlap = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert overlap == 2


def test_code_tests_scores_the_pass_fraction_in_the_sandbox():
    marker = f"/tmp/cloudrl-code-tests-{os.getpid()}"
    completions = [
        "Here it is:\n```python\ndef add(a, b):\n    print('noise')\n    return a + b\n```",
        f"```python\nopen({marker!r}, 'w')\ndef add(a, b):\n    return 3\n```",
        "```python\nimport sys\nprint('0 pass 0')\nsys.exit(0)\n```",
    ]
    truths = ["assert add(1, 2) == 3\nassert add(2, 2) == 4", '["assert add(1, 2) == 3", "assert add(2, 2) == 4"]']
    truths.append(["assert add(1, 2) == 3"])
    threads = threading.active_count()
    assert code_tests(completions, truths) == [1.0, 0.5, 0.0]
    assert not os.path.exists(marker)  # the completion ran elsewhere: the reward's process wrote nothing
    assert threading.active_count() == threads
