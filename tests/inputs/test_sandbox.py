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
from cloudrl.trainer.inputs import sandbox
from cloudrl.trainer.inputs.code_tests import code_tests
from cloudrl.trainer.inputs.sandbox import Limits, run_many, run_python

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
QUICK = Limits(timeout_s=3.0, memory_mb=256, output_bytes=4096)


@pytest.fixture(autouse=True, params=["bwrap", "launcher"])
def backend(request, monkeypatch):
    """Every test runs on both ways of walling code off: bubblewrap (where the node has it and the trainer is
    root) and the hand-written launcher, which must hold the very same line."""
    if request.param == "bwrap":
        found = shutil.which("bwrap")
        if found is None or os.geteuid() != 0:
            pytest.skip("bubblewrap runs the sandbox only where `bwrap` is installed and the trainer is root")
        if not sandbox._bubblewrap_works(found):
            pytest.skip("bwrap is installed but cannot make its namespaces here (unprivileged user namespaces off)")
    monkeypatch.setenv(sandbox.SANDBOX_ENV, request.param)
    sandbox._bubblewrap.cache_clear()
    yield request.param
    sandbox._bubblewrap.cache_clear()


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
    # The launcher leaves its namespace's loopback down, bubblewrap brings up one of its own: either way the
    # address is not the host's, and nothing listens there.
    assert "Network is unreachable" in result.stderr or "ConnectionRefusedError" in result.stderr


def test_no_unix_socket_on_the_hosts_filesystem_is_reachable():
    """A daemon's socket anyone may connect to (a desktop bus, a runtime's API): the read-only view stops
    writes to files, not connect(); the seccomp filter refuses the program any UNIX socket."""
    shared = tempfile.mkdtemp(prefix="cloudrl-unix-", dir="/var/tmp")  # not /tmp, which the sandbox covers
    path = os.path.join(shared, "daemon.sock")
    server = socket.socket(socket.AF_UNIX)
    try:
        os.chmod(shared, 0o755)
        server.bind(path)
        os.chmod(path, 0o777)  # connectable by every uid, the sandbox's own included
        server.listen(1)
        server.settimeout(0.5)
        code = f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})\nprint('connected')"
        result = run_python(code, QUICK)
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
        shutil.rmtree(shared)
    assert not result.ok and "connected" not in result.stdout
    assert "PermissionError: [Errno 1] Operation not permitted" in result.stderr


def test_the_code_can_make_no_namespace_and_none_of_the_rarely_needed_kernel_calls():
    code = (
        "import ctypes, os, socket, threading\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "for name, call in [('unshare', lambda: libc.unshare(0x10000000)), ('keyctl', lambda: libc.syscall(250, 0)),"
        " ('bpf', lambda: libc.syscall(321, 0, 0, 0)), ('userfaultfd', lambda: libc.syscall(323, 0))]:\n"
        "    print(name, call(), ctypes.get_errno())\n"
        # What ordinary programs do still works: threads, a child process, a socket pair.
        "t = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()\n"
        "print('child', os.system('true'))\nprint('pair', len(socket.socketpair()))\n"
    )
    if os.uname().machine != "x86_64":
        pytest.skip("the raw syscall numbers in this program are x86_64's")
    result = run_python(code, QUICK)
    assert result.ok, result.stderr
    assert result.stdout.split("\n")[:4] == ["unshare -1 1", "keyctl -1 1", "bpf -1 1", "userfaultfd -1 1"]
    assert "thread\nchild 0\npair 2\n" in result.stdout


def run_bpf(program: list[tuple[int, int, int, int]], nr: int, arch: int, arg0: int) -> int:
    """Classic BPF as the kernel runs a seccomp filter, over (nr, arch, args[0]): the value it returns."""
    data = {0: nr, 4: arch, 16: arg0 & 0xFFFFFFFF}
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        if code == 0x20:  # load a word of seccomp_data
            acc, pc = data[k], pc + 1
        elif code == 0x06:  # return
            return k
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if taken else jf)


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_seccomp_filter_denies_what_it_names_and_allows_the_rest(machine):
    from cloudrl.trainer.inputs.sandbox_launcher import SECCOMP_ARCHES, SECCOMP_SYSCALLS, seccomp_program

    program = seccomp_program(machine)
    column, arch = SECCOMP_ARCHES[machine]
    nr = {name: pair[column] for name, pair in SECCOMP_SYSCALLS.items()}
    eperm, enosys, allow, kill = 0x50001, 0x50026, 0x7FFF0000, 0x80000000
    assert run_bpf(program, nr["socket"], arch, 1) == eperm  # AF_UNIX
    assert run_bpf(program, nr["socket"], arch, 2) == allow  # AF_INET (its namespace has no network)
    assert run_bpf(program, nr["clone"], arch, 0x11) == allow  # fork: SIGCHLD
    assert run_bpf(program, nr["clone"], arch, 0x3D0F00) == allow  # a thread
    for flag in (0x10000000, 0x20000000, 0x40000000, 0x00020000, 0x08000000, 0x04000000, 0x02000000, 0x80):
        assert run_bpf(program, nr["clone"], arch, 0x11 | flag) == eperm, hex(flag)
    assert run_bpf(program, nr["clone3"], arch, 0) == enosys
    for name in set(nr) - {"socket", "clone", "clone3"}:
        assert run_bpf(program, nr[name], arch, 0) == eperm, name
    for ordinary in (0, 1, 2, 3, 9, 59, 60, 231):  # read, write, open(at), close, mmap, execve, exit, ...
        if ordinary not in nr.values():
            assert run_bpf(program, ordinary, arch, 0) == allow
    assert run_bpf(program, 0, 0x40000003, 0) == kill  # another architecture's calling convention
    if machine == "x86_64":
        assert run_bpf(program, 0x40000000 | 1, arch, 0) == eperm  # x32's numbering


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


HOG = """
import os, time
held = []
for _ in range(8):  # each child stays under RLIMIT_AS (256 MB) alone; together they hold 8 x 100 MB
    if os.fork() == 0:
        block = bytearray(100 << 20)
        block[::4096] = b"x" * len(block[::4096])  # every page resident
        time.sleep(3)
        os._exit(0)
    held.append(1)
print("forked", len(held), flush=True)
print("children", [os.waitstatus_to_exitcode(os.wait()[1]) for _ in held])
"""


def test_many_processes_cannot_hold_more_than_the_memory_limit_together(monkeypatch):
    from cloudrl.trainer.inputs import sandbox_cgroup

    if sandbox_cgroup._parent() is None:
        pytest.skip("this node allows no memory cgroup: the two-process fallback test covers it")
    made = []
    create = sandbox_cgroup.create
    monkeypatch.setattr(sandbox_cgroup, "create", lambda limit_bytes: made.append(create(limit_bytes)) or made[-1])
    result = run_python(HOG, Limits(timeout_s=8.0, memory_mb=256))
    assert not result.ok and result.reason == "memory limit 256 MB", (result.stdout, result.stderr)
    assert "children [0, 0, 0, 0, 0, 0, 0, 0]" not in result.stdout
    # The run's own cgroup is gone with it (other runs, say of another test process, may have theirs meanwhile).
    assert len(made) == 1 and made[0] is not None and not made[0].path.exists()


def test_without_a_memory_cgroup_the_program_gets_two_processes(monkeypatch):
    from cloudrl.trainer.inputs import sandbox_cgroup

    monkeypatch.setattr(sandbox_cgroup, "create", lambda limit_bytes: None)
    result = run_python(HOG, Limits(timeout_s=8.0, memory_mb=256))
    assert not result.ok and "BlockingIOError: [Errno 11] Resource temporarily unavailable" in result.stderr
    assert "forked" not in result.stdout or "forked 1" in result.stdout


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
def test_as_a_non_root_user_the_code_keeps_no_capability_and_cannot_remount(tmp_path, backend):
    """The user-namespace mode: the trainer runs as nobody, the code runs as uid 0 of its own namespace."""
    if backend == "bwrap":
        pytest.skip("a trainer that is not root runs the launcher: the launcher's run of this test covers it")
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
            "from cloudrl.trainer.inputs.code_tests import code_tests\nprint(code_tests([sys.stdin.read()], [['1/0']]))"
        )
        assert as_nobody(script, forge).strip() == "[0.0]"
    finally:
        shutil.rmtree(shared)


def test_only_the_interpreter_and_its_scratch_directory_are_in_sight(backend):
    """bubblewrap builds the code a root of its own: /usr, the system libraries and the Python installation,
    nothing else of the host's, so a world-readable file elsewhere (a dataset, a config) cannot be read. The
    hand-written launcher shows the host's tree read-only, which the module docstring says."""
    shared = tempfile.mkdtemp(prefix="cloudrl-visible-", dir="/var/tmp")
    try:
        secret = Path(shared) / "readable.txt"
        secret.write_text("anyone may read this")
        os.chmod(shared, 0o755)
        os.chmod(secret, 0o644)
        result = run_python(f"print(open({str(secret)!r}).read())", QUICK)
    finally:
        shutil.rmtree(shared)
    if backend == "launcher":
        assert result.ok and "anyone may read this" in result.stdout
        return
    assert not result.ok and "FileNotFoundError" in result.stderr
    listing = run_python("import os\nprint(sorted(os.listdir('/')))", QUICK)
    assert listing.ok, listing.stderr
    assert set(eval(listing.stdout)) <= {
        "bin",
        "dev",
        "etc",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "proc",
        "sbin",
        "tmp",
        "usr",
    } | {p.strip("/").split("/")[0] for p in sandbox._installation()}


def _descendants(root: int) -> dict[int, int]:
    """{pid: parent pid} of every process below `root`, from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    below, frontier = {}, {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier and pid not in below}
        below.update({pid: parents[pid] for pid in frontier})
    return below


def test_the_code_runs_as_a_uid_of_its_own_on_the_host(backend):
    """Seen from the host, the sandboxed program belongs to the run's own uid, never root's: the launcher drops
    to it before the code starts, and bubblewrap is started as it, so its user namespace maps nothing to root."""
    if os.geteuid() != 0:
        pytest.skip("as a non-root user the code runs as that user: the test is for a root trainer")
    uids: list[int] = []

    def look() -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not uids:
            below = _descendants(os.getpid())
            leaves = [pid for pid in below if pid not in below.values()]
            for pid in leaves:
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                if b"main.py" in cmdline and b"sandbox_launcher" not in cmdline:
                    uids.extend(int(u) for u in status.split("Uid:")[1].split()[:4])
            time.sleep(0.05)

    watcher = threading.Thread(target=look)
    watcher.start()
    result = run_python("import time\ntime.sleep(1.5)", QUICK)
    watcher.join()
    assert result.ok, result.stderr
    assert uids and min(uids) >= sandbox._UID_BASE, uids  # real, effective, saved and filesystem uid


def test_a_sandbox_choice_that_cannot_be_had_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(sandbox.SANDBOX_ENV, "docker")
    sandbox._bubblewrap.cache_clear()
    with pytest.raises(sandbox.SandboxUnavailable, match=r"CLOUDRL_SANDBOX=docker: give auto, bwrap or launcher"):
        run_python("print(1)", QUICK)
    monkeypatch.setenv(sandbox.SANDBOX_ENV, "bwrap")
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    sandbox._bubblewrap.cache_clear()
    if os.geteuid() == 0:
        with pytest.raises(sandbox.SandboxUnavailable, match=r"CLOUDRL_SANDBOX=bwrap: no bubblewrap that runs here"):
            run_python("print(1)", QUICK)


def test_a_code_reward_on_a_node_that_cannot_isolate_code_fails_at_start_in_one_line(monkeypatch):
    """`code_tests` checks the sandbox where it will score (a reward worker's start, or the driver's with
    reward.in_driver): a node that cannot isolate code ends the run there, in one line, not at the first reward."""
    from cloudrl.trainer.inputs.rewards import check_reward_runs, code_tests, resolve_reward_fn

    check_reward_runs(code_tests)  # this node can: nothing raised
    check_reward_runs(resolve_reward_fn("arithmetic"))  # no code to run: no probe at all
    monkeypatch.setattr(sandbox, "_user_namespaces", lambda: False)
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
    with pytest.raises(sandbox.SandboxUnavailable, match="needs root or unprivileged user namespaces") as caught:
        check_reward_runs(code_tests)
    assert "\n" not in str(caught.value)
