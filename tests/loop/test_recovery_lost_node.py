"""A node lost for good: the restart waits trainer.restart_wait_s (capacity check and placement together,
not placement.timeout_s) and then ends the run with one line naming the node, the roles it held and the
ways on. No cluster here: Ray is stubbed at its edge (`ray.nodes` and its draining set, `ray.util.placement_group`,
`ray.wait`), and everything above it (the restart loop, the capacity check, the placement wait) is the
trainer's own code."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import ray
import ray.util
from cloudrl.trainer.config import load_config
from cloudrl.trainer.errors import RecoveryFailed
from cloudrl.trainer.recovery import run_with_restarts
from cloudrl.trainer.roles import launch as launching
from cloudrl.trainer.roles.placement import plan
from ray.exceptions import ActorDiedError

HEAD, LOST, SPARE = "aa11" * 14, "bb22" * 14, "cc33" * 14  # Ray node ids are 56 hex digits


def _node(node_id: str, alive: bool) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 4.0}, "NodeManagerAddress": "x"}


class _Dead(ActorDiedError):
    """Ray's error for the critic's rank 1, whose node went away."""

    def __init__(self):
        super().__init__()
        self.actor_id = "critic1"

    def __str__(self):
        return (
            "The actor died unexpectedly before finishing this task.\n\tclass_name: CriticWorker\n"
            f"\tip: 10.0.0.2\nThe actor is dead because its node has died. Node Id: {LOST}\n"
        )


class _Group:
    def __init__(self, name: str):
        self.name = name
        self.places = [{"rank": 0, "node_id": HEAD, "ip": "10.0.0.1"}, {"rank": 1, "node_id": LOST, "ip": "10.0.0.2"}]
        self.workers = [SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda r=r: f"{name}{r}")) for r in range(2)]

    def labels(self):
        return [f"{self.name} rank {p['rank']} on {p['ip']}" for p in self.places]


class _Roles:
    """The actor and the critic, rank 0 on the head and rank 1 on the node that goes away."""

    shut = 0

    def groups(self):
        return [_Group("actor"), _Group("critic")]

    def shutdown(self):
        _Roles.shut += 1


@pytest.fixture
def cfg(tmp_path):
    _Roles.shut = 0
    return load_config(
        "local",
        [
            f"trainer.run_dir={tmp_path}",
            "actor.nodes=2",
            "critic.nodes=2",
            "actor.micro_batch_size=8",
            "critic.micro_batch_size=8",
            "placement.timeout_s=60",
        ],
    )


def _inputs():
    return SimpleNamespace(resume=None, model_path="m", critic_path="c")


@pytest.fixture(autouse=True)
def no_draining_nodes(monkeypatch):
    """Ray's set of draining nodes (those with a preemption notice), stubbed with the rest of its edge: empty."""
    from ray._private.state import state

    monkeypatch.setattr(state, "get_draining_nodes", lambda: {})


def test_a_node_lost_for_good_ends_the_run_after_restart_wait_s_naming_it(cfg, monkeypatch, capsys):
    cfg.trainer.restart_wait_s = 1.5
    nodes = [_node(HEAD, True), _node(LOST, True)]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    launches = []

    def launch():
        launches.append(time.monotonic())
        return _Roles()

    def run(roles, restarts):
        nodes[1] = _node(LOST, False)  # Ray has noticed: the node is dead, and nothing replaces it
        raise _Dead()

    start = time.monotonic()
    with pytest.raises(RecoveryFailed) as err:
        run_with_restarts(cfg, plan(cfg), _inputs(), launch, run)
    took = time.monotonic() - start
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"lost node 10.0.0.2 (id {LOST[:12]}, held actor rank 1, critic rank 1); ")
    assert (
        "no replacement joined within trainer.restart_wait_s=1.5s (the cluster now has 1 node with no GPU, 4 CPUs)"
        in line
    )
    assert "add a replacement node and resubmit the same config with trainer.resume=auto" in line
    assert "run the same job on fewer nodes: lower actor.nodes=2, critic.nodes=2 and resubmit" in line
    assert 1.5 <= took < 5, took  # restart_wait_s, not placement.timeout_s=60
    assert len(launches) == 1  # the roles were never started again on a cluster that cannot hold them
    assert _Roles.shut == 1
    assert "within trainer.restart_wait_s=1.5s (restart 1 of trainer.max_restarts=3)" in capsys.readouterr().out


def test_a_lost_node_ray_still_counts_alive_ends_on_restart_wait_s_not_the_placement_timeout(cfg, monkeypatch):
    """Ray marks a vanished node dead only after its health checks fail: until then the capacity check
    passes and the placement group stays pending. Each placement wait is cut to the restart's time left."""
    cfg.trainer.restart_wait_s = 2.0
    monkeypatch.setattr(ray, "nodes", lambda: [_node(HEAD, True), _node(LOST, True)])
    waits, removed = [], []

    def pending_wait(refs, timeout):
        waits.append(timeout)
        time.sleep(min(timeout, 30))
        return [], refs

    monkeypatch.setattr(ray, "wait", pending_wait)
    monkeypatch.setattr(ray.util, "placement_group", lambda *a, **k: SimpleNamespace(ready=lambda: "ref"))
    monkeypatch.setattr(ray.util, "remove_placement_group", removed.append)
    requests = plan(cfg)
    runs = []

    def launch():
        if runs:  # the restart: the real placement wait, on a group Ray cannot place
            launching.create_placement_group(requests[0], cfg.placement.timeout_s)
        return _Roles()

    def run(roles, restarts):
        runs.append(restarts)
        raise _Dead()

    start = time.monotonic()
    with pytest.raises(RecoveryFailed) as err:
        run_with_restarts(cfg, requests, _inputs(), launch, run)
    took = time.monotonic() - start
    assert str(err.value).startswith(f"lost node 10.0.0.2 (id {LOST[:12]}, held actor rank 1, critic rank 1); ")
    assert "trainer.restart_wait_s=2s" in str(err.value)
    assert took < 10, took  # not placement.timeout_s=60
    assert waits and all(w <= 2.0 for w in waits), waits
    assert len(removed) == len(waits)  # every pending group removed
    assert launching.PLACEMENT_DEADLINE is None  # later placements get placement.timeout_s again
    assert runs == [0]


def test_a_replacement_node_within_restart_wait_s_restarts_the_run(cfg, monkeypatch):
    cfg.trainer.restart_wait_s = 30
    lost_at = []

    def nodes():
        spare = [_node(SPARE, True)] if lost_at and time.monotonic() > lost_at[0] + 0.5 else []
        return [_node(HEAD, True), _node(LOST, not lost_at)] + spare

    monkeypatch.setattr(ray, "nodes", nodes)

    def run(roles, restarts):
        if not lost_at:
            lost_at.append(time.monotonic())
            raise _Dead()
        return {"steps": 2, "restarts": restarts}

    assert run_with_restarts(cfg, plan(cfg), _inputs(), _Roles, run) == {"steps": 2, "restarts": 1}
    assert _Roles.shut == 2  # after the loss, and at the end


SLOW_LABEL = "actor rank 0 on 10.0.0.1"


@pytest.mark.parametrize(
    ("exclude", "spares", "left_out"),
    [(True, 2, True), (True, 1, False), (False, 2, False)],
    ids=["room-without-it", "no-room-without-it", "setting-off"],
)
def test_a_straggler_node_is_left_out_at_a_restart_only_when_the_others_hold_every_role(
    cfg, monkeypatch, capsys, exclude, spares, left_out
):
    """trainer.exclude_stragglers: the head, where the watch named the actor's rank 0 a straggler, is left out of
    the restart's placement (Ray's node-id label selector, roles/launch.py) when the nodes that stay hold every
    role; with one spare node too few, or the setting off, it is kept."""
    from cloudrl.trainer.hangs import WATCH
    from cloudrl.trainer.stragglers import Stragglers

    cfg.trainer.restart_wait_s = 30
    cfg.trainer.exclude_stragglers = exclude
    named = Stragglers()
    named.named.add(SLOW_LABEL)
    monkeypatch.setattr(WATCH, "stragglers", named)
    monkeypatch.setattr(WATCH, "places", {SLOW_LABEL: (HEAD, 1)})
    lost = []
    spare_ids = [SPARE, "dd44" * 14][:spares]
    monkeypatch.setattr(
        ray, "nodes", lambda: [_node(HEAD, True), _node(LOST, not lost)] + [_node(n, True) for n in spare_ids]
    )
    avoided = []

    def launch():
        avoided.append(launching.AVOIDED_NODES)
        return _Roles()

    def run(roles, restarts):
        if not lost:
            lost.append(True)
            raise _Dead()
        return {"restarts": restarts}

    assert run_with_restarts(cfg, plan(cfg), _inputs(), launch, run) == {"restarts": 1}
    assert avoided == [frozenset(), frozenset({HEAD}) if left_out else frozenset()]
    assert launching.AVOIDED_NODES == frozenset()  # only while the restart places its groups
    out = capsys.readouterr().out
    if left_out:
        assert f"straggler node(s) {HEAD[:12]} left out at this restart (trainer.exclude_stragglers)" in out
    elif exclude:
        assert f"straggler node(s) {HEAD[:12]} kept at this restart: the cluster cannot hold every role" in out
    else:
        assert "straggler node" not in out


def test_a_group_with_avoided_nodes_asks_ray_to_place_it_elsewhere(monkeypatch):
    """The selector create_placement_group hands Ray: its node-id label, not in the avoided set (Ray's own
    placement honouring it: tests/roles/test_placement_avoid.py)."""
    from cloudrl.trainer.roles.placement import RoleRequest

    made = []

    def placement_group(bundles, strategy, name, **options):
        made.append(options)
        return SimpleNamespace(ready=lambda: "ref")

    monkeypatch.setattr(ray.util, "placement_group", placement_group)
    monkeypatch.setattr(ray, "wait", lambda refs, timeout: (refs, []))
    request = RoleRequest("actor", [{"CPU": 1.0}, {"CPU": 1.0}], "PACK", workers_per_bundle=1, keys="actor.nodes=1")
    launching.create_placement_group(request, 5)
    monkeypatch.setattr(launching, "AVOIDED_NODES", frozenset({LOST, HEAD}))
    launching.create_placement_group(request, 5)
    assert made[0] == {}
    assert made[1] == {"bundle_label_selector": [{"ray.io/node-id": f"!in({HEAD},{LOST})"}] * 2}


# --- the same on a real 2-node Ray cluster: the second node SIGKILLed and never replaced -------------------

DRIVER = '''
import json, os, sys, tempfile, time
from pathlib import Path
from types import SimpleNamespace

import ray
from cloudrl.trainer.config import load_config
from cloudrl.trainer.errors import RecoveryFailed
from cloudrl.trainer.recovery import run_with_restarts
from cloudrl.trainer.roles.launch import WORKER_CLASSES, launch_roles
from cloudrl.trainer.roles.placement import plan


class Probe:
    """Any role's worker, loading nothing: the trainer's own launch code places and starts it."""

    def __init__(self, *args, rank=0, world_size=1, **kwargs):
        self.rank = rank

    def where(self):
        return {"rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid(), "gpus": []}

    def open_rendezvous(self):
        return "127.0.0.1", 0

    def start_training(self, addr, port):
        pass


ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR")
cfg = load_config("local", sys.argv[1:])
model = tempfile.mkdtemp()
Path(model, "config.json").write_text("{}")
requests = plan(cfg)


def launch():
    return launch_roles(cfg, requests, model, model, classes={role: Probe for role in WORKER_CLASSES})


def run(roles, restarts):
    print("PLACED " + json.dumps({g.name: [p["node_id"] for p in g.places] for g in roles.groups()}), flush=True)
    while True:  # the training loop: every worker answers, until one is gone
        ray.get([w.where.remote() for g in roles.groups() for w in g.workers], timeout=300)
        time.sleep(0.2)


try:
    run_with_restarts(cfg, requests, SimpleNamespace(resume=None, model_path=model, critic_path=model), launch, run)
except RecoveryFailed as exc:
    print(f"error: {exc}", flush=True)
    sys.exit(1)
'''


@pytest.mark.ray
def test_a_node_killed_for_good_ends_a_real_run_after_restart_wait_s(private_cache, tmp_path):
    import json
    import os
    import re
    import subprocess
    import sys

    from cloudrl.cli.node_processes import stop_node
    from runs import REPO, local_cluster, start_worker_node, wait_nodes
    from test_recovery_node_loss import CPUS, _sigkill_node

    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    overrides = [
        f"trainer.run_dir={tmp_path / 'run'}",
        "actor.nodes=2",
        "critic.nodes=2",
        "actor.micro_batch_size=8",
        "critic.micro_batch_size=8",
        "trainer.restart_wait_s=8",
        "placement.timeout_s=600",
    ]
    nodes = []
    with local_cluster(nodes=1, cpus_per_node=4, gpus_per_node=0) as state:
        try:
            nodes.append(start_worker_node(state, "w1", CPUS))
            wait_nodes(state, 2)
            log = tmp_path / "driver.log"
            with open(log, "w") as out:
                proc = subprocess.Popen(
                    [sys.executable, str(script), *overrides],
                    cwd=REPO,
                    env={**os.environ, "RAY_ADDRESS": state["gcs_address"], "PYTHONUNBUFFERED": "1"},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            try:
                deadline = time.monotonic() + 180
                while "PLACED " not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.2)
                text = log.read_text()
                assert "PLACED " in text, text[-3000:]
                placed = json.loads(text.split("PLACED ", 1)[1].splitlines()[0])
                _sigkill_node(nodes[0])
                killed = time.monotonic()
                code = proc.wait(timeout=240)
                took = time.monotonic() - killed
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
                    proc.wait(timeout=30)
            text = log.read_text()
            assert code == 1, text[-3000:]
            errors = [line for line in text.splitlines() if line.startswith("error: ")]
            assert len(errors) == 1, text[-3000:]
            found = re.match(
                r"error: lost node [0-9.]+ \(id ([0-9a-f]{12}), held ([^)]*)\); no replacement joined within "
                r"trainer\.restart_wait_s=8s \(the cluster now has [^)]*\): add a replacement node and resubmit the "
                r"same config with trainer\.resume=auto to continue from the latest checkpoint, or run the same job "
                r"on fewer nodes: lower ([^ ]+(?: [^ ]+)*?) and resubmit with trainer\.resume=auto",
                errors[0],
            )
            assert found, errors[0]
            node_id, held, keys = found.groups()
            on_node = [
                f"{role} rank {r}" for role, ids in placed.items() for r, n in enumerate(ids) if n[:12] == node_id
            ]
            assert held == ", ".join(on_node), (held, placed)
            assert "actor rank" in held and "critic rank" in held  # both spread over the two nodes
            assert "actor.nodes=2" in keys and "critic.nodes=2" in keys
            assert 8 <= took < 120, took  # restart_wait_s (and Ray noticing the loss), never placement.timeout_s=600
        finally:
            for node in nodes:
                stop_node(node)
