"""The sandbox's launcher: run by `sandbox.py` as `python -I -S sandbox_launcher.py SETTINGS` in a fresh
process of its own session, it walls itself off and then becomes untrusted Python.

Standard library only, and run by path (not imported), so it starts in milliseconds. It reads the payload
(`{"code": ..., "stdin": ...}` as JSON) from its stdin, then:

1. joins the run's memory cgroup, if sandbox.py made one (sandbox_cgroup.py), then leaves the trainer's
   namespaces: network (no interface but a downed loopback), mount (private, so nothing it mounts reaches
   the host), PID (everything it starts dies with it), System V IPC (shared memory, semaphores and message
   queues of its own, gone with it); as a non-root user it first enters a user namespace of its own, where
   it maps itself to root;
2. forks the first process of the new PID namespace, which mounts a fresh /proc (the trainer's processes,
   their command lines and environments are out of sight), a size-bounded tmpfs over /tmp (the scratch
   directory: the code, its stdin, whatever it writes; gone with the namespace), remounts every other
   mount read-only and nosuid, sets the resource limits, drops to an unprivileged uid/gid of its own (as
   root), drops every capability (bounding set, ambient, effective, permitted, inheritable; securebits
   locked so that uid 0 of a user namespace regains none on exec), sets no_new_privs, installs a seccomp
   filter (SECCOMP below: no UNIX sockets, no new namespaces, none of the kernel's rarely needed, often
   attacked interfaces), and execs `python -I main.py` with a minimal environment;
3. waits for it and reports how it ended on the status pipe (`exit N` or `signal N`).

With `bwrap` in its settings (a root trainer on a node with bubblewrap), steps 1 and 2 go through bubblewrap
instead (`_run_in_bwrap`): after the cgroup, a child enters a mount namespace of its own only to make the
Python installation reachable, takes the run's uid, gid and limits, and execs bwrap as that uid with the
command line of `bwrap_command`, the same seccomp filter passed as a file.

A setup step that fails is reported as `error ...` on the status pipe and exit 125; the parent raises it.
The untrusted program cannot write to the status pipe: it is closed on exec.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import stat
import struct
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
# SECBIT_NOROOT, SECBIT_NO_SETUID_FIXUP and SECBIT_KEEP_CAPS, each with its lock, but KEEP_CAPS itself unset.
SECUREBITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20
_CAPABILITY_VERSION_3 = 0x20080522
SIGKILL = 9

# Per-mount flags a bind remount must repeat: in a user namespace the kernel refuses to clear locked ones.
_MOUNT_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}
SCRATCH = "/tmp"

# The seccomp filter: what the program may not ask the kernel for. Each denied call fails with EPERM, as a
# container runtime's default profile answers, so the program sees an ordinary error.
# - socket(AF_UNIX): a UNIX socket on the host's filesystem (a daemon's, a desktop bus) is otherwise
#   reachable through the read-only view, which blocks writes to files but not connect(); the network
#   namespace already walls off TCP/IP and abstract UNIX sockets. socketpair() stays allowed.
# - clone() with a namespace flag, unshare, setns: no namespace of its own, so no uid 0 anywhere.
# - clone3: its flags are out of a filter's reach; ENOSYS makes the C library fall back to clone().
# - the rest: kernel interfaces a Python program has no use for and exploits often start from.
SECCOMP_SYSCALLS = {
    # name: (x86_64, aarch64)
    "socket": (41, 198),
    "clone": (56, 220),
    "clone3": (435, 435),
    "unshare": (272, 97),
    "setns": (308, 268),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "kexec_load": (246, 104),
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "fsopen": (430, 430),
    "fsmount": (432, 432),
    "move_mount": (429, 429),
    "open_tree": (428, 428),
}
SECCOMP_ARCHES = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7), "arm64": (1, 0xC00000B7)}
X32_SYSCALL_BIT = 0x40000000
AF_UNIX = 1
NAMESPACE_FLAGS = 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00020000 | 0x80
"""CLONE_NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWNS, NEWTIME."""
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
EPERM = 1
ENOSYS = 38
# Classic BPF: load a 32-bit word, jump on equal / greater-or-equal / any bit set, return.
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
# Offsets into struct seccomp_data: nr, arch, then args[0]'s low 32 bits (little-endian).
_NR, _ARCH, _ARG0 = 0, 4, 16
_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A step of the isolation failed: the untrusted code never runs."""


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None, what: str) -> None:
    def c(text: str | None):
        return None if text is None else text.encode()

    _check(_libc.mount(c(source), c(target), c(fstype), ctypes.c_ulong(flags), c(data)), what)


def _unescape(path: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        path = path.replace(code, chr(int(code[1:], 8)))
    return path


def _mounts() -> list[tuple[str, int]]:
    """This namespace's mount points, parents first, each with the per-mount flags to keep."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            options = fields[5].split(",")
            flags = sum(bit for name, bit in _MOUNT_FLAGS.items() if name in options)
            found.append((_unescape(fields[4]), flags))
    return found


def _enter_namespaces(as_root: bool) -> None:
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | (0 if as_root else CLONE_NEWUSER)
    _check(_libc.unshare(flags), "unshare (network, mount, PID and IPC namespaces)")
    if not as_root:
        # Root inside the user namespace, only to mount; outside it is still this user.
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {gid} 1")
    # Private first: without it a shared root would carry the mounts below back to the host.
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None, "making mounts private")


def _expose(paths: list[str]) -> None:
    """Make each of `paths` (the Python installation) reachable by the unprivileged uid: a directory on the
    way that others cannot enter (say a 0700 /root holding pyenv) is covered, in this namespace only, by
    an empty tmpfs holding just those paths, bound from the originals."""
    blocked: dict[str, list[str]] = {}
    for path in paths:
        parts = path.strip("/").split("/")
        for depth in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:depth])
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                blocked.setdefault(ancestor, []).append(path)
                break
    for ancestor, inside in blocked.items():
        # Held open before the tmpfs hides them, then bound through /proc/self/fd.
        handles = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in inside]
        _mount("tmpfs", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755", f"covering {ancestor}")
        for path, handle in handles:
            os.makedirs(path, exist_ok=True)
            _mount(f"/proc/self/fd/{handle}", path, None, MS_BIND | MS_REC, None, f"exposing {path}")
            os.close(handle)


def _drop_bounding_set() -> None:
    """Empty the capability bounding set: no exec, of a setuid binary or as uid 0, can grant one again."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap} from the bounding set")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities() -> None:
    """Clear the ambient, effective, permitted and inheritable sets, after the mounts and the uid change that
    need them. In the user-namespace mode this is what keeps the program from undoing the read-only mounts."""
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clearing the ambient capabilities")
    header = _CapHeader(_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset (dropping every capability)")


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter as classic BPF instructions (code, jump-if-true, jump-if-false, k) for `machine`; an
    empty list where no syscall table is known for it (then no filter is installed, and the rest holds)."""
    if machine not in SECCOMP_ARCHES:
        return []
    column, audit_arch = SECCOMP_ARCHES[machine]
    numbers = {name: pair[column] for name, pair in SECCOMP_SYSCALLS.items()}
    special = {"socket", "clone", "clone3"}
    denied = sorted(n for name, n in numbers.items() if name not in special)
    deny, allow = (_RET_K, 0, 0, SECCOMP_RET_ERRNO | EPERM), (_RET_K, 0, 0, SECCOMP_RET_ALLOW)
    program = [(_LD_W_ABS, 0, 0, _ARCH), (_JEQ_K, 1, 0, audit_arch), (_RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS)]
    program.append((_LD_W_ABS, 0, 0, _NR))
    if column == 0:  # x86_64's x32 calls carry this bit and other numbers: none is allowed
        program += [(_JGE_K, 0, 1, X32_SYSCALL_BIT), deny]
    for number in denied:
        program += [(_JEQ_K, 0, 1, number), deny]
    program += [(_JEQ_K, 0, 1, numbers["clone3"]), (_RET_K, 0, 0, SECCOMP_RET_ERRNO | ENOSYS)]
    program += [(_JEQ_K, 0, 4, numbers["socket"]), (_LD_W_ABS, 0, 0, _ARG0), (_JEQ_K, 0, 1, AF_UNIX), deny, allow]
    program += [(_JEQ_K, 0, 3, numbers["clone"]), (_LD_W_ABS, 0, 0, _ARG0), (_JSET_K, 0, 1, NAMESPACE_FLAGS), deny]
    program.append(allow)
    return program


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def seccomp_filter() -> bytes:
    """This machine's filter as the kernel takes it (struct sock_filter after struct sock_filter); b"" where
    no syscall table is known for it. `_install_seccomp` installs it; bubblewrap reads it from a file."""
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in seccomp_program(platform.machine()))


def _install_seccomp() -> None:
    """Install the filter (after no_new_privs, which lets an unprivileged process do so); it holds for the
    program and everything it starts, and nothing can lift it."""
    code = seccomp_filter()
    if not code:
        return
    buffer = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(code) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")


def _wall_off(settings: dict, payload: dict) -> None:
    """In the first process of the new PID namespace: the filesystem view, the files, the limits, the user."""
    uid, gid = (settings["uid"], settings["gid"]) if settings["as_root"] else (0, 0)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None, "mounting /proc")
    if settings["as_root"]:
        _expose(settings["expose"])
    scratch_mb = settings["scratch_mb"]
    options = f"size={scratch_mb}m,mode=0700,uid={uid},gid={gid}"
    _mount("tmpfs", SCRATCH, "tmpfs", MS_NOSUID | MS_NODEV, options, f"mounting the scratch tmpfs on {SCRATCH}")
    for target, flags in _mounts():
        if target in ("/proc", SCRATCH) or target.startswith("/proc/"):
            continue
        try:
            remount = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | flags
            _mount(None, target, None, remount, None, f"remounting {target} read-only")
        except SetupError:
            # A mount hidden under the scratch tmpfs or /proc cannot be reached and needs no remount.
            if not (target.startswith(SCRATCH + "/") or not os.path.exists(target)):
                raise
    main = os.path.join(SCRATCH, "main.py")
    with open(main, "w") as f:
        f.write(payload["code"])
    os.chown(main, uid, gid)
    # The program reads its stdin from an unlinked file: no size limit of a pipe, nothing left to find.
    stdin_path = os.path.join(SCRATCH, ".stdin")
    with open(stdin_path, "w") as f:
        f.write(payload["stdin"])
    stdin = os.open(stdin_path, os.O_RDONLY)
    os.unlink(stdin_path)
    os.dup2(stdin, 0)
    os.close(stdin)
    status_fd = settings["status_fd"]
    os.closerange(3, status_fd)
    os.closerange(status_fd + 1, 1 << 16)
    _limit(settings, settings["max_processes"])
    _drop_bounding_set()
    _check(_libc.prctl(PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0), "prctl(PR_SET_SECUREBITS)")
    if settings["as_root"]:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    os.chdir(SCRATCH)
    _drop_capabilities()
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    # After the uid change, which clears it: the program dies with its launcher.
    _check(_libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    _install_seccomp()  # last: the steps above need calls it denies
    python = settings["python"]
    os.execve(python, [python, "-I", "main.py"], settings["env"])


_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""Top-level directories an interpreter may load from besides /usr: bound as they are, or, where they are
links into /usr (a merged /usr), made the same links."""


def bwrap_command(settings: dict, code_fd: int, seccomp_fd: int | None, started_fd: int) -> list[str]:
    """The bubblewrap command line that runs main.py walled off as the hand-written path does: new user, PID
    (the program its first process), network, IPC, UTS and cgroup namespaces; a root of its own holding only
    /usr and the system library directories, /etc/ld.so.cache and the Python installation (`expose`), all
    read-only and nosuid, a fresh /proc, a minimal /dev and a tmpfs of `scratch_mb` on /tmp (its working
    directory, holding main.py from `code_fd`), the only place it can write (bwrap's own root is remounted
    read-only); no capability (bounding set included), no_new_privs (bwrap always sets it), a session of its
    own, dying with its launcher; the seccomp filter from `seccomp_fd`; only `env`. The interpreter writes to
    `started_fd` and closes it before it reads main.py: once it has, a failure is the program's, never the
    sandbox's."""
    uid, gid = settings["uid"], settings["gid"]
    args = [settings["bwrap"], "--unshare-all", "--uid", str(uid), "--gid", str(gid), "--as-pid-1"]
    args += ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--ro-bind", "/usr", "/usr"]
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for path in settings["expose"]:
        args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--size", str(settings["scratch_mb"] << 20), "--perms", "0700", "--tmpfs", SCRATCH]
    args += ["--file", str(code_fd), f"{SCRATCH}/main.py", "--remount-ro", "/", "--chdir", SCRATCH, "--clearenv"]
    for name, value in settings["env"].items():
        args += ["--setenv", name, value]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    start = (
        f"import os as _o;_o.write({started_fd},b'1');_o.close({started_fd});del _o;__file__='main.py';"
        "import sys;sys.argv=['main.py'];del sys;exec(compile(open('main.py','rb').read(),'main.py','exec'))"
    )
    return [*args, settings["python"], "-I", "-c", start]


def _memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding `data`, read from its start: no size limit of a pipe, no path."""
    fd = os.memfd_create(name, 0)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _close_all_but(keep: list[int]) -> None:
    """Close every descriptor from 3 up but those in `keep`."""
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 16)


def _limit(settings: dict, processes: int) -> None:
    """The run's resource limits, inherited by everything it starts (as in `_wall_off`)."""
    memory = settings["memory_mb"] << 20
    limits = [
        (resource.RLIMIT_AS, memory),
        (resource.RLIMIT_CPU, settings["cpu_s"]),
        (resource.RLIMIT_NPROC, processes),
        (resource.RLIMIT_FSIZE, settings["scratch_mb"] << 20),
        (resource.RLIMIT_NOFILE, 256),
        (resource.RLIMIT_CORE, 0),
    ]
    for which, value in limits:
        # The hard CPU limit a second later: SIGXCPU at the soft one, SIGKILL if it is caught.
        resource.setrlimit(which, (value, value + 1 if which == resource.RLIMIT_CPU else value))


def _run_in_bwrap(settings: dict, payload: dict, status) -> int:
    """As root: a child takes the run's own unprivileged uid/gid and limits and execs bwrap, which walls the
    program off in an unprivileged user namespace (so its uid outside is that uid, never root's); this process
    waits and reports how the program ended. bwrap's own process counts as one of the uid's processes."""
    code = _memfd("main.py", payload["code"].encode())
    stdin = _memfd("stdin", payload["stdin"].encode())
    filters = seccomp_filter()
    seccomp = _memfd("seccomp", filters) if filters else None
    started_read, started_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(started_read)
            os.dup2(stdin, 0)
            # A mount namespace of this launcher's own, where an installation under a directory the uid cannot
            # enter (a 0700 /root holding pyenv) is made reachable for bwrap to bind (`_expose`).
            _check(_libc.unshare(CLONE_NEWNS), "unshare (a mount namespace)")
            _mount(None, "/", None, MS_REC | MS_PRIVATE, None, "making mounts private")
            _expose(settings["expose"])
            passed = [fd for fd in (code, seccomp, started_write) if fd is not None]
            for fd in passed:
                os.set_inheritable(fd, True)
            _close_all_but([*passed, status.fileno()])  # the status pipe closes on exec: bwrap never has it
            _limit(settings, settings["max_processes"] + 1)
            os.setgroups([])
            os.setgid(settings["gid"])
            os.setuid(settings["uid"])
            command = bwrap_command(settings, code, seccomp, started_write)
            os.execve(command[0], command, settings["env"])
        except (OSError, SetupError) as exc:
            status.write(f"error starting bubblewrap: {exc}\n")
            status.flush()
        os._exit(125)
    os.close(started_write)
    with os.fdopen(started_read, "rb") as started:
        ran = started.read(1) == b"1"  # until the interpreter closes it, or bwrap fails and exits
    _, code_status = os.waitpid(pid, 0)
    if not ran:
        status.write("error bubblewrap could not set the sandbox up\n")
        return 125
    # bwrap exits with the program's code, or 128 + the signal that ended it: above 128 is read as a signal.
    code = os.waitstatus_to_exitcode(code_status)
    status.write(f"signal {code - 128}\n" if code > 128 else f"exit {code}\n" if code >= 0 else f"signal {-code}\n")
    return 0


def main() -> int:
    settings = json.loads(sys.argv[1])
    status_fd = settings["status_fd"]
    os.set_inheritable(status_fd, False)
    status = os.fdopen(status_fd, "w", buffering=1)
    payload = json.loads(sys.stdin.buffer.read())
    try:
        if settings["cgroup_procs"]:  # first: the program and all it starts are inside the run's memory cgroup
            with open(settings["cgroup_procs"], "w") as procs:
                procs.write("0")
        os.nice(settings["nice"])
        if settings.get("bwrap"):
            return _run_in_bwrap(settings, payload, status)
        _enter_namespaces(settings["as_root"])
    except (OSError, SetupError) as exc:
        status.write(f"error {exc}\n")
        return 125
    pid = os.fork()
    if pid == 0:
        try:
            _wall_off(settings, payload)
        except (OSError, SetupError) as exc:
            status.write(f"error {exc}\n")
            status.flush()
        os._exit(125)
    _, code = os.waitpid(pid, 0)
    if os.WIFSIGNALED(code):
        status.write(f"signal {os.WTERMSIG(code)}\n")
    else:
        status.write(f"exit {os.WEXITSTATUS(code)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
