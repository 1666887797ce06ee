"""Checkpoints of an expert-parallel model without gathering its experts on one rank.

`save_sharded` / `load_sharded` go through torch.distributed.checkpoint (DCP): every rank writes its
own experts (and Adam moments) and reads them back on the same layout, so resuming continues bit for
bit. DCP treats a plain tensor as replicated (one rank writes it), so the expert tensors, which
differ per rank, are handed to it as DTensors sharded along the expert dim of the EP mesh (and
replicated along its expert_replica dim); everything else goes as `get_state_dict` returns it.

`export_released_sharded` writes the servable released layout (`save_released`'s:
`language_model.…experts.{e}.w1.weight`, one 2-D tensor per expert) straight from the shards: each
rank of the first EP group writes one file with its own experts, rank 0 writes the dense weights,
the configs and the safetensors index, whose expert names it knows by arithmetic. No expert tensor
crosses ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from posttrain.model.released import (
    INDEX_FILE,
    MEDIA_PLACEHOLDER_TOKEN,
    PREPROCESSOR_FILE,
    TEXT_PREFIX,
    default_preprocessor_config,
    released_config_dict,
)
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


def _unwrapped(state: dict, experts: dict) -> dict:
    """`_wrapped`'s inverse: the expert entries back to this rank's local tensors (FSDP2's own
    DTensors stay DTensors: set_state_dict expects them)."""

    def local(v):
        return v.to_local() if isinstance(v, DTensor) else v

    model_sd = {k: local(v) if k in experts else v for k, v in state["model"].items()}
    optim_state = {
        name: {key: local(v) for key, v in entry.items()} if name in experts else entry
        for name, entry in state["optim"]["state"].items()
    }
    return {"model": model_sd, "optim": {**state["optim"], "state": optim_state}}


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
    plain = _unwrapped(state, _expert_names(model))
    # strict=False for those stateless parameters only: the model keys are get_state_dict's own, all
    # of them loaded above (dcp.load fails on a key the checkpoint lacks).
    set_state_dict(
        model,
        optimizer,
        model_state_dict=plain["model"],
        optim_state_dict=plain["optim"],
        options=StateDictOptions(strict=False),
    )


def export_released_sharded(
    model: nn.Module,
    out_dir: str | Path,
    mesh: DeviceMesh,
    tokenizer: Any = None,
    stop_token_ids: list[int] | None = None,
) -> None:
    """Write the model to out_dir in the released layout `save_released` writes (wrapper config,
    `language_model.*` names, per-expert routed weights, untied LM head, master dtype), the experts
    straight from their shards.

    Files: `model-experts-{r}-of-{R}.safetensors` (rank r of the first EP group: its experts),
    `model-dense.safetensors`, `model.safetensors.index.json`, config.json, the preprocessor and
    generation configs and the tokenizer (rank 0). Expert tensors never cross ranks; FSDP2's dense
    shards are gathered (`full_tensor`, on every rank, in state-dict order) for rank 0 to write.
    With stop_token_ids, generation stops on them and pads with the tokenizer's pad, as
    `save_final_model` sets it. A collective; it ends with a barrier, so every file exists when any
    rank returns. out_dir may exist (the stage's output dir does) but holds nothing of ours yet.
    """
    out = Path(out_dir)
    replica, ep = mesh[REPLICA_DIM].get_local_rank(), mesh[EXPERT_DIM].get_local_rank()
    ep_size = mesh[EXPERT_DIM].size()
    experts = _expert_names(model)
    width = len(str(ep_size))
    if tokenizer is not None and stop_token_ids is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = list(stop_token_ids)

    def expert_file(r: int) -> str:
        return f"model-experts-{r + 1:0{width}d}-of-{ep_size}.safetensors"

    out.mkdir(parents=True, exist_ok=True)
    if replica == 0:
        params = dict(model.named_parameters())
        tensors = {}
        for name, module in experts.items():
            prefix, weight = name.rsplit(".", 1)
            for i in range(module.num_local_experts):
                e = module.first_expert + i
                tensors[f"{TEXT_PREFIX}{prefix}.{e}.{weight}.weight"] = params[name].detach()[i].contiguous()
        save_file(tensors, out / expert_file(ep), metadata={"format": "pt"})
    dense = {}
    for name, value in model.state_dict().items():
        if name not in experts:
            full = value.full_tensor() if isinstance(value, DTensor) else value
            dense[TEXT_PREFIX + name] = full.detach().contiguous()
    if getattr(model.config, "tie_word_embeddings", False):
        dense[f"{TEXT_PREFIX}lm_head.weight"] = dense[f"{TEXT_PREFIX}model.embed_tokens.weight"].clone()
    if dist.get_rank() == 0:
        save_file(dense, out / "model-dense.safetensors", metadata={"format": "pt"})
        weight_map = dict.fromkeys(dense, "model-dense.safetensors")
        params = dict(model.named_parameters())
        total = sum(t.numel() * t.element_size() for t in dense.values())
        for name, module in experts.items():
            prefix, weight = name.rsplit(".", 1)
            total += params[name].element_size() * params[name][0].numel() * module.num_experts
            for e in range(module.num_experts):
                owner = expert_file(e // module.num_local_experts)
                weight_map[f"{TEXT_PREFIX}{prefix}.{e}.{weight}.weight"] = owner
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        placeholder = None
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))
            if MEDIA_PLACEHOLDER_TOKEN in tokenizer.get_vocab():
                placeholder = tokenizer.convert_tokens_to_ids(MEDIA_PLACEHOLDER_TOKEN)
        dtype = next(iter(params.values())).dtype
        config = released_config_dict(model.config, dtype=dtype, media_placeholder_token_id=placeholder)
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        preprocessor = default_preprocessor_config(config["vision_config"])
        (out / PREPROCESSOR_FILE).write_text(json.dumps(preprocessor, indent=2) + "\n")
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(out))
    dist.barrier()
