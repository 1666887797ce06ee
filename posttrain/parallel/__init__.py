"""Training K3 over several processes: expert parallelism (routed experts split over an EP group,
tokens exchanged by all-to-all) and its gradient synchronisation."""

from posttrain.parallel.expert import (
    ShardedKimiK3Experts,
    expert_parallel_mesh,
    expert_parameters,
    shard_experts,
    sync_gradients,
)

__all__ = [
    "ShardedKimiK3Experts",
    "expert_parallel_mesh",
    "expert_parameters",
    "shard_experts",
    "sync_gradients",
]
