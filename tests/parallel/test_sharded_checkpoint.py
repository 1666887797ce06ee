"""Sharded checkpoints of an expert-parallel model, in 2 gloo processes: a DCP save / load that
resumes bit for bit, and the gather-free per-expert export read back by transformers'
`from_pretrained` (the loader every K3 consumer uses for this layout)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from dist_support import batch, run_ranks, seeded_model

from posttrain.model import KimiK3ForCausalLM
from posttrain.model.balancing import update_router_bias
from posttrain.parallel import expert_parallel_mesh, shard_experts, sync_gradients
from posttrain.parallel.checkpoint import export_experts_safetensors, load_sharded, save_sharded


def _sharded(seed: int, mesh):
    model = seeded_model(seed)
    shard_experts(model, mesh["expert"].get_group())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _steps(model, optimizer, mesh, rank: int, n: int) -> None:
    ids, labels = batch(mesh.size())
    for _ in range(n):
        logits = model(input_ids=ids[rank : rank + 1]).logits
        F.cross_entropy(logits.flatten(0, 1), labels[rank]).backward()
        sync_gradients(model, mesh)
        optimizer.step()
        optimizer.zero_grad()
        update_router_bias(model)  # the router biases move too, and are part of the state


def _worker(rank: int, world: int, workdir: str) -> None:
    mesh = expert_parallel_mesh(world)
    model, optimizer = _sharded(0, mesh)
    _steps(model, optimizer, mesh, rank, 2)
    save_sharded(Path(workdir) / "ckpt", model, optimizer, mesh)
    _steps(model, optimizer, mesh, rank, 2)
    uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}

    resumed, resumed_opt = _sharded(7, mesh)  # other initial weights: the load must replace all
    assert not torch.equal(resumed.state_dict()["lm_head.weight"], uninterrupted["lm_head.weight"])
    load_sharded(Path(workdir) / "ckpt", resumed, resumed_opt, mesh)
    _steps(resumed, resumed_opt, mesh, rank, 2)
    for name, value in resumed.state_dict().items():
        assert torch.equal(value, uninterrupted[name]), name

    out = Path(workdir) / "export"
    export_experts_safetensors(model, out, mesh)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == [
        "model-dense.safetensors",
        "model-experts-1-of-2.safetensors",
        "model-experts-2-of-2.safetensors",
    ]
    loaded = KimiK3ForCausalLM.from_pretrained(out).state_dict()
    mine = model.state_dict()
    assert loaded.keys() == mine.keys()
    for name, value in mine.items():
        if name.split(".")[-1] in ("w1", "w2", "w3"):
            local = slice(rank * 4, rank * 4 + 4)  # 8 experts over 2 ranks
            assert torch.equal(loaded[name][local], value), name
        else:
            assert torch.equal(loaded[name], value), name


def test_sharded_checkpoint_resumes_bit_exact_and_exports_per_expert(tmp_path) -> None:
    run_ranks(_worker, 2, tmp_path)
