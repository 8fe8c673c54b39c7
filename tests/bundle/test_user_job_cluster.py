"""A user's own job on a 2-node cluster whose nodes have disks of their own: README's cloud walk.

The cluster runs the dstack task's own commands (tests/helpers/bundle_netns.py plays dstack's runner), each
node with its own /tmp, home and working directory. The user's machine is the host: `cloudrl submit`
runs with the host's filesystem at the end of the dashboard tunnel (inside the head's network
namespace), from a directory holding only README's files (examples/my-job). Nothing of it is on any
node: the reward code and the prompts travel with the job, the built-in model is made on the head and
shipped to the other node, and a model directory that exists only on the user's machine reaches both.
Each node has 2 CPUs, so the job's four single-CPU roles need both nodes.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from test_bundle_cluster import READY, client_env, dashboard_port, kind, new_cluster, start_node, task  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "my-job"
CLOUDRL = str(Path(sys.executable).parent / "cloudrl")

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster(kind, task, tmp_path_factory):  # noqa: F811 (fixtures imported above)
    cluster = new_cluster(kind, 2, tmp_path_factory.mktemp(f"user-job-{kind}"))
    try:
        cluster.create()
        # CLOUDRL_RUNS_DIR stands in for the /checkpoints volume the bootstrap would pick: on the
        # head's own /tmp (the loopback stand-in has no private /tmp, so a directory of the test's).
        cluster.volume = "/tmp/volume" if cluster.kind == "netns" else str(cluster.workdir / "volume")
        for rank in range(2):
            start_node(cluster, task, rank, CLOUDRL_NUM_CPUS="2", CLOUDRL_RUNS_DIR=cluster.volume)
        cluster.nodes[0].wait_for(READY, 150)
        yield cluster
    finally:
        cluster.stop()
    assert cluster.leftover_pids() == []


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    """A directory with only README's three files in it, on the user's machine."""
    job = tmp_path_factory.mktemp("user") / "my-job"
    job.mkdir()
    for name in ("my_reward.py", "train.jsonl", "my-job.yaml"):
        shutil.copyfile(EXAMPLE / name, job / name)
    return job


def cloudrl(cluster, cwd: Path, *args: str, timeout: float = 420):
    """`cloudrl ARGS` from `cwd` on the user's machine, with the forwarded dashboard as RAY_ADDRESS."""
    env = {**client_env(cluster), "RAY_ADDRESS": f"http://127.0.0.1:{dashboard_port(cluster)}"}
    return cluster.exec(0, ["sh", "-c", 'cd "$0" && exec "$@"', str(cwd), CLOUDRL, *args], timeout, env=env)


def step_means(log: str, key: str) -> list[float]:
    return [float(v) for v in re.findall(rf"^step \d+/\d+ .*\b{re.escape(key)}=([-\d.e+]+)", log, re.M)]


def test_readme_walk_runs_the_users_reward_and_data_on_both_nodes(cluster, user_dir: Path) -> None:
    readme = (REPO / "README.md").read_text()
    for line in ("cloudrl submit --preset my-job.yaml --dry-run", "cloudrl submit --preset my-job.yaml --follow"):
        assert line in readme, f"README's cloud walk lost `{line}`"

    dry = cloudrl(cluster, user_dir, "submit", "--preset", "my-job.yaml", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    listing = dry.stdout.split("# files shipped as the job's working directory\n")[1].split("# job request")[0]
    assert [line.split()[-1] for line in listing.strip().splitlines()[:-1]] == ["my_reward.py", "train.jsonl"]
    assert " zipped (limit " in listing.strip().splitlines()[-1], listing

    run = cloudrl(cluster, user_dir, "submit", "--preset", "my-job.yaml", "--follow")
    log = run.stdout + run.stderr
    assert run.returncode == 0 and "SUCCEEDED" in log, log[-6000:]
    # The roles ran on both nodes, and the built-in model made on the head was copied to the other one.
    nodes = set(re.findall(r"^placement: \w+: \d+ worker\(s\) on node\(s\) (.+)$", log, re.M))
    assert len({n for line in nodes for n in line.split(", ")}) == 2, log[-6000:]
    assert re.search(r"model: .*builtin-tiny-\w+: copied to 1 node\(s\) that lacked it", log), log[-6000:]
    # The user's prompts (operands 5..9: the built-in task's go up to 4) and the user's reward.
    prompts = {f"{a}+{b}=" for a in range(5, 10) for b in range(10)}
    samples = re.findall(r"^sample: prompt '([^']*)'", log, re.M)
    assert samples and set(samples) <= prompts, log[-6000:]
    rewards = step_means(log, "rollout/reward_mean")
    assert len(rewards) == 4
    # `closeness` gives partial credit (0.1 steps); the built-in rewards give 0 or 1 per sample, so a
    # mean over a step's 256 samples (my-job.yaml keeps its base's 32 prompts x 8) would be a multiple of 1/256.
    assert any(abs(r * 256 - round(r * 256)) > 1e-3 for r in rewards), rewards
    # The run's relative run_dir landed on the head's volume, not in the job's temporary working dir.
    volume = cluster.node_path(0, cluster.volume) if cluster.kind == "netns" else Path(cluster.volume)
    metrics = volume / "runs" / "my-job" / "metrics.jsonl"  # its own run directory (my-job.yaml)
    logged = [json.loads(line)["rollout/reward_mean"] for line in metrics.read_text().splitlines()]
    assert logged == pytest.approx(rewards, rel=1e-3)


def test_a_model_directory_and_a_package_only_on_the_users_machine_reach_every_node(
    cluster, user_dir: Path, tmp_path_factory
) -> None:
    from cloudrl.trainer.inputs.demo import materialize_builtin

    # The user's model: a directory outside the job's directory, on the user's machine only.
    own = tmp_path_factory.mktemp("user-models") / "tiny-mine"
    shutil.copytree(materialize_builtin("tiny", warmup_steps=0), own)
    if cluster.kind == "netns":  # the loopback stand-in shares the host's filesystem
        for rank in range(2):
            assert not cluster.node_path(rank, own).exists()
            probe = cluster.run_in_node(rank, ["test", "-e", str(own)], timeout=30)
            assert probe.returncode == 1, f"node {rank} sees the user's model directory"

    # And the reward as a module of the user's own package, shipped with --workdir.
    (user_dir / "scoring").mkdir(exist_ok=True)
    (user_dir / "scoring" / "__init__.py").write_text("from my_reward import closeness  # noqa: F401\n")
    run = cloudrl(
        cluster,
        user_dir,
        "submit",
        "--preset",
        "my-job.yaml",
        "--follow",
        "--workdir",
        ".",
        f"model.path={own}",
        "model.sft_warmup_steps=0",
        "trainer.total_steps=2",
        "trainer.run_dir=runs/own-model",
        "reward.function=scoring:closeness",
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0 and "SUCCEEDED" in log, log[-6000:]
    assert f"model.path=_external/1/{own.name}\n" in log  # the config was pointed at the shipped copy
    # Shipped in the job's working directory, which Ray unpacks on both nodes: found in place.
    assert re.search(rf"model: _external/1/{own.name}: present on all 2 node\(s\)", log), log[-6000:]
    assert len(step_means(log, "rollout/reward_mean")) == 2


def test_a_missing_file_or_an_oversized_upload_submits_nothing(cluster, user_dir: Path) -> None:
    before = cloudrl(cluster, user_dir, "list")
    assert before.returncode == 0, before.stderr
    missing = cloudrl(cluster, user_dir, "submit", "--preset", "my-job.yaml", "data.train_files=typo.jsonl")
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [
        f"error: data.train_files: typo.jsonl not found (relative to {user_dir}): fix the path; a file that exists "
        f"only on the cluster must be given as an absolute path (e.g. /checkpoints/...)"
    ]
    big = user_dir / "big.jsonl"
    with open(big, "wb") as f:  # random bytes do not compress: over the 100 MiB limit once zipped
        for _ in range(101):
            f.write(__import__("os").urandom(1024 * 1024))
    try:
        over = cloudrl(cluster, user_dir, "submit", "--preset", "my-job.yaml", "data.val_files=big.jsonl")
    finally:
        big.unlink()
    assert over.returncode == 1
    lines = over.stderr.strip().splitlines()
    assert len(lines) == 1 and "over Ray's 100.0 MiB upload limit (largest: big.jsonl (101.0 MiB)" in lines[0], lines
    after = cloudrl(cluster, user_dir, "list")
    assert after.stdout == before.stdout  # no job was created
