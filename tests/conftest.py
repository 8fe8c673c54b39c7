"""Shared fixtures: one local Ray instance for the trainer tests, and a private model cache."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Built-in models are materialised into a cache of this test session only."""
    cache = tmp_path_factory.mktemp("cloudrl-cache")
    old = os.environ.get("CLOUDRL_CACHE")
    os.environ["CLOUDRL_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("CLOUDRL_CACHE", None)
    else:
        os.environ["CLOUDRL_CACHE"] = old


@pytest.fixture(scope="session")
def ray_local(private_cache):
    """A real single-node Ray instance (8 logical CPUs) shared by the trainer tests.

    The trainer reuses an initialised Ray instead of starting its own, so each test pays only for
    its actors. Yields the GCS address, so subprocess drivers can join the same instance.
    """
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Without a mode, Ray turns token auth on when ~/.ray/auth_token exists and writes RAY_AUTH_MODE=token
    # into this process's environment, which every later subprocess (trainer drivers joining the
    # token-less `cloudrl local` clusters) would inherit. Off, explicitly, as the local clusters are.
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ctx = ray.init(
        address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING", configure_logging=True
    )
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


@contextlib.contextmanager
def local_cluster(nodes: int, cpus_per_node: int, gpus_per_node: int):
    """A real Ray cluster of `nodes` nodes on 127.0.0.1, brought up and torn down by `cloudrl local`.
    Logical GPUs: Ray hands out their ids as on GPU nodes; nothing runs CUDA. Yields its state."""
    from cloudrl.cli import local_cluster as cluster

    os.environ["CLOUDRL_LOCAL_DASHBOARD_PORT"] = "0"
    state = cluster.up(nodes=nodes, cpus_per_node=cpus_per_node, gpus_per_node=gpus_per_node, echo=lambda line: None)
    try:
        yield state
    finally:
        cluster.down(echo=lambda line: None)
        os.environ.pop("CLOUDRL_LOCAL_DASHBOARD_PORT", None)


def run_trainer(*args: str, env: dict | None = None, timeout: float = 300):
    """`python -m cloudrl.trainer ARGS` in a subprocess; returns the CompletedProcess."""
    import subprocess

    full_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # The Ray it starts is a private one: no token auth, even where ~/.ray/auth_token exists (Ray would
    # turn it on and warn on stderr, whichever test ran first).
    full_env.setdefault("RAY_AUTH_MODE", "disabled")
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "cloudrl.trainer", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=REPO,
    )


def tiny_overrides(run_dir: Path, **extra) -> list[str]:
    """A short, fast run of the local preset."""
    values = {
        "trainer.run_dir": str(run_dir),
        "trainer.total_steps": 2,
        "trainer.val_every": 0,
        "model.sft_warmup_steps": 20,
        "trainer.loggers": "[jsonl]",
        "data.train_batch_size": 8,
        "rollout.n": 2,
        "actor.mini_batch_size": 16,
        "actor.micro_batch_size": 8,
        "critic.mini_batch_size": 16,
        "critic.micro_batch_size": 8,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


@contextlib.contextmanager
def serving_retriever(corpus: Path, index_dir: Path, topk: int = 3):
    """trainer/search/retriever_server.py's BM25 index of `corpus`, served on 127.0.0.1 in a thread; yields its
    /retrieve URL and stops the server on exit."""
    import threading

    from cloudrl.trainer.search.retriever_server import RetrieverServer, build_index, load_index

    build_index(corpus, index_dir)
    server = RetrieverServer(("127.0.0.1", 0), load_index(index_dir), topk=topk)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/retrieve"
    finally:
        server.shutdown()
        server.server_close()


def step_metrics(run_dir: Path) -> list[dict]:
    """The training steps' rows of run_dir/metrics.jsonl (step 0 and validation-only rows left out)."""
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("step", 0) > 0 and "rollout/reward_mean" in r]
