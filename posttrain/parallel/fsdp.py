"""FSDP2 (`fully_shard`) over everything of K3 but its expert-parallel routed experts.

The experts are already split over the EP group and must not be gathered (that is the point of
expert parallelism), so they are FSDP's `ignored_params`: FSDP2 shards, gathers and averages the
gradients of the rest (one unit per decoder layer, the `fsdp.wrap_classes` default, then the root),
and `sync_expert_gradients` brings the expert gradients to the same mean after each backward.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from posttrain.parallel.expert import expert_parameters


def fully_shard_dense(
    model: nn.Module,
    device_type: str = "cpu",
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> DeviceMesh:
    """Apply FSDP2 over the whole world to every `model.model.layers[i]` and to the root, leaving the
    sharded experts out; returns the 1-D world mesh it used. Call after `shard_experts`."""
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    ignored = set(expert_parameters(model))
    if not ignored:
        raise ValueError("fully_shard_dense: no sharded experts in the model; call shard_experts first")
    options = {"mesh": mesh, "ignored_params": ignored, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    for layer in model.model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return mesh
