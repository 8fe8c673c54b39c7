"""Place every role of a config on a running Ray cluster with light probe workers instead of the real
ones, and print where each worker landed (JSON). Runs the trainer's own launch code
(`launch_roles` in trainer/roles/launch.py): placement groups, slots, GPU ids of colocated workers.

    RAY_ADDRESS=127.0.0.1:6379 python tests/helpers/placement_probe.py '[["--preset", "gsm8k-7b", "key=value"]]'
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path


class Probe:
    """Stands in for any role's worker: reports its node and the GPUs it may use, nothing else."""

    def __init__(self, *args, rank: int = 0, world_size: int = 1, **kwargs):
        from cloudrl.trainer.roles.staging import NodePaths, on_this_node

        # A staged model path is reported as the directory it names on this worker's node.
        self.rank = rank
        self.kwargs = {k: on_this_node(v) if isinstance(v, NodePaths) else v for k, v in kwargs.items()}

    def where(self) -> dict:
        import ray

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = [g for g in visible.split(",") if g] if visible is not None else None
        return {
            "rank": self.rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "gpus": gpus,
            "ip": ray.util.get_node_ip_address(),
            "ray_gpus": [str(g) for g in ray.get_gpu_ids()],
            "kwargs": self.kwargs,
        }

    def open_rendezvous(self) -> tuple[str, int]:
        return "127.0.0.1", 0

    def start_training(self, addr: str, port: int) -> None:
        pass


def main() -> None:
    import ray
    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.roles.launch import WORKER_CLASSES, launch_roles
    from cloudrl.trainer.roles.placement import plan

    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR")
    # Probes load nothing, but the models are still staged on every node first: a stand-in directory.
    model = tempfile.mkdtemp(prefix="probe-model-")
    Path(model, "config.json").write_text("{}")
    layouts = []
    for argv in json.loads(sys.argv[1]):
        preset, overrides = argv[1], argv[2:]
        cfg = load_config(preset, overrides)
        cfg.reward.model_path = model if cfg.reward.model_path else ""
        roles = launch_roles(cfg, plan(cfg), model, model, classes={role: Probe for role in WORKER_CLASSES})
        try:
            layouts.append({g.name: g.where() for g in roles.groups()})
        finally:
            roles.shutdown()
    print("LAYOUTS " + json.dumps(layouts))


if __name__ == "__main__":
    main()
