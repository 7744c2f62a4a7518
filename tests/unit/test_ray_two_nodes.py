"""A two-node Ray cluster simulated on this machine (`ray.cluster_utils.Cluster`: a head and a
worker node of one CPU each): two replicas, each reserving one CPU, are placed one per node, and
requests through the head's HTTP proxy are served on both nodes."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from test_ray_serve import answer, deploy_on, node_args, ray_environment, stop_ray  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def test_replicas_on_both_nodes_and_both_serve():
    from ray.cluster_utils import Cluster

    with ray_environment():
        cluster = Cluster(initialize_head=True, head_node_args=node_args(1))
        try:
            cluster.add_node(**node_args(1))
            # One proxy, on the head: both nodes share this machine's loopback address.
            port = deploy_on(cluster)
            nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
            assert len(nodes) == 2
            served = {(r.headers["x-specdec-replica"], r.headers["x-specdec-node"])
                      for r in (answer(f"http://127.0.0.1:{port}", f"key-{i}") for i in range(16))}
            assert len({replica for replica, _ in served}) == 2
            assert {node for _, node in served} == nodes
        finally:
            stop_ray(cluster)
