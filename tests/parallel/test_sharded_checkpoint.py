"""Sharded checkpoints of an expert-parallel model in gloo processes: a DCP save / load that resumes
bit for bit, and the gather-free per-expert export (released layout) read back by transformers'
`from_pretrained` (the loader every K3 consumer uses for this layout). At 2 ranks EP 2 with the
dense gradients all-reduced; at 4 ranks EP 2 (two groups holding the same experts) under FSDP2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dist_support import batch, run_ranks, seeded_model
from torch.distributed.tensor import DTensor

from posttrain.model import KimiK3ForCausalLM
from posttrain.model.balancing import update_router_bias
from posttrain.parallel import expert_parallel_mesh, shard_experts, sync_expert_gradients, sync_gradients
from posttrain.parallel.checkpoint import export_released_sharded, load_sharded, save_sharded
from posttrain.parallel.fsdp import fully_shard_dense


def _sharded(seed: int, mesh, fsdp: bool):
    model = seeded_model(seed)
    shard_experts(model, mesh["expert"].get_group())
    if fsdp:
        fully_shard_dense(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _steps(model, optimizer, mesh, rank: int, n: int, fsdp: bool) -> None:
    ids, labels = batch(mesh.size())
    for _ in range(n):
        logits = model(input_ids=ids[rank : rank + 1]).logits
        F.cross_entropy(logits.flatten(0, 1), labels[rank]).backward()
        (sync_expert_gradients if fsdp else sync_gradients)(model, mesh)
        optimizer.step()
        optimizer.zero_grad()
        update_router_bias(model)  # the router biases move too, and are part of the state


def _local(state: dict) -> dict:
    """Plain tensors: FSDP2's shards as this rank holds them."""
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}


def _worker(rank: int, world: int, workdir: str, ep: int, fsdp: bool) -> None:
    mesh = expert_parallel_mesh(ep)
    steps = 2 if world == 2 else 1  # 4 processes share CI's 2 cores
    model, optimizer = _sharded(0, mesh, fsdp)
    _steps(model, optimizer, mesh, rank, steps, fsdp)
    save_sharded(Path(workdir) / "ckpt", model, optimizer, mesh)
    _steps(model, optimizer, mesh, rank, steps, fsdp)
    uninterrupted = {k: v.clone() for k, v in _local(model.state_dict()).items()}

    resumed, resumed_opt = _sharded(7, mesh, fsdp)  # other initial weights: the load must replace all
    assert not torch.equal(_local(resumed.state_dict())["lm_head.weight"], uninterrupted["lm_head.weight"])
    load_sharded(Path(workdir) / "ckpt", resumed, resumed_opt, mesh)
    _steps(resumed, resumed_opt, mesh, rank, steps, fsdp)
    for name, value in _local(resumed.state_dict()).items():
        assert torch.equal(value, uninterrupted[name]), name

    out = Path(workdir) / "export"
    export_released_sharded(model, out, mesh)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == [
        "model-dense.safetensors",
        *(f"model-experts-{r}-of-{ep}.safetensors" for r in range(1, ep + 1)),
    ]
    loaded = KimiK3ForCausalLM.from_pretrained(out).state_dict()
    mine = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    assert loaded.keys() == mine.keys()
    per_rank, ep_rank = 8 // ep, rank % ep
    for name, value in mine.items():
        if name.split(".")[-1] in ("w1", "w2", "w3"):
            local = slice(ep_rank * per_rank, (ep_rank + 1) * per_rank)
            assert torch.equal(loaded[name][local], value), name
        else:
            assert torch.equal(loaded[name], value), name


@pytest.mark.parametrize(("world", "ep", "fsdp"), [(2, 2, False), (4, 2, True)])
def test_sharded_checkpoint_resumes_bit_exact_and_exports_per_expert(world, ep, fsdp, tmp_path) -> None:
    run_ranks(_worker, world, tmp_path, ep, fsdp)
