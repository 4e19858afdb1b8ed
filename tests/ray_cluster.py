"""The three-node Ray cluster of the `ray` tests (fixture `ray_cluster` in tests/cli/conftest.py): its nodes,
and the overrides that place a run's roles on them; and the one-node cluster with declared GPUs of
tests/cli/test_ray_gpus.py."""

from __future__ import annotations

# Logical CPUs: what the processes of a run reserve, not the host's cores. The custom resources pin the
# roles: the supervisor and the rollout workers on the head node, the trainer ranks on the other two. Each
# trainer node holds one rank's bundle, so the packed placement group must span both: the ranks form their
# torch.distributed group across Ray nodes (MASTER_ADDR from the first bundle's node).
# A small object store per node: the runs move nothing through it, and three default-sized ones would take
# a third of this machine's memory each.
STORE = 80 * 1024 * 1024
HEAD = {"num_cpus": 8, "resources": {"rollout_node": 8}, "object_store_memory": STORE}
TRAINER_NODES = [{"num_cpus": 2, "resources": {"trainer_node": 1}, "object_store_memory": STORE}] * 2
# GPUs the node declares but this host does not have: Ray hands them out (CUDA_VISIBLE_DEVICES per actor) all the
# same, and the processes, whose torch has no CUDA, compute on the CPU.
GPU_NODE = {"num_cpus": 8, "num_gpus": 4, "object_store_memory": STORE}
PLACEMENT = ["launcher.ray.supervisor.num_cpus=0.5", "launcher.ray.supervisor.resources={rollout_node: 1}",
             "launcher.ray.rollout.resources={rollout_node: 1}", "launcher.ray.trainer.resources={trainer_node: 1}"]


def node_ids() -> dict[str, str]:
    """Ray node id -> the node's custom resource (rollout_node or trainer_node) for every live node."""
    import ray

    return {n["NodeID"]: next(k for k in n["Resources"] if k.endswith("_node")) for n in ray.nodes() if n["Alive"]}
