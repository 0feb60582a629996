"""Placement against what the cluster's alive nodes hold, with Ray's cluster view faked: a node
that died or left stops ``place`` at once, or while a group waits, with one line naming what is
missing; groups already made are removed. (tests/e2e/test_cluster.py does it on a real cluster.)"""

from __future__ import annotations

import time

import pytest

from xrlhf.config.schema import Resources
from xrlhf.coordinator import resources
from xrlhf.utils.errors import UserError


class FakeCluster:
    """``ray.nodes()`` / ``ray.wait`` / placement groups as ``place`` sees them."""

    def __init__(self, *cpus: float, dead: int = 0):
        self.nodes = [{"NodeID": f"n{i}", "Alive": True, "Resources": {"CPU": c}} for i, c in enumerate(cpus)]
        self.nodes += [{"NodeID": f"d{i}", "Alive": False, "Resources": {}} for i in range(dead)]
        self.placed_at_once = 10**9  # groups placed at once; later ones stay pending
        self.made, self.removed = [], []
        self.on_wait = None  # called on every wait of a pending group (a node dies meanwhile)

    def placement_group(self, bundles, strategy):
        pg = FakeGroup(len(self.made) < self.placed_at_once)
        self.made.append(pg)
        return pg

    def wait(self, refs, timeout):
        (ref,) = refs
        if ref.placed:
            return [ref], []
        if self.on_wait:
            self.on_wait(self)
        time.sleep(min(timeout, 0.01))
        return [], [ref]

    def kill_node(self, i: int = 0) -> None:
        self.nodes[i] = {**self.nodes[i], "Alive": False}


class FakeGroup:
    def __init__(self, placed: bool):
        self.placed = placed

    def ready(self):
        return self


@pytest.fixture()
def cluster(monkeypatch):
    def make(*cpus, dead=0):
        c = FakeCluster(*cpus, dead=dead)
        monkeypatch.setattr(resources.ray, "nodes", lambda: c.nodes)
        monkeypatch.setattr(resources.ray, "wait", c.wait)
        monkeypatch.setattr(resources.ray, "available_resources", lambda: {"CPU": 0.0, "memory": 1.0})
        monkeypatch.setattr(resources, "placement_group", c.placement_group)
        monkeypatch.setattr(resources, "remove_placement_group", c.removed.append)
        return c
    return make


SPLIT = {"policy": Resources(), "rollout": Resources(), "reference": Resources()}  # 1 CPU each, own groups


def test_places_one_group_per_anchor(cluster):
    c = cluster(1, 1, 1)
    slots = resources.place({**SPLIT, "critic": Resources(colocate_with="policy")})
    assert len(c.made) == 3 and not c.removed
    assert slots["critic"].pg is slots["policy"].pg and slots["critic"].num_cpus == 0.5 == slots["policy"].num_cpus


def test_a_dead_node_does_not_count(cluster):
    c = cluster(1, 1, 1, dead=1)
    c.kill_node(2)
    with pytest.raises(UserError) as e:
        resources.place(SPLIT)
    assert e.value.messages == [
        "resources: the handles need 3 CPU in all (policy 1, rollout 1, reference 1) but the Ray cluster's 2 alive "
        "nodes have 2 (2 nodes of the cluster died or left): 1 CPU missing; add nodes, lower "
        "<handle>.resources.cpus_per_rank or ranks, or co-locate handles with resources.colocate_with"]
    assert not c.made  # nothing was asked of Ray


def test_a_rank_larger_than_every_node(cluster):
    cluster(2, 2)
    with pytest.raises(UserError) as e:
        resources.place({"policy": Resources(cpus_per_rank=3)})
    assert e.value.messages == ["policy.resources: one rank needs 3 CPU on one node but no alive node has that much "
                                "(the most one has: 2 CPU); lower policy.resources.cpus_per_rank / gpus_per_rank, "
                                "or add a larger node"]


def test_a_node_dying_while_a_group_waits_stops_the_wait(cluster):
    c = cluster(1, 1, 1)
    c.placed_at_once = 2  # the reference's group waits (its node is going away) ...
    c.on_wait = lambda c: c.kill_node(2)  # ... and the node is gone at the next look
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        resources.place(SPLIT, ready_timeout=60, poll_s=0.05)
    assert time.monotonic() - t0 < 30  # not the 60 s ready_timeout
    assert "but the Ray cluster's 2 alive nodes have 2 (1 node of the cluster died or left): 1 CPU missing" in \
        e.value.messages[0]
    assert c.removed == c.made and len(c.made) == 3  # every group made is given back


def test_a_group_that_never_fits_times_out_saying_what_is_free(cluster):
    c = cluster(1, 1, 1)
    c.placed_at_once = 0
    with pytest.raises(UserError) as e:
        resources.place(SPLIT, ready_timeout=0.2, poll_s=0.05)
    assert e.value.messages == ["policy.resources: Ray could not place 1 x {1 CPU} within 0.2 s; free now: 0 CPU "
                                "(other jobs or placement groups hold the rest)"]
    assert c.removed == c.made


def test_a_handle_restarted_in_its_group_after_its_node_died(cluster):
    """A restart in place asks for an actor in the old group; Ray is placing the dead node's
    bundle again, and the alive nodes cannot hold it: ``Slot.options`` says so instead of
    handing out a bundle the actor would wait for for ever."""
    c = cluster(1, 1, 1)
    slots = resources.place(SPLIT)
    assert slots["reference"].options(0)["num_cpus"] == 1  # placed: no wait
    c.made[2].placed = False  # the reference's bundle is being placed again ...
    c.kill_node(2)  # ... because its node is gone
    with pytest.raises(UserError) as e:
        slots["reference"].options(0)
    assert e.value.messages[0].startswith("resources: the handles need 3 CPU in all (policy 1, rollout 1, "
                                          "reference 1) but the Ray cluster's 2 alive nodes have 2")
