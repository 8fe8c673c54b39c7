"""`cloudrl validate`: the bundle passes; each broken YAML fails with its one line and exit status 1."""

from __future__ import annotations

import shutil
import sys
import textwrap
from pathlib import Path

import pytest
from cloudrl.cli.app import app
from cloudrl.cli.pins import RAY_VERSION
from cloudrl.cli.validate import Problem, bundle_files, validate_bundle
from typer.testing import CliRunner

REPO_ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def test_the_bundle_passes():
    # Only the warning for the AMD image that could not be confirmed to exist (docs/cluster.md).
    assert [str(p) for p in validate_bundle(REPO_ROOT)] == [
        "warning: tasks/ray-cluster-amd.dstack.yml: image: vllm/vllm-openai-rocm:v0.32.0 was not confirmed to "
        "exist when this bundle was written — check it with `docker manifest inspect vllm/vllm-openai-rocm:v0.32.0` "
        "before `dstack apply`"
    ]
    names = {p.relative_to(REPO_ROOT).as_posix() for p in bundle_files(REPO_ROOT)}
    assert {
        "tasks/ray-cluster.dstack.yml",
        "tasks/ray-cluster-groups.dstack.yml",
        "tasks/ray-cluster-amd.dstack.yml",
    } <= names
    assert len([n for n in names if n.startswith("fleets/")]) >= 3
    result = runner.invoke(app, ["validate", str(REPO_ROOT)])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"ok: {len(names)} files in fleets/ and tasks/ pass")
    assert result.stderr.startswith("warning: tasks/ray-cluster-amd.dstack.yml: image:")


def test_the_bootstrap_pins_cloudrls_ray():
    assert f'CLOUDRL_RAY_VERSION="{RAY_VERSION}"' in (REPO_ROOT / "tasks" / "ray-bootstrap.sh").read_text()


TASK = "tasks/broken.dstack.yml"
FLEET = "fleets/broken.dstack.yml"

# (id, file, YAML, the expected line)
BROKEN = [
    (
        "unknown-key",
        TASK,
        """
        type: task
        commands: [echo]
        resourcez:
          gpu: H100:8
     """,
        "tasks/broken.dstack.yml: resourcez: dstack does not know the key `resourcez` — remove it or fix its "
        "spelling (did you mean `resources`?)",
    ),
    (
        "bad-enum",
        TASK,
        """
        type: task
        commands: [echo]
        startup_order: head-first
     """,
        "tasks/broken.dstack.yml: startup_order: dstack does not accept 'head-first' — set it to 'any', "
        "'master-first' or 'workers-first'",
    ),
    (
        "unknown-type",
        TASK,
        """
        type: tsk
        commands: [echo]
     """,
        "tasks/broken.dstack.yml: type: dstack has no configuration type 'tsk' — use `type: task` (in tasks/) "
        "or `type: fleet` (in fleets/)",
    ),
    (
        "missing-required",
        FLEET,
        """
        type: fleet
        placement: cluster
        ssh_config:
          user: ubuntu
          identity_file: ~/.ssh/id_rsa
          hosts:
            - hostname: 10.0.0.1
              proxy_jump:
                hostname: bastion
                identity_file: ~/.ssh/bastion
     """,
        "fleets/broken.dstack.yml: ssh_config.hosts[0].proxy_jump.user: `user` is required here — add `user:`",
    ),
    (
        "group-name",
        TASK,
        """
        type: task
        startup_order: master-first
        groups:
          - name: Head
            commands: [echo]
     """,
        "tasks/broken.dstack.yml: groups[0].name: dstack rejects it: Node group name should match regex "
        "'^[a-z0-9][a-z0-9-]{0,39}$' — fix the value as dstack says; see dstack's reference for this key",
    ),
    (
        "gpu-unparsable",
        TASK,
        """
        type: task
        commands: [echo]
        resources:
          gpu: 8xH100
     """,
        "tasks/broken.dstack.yml: resources.gpu: dstack cannot read this GPU spec (could not convert string to "
        "float: '8xh100') — write NAME:COUNT or MEMORY:COUNT, e.g. `gpu: H100:8` or `gpu: 80GB..:8`",
    ),
    (
        "gpu-count-glued",
        TASK,
        """
        type: task
        commands: [echo]
        resources:
          gpu: H100x8
     """,
        "tasks/broken.dstack.yml: resources.gpu: dstack reads 'H100x8' as one GPU named 'H100x8', not 8 GPUs — "
        "write the count as its own token: `gpu: H100:8`",
    ),
    (
        "gpu-no-count",
        TASK,
        """
        type: task
        commands: [echo]
        resources:
          gpu: H100
     """,
        "tasks/broken.dstack.yml: resources.gpu: 'H100' gives no GPU count, which dstack reads as 1 or more GPUs "
        "— add the count per node, e.g. `gpu: H100:8`",
    ),
    (
        "gpu-unknown-name",
        FLEET,
        """
        type: fleet
        nodes: 1
        resources:
          gpu: H1000:8
     """,
        "fleets/broken.dstack.yml: resources.gpu: no GPU is named 'H1000', so dstack would find no offers — use "
        "a GPU name dstack knows, e.g. H100, V100, P100",
    ),
    (
        "bad-name",
        TASK,
        """
        type: task
        name: Cloudrl_Ray
        commands: [echo]
     """,
        "tasks/broken.dstack.yml: name: 'Cloudrl_Ray' is rejected by the dstack server (^[a-z][a-z0-9-]{1,40}$) "
        "— use lowercase letters, digits and dashes, starting with a letter, e.g. `cloudrl-ray`",
    ),
    (
        "fleet-nodes-and-ssh",
        FLEET,
        """
        type: fleet
        nodes: 2
        placement: cluster
        ssh_config:
          user: ubuntu
          identity_file: ~/.ssh/id_rsa
          hosts: [10.0.0.1, 10.0.0.2]
     """,
        "fleets/broken.dstack.yml: ssh_config: a fleet has either `nodes` (cloud) or `ssh_config` (your hosts), "
        "not both — remove `nodes` for an SSH fleet, or `ssh_config` for a cloud fleet",
    ),
    (
        "fleet-neither",
        FLEET,
        """
        type: fleet
        placement: cluster
     """,
        "fleets/broken.dstack.yml: nodes: a fleet needs `nodes` (cloud) or `ssh_config` (your hosts) — add "
        "`nodes: 2` for a cloud fleet or `ssh_config:` with `hosts:` for on-prem",
    ),
    (
        "ssh-fleet-cloud-key",
        FLEET,
        """
        type: fleet
        placement: cluster
        spot_policy: auto
        ssh_config:
          user: ubuntu
          identity_file: ~/.ssh/id_rsa
          hosts: [10.0.0.1, 10.0.0.2]
     """,
        "fleets/broken.dstack.yml: spot_policy: is a cloud fleet key; the dstack server rejects it on an SSH "
        "fleet — remove it: SSH fleets use what the hosts have",
    ),
    (
        "cloud-fleet-ssh-key",
        FLEET,
        """
        type: fleet
        nodes: 1
        env: [A=1]
     """,
        "fleets/broken.dstack.yml: env: is an SSH fleet key; the dstack server rejects it on a cloud fleet — "
        "remove it (set env in the task instead)",
    ),
    (
        "ssh-host-without-user",
        FLEET,
        """
        type: fleet
        placement: cluster
        ssh_config:
          identity_file: ~/.ssh/id_rsa
          hosts:
            - 10.0.0.1
            - hostname: 10.0.0.2
              user: ubuntu
     """,
        "fleets/broken.dstack.yml: ssh_config.hosts[0]: no SSH user for host 10.0.0.1 — set `user:` under "
        "ssh_config (all hosts) or on the host",
    ),
    (
        "fleet-without-cluster-placement",
        FLEET,
        """
        type: fleet
        nodes: 2
     """,
        "fleets/broken.dstack.yml: placement: dstack runs multi-node tasks only on fleets with cluster "
        "placement — set `placement: cluster`",
    ),
    (
        "shipped-file-missing",
        TASK,
        """
        type: task
        files: [missing.sh:tasks/missing.sh]
        commands: [bash tasks/missing.sh]
     """,
        "tasks/broken.dstack.yml: files[0]: ships missing.sh, which does not exist — create it, or fix the path "
        "(relative to tasks/)",
    ),
    (
        "dashboard-on-all-addresses",
        TASK,
        """
        type: task
        nodes: 2
        startup_order: master-first
        commands:
          - ray start --head --dashboard-host=0.0.0.0 --block
     """,
        "tasks/broken.dstack.yml: commands[0]: the Ray dashboard listens on 0.0.0.0: anyone who reaches the node "
        "can submit jobs — use --dashboard-host=127.0.0.1; dstack forwards the port through its SSH tunnel",
    ),
    (
        "unpinned-ray",
        TASK,
        """
        type: task
        commands:
          - pip install "ray[default]" && ray start --head --block
     """,
        f"tasks/broken.dstack.yml: commands[0]: installs 'ray[default]', not cloudrl's Ray {RAY_VERSION} — pin it: "
        f"'ray[default]=={RAY_VERSION}'",
    ),
    (
        "fleet-in-tasks",
        TASK,
        """
        type: fleet
        nodes: 1
     """,
        "tasks/broken.dstack.yml: type: is `fleet` but tasks/ holds `type: task` files — move the file or set "
        "`type: task`",
    ),
    (
        "not-yaml",
        TASK,
        """
        type: task
        commands: [echo
     """,
        "tasks/broken.dstack.yml: -: is not valid YAML at line 3, column 1 (expected ',' or ']', but got "
        "'<stream end>') — fix the YAML syntax there",
    ),
]


def write_bundle(root: Path, rel: str, text: str) -> None:
    """A bundle of one broken file, beside the real bootstrap (tasks may ship it)."""
    (root / "tasks").mkdir()
    (root / "fleets").mkdir()
    shutil.copy(REPO_ROOT / "tasks" / "ray-bootstrap.sh", root / "tasks" / "ray-bootstrap.sh")
    (root / rel).write_text(textwrap.dedent(text).lstrip())


@pytest.mark.parametrize("rel, text, line", [case[1:] for case in BROKEN], ids=[case[0] for case in BROKEN])
def test_a_broken_yaml_fails_with_its_line(tmp_path, rel, text, line):
    write_bundle(tmp_path, rel, text)
    assert [str(p) for p in validate_bundle(tmp_path)] == [line]

    result = runner.invoke(app, ["validate", str(tmp_path)])
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [line]
    assert "1 problem(s) in 1 file(s)" in result.stderr


def copy_bundle(root: Path) -> None:
    from test_bundle_mutations import copy_bundle as copy_with_shipped_files

    copy_with_shipped_files(root)


def test_a_bootstrap_with_another_ray_pin_fails_once_for_all_tasks_that_ship_it(tmp_path):
    copy_bundle(tmp_path)
    script = tmp_path / "tasks" / "ray-bootstrap.sh"
    script.write_text(
        script.read_text().replace(f'CLOUDRL_RAY_VERSION="{RAY_VERSION}"', 'CLOUDRL_RAY_VERSION="2.59.0"')
    )
    assert [p for p in validate_bundle(tmp_path) if not p.warning] == [
        Problem(
            "tasks/ray-bootstrap.sh",
            "CLOUDRL_RAY_VERSION",
            f"pins Ray 2.59.0 but cloudrl pins {RAY_VERSION}: the client on your machine would not match the cluster",
            f'set CLOUDRL_RAY_VERSION="{RAY_VERSION}" (cli/pins.py)',
        )
    ]
    result = runner.invoke(app, ["validate", str(tmp_path)])
    assert result.exit_code == 1
    assert result.stdout.startswith("tasks/ray-bootstrap.sh: CLOUDRL_RAY_VERSION: pins Ray 2.59.0")


def test_a_bootstrap_without_a_ray_pin_fails(tmp_path):
    copy_bundle(tmp_path)
    script = tmp_path / "tasks" / "ray-bootstrap.sh"
    script.write_text(script.read_text().replace(f'CLOUDRL_RAY_VERSION="{RAY_VERSION}"\n', ""))
    assert [str(p) for p in validate_bundle(tmp_path) if not p.warning] == [
        f"tasks/ray-bootstrap.sh: CLOUDRL_RAY_VERSION: starts Ray without cloudrl's version pin — add "
        f'CLOUDRL_RAY_VERSION="{RAY_VERSION}" and install ray[default]==that'
    ]


def test_a_bootstrap_that_opens_the_dashboard_fails_with_its_line_number(tmp_path):
    copy_bundle(tmp_path)
    script = tmp_path / "tasks" / "ray-bootstrap.sh"
    text = script.read_text().replace("--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0")
    script.write_text(text)
    number = next(n for n, line in enumerate(text.splitlines(), 1) if "--dashboard-host=0.0.0.0" in line)
    assert [str(p) for p in validate_bundle(tmp_path) if not p.warning] == [
        f"tasks/ray-bootstrap.sh: line {number}: the Ray dashboard listens on 0.0.0.0: anyone who reaches the "
        f"node can submit jobs — use --dashboard-host=127.0.0.1; dstack forwards the port through its SSH tunnel"
    ]


def test_a_directory_without_a_bundle_is_one_red_line(tmp_path):
    result = runner.invoke(app, ["validate", str(tmp_path)])
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        f"error: no fleets/ or tasks/ in {tmp_path.resolve()}: run `cloudrl validate` "
        f"in the cloudrl checkout or pass its path (cloudrl validate PATH)"
    )


def test_without_dstack_validate_says_how_to_install_it(tmp_path, monkeypatch):
    copy_bundle(tmp_path)
    for name in [n for n in sys.modules if n == "dstack" or n.startswith("dstack.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "dstack", None)
    result = runner.invoke(app, ["validate", str(tmp_path)])
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        "error: dstack is not installed: pip install 'cloudrl[dstack]' "
        "(`cloudrl validate` runs dstack's own configuration parser)"
    )
