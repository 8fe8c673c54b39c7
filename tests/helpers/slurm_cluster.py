"""A real Slurm (Debian's slurm-wlm) on simulated machines: a login node running slurmctld, and compute
nodes each running a slurmd, every one in its own network namespace with its own hostname, /tmp, home
and working dir (tests/helpers/bundle_netns.py's nodes), on a bridge with no uplink.

What a site's cluster has and these nodes share: the "image" (this interpreter and the repository, as
bundle_netns.py keeps them) and one shared directory outside /tmp and home (/var/tmp/clr-slurm-<id>),
standing in for the site's shared filesystem: slurm.conf, the controller's state, the daemons' logs
and the jobs' output files. Authentication is auth/none (no munge daemon to run), which the packaged
Slurm 22.05 still ships; jobs run as root. Process tracking is proctrack/linuxproc: no cgroups here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from bundle_netns import MARKER_VAR, NetnsCluster, Node, private_disk_script
from dstack_runner import REPO_ROOT, base_env

SSHD = "/usr/sbin/sshd"
SLURM_DAEMONS = ("slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "scontrol", "scancel")


def slurm_unavailable_reason() -> str | None:
    """None when slurm-wlm's daemons and client tools are installed, else why not."""
    for tool in SLURM_DAEMONS[:2] + SLURM_DAEMONS[3:]:
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"`{tool}` is not installed (apt-get install -y slurm-wlm)"
    if shutil.which("nsenter") is None:
        return "`nsenter` is not installed (apt-get install -y util-linux)"
    plugins = Path("/usr/lib/x86_64-linux-gnu/slurm-wlm")
    if plugins.is_dir() and not (plugins / "auth_none.so").exists():
        return "this Slurm has no auth/none plugin (newer releases dropped it): these tests need one, or munged set up for them"
    return None


class SlurmCluster(NetnsCluster):
    """`size` compute nodes node-0..node-{size-1} plus the login node (rank `size`, hostname `login`)
    that runs slurmctld and the user's sbatch/scancel/cloudrl."""

    def __init__(self, size: int, workdir: Path, net: int, cpus_per_node: int = 2):
        super().__init__(size + 1, workdir, net)
        self.compute = size
        self.login = size
        self.ips[self.login] = f"10.213.{net}.100"
        self.cpus = cpus_per_node
        # Short, outside /tmp and home: every node sees it (a site's shared filesystem).
        self.shared = Path(tempfile.mkdtemp(prefix=f"clr-slurm-{self.id}-", dir="/var/tmp"))
        self.conf = self.shared / "slurm.conf"
        self.keep = [*self.keep, self.shared]
        self.user_env: dict[str, str] = {}
        """What the user's shell exports (sbatch passes it on to the job, as --export=ALL does)."""

    def hostname(self, rank: int) -> str:
        return "login" if rank == self.login else f"node-{rank}"

    def node_prefix(self, rank: int) -> list[str]:
        script = private_disk_script(self.own_dirs(rank), self.keep, self.hostname(rank), self.workflow_dir(rank))
        # nsenter, not `ip netns exec`: that mounts a fresh /sys, without the cgroup filesystems slurmd
        # insists on reading (even with proctrack/linuxproc, which it uses here).
        return [
            "nsenter",
            f"--net=/run/netns/{self.ns[rank]}",
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "node-disk",
        ]

    def env(self) -> dict[str, str]:
        """Slurm's clients, daemons and jobs all find the cluster's slurm.conf through SLURM_CONF."""
        return {**base_env(), **self.user_env, "SLURM_CONF": str(self.conf), MARKER_VAR: self.id}

    def write_conf(self) -> None:
        nodes = "\n".join(
            f"NodeName={self.hostname(r)} NodeAddr={self.ips[r]} CPUs={self.cpus} State=UNKNOWN"
            for r in range(self.compute)
        )
        state = self.shared / "state"
        state.mkdir()
        self.conf.write_text(f"""\
ClusterName=cloudrl-test
SlurmctldHost=login({self.ips[self.login]})
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={state}
SlurmdSpoolDir=/tmp/slurmd
SlurmctldPidFile={self.shared}/slurmctld.pid
SlurmdPidFile=/tmp/slurmd.pid
SlurmctldLogFile={self.shared}/slurmctld.log
SlurmdLogFile={self.shared}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
KillWait=10
InactiveLimit=0
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def start_slurm(self, timeout: float = 60) -> None:
        """slurmctld on the login node, one slurmd per compute node; returns when every node is idle."""
        self.write_conf()
        env = self.env()
        self.nodes[self.login] = Node(
            self.login,
            self.ips[self.login],
            self.node_prefix(self.login) + ["slurmctld", "-D", "-i"],
            env,
            self.workdir / "slurmctld.out",
            cwd=self.workflow_dir(self.login),
        )
        for rank in range(self.compute):
            (self.disk(rank) / "tmp" / "slurmd").mkdir(parents=True, exist_ok=True)  # SlurmdSpoolDir
            self.nodes[rank] = Node(
                rank,
                self.ips[rank],
                self.node_prefix(rank) + ["slurmd", "-D", "-N", self.hostname(rank)],
                env,
                self.workdir / f"slurmd{rank}.out",
                cwd=self.workflow_dir(rank),
            )
        deadline = time.monotonic() + timeout
        while True:
            out = self.login_run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=20).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if len(states) == self.compute and all(s == "idle" for s in states.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"Slurm nodes not idle after {timeout:.0f}s: {states}\n{self.daemon_logs()}")
            time.sleep(0.5)

    def daemon_logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted([*self.shared.glob("*.log"), *self.workdir.glob("*.out")])
        )

    def login_run(
        self, argv: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path = REPO_ROOT
    ) -> subprocess.CompletedProcess:
        """`argv` on the login node (its network and hostname, the host's filesystem): the user's shell."""
        return subprocess.run(
            ["ip", "netns", "exec", self.ns[self.login], *argv],
            env={**self.env(), **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def sbatch(self, script: Path, *args: str, env: dict[str, str] | None = None) -> int:
        """Submit `script` from the repository root on the login node; the job's id. Its output file is
        `job_output(id)` on the shared filesystem."""
        out = self.login_run(
            ["sbatch", "--parsable", f"--output={self.shared}/job-%j.out", *args, str(script)], timeout=30, env=env
        )
        assert out.returncode == 0, out.stdout + out.stderr
        return int(out.stdout.strip().split(";")[0])

    def job_output(self, job: int) -> str:
        path = self.shared / f"job-{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_output(self, job: int, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.job_output(job))
            if match:
                return match
            if time.monotonic() > deadline or self.job_state(job) not in ("PENDING", "RUNNING", "CONFIGURING"):
                raise AssertionError(
                    f"job {job} ({self.job_state(job)}) did not print {pattern!r} within "
                    f"{timeout:.0f}s:\n{self.job_output(job)[-4000:]}\n{self.daemon_logs()}"
                )
            time.sleep(0.5)

    def job_state(self, job: int) -> str:
        out = self.login_run(["squeue", "-h", "-j", str(job), "-o", "%T"], timeout=20)
        return out.stdout.strip() or "GONE"

    def node_pids(self, rank: int) -> dict[int, str]:
        """Every process in the compute node's network namespace but its daemons (slurmd, and the sshd of
        a test): {pid: command line}."""
        out = subprocess.run(["ip", "netns", "pids", self.ns[rank]], capture_output=True, text=True, timeout=20).stdout
        daemon = self.nodes[rank].proc.pid
        found = {}
        for pid in map(int, out.split()):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            if pid != daemon and not cmd.startswith(("slurmd ", SSHD, "sshd:")):
                found[pid] = cmd
        return found

    def start_sshd(self, rank: int, keys: Path) -> int:
        """A real sshd on the node's cluster address, port 2222, accepting `keys`/client_key; its port.
        Stopped with the cluster (its process lives in the node's namespace)."""
        port = 2222
        config = keys / f"sshd_config_{rank}"
        config.write_text(
            f"Port {port}\nListenAddress {self.ips[rank]}\nHostKey {keys / 'host_key'}\n"
            f"AuthorizedKeysFile {keys / 'authorized_keys'}\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nAllowTcpForwarding yes\n"
            f"PermitRootLogin prohibit-password\nPidFile {keys / f'sshd{rank}.pid'}\n"
        )
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        self.nodes[f"sshd{rank}"] = Node(
            rank,
            self.ips[rank],
            ["ip", "netns", "exec", self.ns[rank], SSHD, "-D", "-e", "-f", str(config)],
            self.env(),
            self.workdir / f"sshd{rank}.out",
            cwd=keys,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            probe = subprocess.run(
                ["ip", "netns", "exec", self.ns[rank], "bash", "-c", f": >/dev/tcp/{self.ips[rank]}/{port}"],
                capture_output=True,
                timeout=10,
            )
            if probe.returncode == 0:
                return port
            time.sleep(0.2)
        raise AssertionError(f"sshd on node {rank} did not listen: {self.nodes[f'sshd{rank}'].output()[-500:]}")

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.shared, ignore_errors=True)
