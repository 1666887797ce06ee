"""What the multi-process tests share: `run_ranks` runs a test body in `world` gloo processes on this
machine (CPU) and fails the test with the first rank's exception (the body runs as
fn(rank, world, workdir, *args) with the default process group up); every rank builds the same
seeded tiny K3 and batch."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from posttrain.model import KimiK3ForCausalLM, load_model_config
from posttrain.model.moe import KimiK3MoEGate

TINY_YAML = Path(__file__).resolve().parents[2] / "stages" / "models" / "tiny.yaml"
T = 11


def _entry(rank: int, fn: Callable, world: int, workdir: str, args: tuple) -> None:
    # One thread per rank: up to four ranks share CI's two cores.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world)
    try:
        fn(rank, world, workdir, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, workdir: Path, *args) -> None:
    # spawn, not fork: a child forked after torch started its OpenMP pool can deadlock
    # (tests/model/test_k3_balancing.py says so too).
    mp.start_processes(
        _entry, args=(fn, world, os.fspath(workdir), args), nprocs=world, join=True, start_method="spawn"
    )


def seeded_model(seed: int = 0) -> KimiK3ForCausalLM:
    """The tiny K3 in train mode with random attention-residual queries and router biases; experts
    6 and 7 are never picked, and the balancers keep histograms (what they do across ranks)."""
    config = load_model_config(TINY_YAML)
    torch.manual_seed(seed)
    model = KimiK3ForCausalLM(config).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(0.0, 0.5)
        for m in model.modules():
            if isinstance(m, KimiK3MoEGate):
                m.e_score_correction_bias.normal_(0.0, 0.05)
                m.e_score_correction_bias[6:] = -10.0  # experts 6, 7 are never picked
                m.balancer.mode = "histogram"  # the reference observes the same way the ranks do
    return model


def batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), both [world + 1, T]."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 2048, (world + 1, T), generator=g)
    return ids, torch.randint(0, 2048, (world + 1, T), generator=g)
