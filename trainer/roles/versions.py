"""One stack on every node: before any worker starts, each node the roles landed on reports its versions,
and a node that differs stops the job with one line naming it, what differs, and the fix.

    check_one_stack(node_ids, timeout_s=600)   # raises StackMismatch; placement.check_versions=false skips it

A report reads files only (package metadata, torch's version.py, the NVIDIA driver's /proc files): nothing is
imported, so it costs a node milliseconds. Python and the packages are compared with the driver's own (the
job's head); CUDA, NCCL, the NVIDIA driver and the GPU model among the nodes that have a GPU stack (the head
may have none).
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import platform
import re
from pathlib import Path

from ..errors import TrainerError

PACKAGES = ("torch", "transformers", "vllm", "sglang", "ray", "peft")
"""What the workers import that must match the driver's (by release, without a `+cu128`-style local part)."""
NODE_ONLY = ("cuda", "nccl", "nvidia driver", "gpu")
"""What only the GPU nodes need to agree on among themselves."""
MISSING = "not installed"


class StackMismatch(TrainerError, RuntimeError):
    """The nodes of one job run different versions of what the workers use."""


def _package(name: str) -> str:
    try:
        return importlib.metadata.version(name).split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return MISSING


def _torch_cuda() -> str:
    """torch's CUDA version, read from its version.py (importing torch would cost seconds)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return ""
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return ""
    found = re.search(r"^cuda\b[^=\n]*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return found.group(1) if found else ""


def _nccl() -> str:
    """The NCCL wheel torch's CUDA builds depend on (none on CPU builds)."""
    for name in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"):
        version = _package(name)
        if version != MISSING:
            return version
    return ""


def _nvidia_driver() -> str:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return ""
    found = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d[\w.]*)", text)
    return found.group(1) if found else ""


def _gpu_models() -> str:
    models = set()
    for info in glob.glob("/proc/driver/nvidia/gpus/*/information"):
        try:
            found = re.search(r"^Model:\s*(.+)$", Path(info).read_text(), re.M)
        except OSError:
            continue
        if found:
            models.add(found.group(1).strip())
    return ", ".join(sorted(models))


def node_versions() -> dict[str, str]:
    """This node's stack, as the job's workers see it: {"python": "3.11.7", "torch": "2.13.0", ...}; the
    GPU entries are "" on a node without them."""
    report = {"python": platform.python_version()}
    report.update({name: _package(name) for name in PACKAGES})
    report.update({"cuda": _torch_cuda(), "nccl": _nccl(), "nvidia driver": _nvidia_driver(), "gpu": _gpu_models()})
    return report


def differences(driver: dict[str, str], nodes: dict[str, dict[str, str]]) -> list[str]:
    """`node 10.0.0.3 (8974a1b2): torch 2.12.0 (the driver: 2.13.0)` for each node and entry that differs: Python and
    the packages from the driver's, the GPU stack from the first GPU node's; [] when they agree."""
    found = []
    gpu_reference: dict[str, tuple[str, str]] = {}
    for label, report in nodes.items():
        for key in NODE_ONLY:
            if report.get(key) and key not in gpu_reference:
                gpu_reference[key] = (label, report[key])
    for label, report in nodes.items():
        wrong = []
        for key in ("python", *PACKAGES):
            if key == "python" and report.get(key, "").split(".")[:2] == driver.get(key, "").split(".")[:2]:
                continue  # Ray itself refuses another Python; a patch release differs harmlessly
            if report.get(key) != driver.get(key):
                wrong.append(f"{key} {report.get(key) or MISSING} (the driver: {driver.get(key) or MISSING})")
        for key, (first, value) in gpu_reference.items():
            if report.get(key) and report[key] != value:
                wrong.append(f"{key} {report[key]} ({first}: {value})")
        if wrong:
            found.append(f"{label}: {', '.join(wrong)}")
    return found


def check_one_stack(node_ids: list[str], timeout_s: float) -> None:
    """Every node in `node_ids` reports its versions (a task without CPUs on each); StackMismatch naming each
    node that differs, and how, before any worker starts."""
    import ray

    from ..waiting import get_all
    from .staging import _on

    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    names = [f"node {ips.get(node, '?')} ({node[:8]})" for node in node_ids]
    reports = get_all([_on(node, node_versions).remote() for node in node_ids], names, timeout_s, "reading versions")
    found = differences(node_versions(), dict(zip(names, reports)))
    if found:
        raise StackMismatch(
            f"the nodes do not run one stack: {'; '.join(found)}; workers built against other versions fail in "
            f"ways that are hard to place (NCCL hangs, unpickling errors, kernels that differ): run one image on "
            f"every node (the dstack tasks' `image:`, one venv on a shared disk under Slurm), or set "
            f"placement.check_versions=false to run anyway"
        )
