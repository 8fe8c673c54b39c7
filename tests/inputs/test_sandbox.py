"""The sandbox runs untrusted Python in real subprocesses: each attack below is contained and reported as a
failed execution, while the caller (this test process) is unharmed. Each test fails without its protection."""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

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


def test_code_tests_cannot_be_forged():
    tests = [
        "assert add(1, 2) == 3",
        "assert [add(i, i) for i in range(3)] == [0, 2, 4]",
        "assert {1: add(1, 1)} == {1: 2}",
    ]
    forgeries = {
        # The pass reporter of the old harness, a global of __main__.
        "reporter": "import __main__\nfor i in range(3):\n    __main__._say(i)\nraise SystemExit",
        # An object equal to anything.
        "always-equal": (
            "class Any:\n    def __eq__(self, other):\n        return True\n"
            "    def __ne__(self, other):\n        return False\n"
            "def add(a, b):\n    return Any()\n"
        ),
        # Exiting early and cleanly, and writing pass lines to the harness's own stdout.
        "exit": "import os\nos._exit(0)",
        "stdout": "import os\nos.write(os.open('/proc/1/fd/1', os.O_WRONLY), b'pass 0\\npass 1\\npass 2\\n')",
        "builtins": "import builtins\nbuiltins.exec = lambda *args: None\nbuiltins.compile = lambda *args: None",
    }
    real = "def add(a, b):\n    return a + b\n"
    completions = [f"```python\n{code}\n```" for code in [real, *forgeries.values()]]
    scores = code_tests(completions, [tests] * len(completions))
    assert scores[0] == 1.0
    assert dict(zip(forgeries, scores[1:])) == {name: 0.0 for name in forgeries}
    # Equality stays Python's for plain data: numbers across types, containers item by item.
    assert code_tests(
        [f"```python\n{real}\n```"], [["assert add(1, 2) == 3.0", "x = add(1, 1)", "assert x != 3 and (x,) == (2,)"]]
    ) == [1.0]


def test_system_v_shared_memory_stays_in_the_sandbox():
    key = 0x434C0000 + os.getpid() % 0xFFFF
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"print(libc.shmget({key}, 1 << 20, 0o1000 | 0o600))\n"  # IPC_CREAT, never removed
        "print(open('/proc/sysvipc/shm').read().count('\\n') - 1)\n"
    )
    result = run_python(code, QUICK)
    assert result.ok, result.stderr
    created, visible = map(int, result.stdout.split())
    with open("/proc/sysvipc/shm") as f:
        keys = [int(line.split()[0]) for line in f.readlines()[1:]]
    if key in keys:  # clean up before failing
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmctl(libc.shmget(key, 0, 0), 0, None)  # IPC_RMID
    assert created >= 0 and visible == 1  # its own segment only, none of the host's
    assert key not in keys


def test_the_code_gets_no_new_privileges_and_no_capabilities():
    result = run_python("print(open('/proc/self/status').read())", QUICK)
    assert result.ok, result.stderr
    status = dict(line.split(":\t", 1) for line in result.stdout.splitlines() if ":\t" in line)
    assert status["NoNewPrivs"].strip() == "1"
    for which in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert status[which].strip() == "0" * 16, which
    # No setuid binary grants anything either: every mount in its view is nosuid (the last one on each mount
    # point, which hides those below it).
    result = run_python("print(open('/proc/self/mountinfo').read())", QUICK)
    assert result.ok, result.stderr
    options = {line.split()[4]: line.split()[5].split(",") for line in result.stdout.splitlines() if line}
    assert options and [target for target, flags in options.items() if "nosuid" not in flags] == []
    result = run_python("import os\nprint(os.system('mount -o remount,rw / 2>/dev/null'))\nopen('/x', 'w')", QUICK)
    assert not result.ok and result.stdout.strip() != "0"


ESCAPE = """
import ctypes, os
caps = [line for line in open('/proc/self/status') if line.startswith(('CapEff', 'CapBnd', 'NoNewPrivs'))]
print(''.join(caps), end='')
libc = ctypes.CDLL(None, use_errno=True)
print('remount', libc.mount(None, b'/', None, ctypes.c_ulong(32 | 4096), None))  # MS_REMOUNT | MS_BIND, not MS_RDONLY
open({target!r}, 'w').write('escaped')
"""


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv"), reason="needs root and setpriv")
def test_as_a_non_root_user_the_code_keeps_no_capability_and_cannot_remount(tmp_path):
    """The user-namespace mode: the trainer runs as nobody, the code runs as uid 0 of its own namespace."""
    system_python = "/usr/bin/python3"
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]
    if not os.path.exists(system_python):
        pytest.skip("no /usr/bin/python3 that user nobody can run")
    if subprocess.run([*nobody, "unshare", "-U", "-r", "-m", "-n", "-p", "-i", "-f", "true"]).returncode != 0:
        pytest.skip("this machine refuses user namespaces to user nobody")
    shared = tempfile.mkdtemp(prefix="cloudrl-userns-", dir="/var/tmp")  # not /tmp, which the sandbox covers
    try:
        os.chmod(shared, 0o777)  # writable by nobody: only the sandbox's read-only view stops the write
        os.symlink(Path(__file__).resolve().parents[2], os.path.join(shared, "cloudrl"))
        target = os.path.join(shared, "escaped.txt")
        prelude = f"import sys\nsys.path.insert(0, {shared!r})\n"

        def as_nobody(script: str, stdin: str) -> str:
            done = subprocess.run(
                [*nobody, system_python, "-I", "-c", prelude + script],
                input=stdin,
                capture_output=True,
                text=True,
                cwd="/",
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            return done.stdout

        script = (
            "from cloudrl.trainer.inputs.sandbox import Limits, run_python\n"
            "r = run_python(sys.stdin.read(), Limits(timeout_s=5))\nprint(r.stdout + r.stderr + r.reason)\n"
        )
        out = as_nobody(script, ESCAPE.format(target=target))
        assert "CapEff:\t0000000000000000" in out and "CapBnd:\t0000000000000000" in out
        assert "NoNewPrivs:\t1" in out
        assert "remount -1" in out and "Read-only file system" in out
        assert not os.path.exists(target)
        # Here the code's uid owns the pipe of code_tests' pass lines: only the harness being non-dumpable keeps
        # the code from opening it through /proc/1/fd.
        forge = "```python\nimport os\nos.write(os.open('/proc/1/fd/1', os.O_WRONLY), b'pass 0\\n')\n```"
        script = (
            "from cloudrl.trainer.inputs.rewards import code_tests\nprint(code_tests([sys.stdin.read()], [['1/0']]))"
        )
        assert as_nobody(script, forge).strip() == "[0.0]"
    finally:
        shutil.rmtree(shared)
