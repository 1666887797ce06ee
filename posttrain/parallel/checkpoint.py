"""Checkpoints of an expert-parallel model without gathering its experts on one rank.

`save_sharded` / `load_sharded` go through torch.distributed.checkpoint (DCP): every rank writes its
own experts (and Adam moments) and reads them back on the same layout, so resuming continues bit for
bit. DCP treats a plain tensor as replicated (one rank writes it), so the expert tensors, which
differ per rank, are handed to it as DTensors sharded along the expert dim of the EP mesh (and
replicated along its expert_replica dim); everything else goes as `get_state_dict` returns it.

`export_experts_safetensors` writes the servable layout (`...experts.{e}.w1.weight`, one 2-D
tensor per expert, the names `save_pretrained` writes) straight from the shards: each rank of the
first EP group writes one file with its own experts, rank 0 writes the dense weights, config.json
and the safetensors index, whose expert names it knows by arithmetic. No tensor crosses ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from posttrain.parallel.expert import EXPERT_DIM, REPLICA_DIM, ShardedKimiK3Experts

EXPERT_WEIGHTS = ("w1", "w2", "w3")


def _expert_names(model: nn.Module) -> dict[str, ShardedKimiK3Experts]:
    """Qualified parameter name -> its module, for every sharded expert weight."""
    return {
        f"{name}.{w}": module
        for name, module in model.named_modules()
        if isinstance(module, ShardedKimiK3Experts)
        for w in EXPERT_WEIGHTS
    }


def _as_dtensor(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    return DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False)


def _wrapped(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh) -> dict:
    """{"model": ..., "optim": ...} from get_state_dict, expert tensors as sharded DTensors."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    experts = _expert_names(model)
    # New dicts, never assignments into get_state_dict's: its optimizer entries are the optimizer's
    # own state dicts, and a DTensor left there breaks the next step.
    model_sd = {k: _as_dtensor(v, mesh) if k in experts else v for k, v in model_sd.items()}
    state = {
        name: {
            # Adam's moments are sharded like their parameter; its step count is a scalar
            key: _as_dtensor(v, mesh) if name in experts and isinstance(v, torch.Tensor) and v.dim() else v
            for key, v in entry.items()
        }
        for name, entry in optim_sd["state"].items()
    }
    optim_sd = {**optim_sd, "state": state}
    return {"model": model_sd, "optim": optim_sd}


def _unwrapped(tree):
    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return {k: _unwrapped(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_unwrapped(v) for v in tree]
    return tree


def save_sharded(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh
) -> None:
    """Write model and optimizer state to the DCP directory `path` (a collective: every rank calls it)."""
    dcp.save(_wrapped(model, optimizer, mesh), checkpoint_id=Path(path))


def load_sharded(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh
) -> None:
    """Read `save_sharded`'s directory into model and optimizer, on the mesh it was written from (same
    world and EP size: the expert shards are read back where they were written)."""
    state = _wrapped(model, optimizer, mesh)
    # get_state_dict gives a fresh optimizer state for every parameter; the checkpoint has none for
    # the parameters that never had a gradient, and these stay without one.
    saved = dcp.FileSystemReader(Path(path)).read_metadata().state_dict_metadata
    with_state = {
        k.removeprefix("optim.state.").rsplit(".", 1)[0] for k in saved if k.startswith("optim.state.")
    }
    optim_state = state["optim"]["state"]
    for name in [n for n in optim_state if n not in with_state]:
        del optim_state[name]
    dcp.load(state, checkpoint_id=Path(path))
    plain = _unwrapped(state)
    # strict=False for those stateless parameters only: the model keys are get_state_dict's own, all
    # of them loaded above (dcp.load fails on a key the checkpoint lacks).
    set_state_dict(
        model,
        optimizer,
        model_state_dict=plain["model"],
        optim_state_dict=plain["optim"],
        options=StateDictOptions(strict=False),
    )


def export_experts_safetensors(model: nn.Module, out_dir: str | Path, mesh: DeviceMesh) -> None:
    """Write the model in the released per-expert layout to out_dir, sharded by EP rank.

    Files: `model-experts-{r}-of-{R}.safetensors` (rank r of the EP group: its experts),
    `model-dense.safetensors` (rank 0: everything else), `model.safetensors.index.json` and
    config.json (rank 0). `from_pretrained` reads the directory as one checkpoint. A collective (it
    ends with a barrier, so every file exists when any rank returns).
    """
    out = Path(out_dir)
    replica, ep = mesh[REPLICA_DIM].get_local_rank(), mesh[EXPERT_DIM].get_local_rank()
    ep_size = mesh[EXPERT_DIM].size()
    experts = _expert_names(model)
    width = len(str(ep_size))

    def expert_file(r: int) -> str:
        return f"model-experts-{r + 1:0{width}d}-of-{ep_size}.safetensors"

    if replica == 0:
        out.mkdir(parents=True, exist_ok=True)
        params = dict(model.named_parameters())
        tensors = {}
        for name, module in experts.items():
            prefix, weight = name.rsplit(".", 1)
            for i, e in enumerate(range(module.first_expert, module.first_expert + module.num_local_experts)):
                tensors[f"{prefix}.{e}.{weight}.weight"] = params[name].detach()[i].contiguous()
        save_file(tensors, out / expert_file(ep), metadata={"format": "pt"})
    if dist.get_rank() == 0:
        dense = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k not in experts}
        save_file(dense, out / "model-dense.safetensors", metadata={"format": "pt"})
        weight_map = dict.fromkeys(dense, "model-dense.safetensors")
        for name, module in experts.items():
            prefix, weight = name.rsplit(".", 1)
            for e in range(module.num_experts):
                weight_map[f"{prefix}.{e}.{weight}.weight"] = expert_file(e // module.num_local_experts)
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        model.config.save_pretrained(out)
    dist.barrier()
