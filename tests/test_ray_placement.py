"""Where actors go on a Ray cluster of several nodes: training ranks pinned node by node, engine replicas round-robin
(the node list is Ray's own ``ray.nodes()`` answer, here a recorded one of three nodes, one dead)."""

from __future__ import annotations

import pytest
import ray

from arpo.runtime.ray_utils import cluster_nodes, node_strategy, rank_nodes

NODES = [
    {"NodeID": "b2", "Alive": True, "Resources": {"CPU": 4.0}},
    {"NodeID": "a1", "Alive": True, "Resources": {"CPU": 8.0, "GPU": 2.0}},
    {"NodeID": "c3", "Alive": False, "Resources": {"CPU": 16.0}},
    {"NodeID": "d4", "Alive": True, "Resources": {"CPU": 4.0}},
]


@pytest.fixture(autouse=True)
def recorded_cluster(monkeypatch):
    monkeypatch.setattr(ray, "nodes", lambda: NODES)


def test_alive_nodes_with_room_most_cpus_first():
    assert cluster_nodes() == ["a1", "b2", "d4"]  # ties in CPUs by id; the dead node never
    assert cluster_nodes(cpus=6) == ["a1"] and cluster_nodes(gpus=1) == ["a1"]


def test_ranks_fill_one_node_after_another():
    assert rank_nodes(1, 4, 1.0, 0.0) is None  # one node: Ray places them
    assert rank_nodes(2, 2, 1.0, 0.0) == ["a1", "a1", "b2", "b2"]
    assert rank_nodes(3, 1, 2.0, 0.0) == ["a1", "b2", "d4"]
    with pytest.raises(ValueError, match=r"trainer.nnodes=2: the Ray cluster has 1 node\(s\) with room for "
                                         r"trainer.n_gpus_per_node=2 ranks of 1 CPU\(s\) and 1 GPU\(s\)"):
        rank_nodes(2, 2, 1.0, 1.0)


def test_node_strategy_pins_hard_or_soft():
    assert node_strategy(None) == "DEFAULT"
    node = "ab" * 28  # Ray checks the id's form (hex)
    hard, soft = node_strategy(node), node_strategy(node, soft=True)
    assert (hard.node_id, hard.soft, soft.soft) == (node, False, True)
