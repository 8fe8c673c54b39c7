"""The GPU layout rehearsed on CPU: a real 2-node Ray cluster whose nodes declare 8 logical GPUs each.

Ray hands out GPU ids and sets CUDA_VISIBLE_DEVICES exactly as on GPU nodes; nothing runs CUDA. The
placement tests start light probes through the trainer's own launch code and check every rank's node
and GPU ids; the rehearsal runs the shipped `gsm8k-7b` layout end to end (tiny model, built-in data) with
the real workers: one rank per logical GPU, FSDP2 over gloo, engines on their own GPUs. What only a
GPU shows (kernels, NCCL, CUDA IPC, memory) is listed in docs/multinode.md, "The GPU path".

Like test_cluster_two_nodes.py, every driver here is a subprocess, and this module runs before any test
starts the session's in-process Ray instance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runs import REPO, local_cluster, run_trainer

pytestmark = pytest.mark.ray

TINY = [
    "model.path=builtin:tiny",
    "data.train_files=builtin:arithmetic",
    "data.val_files=",
    "reward.function=arithmetic",
    "data.max_prompt_length=64",
    "rollout.max_new_tokens=4",
    "trainer.loggers=[jsonl]",
]


@pytest.fixture(scope="module")
def gpu_nodes(private_cache):
    """2 nodes x (8 logical GPUs, 40 logical CPUs), brought up and torn down by `cloudrl local`."""
    with local_cluster(nodes=2, cpus_per_node=40, gpus_per_node=8) as state:
        yield state


LAYOUTS = {
    "gsm8k-7b": [],
    "actor-on-2-nodes": ["actor.nodes=2", "rollout.num_engines=2"],
    "colocate-all": [
        "placement.colocate_all=true",
        "actor.gpus_per_node=8",
        "critic.gpus_per_node=8",
        "rollout.num_engines=4",
    ],
    "colocate-critic-reward": ["placement.colocate_critic_reward=true", "reward.model_path=local/reward-model"],
}


# The one-box presets, placed as shipped (they use one node of the two).
ONE_BOX = ["gsm8k-1gpu", "gsm8k-1node"]


@pytest.fixture(scope="module")
def layouts(gpu_nodes):
    """Every layout of LAYOUTS and ONE_BOX placed once, with probes: {name: {role: [worker, ...]}}."""
    argv = [["--preset", "gsm8k-7b", *overrides] for overrides in LAYOUTS.values()]
    argv += [["--preset", preset] for preset in ONE_BOX]
    env = {**os.environ, "RAY_ADDRESS": gpu_nodes["gcs_address"]}
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "helpers" / "placement_probe.py"), json.dumps(argv)],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("LAYOUTS "))
    return dict(zip([*LAYOUTS, *ONE_BOX], json.loads(line.removeprefix("LAYOUTS ")), strict=True))


def devices(workers: list[dict]) -> list[tuple[str, str]]:
    return [(w["node_id"], g) for w in workers for g in w["gpus"]]


def check_data_parallel(workers: list[dict]) -> None:
    """One whole GPU per rank, and no two ranks on one GPU (NCCL refuses that)."""
    assert all(len(w["gpus"]) == 1 and w["gpus"] == w["ray_gpus"] for w in workers), workers
    assert len(set(devices(workers))) == len(workers), workers


@pytest.mark.parametrize("name", ["gsm8k-7b", "actor-on-2-nodes"])
def test_separate_roles_get_their_own_gpus(layouts, name):
    layout = layouts[name]
    actor, critic, rollout = layout["actor"], layout["critic"], layout["rollout"]
    check_data_parallel(actor)
    check_data_parallel(critic)
    assert "reference" not in layout and all(w["kwargs"] == {"with_reference": True} for w in actor)
    for engine in rollout:  # tensor_parallel_size=2: two GPUs, in one process, so on one node
        assert len(engine["gpus"]) == 2 and engine["gpus"] == engine["ray_gpus"], engine
    assert all(w["gpus"] == [] for w in layout["reward"])  # rule-based reward: no GPU
    used = devices(actor) + devices(critic) + devices(rollout)
    assert len(used) == len(set(used)) == len(actor) + len(critic) + 2 * len(rollout)
    if name == "actor-on-2-nodes":
        assert len({w["node_id"] for w in actor}) == 2
        assert [len([w for w in actor if w["node_id"] == n]) for n in {w["node_id"] for w in actor}] == [4, 4]


def test_colocate_all_puts_every_role_on_the_actors_gpus(layouts):
    layout = layouts["colocate-all"]
    actor = sorted(layout["actor"], key=lambda w: w["rank"])
    check_data_parallel(actor)
    # Critic rank r shares actor rank r's GPU: its own process group still has one rank per GPU.
    for c in layout["critic"]:
        a = actor[c["rank"]]
        assert (c["node_id"], c["gpus"], c["ray_gpus"]) == (a["node_id"], a["gpus"], []), (c, a)
    # Engine e (tensor_parallel_size=2) sees exactly actor ranks 2e and 2e+1's GPUs, on their node:
    # what CUDA IPC weight sync needs.
    for e in layout["rollout"]:
        pair = actor[2 * e["rank"] : 2 * e["rank"] + 2]
        assert e["node_id"] == pair[0]["node_id"] == pair[1]["node_id"]
        assert e["gpus"] == pair[0]["gpus"] + pair[1]["gpus"] and e["ray_gpus"] == [], (e, pair)
    assert all(w["gpus"] == [] for w in layout["reward"])


def test_the_one_gpu_preset_puts_actor_and_engine_on_one_gpu(layouts):
    """gsm8k-1gpu: one actor rank (the reference in its process) and one vLLM engine that sees the same GPU."""
    layout = layouts["gsm8k-1gpu"]
    (actor,) = layout["actor"]
    (engine,) = layout["rollout"]
    check_data_parallel([actor])
    assert "critic" not in layout and "reference" not in layout
    assert (engine["node_id"], engine["gpus"], engine["ray_gpus"]) == (actor["node_id"], actor["gpus"], [])


def test_the_one_node_preset_keeps_every_rank_and_engine_on_one_node(layouts):
    """gsm8k-1node: 8 actor ranks on the 8 GPUs of one node; engine e (tp=2) sees actor ranks 2e and 2e+1's."""
    layout = layouts["gsm8k-1node"]
    actor = sorted(layout["actor"], key=lambda w: w["rank"])
    check_data_parallel(actor)
    assert len(actor) == 8 and len({w["node_id"] for w in actor}) == 1
    for e in layout["rollout"]:
        pair = actor[2 * e["rank"] : 2 * e["rank"] + 2]
        assert e["node_id"] == pair[0]["node_id"] and e["gpus"] == pair[0]["gpus"] + pair[1]["gpus"], (e, pair)
    assert len(layout["rollout"]) == 4


def test_colocated_reward_model_shares_the_critics_gpus(layouts):
    layout = layouts["colocate-critic-reward"]
    critic = sorted(layout["critic"], key=lambda w: w["rank"])
    check_data_parallel(critic)
    (reward,) = layout["reward"]
    assert reward["node_id"] == critic[0]["node_id"] and reward["ray_gpus"] == []
    assert reward["gpus"] == [g for w in critic for g in w["gpus"]]
    assert set(devices(layout["actor"])).isdisjoint(devices(critic))


def test_gsm8k_7b_layout_trains_on_the_rehearsal_cluster(gpu_nodes, tmp_path):
    """The shipped GPU preset, 2 PPO steps on 2 nodes x 8 logical GPUs: 4 actor ranks and 2 critic ranks
    sharded with FSDP2 (gloo) in bf16 mixed precision over fp32 master weights, 4 rollout engines with 2
    GPUs each, the reference in the actor's processes; checkpoint and HF export gathered from the shards."""
    overrides = TINY + [
        f"trainer.run_dir={tmp_path}",
        "trainer.total_steps=2",
        "trainer.save_every=0",
        "trainer.val_every=0",
        "data.train_batch_size=8",
        "rollout.n=2",
        "rollout.engine=hf",
        "rollout.tensor_parallel_size=1",
        "rollout.gpus_per_engine=2",
        "actor.mini_batch_size=16",
        "critic.mini_batch_size=16",
        "actor.cpus_per_worker=1",
        "critic.cpus_per_worker=1",
        "model.sft_warmup_steps=20",
        "actor.lr=1e-3",
        "critic.lr=1e-3",
    ]
    result = run_trainer("--preset", "gsm8k-7b", *overrides, env={"RAY_ADDRESS": gpu_nodes["gcs_address"]}, timeout=540)
    assert result.returncode == 0, result.stderr[-4000:]
    placement = json.loads((tmp_path / "placement.json").read_text())
    for role in ("actor", "critic"):
        check_data_parallel([{**w, "ray_gpus": w["gpus"]} for w in placement[role]])
        assert all(w["sharded"] and w["device"] == "cpu" for w in placement[role])
    assert [len(w["gpus"]) for w in placement["rollout"]] == [2, 2, 2, 2]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(0 < r["actor/grad_norm"] < 1e6 and 0 < r["critic/grad_norm"] < 1e6 for r in steps), steps
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["exported_model"]
    # The export (bf16, gathered from the shards) is the final fp32 policy, rounded, and it moved away
    # from the run's real starting weights.
    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.inputs.models import resolve_path
    from cloudrl.trainer.state.checkpoint import read_full
    from safetensors.torch import load_file

    exported = load_file(next(Path(summary["exported_model"]).glob("*.safetensors")))
    final = read_full(tmp_path / "checkpoints/step_000002", "actor")["model"]
    start_dir = resolve_path("builtin:tiny", load_config("gsm8k-7b", overrides))
    start = load_file(next(Path(start_dir).glob("*.safetensors")))
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    for name, value in exported.items():
        assert torch.equal(value, final[name].to(torch.bfloat16)), name
    assert sum(not torch.equal(exported[n], start[n].to(torch.bfloat16)) for n in exported) > len(exported) // 2
