"""Every simulated node has a disk of its own, as separate machines do.

A node sees its own /tmp, home (so ~/.cache/cloudrl, ~/.cache/huggingface) and working dir, and of
the host only "the image" (the interpreter and the repository); so a file that exists only on the
submitting machine is on no node. These checks need namespaces but no Ray: the Ray-level ones (a
task pinned to node 1 cannot see node 0's home) run on test_bundle_cluster.py's 2-node cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from bundle_netns import REPO_ROOT, Cluster, LoopbackCluster, home_dir, private_disk_script
from test_bundle_cluster import netns_reason, new_cluster

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(scope="module", params=[pytest.param("netns", marks=pytest.mark.netns), "loopback"])
def kind(request) -> str:
    """Network namespaces where this machine has them for us, else the loopback stand-in
    (CLOUDRL_TEST_CLUSTER=loopback forces it)."""
    forced = os.environ.get("CLOUDRL_TEST_CLUSTER") == "loopback"
    use_netns = not (netns_reason() or forced)
    if (request.param == "netns") != use_netns:
        pytest.skip(f"the {'netns' if use_netns else 'loopback'} run covers these checks here")
    return request.param


@pytest.fixture(scope="module")
def cluster(kind, tmp_path_factory):
    cluster = new_cluster(kind, 2, tmp_path_factory.mktemp(f"disks-{kind}"))
    try:
        cluster.create()
        yield cluster
    finally:
        cluster.stop()
    assert cluster.leftover_pids() == []
    if kind == "netns":
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"clr{cluster.id}" not in namespaces
    # The nodes' mounts lived only in their own mount namespaces.
    assert str(cluster.workdir) not in Path("/proc/self/mountinfo").read_text()


def in_node(cluster: Cluster, rank: int, script: str) -> subprocess.CompletedProcess:
    return cluster.run_in_node(rank, ["sh", "-c", script], timeout=60)


def test_a_file_only_on_the_host_is_on_no_node(cluster, tmp_path):
    if isinstance(cluster, LoopbackCluster):
        pytest.skip("the loopback stand-in's nodes share the host's filesystem")
    model = tmp_path / "model"
    model.mkdir()
    for rank in range(cluster.size):
        assert in_node(cluster, rank, f"test -e {model}").returncode == 1
        # The user's machine at the end of dstack's SSH tunnel keeps the host's filesystem.
        assert cluster.exec(rank, ["test", "-d", str(model)], timeout=60).returncode == 0


def test_what_a_node_writes_to_its_home_and_tmp_stays_on_that_node(cluster):
    name = f"clr-disk-{uuid.uuid4().hex[:8]}"
    # TMPDIR: where the loopback stand-in points a node's /tmp (unset on a netns node).
    written = in_node(
        cluster, 1, f'mkdir -p ~/.cache/{name} && echo 1 > ~/.cache/{name}/f && echo 1 > "${{TMPDIR:-/tmp}}/{name}"'
    )
    assert written.returncode == 0, written.stderr
    for path in (f"~/.cache/{name}/f", f"/tmp/{name}"):
        assert cluster.node_path(1, path).is_file()
        assert not cluster.node_path(0, path).exists()
    assert not (Path.home() / ".cache" / name).exists() and not (Path("/tmp") / name).exists()
    seen = in_node(cluster, 0, f'ls ~/.cache/{name} "${{TMPDIR:-/tmp}}/{name}"')
    assert seen.returncode != 0 and "No such file" in seen.stderr, seen.stdout + seen.stderr


def test_every_node_has_the_image_its_working_dir_and_its_own_home(cluster):
    probe = (
        "import cloudrl.cli, os, socket\n"
        "print(os.getcwd(), os.path.expanduser('~'), socket.gethostname(), cloudrl.cli.__file__)\n"
    )
    for rank in range(cluster.size):
        result = cluster.run_in_node(rank, [sys.executable, "-c", probe], timeout=60)
        assert result.returncode == 0, result.stderr
        cwd, home, hostname, package = result.stdout.split()
        assert Path(cwd) == cluster.workflow_dir(rank)
        assert Path(package).is_relative_to(REPO_ROOT)
        if cluster.kind == "netns":  # the usual home path, with the node's own dir laid over it
            assert (Path(home), hostname) == (home_dir(), f"node-{rank}")
        else:
            assert Path(home) == cluster.node_path(rank, "~")


def test_an_image_under_tmp_stays_visible_on_the_nodes(cluster, tmp_path):
    # As when CI checks the repository out under /tmp: kept paths stay, their siblings do not.
    if isinstance(cluster, LoopbackCluster):
        pytest.skip("the loopback stand-in's nodes share the host's filesystem")
    image, other = tmp_path / "image", tmp_path / "other"
    image.mkdir()
    other.mkdir()
    (image / "python").write_text("")
    cluster.keep.append(image)
    try:
        assert in_node(cluster, 1, f"test -f {image / 'python'}").returncode == 0
        assert in_node(cluster, 1, f"test -e {other}").returncode == 1
    finally:
        cluster.keep.remove(image)


def test_the_disk_script_keeps_the_image_and_the_nodes_own_dirs():
    disk = Path("/tmp/w/node1-disk")
    covers = [(Path("/tmp"), disk / "tmp"), (Path("/root"), disk / "home")]
    keep = [Path("/root/.pyenv/3.11"), Path("/tmp/repo"), Path("/tmp/repo/.venv"), Path("/usr")]
    lines = private_disk_script(covers, keep, "node-1", disk / "workflow").splitlines()
    binds = [line for line in lines if line.startswith("mount")]
    assert binds == [
        # The home first (/root sorts before /tmp): what the image has under it, then the cover.
        f"mount --rbind /root/.pyenv/3.11 {disk}/home/.pyenv/3.11",
        f"mount --rbind {disk}/home /root",
        # Then /tmp: the repository (its venv with it), and the node's home and working dir, whose
        # host paths lie under /tmp.
        f"mount --rbind /tmp/repo {disk}/tmp/repo",
        f"mount --rbind {disk}/home {disk}/tmp/w/node1-disk/home",
        f"mount --rbind {disk}/workflow {disk}/tmp/w/node1-disk/workflow",
        f"mount --rbind {disk}/tmp /tmp",
    ]
    assert lines[-2:] == [f"cd {disk}/workflow", 'exec "$@"']
    with pytest.raises(ValueError, match="/tmp holds the image"):
        private_disk_script(covers, [Path("/tmp")], "node-1", disk / "workflow")
