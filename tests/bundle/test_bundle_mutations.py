"""`cloudrl validate` on broken copies of the real bundle: each case makes one small edit to fleets/ or tasks/
and expects exactly one line naming it (exit 1). Also: what dstack accepts is not flagged, and dstack's
private names that validate uses still resolve."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import tomllib
import yaml
from cloudrl.cli.app import app
from cloudrl.cli.bundle_checks import SUPPORTED_VLLM
from cloudrl.cli.dstack_compat import NAMES, dstack_api
from cloudrl.cli.pins import RAY_VERSION
from cloudrl.cli.validate import validate_bundle
from typer.testing import CliRunner

REPO_ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
PLAIN, GROUPS, CLOUD = (
    "tasks/ray-cluster.dstack.yml",
    "tasks/ray-cluster-groups.dstack.yml",
    "fleets/gpu-cluster.dstack.yml",
)
BOOT = "tasks/ray-bootstrap.sh"
ROLLOUT = "tasks/ray-rollout-spot.dstack.yml"
WHERE = "fleet cloudrl-cluster (fleets/gpu-cluster.dstack.yml)"


def replace(old: str, new: str, count: int = 1):
    def edit(text: str) -> str:
        assert text.count(old) >= count, f"the bundle no longer holds {old!r}"
        return text.replace(old, new, count)

    return edit


def append_after(marker: str, line: str):
    def edit(text: str) -> str:
        assert marker in text, marker
        return text.replace(marker, marker + line, 1)

    return edit


def boot_line(text: str, needle: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if needle in line)


# (id, file to edit, edit, expected line; `{line}` is filled with the edited line's number in the file)
MUTATIONS = [
    (
        "gpu-vendor-task",
        PLAIN,
        replace("gpu: nvidia:80GB..:8", "gpu: 80GB..:8"),
        f"{PLAIN}: resources.gpu: '80GB..:8' names no GPU vendor: with `image:` set dstack does not default to NVIDIA, "
        "so the nodes may be AMD, Intel Gaudi or another vendor the tasks' image cannot use — name it: "
        "`gpu: nvidia:80GB..:8`",
    ),
    (
        "gpu-vendor-fleet",
        CLOUD,
        replace("gpu: nvidia:80GB..:8", "gpu: 80GB..:8"),
        f"{CLOUD}: resources.gpu: '80GB..:8' names no GPU vendor: a fleet does not default to NVIDIA, so the nodes "
        "may be AMD, Intel Gaudi or another vendor the tasks' image cannot use — name it: `gpu: nvidia:80GB..:8`",
    ),
    (
        "dashboard-port-removed",
        PLAIN,
        replace("ports:\n  - 8265\n", ""),
        f"{PLAIN}: ports: does not forward the head's dashboard port 8265 (Jobs API, `cloudrl submit`), so `dstack "
        "apply` gives you no way to reach it — list `- 8265` under ports (the bootstrap's dashboard port is "
        "CLOUDRL_DASHBOARD_PORT, default 8265)",
    ),
    (
        "dashboard-port-changed",
        PLAIN,
        replace("ports:\n  - 8265\n", "ports:\n  - 8266\n"),
        f"{PLAIN}: ports: forwards 8266 but the head's dashboard port 8265 (Jobs API, `cloudrl submit`), so `dstack "
        "apply` gives you no way to reach it — list `- 8265` under ports (the bootstrap's dashboard port is "
        "CLOUDRL_DASHBOARD_PORT, default 8265)",
    ),
    (
        "dashboard-port-on-workers",
        GROUPS,
        append_after("  - name: workers\n    nodes: 1\n", "    ports: [8265]\n"),
        f"{GROUPS}: groups[1].ports: lists the dashboard port 8265 on a worker group: only the head (rank 0) serves "
        "the dashboard, workers keep it closed — remove 8265 from this group's ports; the head group forwards it",
    ),
    (
        "command-runs-unshipped-path",
        PLAIN,
        replace("  - bash tasks/ray-bootstrap.sh", "  - bash ray-bootstrap.sh"),
        f"{PLAIN}: commands[0]: runs ray-bootstrap.sh, which no `files:` entry ships (they land at: "
        "tasks/ray-bootstrap.sh, tasks/ray_bringup.py, tasks/retriever.sh) — ship it "
        "(`- ray-bootstrap.sh:ray-bootstrap.sh`) or run the path `files:` gives",
    ),
    (
        "bringup-not-shipped",
        PLAIN,
        replace("  - ray_bringup.py:tasks/ray_bringup.py\n", ""),
        f"{PLAIN}: files: ships tasks/ray-bootstrap.sh without tasks/ray_bringup.py, which every node runs (its Ray "
        "flags; on the head the wait for the nodes, the fabric check, the ready line) — add "
        "`- ray_bringup.py:tasks/ray_bringup.py`",
    ),
    (
        "retriever-not-shipped",
        GROUPS,
        replace("  - retriever.sh:tasks/retriever.sh\n", ""),
        f"{GROUPS}: files: ships tasks/ray-bootstrap.sh without tasks/retriever.sh, which it sources when "
        "CLOUDRL_RETRIEVER_INDEX is set — add `- retriever.sh:tasks/retriever.sh`",
    ),
    (
        "neither-bootstrap-file-shipped",
        PLAIN,
        replace("  - ray_bringup.py:tasks/ray_bringup.py\n  - retriever.sh:tasks/retriever.sh\n", ""),
        f"{PLAIN}: files: ships tasks/ray-bootstrap.sh without tasks/ray_bringup.py, which every node runs (its Ray "
        "flags; on the head the wait for the nodes, the fabric check, the ready line) and tasks/retriever.sh, which "
        "it sources when CLOUDRL_RETRIEVER_INDEX is set — add `- ray_bringup.py:tasks/ray_bringup.py` and "
        "`- retriever.sh:tasks/retriever.sh`",
    ),
    (
        "retriever-crlf",
        "tasks/retriever.sh",
        lambda text: text.replace("\n", "\r\n"),
        "tasks/retriever.sh: line 1: has Windows (CRLF) line endings: bash reads the `\\r` as part of each command — "
        "convert it to LF: `sed -i 's/\\r$//' tasks/retriever.sh` (or dos2unix)",
    ),
    (
        "bootstrap-crlf",
        BOOT,
        lambda text: text.replace("\n", "\r\n"),
        f"{BOOT}: line 1: has Windows (CRLF) line endings: bash reads the `\\r` as part of each command — convert it "
        f"to LF: `sed -i 's/\\r$//' {BOOT}` (or dos2unix)",
    ),
    (
        "bootstrap-syntax",
        BOOT,
        replace('if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then', 'if [[ -n "${RAY_AUTH_TOKEN:-}" ]]'),
        f"{BOOT}: line {{elif}}: bash cannot parse it (syntax error near unexpected token `elif') — fix the syntax "
        f"there; `bash -n {BOOT}` checks it",
    ),
    (
        "bootstrap-unpinned-ray",
        BOOT,
        append_after("set -euo pipefail\n", "pip install ray\n"),
        f"{BOOT}: line {{line}}: installs 'ray', not cloudrl's Ray {RAY_VERSION} — pin it: 'ray[default]=={RAY_VERSION}'",
    ),
    (
        "bootstrap-pip3-ray",
        BOOT,
        append_after("set -euo pipefail\n", f"pip3 install ray[default]=={RAY_VERSION}\n"),
        f"{BOOT}: line {{line}}: installs Ray with `pip3`, which may belong to another Python than the one that runs "
        "`ray start` — use `python3 -m pip install` with the interpreter that starts Ray",
    ),
    (
        "task-more-nodes-than-fleet",
        GROUPS,
        lambda text: replace("[cloudrl-cluster, cloudrl-onprem]", "[cloudrl-cluster]")(
            replace("  - name: workers\n    nodes: 1\n", "  - name: workers\n    nodes: 2\n")(text)
        ),
        f"{GROUPS}: groups: asks for 3 nodes but {WHERE} has 2 nodes at most: the run gets no offer — lower it, or "
        "raise the fleet's `nodes` max (and target)",
    ),
    (
        "task-disk-over-fleet",
        GROUPS,
        replace("      disk: 1TB..", "      disk: 2TB.."),
        f"{GROUPS}: groups[0].resources.disk: asks for 2048GB.. of disk but {WHERE} provisions 1024GB disks (the "
        "smallest its `disk:` allows): no instance fits — ask for at most the fleet's disk, or raise the fleet's `disk:`",
    ),
    (
        "task-memory-over-fleet",
        PLAIN,
        replace("  memory: 1TB..", "  memory: 2TB.."),
        f"{PLAIN}: resources.memory: asks for 2048GB.. of RAM but {WHERE} only guarantees 1024GB..: its instances may "
        "have less — ask for at most the fleet's memory, or raise the fleet's `memory:`",
    ),
    (
        "task-spot-fleet-on-demand",
        PLAIN,
        replace("spot_policy: on-demand", "spot_policy: spot"),
        f"{PLAIN}: spot_policy: is spot but {WHERE} provisions on-demand instances, which a spot run never uses — use "
        "the same spot_policy in both (`spot_policy: on-demand` here, or spot in the fleet)",
    ),
    (
        "task-gpu-vendor-vs-fleet",
        PLAIN,
        replace("fleets: [cloudrl-cluster, cloudrl-onprem]", "fleets: [cloudrl-amd]"),
        f"{PLAIN}: resources.gpu: asks for nvidia GPUs but fleet cloudrl-amd (fleets/amd-cluster.dstack.yml) has amd "
        "GPUs — use a fleet with the task's GPU vendor",
    ),
    (
        "task-without-fleets-fits-none",
        GROUPS,
        lambda text: replace("fleets: [cloudrl-cluster, cloudrl-onprem]\n", "")(
            replace("  - name: workers\n    nodes: 1\n", "  - name: workers\n    nodes: 2\n")(text)
        ),
        f"{GROUPS}: fleets: fits none of the bundle's fleets: groups asks for 3 nodes but fleet cloudrl-amd "
        "(fleets/amd-cluster.dstack.yml) has 2 nodes at most: the run gets no offer; groups asks for 3 nodes but "
        f"{WHERE} has 2 nodes at most: the run gets no offer; groups asks for 3 nodes but fleet cloudrl-onprem "
        "(fleets/on-prem.dstack.yml) has 2 hosts: the run gets no offer; groups asks for 3 nodes but fleet "
        "cloudrl-rollout-spot (fleets/rollout-spot.dstack.yml) has `placement: any`: dstack runs multi-node tasks "
        "only on fleets with cluster placement; groups asks for 3 nodes but fleet "
        "cloudrl-small (fleets/small.dstack.yml) has 2 nodes at most: the run gets no offer — make the task fit its "
        "fleet and name that fleet in `fleets:`",
    ),
    (
        "secret-written-inline",
        PLAIN,
        replace("  - WANDB_API_KEY\n", "  - WANDB_API_KEY=abc123secret\n"),
        f"{PLAIN}: env[0]: writes the value of the secret WANDB_API_KEY into the file: it is stored in plain text in the "
        "repository and with the run on the dstack server — pass it by name (`- WANDB_API_KEY`, read from your shell "
        "at `dstack apply`) or as a dstack secret (`- WANDB_API_KEY=${{ secrets.wandb_api_key }}`)",
    ),
    (
        "ray-token-not-passed",
        PLAIN,
        replace("  - RAY_AUTH_TOKEN\n", ""),
        f"{PLAIN}: env: does not pass RAY_AUTH_TOKEN: the bootstrap refuses to start Ray without token authentication "
        "— add `- RAY_AUTH_TOKEN` (or `- RAY_AUTH_TOKEN=${{ secrets.ray_auth_token }}`) to env; `- CLOUDRL_RAY_AUTH=off` "
        "runs without it on a trusted network",
    ),
    (
        "image-vllm-outside-line",
        PLAIN,
        replace("image: vllm/vllm-openai:v0.32.0", "image: vllm/vllm-openai:v0.11.0"),
        f"{PLAIN}: image: vllm/vllm-openai:v0.11.0 ships vLLM 0.11, but cloudrl's vLLM rollouts and weight sync need "
        "vLLM 0.32.x — use an image with vLLM 0.32 (e.g. vllm/vllm-openai:v0.32.0)",
    ),
    (
        "multinode-task-on-a-single-node-fleet",
        ROLLOUT,
        replace("nodes: 1\n", "nodes: 2\n"),
        f"{ROLLOUT}: nodes: asks for 2 nodes but fleet cloudrl-rollout-spot (fleets/rollout-spot.dstack.yml) has "
        "`placement: any`: dstack runs multi-node tasks only on fleets with cluster placement — set `placement: "
        "cluster` in the fleet, or run the task on one node",
    ),
    (
        "rollout-task-without-its-head",
        ROLLOUT,
        replace("  - CLOUDRL_JOIN_HEAD\n", ""),
        f"{ROLLOUT}: ports: does not forward the head's dashboard port 8265 (Jobs API, `cloudrl submit`), so `dstack "
        "apply` gives you no way to reach it — list `- 8265` under ports (the bootstrap's dashboard port is "
        "CLOUDRL_DASHBOARD_PORT, default 8265)",
    ),
]


def copy_bundle(root: Path) -> None:
    """fleets/, tasks/ and the files outside them that tasks ship (e.g. ../trainer/...)."""
    for folder in ("fleets", "tasks"):
        shutil.copytree(REPO_ROOT / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for task in (REPO_ROOT / "tasks").glob("*.yml"):
        for local in re.findall(r"^\s*-\s*(\.\./[^:\s]+):", task.read_text(), re.MULTILINE):
            target = (root / "tasks" / local).resolve()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy((REPO_ROOT / "tasks" / local).resolve(), target)


def broken_bundle(root: Path, rel: str, edit) -> tuple[str, str]:
    copy_bundle(root)
    before = (root / rel).read_bytes().decode()
    after = edit(before)
    assert after != before
    (root / rel).write_bytes(after.encode())
    return before, after


def only_errors(root: Path) -> list[str]:
    return [str(p) for p in validate_bundle(root) if not p.warning]


@pytest.mark.parametrize("rel, edit, line", [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_a_broken_copy_of_the_bundle_fails_with_its_line(tmp_path, rel, edit, line):
    before, after = broken_bundle(tmp_path, rel, edit)
    if "{line}" in line:  # the first line that differs
        line = line.replace(
            "{line}", str(next(n for n, (a, b) in enumerate(zip(after.splitlines(), before.splitlines()), 1) if a != b))
        )
    if "{elif}" in line:  # bash notices the missing `then` at the next `elif`
        line = line.replace("{elif}", str(boot_line(after, 'elif [[ "${CLOUDRL_RAY_AUTH:-on}"')))
    assert only_errors(tmp_path) == [line]
    result = runner.invoke(app, ["validate", str(tmp_path)])
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [line]
    assert "abc123secret" not in result.output  # a secret's value is never printed


@pytest.mark.parametrize(
    "rel, edit",
    [
        (PLAIN, replace("startup_order: master-first\n", "")),  # dstack's default `any` works: workers retry
        (PLAIN, replace("startup_order: master-first", "startup_order: any")),
        (PLAIN, replace("  - RAY_AUTH_TOKEN\n", "  - RAY_AUTH_TOKEN=${{ secrets.ray_auth_token }}\n")),
        (PLAIN, replace("  - RAY_AUTH_TOKEN\n", "  - CLOUDRL_RAY_AUTH=off\n")),
        (PLAIN, replace("gpu: nvidia:80GB..:8", "gpu: H100:8")),  # the name pins the vendor
        (PLAIN, replace("ports:\n  - 8265\n", "ports:\n  - 18265:8265\n")),  # another local port, same container port
        (PLAIN, replace("spot_policy: on-demand", "spot_policy: auto")),  # an auto task runs on on-demand instances too
    ],
    ids=[
        "no-startup-order",
        "startup-order-any",
        "token-as-dstack-secret",
        "auth-opted-out",
        "gpu-name-pins-vendor",
        "dashboard-forwarded-to-another-local-port",
        "spot-auto-task",
    ],
)
def test_what_dstack_accepts_and_works_is_not_flagged(tmp_path, rel, edit):
    broken_bundle(tmp_path, rel, edit)
    assert only_errors(tmp_path) == []


def test_dstack_compat_names_resolve():
    # Fails naming the module and name when a dstack release moves one of the private names validate uses.
    api = dstack_api()
    for attr, (module, name) in NAMES.items():
        assert getattr(api, attr) is not None, f"dstack._internal.{module}.{name}"
    assert api.is_valid_resource_name("cloudrl-ray") and not api.is_valid_resource_name("Cloudrl_Ray")


def test_no_other_module_imports_dstack_internals():
    offenders = [
        str(p.relative_to(REPO_ROOT))
        for p in (REPO_ROOT / "cli").glob("*.py")
        if "dstack._internal" in p.read_text() and p.name != "dstack_compat.py"
    ]
    assert offenders == []


def test_the_supported_vllm_line_is_pyprojects():
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert re.fullmatch(rf"vllm>={re.escape(SUPPORTED_VLLM)},<\d+\.\d+", extras["vllm"][0].replace(" ", ""))


def test_the_commented_network_volume_alternative_is_valid():
    # Uncommented, the `volumes:` block a user swaps in is YAML that dstack's parser accepts.
    text = (REPO_ROOT / PLAIN).read_text()
    block = re.search(r"^# volumes:\n(?:#   .*\n)+", text, re.MULTILINE).group(0)
    uncommented = "\n".join(line[2:] for line in block.splitlines())
    data = yaml.safe_load(text)
    data["volumes"] = yaml.safe_load(uncommented)["volumes"]
    parsed = dstack_api().parse_apply_configuration(data)
    assert parsed.volumes[0].name == "cloudrl-ckpt-${{ dstack.node_rank }}"


def test_the_on_prem_checklist_names_what_the_hosts_need_and_the_ports_the_bootstrap_uses():
    comments = (REPO_ROOT / "fleets" / "on-prem.dstack.yml").read_text()
    for needed in ("Docker Engine", "NVIDIA Container Toolkit", "AllowTcpForwarding yes", "6379 (Ray GCS)"):
        assert needed in comments, needed
    bootstrap = (REPO_ROOT / BOOT).read_text()
    ports = re.search(
        r"--object-manager-port=(\d+) --node-manager-port=(\d+) --min-worker-port=(\d+) "
        r"--max-worker-port=(\d+)",
        bootstrap,
    ).groups()
    assert f"{ports[0]} (object manager), {ports[1]} (node manager), {ports[2]}-{ports[3]}" in comments
