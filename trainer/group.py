"""Ray placement: one placement group per role request, one ActorGroup per role.

The driver calls `launch_roles(cfg, model_path)` once. It checks the cluster against the config
(`placement.check_fits`) before creating anything, creates each placement group with a timeout, and
starts the workers; data-parallel roles get a torch.distributed group whose rank 0 reports its node
address and a free port. `Roles.shutdown()` kills every actor and removes every group it created.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .cluster import alive_nodes, preflight
from .errors import PlacementTimeout
from .placement import RoleRequest, describe_cluster
from .workers import CriticWorker, PolicyWorker, ReferenceWorker, RewardWorker, RolloutWorker

# Settings the collective libraries read: passed from the job's environment to every worker, so
# `NCCL_SOCKET_IFNAME=eth0 cloudrl submit ...` reaches the processes that open the sockets.
NETWORK_ENV_PREFIXES = ("NCCL_", "GLOO_", "TP_SOCKET_IFNAME", "UCX_", "RCCL_", "HSA_", "HIP_VISIBLE")


def network_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(NETWORK_ENV_PREFIXES)}


class ActorGroup:
    """`len(bundle_of_rank)` workers of one class, rank r placed in bundle `bundle_of_rank[r]`."""

    def __init__(self, worker_cls, pg, bundle_of_rank: list[int], per_worker: dict[str, float],
                 args: tuple, kwargs: dict | None = None, name: str = ""):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name = name or worker_cls.__name__
        remote_cls = ray.remote(worker_cls)
        resources = {k: v for k, v in per_worker.items() if k not in ("CPU", "GPU")}
        env = network_env()
        self.workers = [
            remote_cls.options(
                num_cpus=per_worker.get("CPU", 0), num_gpus=per_worker.get("GPU", 0), resources=resources,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
                runtime_env={"env_vars": env} if env else None, max_concurrency=1,
            ).remote(*args, rank=rank, world_size=len(bundle_of_rank), **(kwargs or {}))
            for rank, b in enumerate(bundle_of_rank)
        ]

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def init_distributed(self) -> None:
        import ray

        if self.world_size > 1:
            addr, port = ray.get(self.workers[0].master_address.remote())
            ray.get([w.init_process_group.remote(addr, port) for w in self.workers])

    def where(self) -> list[dict]:
        import ray

        return ray.get([w.where.remote() for w in self.workers])

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
        for pg in self.placement_groups:
            remove_placement_group(pg)


def create_placement_group(request: RoleRequest, timeout_s: float):
    """A placement group that is ready, or PlacementTimeout naming the keys (and nothing left behind)."""
    import ray
    from ray.util import placement_group, remove_placement_group

    pg = placement_group(request.bundles, strategy=request.strategy, name=f"cloudrl-{request.role}")
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


def _slots(request: RoleRequest, count: int, share: float) -> tuple[list[int], dict[str, float]]:
    """Bundle index per worker (round robin) and each worker's share of its bundle."""
    per_bundle = -(-count // len(request.bundles))
    bundle_of_rank = [r // per_bundle for r in range(count)]
    per_worker = {k: v / per_bundle * share for k, v in request.bundles[0].items()}
    return bundle_of_rank, per_worker


def launch_roles(cfg, model_path: str, critic_path: str) -> Roles:
    """Check the cluster, create the placement groups and start every role's workers."""
    requests = preflight(cfg)
    cfg_dict = cfg.to_dict()
    by_role = {r.role: r for r in requests}
    host_of = {shared: r for r in requests for shared in r.shares}
    pgs: dict[str, object] = {}
    started: list[ActorGroup] = []
    try:
        for req in requests:
            pgs[req.role] = create_placement_group(req, cfg.placement.timeout_s)

        def start(role: str, worker_cls, count: int, args: tuple, kwargs: dict | None = None) -> ActorGroup:
            req = by_role.get(role) or host_of[role]
            share = 1.0 / (1 + len(req.shares)) if req.shares else 1.0
            bundles, per_worker = _slots(req, count, share)
            group = ActorGroup(worker_cls, pgs[req.role], bundles, per_worker, args, kwargs, name=role)
            started.append(group)
            return group

        colocated_ref = cfg.uses_reference and "reference" in by_role["actor"].shares and not cfg.placement.colocate_all
        actor = start("actor", PolicyWorker, cfg.actor.world_size, (cfg_dict, model_path),
                      {"with_reference": cfg.uses_reference and (colocated_ref or cfg.placement.colocate_all)})
        critic = (start("critic", CriticWorker, cfg.critic.world_size, (cfg_dict, critic_path))
                  if cfg.uses_critic else None)
        reference = None
        if cfg.uses_reference and "reference" in by_role:
            reference = start("reference", ReferenceWorker, cfg.reference.world_size, (cfg_dict, model_path))
        reward = (start("reward", RewardWorker, cfg.reward.world_size, (cfg_dict, model_path))
                  if cfg.uses_reward_workers else None)
        rollout = (actor if cfg.placement.rollout_in_actor
                   else start("rollout", RolloutWorker, cfg.rollout.num_engines, (cfg_dict, model_path)))
        roles = Roles(actor=actor, rollout=rollout, reward=reward, critic=critic, reference=reference,
                      placement_groups=list(pgs.values()))
        for group in (actor, critic):
            if group is not None:
                group.init_distributed()
        return roles
    except BaseException:
        from ray.util import remove_placement_group

        for g in started:
            g.kill()
        for pg in pgs.values():
            remove_placement_group(pg)
        raise

