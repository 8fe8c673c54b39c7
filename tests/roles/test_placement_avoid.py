"""trainer.exclude_stragglers' placement on a real Ray: a placement group told to avoid a node (roles/launch.py
`AVOIDED_NODES`, Ray's node-id label selector) is never placed there. On the session's one-node Ray instance,
avoiding its only node leaves the group unplaced (one line, nothing left behind); the same group without
it is placed on that node."""

from __future__ import annotations

import pytest
from cloudrl.trainer.errors import PlacementTimeout
from cloudrl.trainer.roles import launch as launching
from cloudrl.trainer.roles.placement import RoleRequest


def test_a_group_is_never_placed_on_an_avoided_node(ray_local, monkeypatch):
    import ray
    from ray.util import placement_group_table, remove_placement_group

    node = ray.get_runtime_context().get_node_id()
    request = RoleRequest("actor", [{"CPU": 1.0}], "PACK", workers_per_bundle=1, keys="actor.nodes=1")
    monkeypatch.setattr(launching, "AVOIDED_NODES", frozenset({node}))
    with pytest.raises(PlacementTimeout, match="actor workers were not placed within placement.timeout_s=3s"):
        launching.create_placement_group(request, 3)
    left = [t for t in placement_group_table().values() if t["name"] == "cloudrl-actor" and t["state"] != "REMOVED"]
    assert left == []  # the group that could not be placed was removed
    monkeypatch.setattr(launching, "AVOIDED_NODES", frozenset())
    pg = launching.create_placement_group(request, 30)
    try:
        assert set(placement_group_table(pg)["bundles_to_node_id"].values()) == {node}
    finally:
        remove_placement_group(pg)
