"""What the restart loop says without a cluster: which errors count as a lost worker or node (Ray's own
exception classes), and the one line a run that cannot recover ends with."""

from __future__ import annotations

import pytest
from cloudrl.trainer.config import load_config
from cloudrl.trainer.errors import RecoveryFailed
from cloudrl.trainer.recovery import describe_dead_actor, lost_component, run_with_restarts
from ray.exceptions import ActorDiedError, NodeDiedError, RayTaskError

DEAD = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: CriticWorker\n\tactor_id: 00ab\n"
    "\tpid: 4242\n\tnamespace: x\n\tip: 10.0.0.2\nThe actor is dead because its node has died. Node Id: 1234\n"
)


class _Dead(ActorDiedError):
    def __str__(self):
        return DEAD


def test_lost_workers_and_nodes_are_recognised_and_other_errors_are_not():
    assert describe_dead_actor(_Dead(), None) == "critic on 10.0.0.2: dead because its node has died. Node Id: 1234"
    assert lost_component(NodeDiedError("node 1234 died"), None).startswith("a node: ")
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:6000")
    assert lost_component(RayTaskError("update", "Traceback ...", gloo), None).startswith("a peer of a collective")
    assert lost_component(RayTaskError("update", "Traceback ...", ValueError("bad batch")), None) is None
    assert lost_component(ValueError("Connection closed by peer"), None) is None


def test_a_run_out_of_restarts_ends_with_one_line():
    cfg = load_config("local", ["trainer.max_restarts=0"])
    shut = []

    class Roles:
        def shutdown(self):
            shut.append(True)

    def run(roles, restarts):
        raise _Dead()

    with pytest.raises(RecoveryFailed) as err:
        run_with_restarts(cfg, [], None, Roles, run)
    assert str(err.value) == (
        "lost critic on 10.0.0.2: dead because its node has died. Node Id: 1234; no restart "
        "left (trainer.max_restarts=0): fix the cluster, then resubmit the same config with "
        "trainer.resume=auto to continue from the latest checkpoint"
    )
    assert shut == [True]  # the roles were shut down all the same


def test_an_unusable_checkpoint_uri_is_one_line():
    from cloudrl.trainer.errors import CheckpointError
    from cloudrl.trainer.state.storage import check

    with pytest.raises(CheckpointError) as err:
        check("nosuch://bucket/run")
    assert str(err.value).startswith("trainer.checkpoint_uri=nosuch://bucket/run cannot be used (ValueError: ")
    assert "pip install 'cloudrl[s3]'" in str(err.value)


def test_an_unreachable_actor_is_named_with_rays_reason():
    from ray.exceptions import ActorUnavailableError

    class Unreachable(ActorUnavailableError):
        def __init__(self):
            pass

        def __str__(self):
            return (
                "The actor 84f7 is unavailable: The actor is temporarily unavailable: RpcError: RPC error: "
                "Socket closed rpc_code: 14. The task may or may not have been executed on the actor.\n"
                "\tclass_name: PolicyWorker\n\tip: 10.0.0.3\n"
            )

    assert lost_component(Unreachable(), None) == "actor on 10.0.0.3: unreachable (Socket closed)"
