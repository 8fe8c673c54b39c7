"""The roles on the cluster: one Ray placement group per role request, one ActorGroup per role.

The job calls `launch_roles(cfg, requests, model_path, critic_path, reward_model_path)` once, with the plan it made and
checked against the cluster (`placement.plan`, `cluster.preflight`). It creates each placement group with a timeout,
starts the hosts' workers (one whole GPU per data-parallel rank), then the colocated roles' workers on
their hosts' GPUs (`placement.guest_slots`), and finally lets the trained roles join their process
groups and shard. `Roles.shutdown()` kills every actor and removes every group it created.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

from ..config import TrainerConfig
from ..errors import PlacementTimeout
from ..hangs import WATCH
from ..waiting import get_all
from .cluster import alive_nodes
from .placement import RoleRequest, Slot, describe_cluster, engine_gpus, plan_slots, worker_count
from .workers import CriticWorker, PolicyWorker, ReferenceWorker, RewardWorker, RolloutWorker

# Settings the collective libraries read: passed from the job's environment to every worker, so
# `NCCL_SOCKET_IFNAME=eth0 cloudrl submit ...` reaches the processes that open the sockets.
NETWORK_ENV_PREFIXES = ("NCCL_", "GLOO_", "TP_SOCKET_IFNAME", "UCX_", "RCCL_", "HSA_", "HIP_VISIBLE")

WORKER_CLASSES = {
    "actor": PolicyWorker,
    "critic": CriticWorker,
    "reference": ReferenceWorker,
    "reward": RewardWorker,
    "rollout": RolloutWorker,
}


def network_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(NETWORK_ENV_PREFIXES)}


class ActorGroup:
    """One role's workers: rank r runs in `slots[r]` of placement group `pg`."""

    def __init__(
        self,
        name: str,
        worker_cls,
        pg,
        slots: list[Slot],
        args: tuple,
        kwargs: dict | None = None,
        timeout_s: float = TrainerConfig.worker_timeout_s,
    ):
        import ray

        self.name, self.timeout_s = name, timeout_s
        self._remote_cls = ray.remote(worker_cls)
        self._slots, self._args, self._kwargs = slots, args, kwargs or {}
        self._starts = [(pg, slot) for slot in slots]
        """Each rank's placement group and slot in it."""
        self.grown_pgs: list = []
        """The placement groups of the workers `grow` added (removed with the roles' own)."""
        self.workers = [self._start(rank) for rank in range(len(slots))]
        self.places: list[dict] = []

    def _start(self, rank: int):
        """A new worker for `rank`, in its slot of its placement group."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg, slot = self._starts[rank]
        env = network_env()
        if slot.visible_gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = slot.visible_gpus
        return self._remote_cls.options(
            num_cpus=slot.cpus,
            num_gpus=slot.gpus,
            resources=slot.resources,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=slot.bundle),
            runtime_env={"env_vars": env} if env else None,
            max_concurrency=1,
        ).remote(*self._args, rank=rank, world_size=len(self._starts), **self._kwargs)

    def respawn(self, rank: int):
        """Rank `rank` again, in a new worker in the same slot (Ray moves a lost node's share of the placement
        group to a node with room, and the worker starts once it has); the old worker is killed. For workers
        that hold no training state: the rollout engines (`EnginePool.replace_lost`, rollout/engine_pool.py)."""
        import ray

        self._reach_new_nodes()
        with contextlib.suppress(Exception):
            ray.kill(self.workers[rank])
        self.workers[rank] = self._start(rank)
        return self.workers[rank]

    def grow(self):
        """One more worker (the next rank), in a placement group of its own with one bundle the size of rank
        0's slot, created without waiting: Ray places it, and the worker starts, once a node has room (capacity
        that joins the cluster). For the rollout engines (`rollout.elastic`). Returns the new worker."""
        from ray.util import placement_group

        self._reach_new_nodes()
        first = self._slots[0]
        bundle = {"CPU": first.cpus, **({"GPU": first.gpus} if first.gpus else {}), **first.resources}
        pg = placement_group([bundle], strategy="STRICT_PACK", name=f"cloudrl-{self.name}-{len(self.workers)}")
        self.grown_pgs.append(pg)
        self._starts.append((pg, Slot(0, first.cpus, first.gpus, dict(first.resources))))
        self.workers.append(self._start(len(self.workers)))
        return self.workers[-1]

    def _reach_new_nodes(self) -> None:
        """The models in the workers' arguments, reachable from nodes the run did not start on (staging.py
        `for_new_nodes`): a worker started now may land on one."""
        from .staging import NodePaths, for_new_nodes

        self._args = tuple(for_new_nodes(a) if isinstance(a, NodePaths) else a for a in self._args)

    def placed(self, rank: int, place: dict) -> str:
        """A respawned worker's `where()`: recorded for messages and the hang watch; returns its label."""
        if self.places and rank == len(self.places):  # a worker `grow` added
            self.places.append(place)
        elif self.places:
            self.places[rank] = place
        label = self.labels()[rank]
        WATCH.register([label], [place])
        return label

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def labels(self) -> list[str]:
        """`actor rank 1 on 10.0.0.2` per worker, for messages."""
        ips = [p["ip"] for p in self.places] or [""] * self.world_size
        return [f"{self.name} rank {r}" + (f" on {ip}" if ip else "") for r, ip in enumerate(ips)]

    def where(self) -> list[dict]:
        """Node, process and GPU ids of every worker; waits (bounded) until all have started."""
        if not self.places:
            self.places = get_all(
                [w.where.remote() for w in self.workers],
                self.labels(),
                self.timeout_s,
                f"starting the {self.name} workers (loading the model included)",
            )
            WATCH.register(self.labels(), self.places)  # so a hang of these workers can be placed
        return self.places

    def start_training(self) -> None:
        """Every rank joins the role's process group (rank 0 opens its rendezvous on its node's IP and
        a port it holds), then shards its model and builds its optimizer: FSDP2 needs the group before
        sharding."""
        labels = self.labels()
        ((addr, port),) = get_all(
            [self.workers[0].open_rendezvous.remote()], labels[:1], self.timeout_s, f"starting the {self.name} workers"
        )
        get_all(
            [w.start_training.remote(addr, port) for w in self.workers],
            labels,
            self.timeout_s,
            f"{self.name}: joining the process group at {addr}:{port} and sharding",
        )

    def kill(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)


@dataclass
class Roles:
    actor: ActorGroup
    rollout: ActorGroup
    reward: ActorGroup | None
    critic: ActorGroup | None = None
    reference: ActorGroup | None = None
    placement_groups: list = field(default_factory=list)
    engine_gpus: float = 0.0
    """The GPUs the rollout engines hold in the placement Ray reserved (placement.engine_gpus)."""

    @property
    def rollout_in_actor(self) -> bool:
        return self.rollout is self.actor

    def groups(self) -> list[ActorGroup]:
        """Every distinct group (with the rollout inside the actor, the actor group once)."""
        rollout = None if self.rollout_in_actor else self.rollout
        return [g for g in (self.actor, self.critic, self.reference, self.reward, rollout) if g is not None]

    def shutdown(self) -> None:
        from ray.util import remove_placement_group

        for g in self.groups():
            g.kill()
        for pg in self.placement_groups + [pg for g in self.groups() for pg in g.grown_pgs]:
            remove_placement_group(pg)


PLACEMENT_DEADLINE: float | None = None
"""A time.monotonic() no placement wait goes past (at least 1 s each): while recovery.py restarts the
roles, the end of trainer.restart_wait_s."""
AVOIDED_NODES: frozenset[str] = frozenset()
"""Ray node ids no placement group may use: while recovery.py restarts the roles with
trainer.exclude_stragglers, the straggler nodes it leaves out."""


def create_placement_group(request: RoleRequest, timeout_s: float):
    """A placement group that is ready, or PlacementTimeout naming the keys (and nothing left behind)."""
    import time

    import ray
    from ray.util import placement_group, remove_placement_group

    if PLACEMENT_DEADLINE is not None:
        timeout_s = min(timeout_s, max(1.0, PLACEMENT_DEADLINE - time.monotonic()))
    options = {}
    if AVOIDED_NODES:  # Ray's own label on every node, its id: the group is placed on the others only
        avoided = {"ray.io/node-id": f"!in({','.join(sorted(AVOIDED_NODES))})"}
        options["bundle_label_selector"] = [avoided] * len(request.bundles)
    pg = placement_group(request.bundles, strategy=request.strategy, name=f"cloudrl-{request.role}", **options)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise PlacementTimeout(
            f"{request.role} workers were not placed within placement.timeout_s={timeout_s:g}s "
            f"({request.keys}; bundles {request.bundles}, strategy {request.strategy}); the cluster has "
            f"{describe_cluster(alive_nodes())} and other jobs may hold part of it: free resources, "
            f"lower those keys or raise placement.timeout_s"
        )
    return pg


def placement_nodes(pgs) -> list[str]:
    """The ids of the nodes the placement groups' bundles were placed on."""
    from ray.util import placement_group_table

    return sorted({node for pg in pgs for node in placement_group_table(pg)["bundles_to_node_id"].values()})


def launch_roles(
    cfg,
    requests: list[RoleRequest],
    model_path: str,
    critic_path: str,
    reward_model_path: str = "",
    classes: dict | None = None,
) -> Roles:
    """Create the placement groups of `requests` (`placement.plan`, checked against the cluster by
    `cluster.preflight`) and start every role's workers on the models at those paths (resolved by
    inputs/prepare.py; "": no reward model).

    `classes` maps role names to worker classes (tests pass light probes to check placement alone)."""
    from .staging import stage_models
    from .versions import check_one_stack

    classes = {**WORKER_CLASSES, **(classes or {})}
    cfg_dict = cfg.to_dict()
    timeout = cfg.trainer.worker_timeout_s
    pgs: dict[str, object] = {}
    groups: dict[str, ActorGroup] = {}
    args: dict[str, tuple] = {}
    kwargs: dict[str, dict] = {}

    def start(role: str, pg, slots: list[Slot]) -> ActorGroup:
        assert len(slots) == worker_count(cfg, role), role
        groups[role] = ActorGroup(role, classes[role], pg, slots, args[role], kwargs.get(role), timeout)
        return groups[role]

    try:
        for req in requests:
            pgs[req.role] = create_placement_group(req, cfg.placement.timeout_s)
        nodes = placement_nodes(pgs.values())
        if cfg.placement.check_versions:  # one stack on every node, or one line before any worker starts
            check_one_stack(nodes, timeout)
        # Every node the groups landed on gets the models before any worker loads them.
        paths = [model_path, critic_path] + ([reward_model_path] if reward_model_path else [])
        staged = stage_models(paths, nodes, timeout)
        model, critic = staged[model_path], staged[critic_path]
        args = {
            "actor": (cfg_dict, model),
            "critic": (cfg_dict, critic),
            "reference": (cfg_dict, model),
            "reward": (cfg_dict, model),
            "rollout": (cfg_dict, model),
        }
        kwargs = {"actor": {"with_reference": "reference" in requests[0].in_process}}  # plan(): actor first
        if reward_model_path:
            kwargs["reward"] = {"reward_model_path": staged[reward_model_path]}
        for req in requests:  # hosts first: the guests run on the GPUs Ray gave them
            start(req.role, pgs[req.role], plan_slots(cfg, req)[req.role])
        for req in requests:
            if req.guests:
                host_gpus = [w["gpus"] for w in groups[req.role].where()]
                slots = plan_slots(cfg, req, host_gpus)
                for role in req.guests:
                    start(role, pgs[req.role], slots[role])
        for group in groups.values():
            group.where()  # every worker constructed (models loaded), within trainer.worker_timeout_s
        for role in ("actor", "critic"):
            if role in groups:
                groups[role].start_training()
        return Roles(
            actor=groups["actor"],
            rollout=groups.get("rollout", groups["actor"]),
            reward=groups.get("reward"),
            critic=groups.get("critic"),
            reference=groups.get("reference"),
            placement_groups=list(pgs.values()),
            engine_gpus=engine_gpus(requests),
        )
    except BaseException:
        from ray.util import remove_placement_group

        for g in groups.values():
            g.kill()
        for pg in pgs.values():
            remove_placement_group(pg)
        raise
