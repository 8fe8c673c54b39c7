"""The trainer side of SGLang's NCCL weight update (weight_sync.SGLangTransfer), in-process.

The engine actors are recording stand-ins whose `.remote` runs the real `RolloutWorker` forwarding and the
real `SGLangEngine` adapter over a recording `sglang.Engine`; the NCCL group is a recording stand-in (NCCL
needs GPUs) and `get_all` returns at once, noting what it waited for. Checked: who joins SGLang's group with
which rank and world size, and in what order (the engines are asked to join before rank 0 joins, and waited
for after); what each push sends (names, dtypes, shapes announced before the broadcasts, then each tensor in
that order, then the wait and the finish); that other actor ranks make no engine calls; when the driver
picks this path. The torch calls that make the group run for real on gloo with one rank.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from types import SimpleNamespace as NS

import pytest
import torch
from cloudrl.trainer.roles.workers import RolloutWorker
from cloudrl.trainer.rollout import sglang_engine, vllm_engine, weight_sync

TP, ENGINES = 2, 3


class RecordingSGLang:
    """`sglang.Engine`'s methods, recorded."""

    def __init__(self, log, index):
        self.log, self.index = log, index

    def __getattr__(self, name):
        return lambda **kwargs: self.log.append((f"engine {self.index}", name, kwargs))


def engine_actors(log):
    actors = []
    for i in range(ENGINES):
        engine = object.__new__(sglang_engine.SGLangEngine)
        engine.engine_index, engine.sleeps, engine._sleeping, engine.stale = i, False, set(), False
        engine.engine = RecordingSGLang(log, i)
        worker = object.__new__(RolloutWorker)
        worker.engine = engine
        methods = ("init_weight_transfer", "start_weight_update", "update_weights", "finish_weight_update")
        actors.append(NS(**{m: NS(remote=getattr(worker, m)) for m in methods}))
    return actors


class RecordingGroup:
    def __init__(self, log):
        self.log = log

    def broadcast(self, tensor, root):
        self.log.append(("rank 0", "broadcast", tensor.clone(), root))
        return NS(wait=lambda: None)


@pytest.fixture
def log(monkeypatch):
    log = []

    def open_group(addr, port, world_size, group_name, timeout_s):
        log.append(("rank 0", "join", (addr, port, world_size, group_name, timeout_s)))
        return RecordingGroup(log)

    monkeypatch.setattr(weight_sync, "open_torch_group", open_group)
    monkeypatch.setattr(
        weight_sync, "get_all", lambda refs, labels, timeout_s, what: log.append(("driver", "wait", what)) or refs
    )
    return log


def policy():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))


def group(model, actors, rank=0):
    return weight_sync.WeightSyncGroup(
        model,
        actors,
        rank=rank,
        tensor_parallel_size=TP,
        backend="sglang",
        master_address="10.0.0.1",
        master_port=29600,
        timeout_s=42,
        dtype=torch.bfloat16,
    )


def test_rank_0_joins_sglangs_group_between_asking_the_engines_and_waiting_for_them(log):
    group(policy(), engine_actors(log))
    inits = [entry for entry in log if entry[1] == "init_weights_update_group"]
    world = 1 + ENGINES * TP
    assert [e[2]["rank_offset"] for e in inits] == [1, 1 + TP, 1 + 2 * TP]  # SGLang adds each worker's tp rank
    assert {(e[2]["world_size"], e[2]["group_name"], e[2]["master_address"], e[2]["backend"]) for e in inits} == {
        (world, sglang_engine.WEIGHT_GROUP, "10.0.0.1", "nccl")
    }
    steps = [entry[1] for entry in log]
    assert steps == ["init_weights_update_group"] * ENGINES + ["join", "wait"]
    assert log[ENGINES][2] == ("10.0.0.1", 29600, world, sglang_engine.WEIGHT_GROUP, 42)


def test_each_push_announces_then_broadcasts_every_tensor_in_order(log):
    model = policy()
    sync = group(model, engine_actors(log))
    log.clear()
    sync.push()
    names = [n for n, _ in model.named_parameters()]
    updates = [e for e in log if e[1] == "update_weights_from_distributed"]
    broadcasts = [e for e in log if e[1] == "broadcast"]
    assert len(updates) == ENGINES
    for _, _, kwargs in updates:
        assert kwargs["names"] == names and kwargs["dtypes"] == ["bfloat16"] * len(names)
        assert kwargs["shapes"] == [list(p.shape) for p in model.parameters()]
        assert kwargs["group_name"] == sglang_engine.WEIGHT_GROUP and kwargs["flush_cache"] is True  # one bucket
    assert [b[3] for b in broadcasts] == [0] * len(names)  # from rank 0
    for (_, _, sent, _), param in zip(broadcasts, model.parameters()):
        assert sent.dtype == torch.bfloat16 and torch.equal(sent, param.detach().to(torch.bfloat16))
    order = [e[1] for e in log]
    last_update = max(i for i, step in enumerate(order) if step == "update_weights_from_distributed")
    first_broadcast = order.index("broadcast")
    assert last_update < first_broadcast  # every engine is receiving before the first tensor leaves
    after = order[first_broadcast + len(names) :]
    assert after == ["wait", "wait"]  # the engines' receive, then their finish
    assert order[: order.index("update_weights_from_distributed")] == ["wait"]  # start_weight_update


def test_a_push_goes_in_buckets_that_bound_each_engine_call(log):
    """SGLang allocates every receive buffer of one `update_weights_from_distributed` call at once on each
    engine GPU: the push cuts the model into buckets of at most rollout.weight_push_bucket_mb (here 48 bytes
    of bf16; a larger tensor alone), announces each bucket, broadcasts its tensors, waits for the engines,
    and flushes their cache after the last bucket only."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 20))
    sizes = {n: p.numel() * 2 for n, p in model.named_parameters()}  # bf16: 24, 6, 12, 80, 40 bytes
    sync = group(model, engine_actors(log))
    sync.transfer.bucket_bytes = 48
    log.clear()
    sync.push()
    calls = [e[2] for e in log if e[1] == "update_weights_from_distributed" and e[0] == "engine 0"]
    assert [c["names"] for c in calls] == [["0.weight", "0.bias", "1.weight"], ["2.weight"], ["2.bias"]]
    for call in calls:  # each call's receive buffers within the bucket, unless one tensor alone exceeds it
        assert sum(sizes[n] for n in call["names"]) <= 48 or len(call["names"]) == 1
    assert [c["flush_cache"] for c in calls] == [False, False, True]
    order = [e[1] if e[1] != "update_weights_from_distributed" else e[0] for e in log]
    first = order.index("broadcast")
    assert order[first : first + 3] == ["broadcast"] * 3 and order[first + 3] == "wait"  # bucket 1, then its wait
    assert [e[2] for e in log if e[1] == "wait"][1:-1] == [
        "receiving bucket 1/3 (3 tensors, 0 MiB) over SGLang's group",
        "receiving bucket 2/3 (1 tensors, 0 MiB) over SGLang's group",
        "receiving bucket 3/3 (1 tensors, 0 MiB) over SGLang's group",
    ]
    sent = [e[2] for e in log if e[1] == "broadcast"]
    assert all(torch.equal(t, p.detach().to(torch.bfloat16)) for t, p in zip(sent, model.parameters(), strict=True))


def test_other_actor_ranks_only_gather(log):
    actors = engine_actors(log)
    sync = group(policy(), actors, rank=1)
    sync.push()
    assert log == []


def _cfg(engine="sglang", colocate=False, pp=1):
    return NS(
        rollout=NS(engine=engine, gpus_per_engine=TP, tensor_parallel_size=TP, pipeline_parallel_size=pp),
        placement=NS(colocate_all=colocate),
        actor=NS(gpus_per_node=8),
    )


def test_the_driver_pushes_to_sglang_over_nccl_only_where_its_engines_own_their_gpus():
    assert weight_sync.push_mode(_cfg(), actor_on_cuda=True, engine_gpus=TP) == "nccl"
    assert vllm_engine.transfer_backend(_cfg()) == "sglang"
    assert weight_sync.push_mode(_cfg(colocate=True), True, TP) == "object_store"  # no CUDA IPC path for SGLang yet
    assert weight_sync.push_mode(_cfg(pp=2), True, TP) == "object_store"  # SGLang ranks by tp only
    assert weight_sync.push_mode(_cfg(), actor_on_cuda=False, engine_gpus=TP) == "object_store"


def test_the_group_is_made_by_torchs_own_calls():
    """`open_torch_group` on gloo with one rank: the rendezvous, the prefixed store and torch's group helper
    accept the arguments given, and the group broadcasts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    made = weight_sync.open_torch_group("127.0.0.1", port, 1, "cloudrl_test_group", 30, backend="gloo")
    tensor = torch.arange(3.0)
    made.broadcast(tensor, 0).wait()
    assert made.size() == 1 and torch.equal(tensor, torch.arange(3.0))


GROUP_RANK = """
import os, sys

import psutil
import torch
from cloudrl.trainer.rollout.weight_sync import open_torch_group

rank, port = int(sys.argv[1]), int(sys.argv[2])
group = open_torch_group("127.0.0.1", port, 2, "cloudrl_test_group", 60, rank=rank, backend="gloo")
tensor = torch.arange(3.0) if rank == 0 else torch.zeros(3)
group.broadcast(tensor, 0).wait()
listening = [c.laddr.ip for c in psutil.Process(os.getpid()).net_connections("inet") if c.status == "LISTEN" and c.laddr.port == port]
print("received", tensor.tolist(), "listening", listening, flush=True)
"""


def test_rank_0s_store_listens_on_the_master_address_alone_and_another_process_joins():
    """The group between two processes, as SGLang's workers join the trainer's: rank 0 (the trainer) serves the
    rendezvous on the given address only, rank 1 joins through a `tcp://` rendezvous, and a broadcast arrives."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen([sys.executable, "-c", GROUP_RANK, str(rank), str(port)], stdout=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "received [0.0, 1.0, 2.0] listening ['127.0.0.1']" in outs[0]  # not 0.0.0.0 / :: (every interface)
    assert "received [0.0, 1.0, 2.0] listening []" in outs[1]


def test_a_failure_sglang_reports_as_a_value_raises():
    """SGLang answers (False, message) instead of raising: the adapter turns it into an error."""
    engine = object.__new__(sglang_engine.SGLangEngine)
    engine.engine = NS(init_weights_update_group=lambda **kw: (False, "rendezvous timed out"))
    with pytest.raises(RuntimeError, match="could not join the weight-update group: rendezvous timed out"):
        engine.init_weight_transfer({"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 3})
