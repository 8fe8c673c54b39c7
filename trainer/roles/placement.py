"""What each role asks of the cluster, and whether a cluster can hold it. No Ray here.

A role's workers are placed through one Ray placement group. Each bundle of that group is one node's
share of the role (a bundle never spans nodes), so the bundle shapes carry the per-node requirement:
`actor.nodes=2 actor.gpus_per_node=8` is two bundles of 8 GPUs on two different nodes, and a vLLM engine
with `rollout.tensor_parallel_size=4` is one bundle of 4 GPUs. Every data-parallel rank asks Ray for one
whole GPU of its bundle, so no two ranks of a process group share a device.

An engine wider than a node (`rollout.nodes_per_engine` > 1) is the exception: its tensor x pipeline
parallel GPUs are one-GPU bundles (`bundles_per_worker` of them per engine, consecutive in the group),
packed node by node, because vLLM's Ray executor starts one worker per one-GPU bundle. The engine's own
actor sits in its first bundle and asks for no GPU (`Slot.gpus` 0, CUDA_VISIBLE_DEVICES left to Ray).

Colocated roles ("guests") run in their own processes inside the bundles of the role they sit with
(their "host") and ask Ray for no GPU: each guest worker is given the GPUs of a block of host ranks
(`guest_slots`), so an engine under `placement.colocate_all` sees exactly the GPUs its actor ranks train
on. The reference model under `placement.colocate_actor_ref` lives in the actor's own processes. `check_fits` compares all bundles with the cluster's nodes before any actor starts,
so a cluster that is too small gives a sentence naming the config keys instead of a pending group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import Config, ConfigError

GPU_ENGINES = ("vllm", "sglang")
"""Engines that run on GPUs of their own, sized by tensor and pipeline parallelism."""


class ClusterTooSmall(ConfigError):
    """The cluster cannot hold what the config asks for."""


@dataclass
class RoleRequest:
    role: str
    bundles: list[dict[str, float]]
    """One dict of Ray resources per bundle; each bundle must fit on one node."""
    strategy: str
    """Ray placement strategy: STRICT_PACK, PACK, SPREAD or STRICT_SPREAD."""
    workers_per_bundle: int
    keys: str
    """The config keys behind this request, for messages."""
    resource_keys: dict[str, str] = field(default_factory=dict)
    """The config keys behind the amount of one resource, where they differ from `keys` (the CPUs of a
    GPU worker come from its cpus_per_worker, not its GPU count)."""
    guests: list[str] = field(default_factory=list)
    """Colocated roles whose workers (own processes) run inside these bundles, on these GPUs."""
    in_process: list[str] = field(default_factory=list)
    """Roles served by these workers' own processes: the reference model (`colocate_actor_ref`), the
    rollout (`rollout_in_actor`)."""
    bundles_per_worker: int = 1
    """Bundles one worker's processes use (an engine spanning nodes: one per GPU); 1 everywhere else."""

    @property
    def num_workers(self) -> int:
        return len(self.bundles) * self.workers_per_bundle // self.bundles_per_worker

    @property
    def has_gpus(self) -> bool:
        return any(b.get("GPU", 0) for b in self.bundles)

    def bundle_of(self, rank: int) -> int:
        """The bundle worker `rank` runs in (the first of its bundles when it uses several)."""
        return rank // self.workers_per_bundle * self.bundles_per_worker

    def bundles_of(self, rank: int) -> list[int]:
        """Every bundle worker `rank`'s processes use: its own, and its engine's other GPUs."""
        first = self.bundle_of(rank)
        return list(range(first, first + self.bundles_per_worker))

    def total(self, resource: str) -> float:
        return sum(b.get(resource, 0.0) for b in self.bundles)

    def keys_for(self, resource: str) -> str:
        return self.resource_keys.get(resource, self.keys)


def reference_in_actor(cfg: Config) -> bool:
    """The frozen reference model lives in the actor's processes: no workers or GPUs of its own."""
    p = cfg.placement
    return cfg.uses_reference and (p.colocate_all or p.colocate_actor_ref)


def worker_count(cfg: Config, role: str) -> int:
    return cfg.rollout.num_engines if role == "rollout" else getattr(cfg, role).world_size


def guest_uses_gpu(cfg: Config, role: str, host: RoleRequest) -> bool:
    """A colocated role computes on its host's GPUs, except reward workers without a reward model."""
    return host.has_gpus and (role != "reward" or bool(cfg.reward.model_path))


def guest_slots(cfg: Config, host: RoleRequest, role: str) -> list[list[int]]:
    """For each worker of a colocated role, the host ranks whose GPUs (and bundle) it shares.

    A worker on GPUs takes a contiguous block of host ranks inside one bundle (a vLLM engine with
    tensor_parallel_size=2 takes two actor ranks' GPUs on one node); CPU-only workers go round robin.
    """
    count, world = worker_count(cfg, role), host.num_workers
    if not guest_uses_gpu(cfg, role, host):
        return [[i % world] for i in range(count)]
    block = world // count if count <= world and world % count == 0 else 0
    if not block or host.workers_per_bundle % block:
        keys = "rollout.num_engines" if role == "rollout" else f"{role}.nodes x {role}.gpus_per_node"
        raise ConfigError(
            f"{role} shares the {host.role}'s {world} GPUs ({host.keys}) but its {count} workers ({keys}) "
            f"cannot each take a whole block of them on one node: use a worker count that divides {world} "
            f"into blocks within a node's {host.workers_per_bundle} GPUs"
        )
    r = cfg.rollout
    if role == "rollout" and r.engine in GPU_ENGINES and block != r.ranks_per_engine:
        raise ConfigError(
            f"colocated {r.engine} engines tile the {host.role}'s {world} GPUs: set rollout.num_engines x "
            f"rollout.tensor_parallel_size x rollout.pipeline_parallel_size = {world} "
            f"(now {count} x {r.tensor_parallel_size} x {r.pipeline_parallel_size})"
        )
    return [list(range(i * block, (i + 1) * block)) for i in range(count)]


def _role_request(cfg: Config, role: str) -> RoleRequest:
    rc = getattr(cfg, role)
    per_node = rc.gpus_per_node if rc.gpus_per_node > 0 else rc.workers_per_node
    bundle = {"CPU": rc.cpus_per_worker * per_node}
    if rc.gpus_per_node > 0:
        bundle["GPU"] = float(rc.gpus_per_node)
    for name, amount in rc.resources.items():
        bundle[name] = amount * per_node
    bundle = {k: v for k, v in bundle.items() if v > 0}
    if rc.nodes == 1:
        strategy = "STRICT_PACK"
    else:  # one bundle per node, and the nodes must differ
        strategy = "STRICT_SPREAD"
    nodes = f"{role}.nodes={rc.nodes}"
    if rc.gpus_per_node:
        unit = f"{role}.gpus_per_node={rc.gpus_per_node}"
        cpus = f"{nodes} x {unit} x {role}.cpus_per_worker={rc.cpus_per_worker}"
    else:
        unit = f"{role}.workers_per_node={rc.workers_per_node} x {role}.cpus_per_worker={rc.cpus_per_worker}"
        cpus = f"{nodes} x {unit}"
    per_resource = {"CPU": cpus}
    per_resource.update({name: f"{nodes} x {role}.resources.{name}={rc.resources[name]:g}" for name in rc.resources})
    return RoleRequest(
        role,
        [dict(bundle) for _ in range(rc.nodes)],
        strategy,
        per_node,
        keys=f"{nodes} x {unit}",
        resource_keys=per_resource,
    )


def spans_nodes(cfg: Config) -> bool:
    """Each engine's GPUs are spread over several nodes (rollout.nodes_per_engine > 1)."""
    return cfg.rollout.engine in GPU_ENGINES and cfg.rollout.nodes_per_engine > 1


def _rollout_request(cfg: Config) -> RoleRequest:
    r = cfg.rollout
    engines = f"rollout.num_engines={r.num_engines}"
    if spans_nodes(cfg):
        return _spanning_rollout_request(cfg)
    if r.engine in GPU_ENGINES:
        # On a GPU run an engine always owns its GPUs: the GPU builds cannot run on a CPU-only slot.
        on_gpus = r.gpus_per_engine > 0 or r.ranks_per_engine > 1 or cfg.actor.gpus_per_node > 0
        gpus = float(r.ranks_per_engine) if on_gpus else 0.0
        cpus = r.cpus_per_engine * r.ranks_per_engine
        keys = f"{engines} x rollout.tensor_parallel_size={r.tensor_parallel_size}"
        if r.pipeline_parallel_size > 1:
            keys += f" x rollout.pipeline_parallel_size={r.pipeline_parallel_size}"
        cpu_keys = f"{keys} x rollout.cpus_per_engine={r.cpus_per_engine:g}"
    else:
        gpus, cpus = r.gpus_per_engine, r.cpus_per_engine
        keys = f"{engines} x rollout.gpus_per_engine={r.gpus_per_engine:g}"
        cpu_keys = f"{engines} x rollout.cpus_per_engine={r.cpus_per_engine:g}"
    bundle = {"CPU": cpus}
    if gpus:
        bundle["GPU"] = gpus
    bundle.update(r.resources)
    bundle = {k: v for k, v in bundle.items() if v > 0}
    per_resource = {"CPU": cpu_keys}
    per_resource.update({name: f"{engines} x rollout.resources.{name}={r.resources[name]:g}" for name in r.resources})
    return RoleRequest(
        "rollout", [dict(bundle) for _ in range(r.num_engines)], "PACK", 1, keys=keys, resource_keys=per_resource
    )


def _spanning_rollout_request(cfg: Config) -> RoleRequest:
    """Engines wider than a node: one one-GPU bundle per engine GPU, engine after engine, packed so that
    a node's bundles fill before the next node's (Ray's PACK). One placement group holds them all; each
    engine's vLLM takes its own consecutive bundles (`vllm_engine.engine_args`: VLLM_RAY_BUNDLE_INDICES)."""
    r = cfg.rollout
    per_engine = r.ranks_per_engine
    bundle = {"GPU": 1.0, "CPU": float(r.cpus_per_engine)}
    bundle.update(r.resources)
    bundle = {k: v for k, v in bundle.items() if v > 0}
    keys = (
        f"rollout.num_engines={r.num_engines} x rollout.tensor_parallel_size={r.tensor_parallel_size} x "
        f"rollout.pipeline_parallel_size={r.pipeline_parallel_size} over rollout.nodes_per_engine="
        f"{r.nodes_per_engine} nodes"
    )
    per_resource = {"CPU": f"{keys} x rollout.cpus_per_engine={r.cpus_per_engine:g}"}
    per_resource.update({name: f"{keys} x rollout.resources.{name}={r.resources[name]:g}" for name in r.resources})
    return RoleRequest(
        "rollout",
        [dict(bundle) for _ in range(r.num_engines * per_engine)],
        "PACK",
        1,
        keys=keys,
        resource_keys=per_resource,
        bundles_per_worker=per_engine,
    )


def plan(cfg: Config) -> list[RoleRequest]:
    """The placement groups the trainer will create, in creation order."""
    p = cfg.placement
    actor = _role_request(cfg, "actor")
    actor.in_process += ["reference"] if reference_in_actor(cfg) else []
    actor.in_process += ["rollout"] if p.rollout_in_actor else []
    requests = [actor]
    if p.colocate_all:
        # Hybrid engine: everything shares the actor's bundles; engines sleep while the actor trains.
        actor.guests += ["critic"] if cfg.uses_critic else []
        actor.guests += ["reward"] if cfg.uses_reward_workers else []
        actor.guests += [] if p.rollout_in_actor else ["rollout"]
    else:
        if cfg.uses_reference and not reference_in_actor(cfg):
            requests.append(_role_request(cfg, "reference"))
        if cfg.uses_critic:
            critic = _role_request(cfg, "critic")
            requests.append(critic)
            if p.colocate_critic_reward and cfg.uses_reward_workers:
                critic.guests.append("reward")
        if cfg.uses_reward_workers and not (cfg.uses_critic and p.colocate_critic_reward):
            requests.append(_role_request(cfg, "reward"))
        if not p.rollout_in_actor:  # otherwise the actor's workers generate: no engines of their own
            requests.append(_rollout_request(cfg))
    for host in requests:
        for role in host.guests:
            guest_slots(cfg, host, role)  # raises when the guests cannot tile the host's GPUs
    return requests


def engine_gpus(requests: list[RoleRequest]) -> float:
    """The GPUs the rollout engines hold in a plan (`plan(cfg)`, what Ray reserves): their own bundles', or
    under `placement.colocate_all` the actor's, which they share; 0 when they run on CPU or in the actor."""
    for request in requests:
        if request.role == "rollout" or "rollout" in request.guests:
            return sum(bundle.get("GPU", 0.0) for bundle in request.bundles)
    return 0.0


def _describe_node(node: dict[str, float]) -> str:
    parts = [f"{node.get('GPU', 0):g} GPUs" if node.get("GPU") else "no GPU", f"{node.get('CPU', 0):g} CPUs"]
    parts += [
        f"{v:g} {k}"
        for k, v in node.items()
        if k not in ("CPU", "GPU", "memory", "object_store_memory")
        and not k.startswith("node:")
        and not k.startswith("accelerator_type")
    ]
    return ", ".join(parts)


def describe_cluster(nodes: list[dict[str, float]]) -> str:
    if not nodes:
        return "no alive nodes"
    shapes: dict[str, int] = {}
    for n in nodes:
        shapes[_describe_node(n)] = shapes.get(_describe_node(n), 0) + 1
    return "; ".join(f"{count} node{'s' if count > 1 else ''} with {shape}" for shape, count in shapes.items())


def check_fits(requests: list[RoleRequest], nodes: list[dict[str, float]], local: bool = False) -> None:
    """Raise ClusterTooSmall unless every request's bundles (`plan`) can be placed on `nodes` at once,
    naming every shortfall in one message: each resource whose total is short, else each role whose
    bundles find no node. `local`: the cluster is `cloudrl local up`'s, whose own fixes are named.

    `nodes` holds each alive node's total resources (Ray's resource names: CPU, GPU, custom ones).
    """
    have = describe_cluster(nodes)
    # Totals first: the clearest message when a whole resource is missing; GPUs lead.
    short = []
    for resource in sorted({k for req in requests for b in req.bundles for k in b}, key=lambda r: (r != "GPU", r)):
        asked = sum(req.total(resource) for req in requests)
        total = sum(n.get(resource, 0.0) for n in nodes)
        if asked > total + 1e-9:
            who = " + ".join(
                f"{req.total(resource):g} for {req.role} ({req.keys_for(resource)})"
                for req in requests
                if req.total(resource)
            )
            short.append((resource, f"{asked:g} {resource} ({who}) but the cluster has {total:g}"))
    if short:
        fixes = _fixes(requests, nodes, [r for r, _ in short], local, "lower those keys or add nodes")
        raise ClusterTooSmall(f"the config asks for {'; and '.join(text for _, text in short)} ({have}): {fixes}")
    # Then shapes: every bundle on one node, strict-spread bundles on distinct nodes.
    misfits = []
    free = [dict(n) for n in nodes]
    for req in sorted(requests, key=lambda r: -max(b.get("GPU", 0) for b in r.bundles)):
        used_nodes: set[int] = set()
        placed: list[tuple[int, dict[str, float]]] = []
        for bundle in req.bundles:
            candidates = [
                i
                for i, n in enumerate(free)
                if all(n.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())
                and not (req.strategy == "STRICT_SPREAD" and i in used_nodes)
            ]
            if not candidates:
                need = ", ".join(f"{v:g} {k}" for k, v in bundle.items())
                spread = f" on {len(req.bundles)} different nodes" if req.strategy == "STRICT_SPREAD" else ""
                ever = any(all(n.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items()) for n in nodes)
                where = "free after the other roles" if ever else "at all"
                text = f"{req.role} needs {need} on one node{spread} ({req.keys}), but no node has that much {where}"
                # The resources no node has enough of (none: the bundles need more distinct nodes).
                lacking = [k for k, v in bundle.items() if not any(n.get(k, 0.0) + 1e-9 >= v for n in free)]
                if req.role == "rollout" and "GPU" in lacking and not ever:
                    text += " (an engine wider than a node: set rollout.nodes_per_engine to the nodes it spans)"
                misfits.append((text, lacking))
                for i, taken in placed:  # the role is left out: the others are placed without it
                    for k, v in taken.items():
                        free[i][k] += v
                break
            best = min(candidates, key=lambda i: sum(free[i].values()))  # best fit keeps big nodes free
            for k, v in bundle.items():
                free[best][k] = free[best].get(k, 0.0) - v
            used_nodes.add(best)
            placed.append((best, bundle))
    if misfits:
        lacking = sorted({k for _, resources in misfits for k in resources})
        fixes = _fixes(requests, nodes, lacking, local, "lower those keys, or use nodes with more")
        raise ClusterTooSmall(f"{'; '.join(text for text, _ in misfits)} ({have}): {fixes}")


def _fixes(
    requests: list[RoleRequest], nodes: list[dict[str, float]], short: list[str], local: bool, generic: str
) -> str:
    """What to do about a shortfall of the resources `short`: `generic` (the config keys, bigger nodes),
    and on the local cluster its own switches (its CPUs and GPUs are logical: any count starts anywhere)."""
    if not local:
        return generic
    size = _local_size(requests, nodes, short)
    if size is None:
        return generic
    count, per_node = size
    up = " ".join([f"cloudrl local up --nodes {count}", *(f"--{r.lower()}s {n}" for r, n in sorted(per_node.items()))])
    restart = f"restart the local cluster bigger (`cloudrl local down && {up}`"
    # Its CPUs and GPUs are logical: Ray only counts them; without real GPUs the workers compute on CPU.
    fixes = [
        restart
        + ("; its GPUs are logical: without real ones the workers compute on CPU)" if "GPU" in per_node else ")")
    ]
    if "CPU" in short and any(req.role == "reward" or "reward" in req.guests for req in requests):
        fixes.append("score rule-based rewards in the driver (reward.in_driver=true: no reward workers)")
    return "; or ".join([generic, *fixes])


def _local_size(
    requests: list[RoleRequest], nodes: list[dict[str, float]], short: list[str]
) -> tuple[int, dict[str, int]] | None:
    """The smallest `cloudrl local up` that holds `requests`: (nodes, {CPU/GPU: per node}) for the
    resources in `short`, or None when more CPUs or GPUs would not do (a custom resource is short)."""
    if any(r not in ("CPU", "GPU") for r in short):
        return None
    spread = max((len(req.bundles) for req in requests if req.strategy == "STRICT_SPREAD"), default=1)
    count = max(len(nodes), spread)
    base = [dict(nodes[i]) if i < len(nodes) else dict(nodes[0] if nodes else {}) for i in range(count)]
    per_node = {}
    for resource in short:
        others = {r: 10**6 for r in short if r != resource}
        least = max(1, math.ceil(sum(req.total(resource) for req in requests) / count))
        for amount in range(least, least + 4096):
            trial = [{**node, **others, resource: float(amount)} for node in base]
            try:
                check_fits(requests, trial)
            except ClusterTooSmall:
                continue
            per_node[resource] = amount
            break
        else:
            return None
    return count, per_node


@dataclass
class Slot:
    """Where one worker runs and what it asks of its bundle."""

    bundle: int
    cpus: float
    gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    visible_gpus: str | None = None
    """CUDA_VISIBLE_DEVICES for a colocated worker ("" = none); None lets Ray set it."""


def _cpu_share(cpus: float, processes: int) -> float:
    """An equal part of a bundle's CPUs; Ray takes fractions only below 1, so larger parts are whole."""
    part = cpus / max(processes, 1)
    return float(int(part)) if part >= 1 else int(part * 1e4) / 1e4


def plan_slots(cfg, request: RoleRequest, host_gpus: list[list[str]] | None = None) -> dict[str, list[Slot]]:
    """The slot of every worker in `request`'s bundles: its own role's workers (each asking its bundle's
    GPUs divided by the workers in it: one GPU per data-parallel rank, tp GPUs per vLLM engine), and its
    guests' workers, which ask for no GPU and see their block of host ranks' GPUs (`host_gpus[r]` is
    host rank r's CUDA_VISIBLE_DEVICES ids). CPUs are split evenly between all processes of a bundle."""
    per_bundle = request.workers_per_bundle
    guest_blocks = {role: guest_slots(cfg, request, role) for role in request.guests}
    processes = [per_bundle] * len(request.bundles)
    for blocks in guest_blocks.values():
        for block in blocks:
            processes[request.bundle_of(block[0])] += 1
    slots: dict[str, list[Slot]] = {request.role: []}
    for rank in range(request.num_workers):
        b = request.bundle_of(rank)
        bundle = request.bundles[b]
        if request.bundles_per_worker > 1:
            # An engine spanning nodes: its GPUs are its vLLM workers', in its bundles; Ray's default
            # CUDA_VISIBLE_DEVICES stands, the engine decides GPU or not from the config.
            slots[request.role].append(Slot(bundle=b, cpus=_cpu_share(bundle.get("CPU", 0.0), processes[b])))
            continue
        slots[request.role].append(
            Slot(
                bundle=b,
                cpus=_cpu_share(bundle.get("CPU", 0.0), processes[b]),
                gpus=bundle.get("GPU", 0.0) / per_bundle,
                resources={k: v / per_bundle for k, v in bundle.items() if k not in ("CPU", "GPU")},
                visible_gpus=None if bundle.get("GPU") else "",
            )
        )
    for role, blocks in guest_blocks.items():
        on_gpu = guest_uses_gpu(cfg, role, request)
        slots[role] = []
        for block in blocks:
            b = request.bundle_of(block[0])
            visible = ",".join(g for r in block for g in host_gpus[r]) if on_gpu and host_gpus else ""
            slots[role].append(
                Slot(bundle=b, cpus=_cpu_share(request.bundles[b].get("CPU", 0.0), processes[b]), visible_gpus=visible)
            )
    return slots
