"""Training K3 over several processes: expert parallelism (routed experts split over an EP group,
tokens exchanged by all-to-all), its gradient synchronisation, FSDP2 over the rest (`fsdp.py`), and
sharded checkpoints and exports (`checkpoint.py`)."""

from posttrain.parallel.expert import (
    ShardedKimiK3Experts,
    expert_parallel_mesh,
    expert_parameters,
    shard_experts,
    sync_expert_gradients,
    sync_gradients,
)

__all__ = [
    "ShardedKimiK3Experts",
    "expert_parallel_mesh",
    "expert_parameters",
    "shard_experts",
    "sync_expert_gradients",
    "sync_gradients",
]
