"""A retriever per node, started by the bundle: tasks/ray-cluster-search.dstack.yml on a simulated
2-node cluster (tests/helpers/bundle_netns.py). Each node serves the index on its own disk at 127.0.0.1:8000
before it joins Ray; the head's ready line therefore waits for both; the trainer's turn loop and
retrieval client, run in a Ray task on each node, reach that node's own server (counted on the servers).

Network namespaces only: the loopback stand-in gives every node the host's one 127.0.0.1, where two
servers cannot both take port 8000.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from bundle_netns import free_port
from dstack_runner import (
    REPO_ROOT,
    base_env,
    check_shipped_files,
    dstack_env,
    load_task,
    node_argv,
    ready_image_python,
    shipped_files,
    task_env,
)
from test_bundle_cluster import (
    GPUS_PER_NODE,
    LOCAL_ENV,
    READY,
    TEST_KNOBS,
    netns_reason,
    new_cluster,
    run_bootstrap,
    run_job,
)

TASK_PATH = REPO_ROOT / "tasks" / "ray-cluster-search.dstack.yml"
INDEX = "/tmp/search-index"  # as the nodes see it: each node's own /tmp (the task mounts a volume there)

pytestmark = [pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if netns_reason():
        pytest.skip(f"network namespaces unavailable ({netns_reason()})")
    pytest.importorskip("bm25s")
    from cloudrl.trainer.search.retriever_server import build_index

    task = load_task(TASK_PATH)
    check_shipped_files(TASK_PATH, task, REPO_ROOT)
    work = tmp_path_factory.mktemp("search-bundle")
    cluster = new_cluster("netns", 2, work)
    try:
        cluster.create()
        for rank in range(2):  # each node's index names its node, so an answer shows who gave it
            corpus = work / f"corpus{rank}.jsonl"
            corpus.write_text(
                json.dumps({"id": "0", "contents": f"River\nrivers on node {rank}"})
                + "\n"
                + json.dumps({"id": "1", "contents": "Rock\nbasalt is a rock"})
                + "\n"
            )
            build_index(corpus, cluster.node_path(rank, INDEX))
        ips = cluster.ips
        knobs = {**TEST_KNOBS, "CLOUDRL_RETRIEVER_INDEX": INDEX, "CLOUDRL_RETRIEVER_TIMEOUT": "120"}
        token = uuid.uuid4().hex + uuid.uuid4().hex
        started = time.monotonic()
        for rank in range(2):
            env = {
                **base_env(),
                **task_env(task, {**LOCAL_ENV, "RAY_AUTH_TOKEN": token}),
                **knobs,
                **dstack_env(rank, ips, GPUS_PER_NODE),
            }
            cluster.start(rank, node_argv(task, rank), env, files=shipped_files(TASK_PATH, task))
        cluster.nodes[0].wait_for(READY, 150)
        print(f"\n2-node search cluster ready in {time.monotonic() - started:.1f}s")
        yield cluster
    finally:
        cluster.stop()
    assert cluster.leftover_pids() == []


def health(cluster, rank: int) -> dict:
    script = (
        "import json, urllib.request\n"
        "print(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=5).read().decode())\n"
    )
    out = cluster.run_in_node(rank, [sys.executable, "-c", script], timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.netns
@pytest.mark.ray
def test_every_node_serves_its_retriever_before_joining(cluster):
    for rank, node in cluster.nodes.items():
        log = node.output()
        up = log.find("retriever on 127.0.0.1:8000 answers")
        ray_start = log.find("starting the Ray head" if rank == 0 else "joining as worker")
        assert 0 <= up < ray_start, log
        assert health(cluster, rank)["documents"] == 2
    assert len([line for line in cluster.nodes[0].output().splitlines() if "cluster ready:" in line]) == 1


# Runs in a Ray job: on every node, the trainer's turn loop (with a scripted policy in place of a model)
# searches through the trainer's client at its default search.url, sending 2 + 3 * rank queries.
JOB = """
import json, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On
ray.init()

@ray.remote(num_cpus=0, resources={"retriever": 0.01})
def search_here(count):
    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.inputs.demo import build_char_tokenizer
    from cloudrl.trainer.rollout.multiturn import TurnLoop, search_limits
    from cloudrl.trainer.search.retrieval import RetrievalClient
    from cloudrl.trainer.rollout.engines import Completion

    tok = build_char_tokenizer()
    def policy(contexts, settings):  # first turn: a search; then: an answer
        texts = ["<search>river</search>" if "<information>" not in tok.decode(c) else "<answer>a</answer>"
                 for c in contexts for _ in range(settings.n)]
        return [Completion(tok.encode(t, add_special_tokens=False), [0.0] * len(t), "stop") for t in texts]
    cfg = load_config("local")
    search = cfg.search
    loop = TurnLoop(policy, tok, RetrievalClient.from_config(search).passages, search_limits(cfg.rollout))
    out = loop.run([tok.encode("q" + str(i), add_special_tokens=False) for i in range(count)], settings_cls())
    return ray.util.get_node_ip_address(), search.url, [tok.decode(c.token_ids) for c in out]

def settings_cls():
    from cloudrl.trainer.rollout.engines import SamplingSettings
    return SamplingSettings(n=1, max_new_tokens=32)

nodes = sorted((n["NodeManagerAddress"], n["NodeID"], n["Resources"].get("retriever")) for n in ray.nodes() if n["Alive"])
print("RETRIEVERS", json.dumps([[ip, amount] for ip, _, amount in nodes]))
ips = [ip for ip, _, _ in nodes]
results = ray.get([search_here.options(scheduling_strategy=On(node_id, soft=False)).remote(2 + 3 * i)
                   for i, (_, node_id, _) in enumerate(nodes)])
print("RESULTS", json.dumps(results))
"""


@pytest.mark.netns
@pytest.mark.ray
def test_each_nodes_rollouts_query_their_own_nodes_retriever(cluster):
    before = [health(cluster, rank)["queries_served"] for rank in range(2)]
    log = run_job(cluster, JOB)
    retrievers = json.loads(log.split("RETRIEVERS ", 1)[1].splitlines()[0])
    assert sorted(retrievers) == sorted([ip, 1.0] for ip in cluster.ips)  # Ray resource `retriever: 1` each
    results = json.loads(log.split("RESULTS ", 1)[1].splitlines()[0])
    sent = {}
    for ip, url, texts in results:
        rank = cluster.ips.index(ip)
        assert url == "http://127.0.0.1:8000/retrieve"
        assert all(f"rivers on node {rank}" in t and t.endswith("<answer>a</answer>") for t in texts), texts
        sent[rank] = len(texts)
    assert sorted(sent.values()) == [2, 5]
    for rank in range(2):  # each server counted exactly its own node's queries
        assert health(cluster, rank)["queries_served"] - before[rank] == sent[rank]


# --- failures: one line, and the node never joins Ray ---------------------------------------------


def _bootstrap_with_index(index: Path) -> subprocess.CompletedProcess:
    env = {
        **dstack_env(1, ["127.0.0.1", "127.0.0.2"], GPUS_PER_NODE),
        # An image that needs no install; the retriever runs on this interpreter.
        "CLOUDRL_PYTHON": str(ready_image_python(index.parent)),
        "CLOUDRL_RAY_AUTH": "off",
        "CLOUDRL_RETRIEVER_INDEX": str(index),
        "CLOUDRL_RETRIEVER_PORT": str(free_port()),
    }
    return run_bootstrap(env, timeout=120)


def test_bootstrap_fails_when_the_retriever_cannot_start(tmp_path):
    index = tmp_path / "index"
    index.mkdir()
    (index / "meta.json").write_text('{"kind": "bm25"}')  # an index without its corpus
    result = _bootstrap_with_index(index)
    assert result.returncode == 1
    assert "the retriever exited before answering" in result.stderr
    assert "joining" not in result.stdout
    deadline = time.monotonic() + 10  # a reporter's last `sleep 2` may still be ending
    while left := [pid for pid in os.listdir("/proc") if pid.isdigit() and _environ_has(pid, str(tmp_path))]:
        assert time.monotonic() < deadline, f"the failed bootstrap left processes running: {left}"
        time.sleep(0.5)


def _environ_has(pid: str, text: str) -> bool:
    try:
        return text.encode() in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
