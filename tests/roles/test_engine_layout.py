"""Rollout engines wider than a node, on logical GPUs: their placement (one one-GPU bundle per engine GPU,
the engine's actor holding none), the vLLM arguments that put vLLM's Ray workers into those bundles, the
weight-sync group's size and ranks, the preflight and config checks that refuse what cannot fit, and the
shipped presets of such layouts. The one Ray test places engines of tp=8 x pp=2 and tp=16 on a 2-node
cluster of 8 logical GPUs each and starts one stand-in worker per vLLM worker where vLLM would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cloudrl.trainer.config import ConfigError, load_config
from cloudrl.trainer.roles.launch import NETWORK_ENV_PREFIXES
from cloudrl.trainer.roles.placement import ClusterTooSmall, check_fits, plan, plan_slots
from cloudrl.trainer.rollout import vllm_engine
from cloudrl.trainer.rollout.weight_sync import EngineClient, group_ranks
from runs import REPO, local_cluster

NODE = {"GPU": 8.0, "CPU": 40.0}
# The engine alone on GPUs: the actor trains on CPU, so the two nodes' 16 GPUs are all the engine's.
CPU_ACTOR = ["actor.nodes=1", "actor.gpus_per_node=0", "actor.cpu_offload=false"]
TP8_PP2 = ["rollout.tensor_parallel_size=8", "rollout.pipeline_parallel_size=2", "rollout.nodes_per_engine=2"]
TP16 = ["rollout.tensor_parallel_size=16", "rollout.pipeline_parallel_size=1", "rollout.nodes_per_engine=2"]


def config(*overrides: str):
    return load_config("engine-2node", [*CPU_ACTOR, *overrides])


def rollout_request(cfg):
    return next(r for r in plan(cfg) if r.role == "rollout")


@pytest.mark.parametrize("layout", [TP8_PP2, TP16], ids=["tp8xpp2", "tp16"])
def test_an_engine_wider_than_a_node_is_one_bundle_per_gpu(layout):
    cfg = config(*layout)
    req = rollout_request(cfg)
    assert req.strategy == "PACK" and req.bundles == [{"GPU": 1.0, "CPU": 1.0}] * 16
    assert req.num_workers == 1 and req.bundles_of(0) == list(range(16))
    (slot,) = plan_slots(cfg, req)["rollout"]
    assert (slot.bundle, slot.gpus, slot.visible_gpus) == (0, 0.0, None)  # the engine actor holds no GPU
    check_fits(plan(cfg), [NODE, NODE])


def test_two_spanning_engines_take_consecutive_bundles():
    cfg = config(*TP8_PP2, "rollout.num_engines=2", "data.train_batch_size=128")
    req = rollout_request(cfg)
    assert len(req.bundles) == 32 and req.num_workers == 2
    assert [s.bundle for s in plan_slots(cfg, req)["rollout"]] == [0, 16]
    envs = [vllm_engine.engine_args(cfg, "/m", on_gpu=True, engine_index=e)[1] for e in (0, 1)]
    assert [env[vllm_engine.BUNDLE_INDICES] for env in envs] == [
        ",".join(map(str, range(16))),
        ",".join(map(str, range(16, 32))),
    ]
    check_fits(plan(cfg), [NODE] * 4)
    with pytest.raises(ClusterTooSmall, match="32 for rollout"):
        check_fits(plan(cfg), [NODE] * 3)


def test_24_gpus_on_two_8_gpu_nodes_are_refused_in_one_line():
    cfg = config("rollout.tensor_parallel_size=8", "rollout.pipeline_parallel_size=3", "rollout.nodes_per_engine=3")
    with pytest.raises(ClusterTooSmall) as err:
        check_fits(plan(cfg), [NODE, NODE])
    text = str(err.value)
    assert "\n" not in text and "24 GPU" in text and "rollout.pipeline_parallel_size=3" in text
    assert "the cluster has 16" in text


def test_an_engine_too_wide_for_a_node_without_nodes_per_engine_names_the_key():
    cfg = config("rollout.tensor_parallel_size=16", "rollout.nodes_per_engine=1", "rollout.pipeline_parallel_size=1")
    with pytest.raises(ClusterTooSmall, match="set rollout.nodes_per_engine"):
        check_fits(plan(cfg), [NODE, NODE])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["placement.colocate_all=true", "actor.nodes=2", "actor.gpus_per_node=8"], "CUDA IPC"),
        (["rollout.nodes_per_engine=3"], "must divide"),
        (["rollout.engine=hf", "rollout.tensor_parallel_size=1"], "need rollout.engine=vllm or sglang"),
        (["rollout.engine=sglang"], "not supported yet"),
    ],
    ids=["colocated", "uneven", "hf", "sglang"],
)
def test_config_checks_refuse_layouts_that_cannot_span_nodes(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config(*TP8_PP2, *overrides)


def test_vllm_gets_the_ray_executor_across_nodes_and_mp_within_one():
    kwargs, env = vllm_engine.engine_args(config(*TP8_PP2), "/m", on_gpu=True, environ={})
    assert kwargs["distributed_executor_backend"] == "ray"
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"]) == (8, 2)
    assert env[vllm_engine.BUNDLE_INDICES] == ",".join(map(str, range(16)))
    # Every network variable launch.py passes to the engine's actor reaches vLLM's Ray workers too: vLLM
    # copies NCCL_ and UCX_ itself, the others through VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY.
    copied = ("NCCL_", "UCX_", *env[vllm_engine.EXTRA_PREFIXES].split(","))
    per_worker = ("HIP_VISIBLE",)  # device ids are each worker's own
    assert all(p.startswith(copied) for p in NETWORK_ENV_PREFIXES if p not in per_worker)
    within = load_config("gsm8k-7b", ["rollout.tensor_parallel_size=2", "rollout.pipeline_parallel_size=2"])
    kwargs, env = vllm_engine.engine_args(within, "/m", on_gpu=True, environ={})
    assert kwargs["distributed_executor_backend"] == "mp" and vllm_engine.BUNDLE_INDICES not in env
    assert rollout_request(within).bundles[0]["GPU"] == 4.0


def test_vllm_takes_its_placement_group_and_bundle_indices_as_this_code_provides_them():
    """vLLM 0.32 has no placement-group argument: it reads the Ray actor's own group, and the bundles from
    VLLM_RAY_BUNDLE_INDICES, and refuses bundles of more than one GPU. Checked in vLLM's source as installed."""
    import inspect

    from vllm import envs
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor import ray_executor_v2, ray_utils

    assert "get_current_placement_group" in inspect.getsource(EngineArgs.create_engine_config)
    assert "VLLM_RAY_BUNDLE_INDICES" in inspect.getsource(ray_executor_v2)
    assert "cannot have more than 1" in inspect.getsource(ray_utils.initialize_ray_cluster)
    assert vllm_engine.BUNDLE_INDICES in envs.environment_variables
    assert vllm_engine.EXTRA_PREFIXES in envs.environment_variables
    fields = inspect.signature(EngineArgs).parameters
    kwargs, _ = vllm_engine.engine_args(config(*TP8_PP2), "/m", on_gpu=True, environ={})
    assert set(kwargs) <= set(fields)


def test_the_bundle_indices_are_not_left_to_a_stale_environment():
    environ = {vllm_engine.BUNDLE_INDICES: "0,1"}
    vllm_engine.apply_env({vllm_engine.BUNDLE_INDICES: "16,17"}, environ)
    assert environ[vllm_engine.BUNDLE_INDICES] == "16,17"


def test_the_cpu_build_refuses_an_engine_spanning_nodes_with_the_reason():
    with pytest.raises(ConfigError, match="does not support: set rollout.nodes_per_engine=1"):
        vllm_engine.check_ray_executor(config(*TP8_PP2))


@pytest.mark.parametrize("tp, pp", [(8, 2), (16, 1), (2, 1)])
def test_weight_sync_group_counts_every_engine_rank(tp, pp):
    world, offsets = group_ranks(3, tp, pp)
    assert world == 1 + 3 * tp * pp and offsets == [1, 1 + tp * pp, 1 + 2 * tp * pp]

    class Worker:
        def __init__(self):
            self.info = None
            self.init_weight_transfer = self

        def remote(self, info):
            self.info = info
            return info

    workers = [Worker() for _ in range(3)]
    client = EngineClient(workers, tp, pipeline_parallel_size=pp)
    client._wait = lambda refs, what: None
    client.init_weight_transfer_engine({"rank_offset": 1, "world_size": world})
    assert [w.info["rank_offset"] for w in workers] == offsets
    # vLLM numbers a worker rank_offset + its rank in the engine (0 .. tp*pp-1): no two ranks collide.
    ranks = [0] + [o + r for o in offsets for r in range(tp * pp)]
    assert sorted(ranks) == list(range(world))


@pytest.mark.parametrize("preset, nodes", [("engine-2node", 4), ("sglang-2x8", 2)])
def test_shipped_layouts_load_pass_checks_and_fit(preset, nodes):
    cfg = load_config(preset, [])
    check_fits(plan(cfg), [{"GPU": 8.0, "CPU": 128.0}] * nodes)
    with pytest.raises(ClusterTooSmall):
        check_fits(plan(cfg), [{"GPU": 8.0, "CPU": 128.0}] * (nodes - 1))
    if preset == "sglang-2x8":  # the seed's layout: 4 engines x tp=4 on the actor's 16 GPUs
        (actor,) = plan(cfg)
        assert "rollout" in actor.guests and cfg.rollout.engine == "sglang"
        assert [
            len(s.visible_gpus.split(",")) for s in plan_slots(cfg, actor, [[str(g % 8)] for g in range(16)])["rollout"]
        ] == [4] * 4


# ------------------------------------------------------------------------------------------------
# On a Ray cluster of 2 nodes x 8 logical GPUs
# ------------------------------------------------------------------------------------------------

PROBE = r"""
import json, os, sys, tempfile
from pathlib import Path
import ray
sys.path.insert(0, os.path.join(os.environ["REPO"], "tests", "helpers"))
import placement_probe
from placement_probe import Probe
from ray import cloudpickle
cloudpickle.register_pickle_by_value(placement_probe)  # the workers cannot import tests/helpers
from cloudrl.trainer.config import load_config
from cloudrl.trainer.roles.launch import WORKER_CLASSES, launch_roles
from cloudrl.trainer.roles.placement import plan


@ray.remote(num_gpus=1, num_cpus=0)
def vllm_worker():
    return {"node_id": ray.get_runtime_context().get_node_id(), "gpus": [str(g) for g in ray.get_gpu_ids()],
            "nccl": os.environ.get("NCCL_SOCKET_IFNAME")}


class EngineProbe(Probe):
    # Starts one stand-in per vLLM worker as vLLM's Ray executor would: in the bundles VLLM_RAY_BUNDLE_INDICES
    # names, of the placement group vLLM finds around the engine's actor.
    def where(self):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from cloudrl.trainer.rollout.vllm_engine import BUNDLE_INDICES, engine_args

        here = super().where()
        cfg = load_config(*CONFIG)
        _, env = engine_args(cfg, "/m", on_gpu=True, engine_index=self.rank)
        pg = ray.util.get_current_placement_group()
        runtime_env = ray.get_runtime_context().runtime_env  # what vLLM passes on to its workers
        bundles = [int(b) for b in env[BUNDLE_INDICES].split(",")]
        here["workers"] = ray.get([
            vllm_worker.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
                runtime_env=dict(runtime_env),
            ).remote()
            for b in bundles
        ])
        return here


ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR")
model = tempfile.mkdtemp(prefix="probe-model-")
Path(model, "config.json").write_text("{}")
layouts = []
for CONFIG in json.loads(sys.argv[1]):
    cfg = load_config(*CONFIG)
    classes = {role: Probe for role in WORKER_CLASSES}
    classes["rollout"] = EngineProbe
    roles = launch_roles(cfg, plan(cfg), model, model, classes=classes)
    try:
        layouts.append({g.name: g.where() for g in roles.groups()})
    finally:
        roles.shutdown()
print("LAYOUTS " + json.dumps(layouts))
"""


@pytest.mark.ray
def test_spanning_engines_place_one_vllm_worker_per_gpu_on_two_nodes(private_cache):
    configs = [["engine-2node", [*CPU_ACTOR, *layout]] for layout in (TP8_PP2, TP16)]
    with local_cluster(nodes=2, cpus_per_node=40, gpus_per_node=8) as state:
        env = {**os.environ, "RAY_ADDRESS": state["gcs_address"], "REPO": str(REPO), "NCCL_SOCKET_IFNAME": "lo"}
        result = subprocess.run(
            [sys.executable, "-c", PROBE, json.dumps(configs)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            cwd=REPO,
        )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("LAYOUTS "))
    for layout in json.loads(line.removeprefix("LAYOUTS ")):
        (engine,) = layout["rollout"]
        assert engine["ray_gpus"] == [] and engine["gpus"] in ([], None)  # the engine's actor holds no GPU
        workers = engine["workers"]
        devices = [(w["node_id"], g) for w in workers for g in w["gpus"]]
        assert all(len(w["gpus"]) == 1 for w in workers) and len(set(devices)) == 16
        per_node = {}
        for node, _ in devices:
            per_node[node] = per_node.get(node, 0) + 1
        assert sorted(per_node.values()) == [8, 8]
        assert engine["node_id"] in per_node
        assert {w["nccl"] for w in workers} == {"lo"}  # the network environment reaches vLLM's workers
