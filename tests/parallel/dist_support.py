"""Run a test body in `world` gloo processes on this machine (CPU), and fail the test with the first
rank's exception. The body runs as fn(rank, world, workdir, *args) with the default process group up."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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
