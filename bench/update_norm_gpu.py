"""What RL's `update_norm` metric costs on a GPU: its snapshot of the trained weights in host memory
(`posttrain.trainers.rl.weights_snapshot` / `update_norm`) against the device copy it replaced
(baseline: `p.detach().clone()` beside the weights, the norm taken on the device).

Weights: float32 tensors of 64M elements each, `--billions` billion parameters in all (default 1, the
k3-1b preset's size). One iteration is snapshot, an in-place update standing in for the optimizer
steps, then the norm. Prints each way's median time of an iteration and the device memory it held
above the weights, and the ratios; asserts nothing.

Usage: python bench/update_norm_gpu.py [--billions 1.0] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from posttrain.trainers.rl import update_norm, weights_snapshot

CHUNK = 64 * 2**20  # elements a tensor


def device_clone(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def device_norm(params: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    return float(torch.stack([(p.detach() - p0).norm() for p, p0 in zip(params, start, strict=True)]).norm())


def iteration(params: list[torch.Tensor], snapshot, norm) -> tuple[float, float, float]:
    """(seconds, the norm, the peak device bytes above the weights) of one iteration."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    start = snapshot(params)
    for p in params:
        p.add_(1e-3)
    value = norm(params, start)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    del start
    return seconds, value, torch.cuda.max_memory_allocated() - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--billions", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    count = max(1, round(args.billions * 1e9 / CHUNK))
    params = [torch.randn(CHUNK, device="cuda") for _ in range(count)]
    rows = {}
    for name, snapshot, norm in (
        ("host snapshot (ours)", weights_snapshot, update_norm),
        ("device clone (baseline)", device_clone, device_norm),
    ):
        iteration(params, snapshot, norm)  # warm-up: allocator, pinned pages
        runs = [iteration(params, snapshot, norm) for _ in range(args.repeats)]
        rows[name] = (statistics.median(r[0] for r in runs), runs[-1][1], max(r[2] for r in runs))
    billions = count * CHUNK / 1e9
    print(f"{count} float32 tensors of {CHUNK} elements ({billions:.2f}B parameters), {args.repeats} runs")
    for name, (seconds, value, peak) in rows.items():
        held = peak / 2**30
        print(
            f"{name:24s} {seconds:8.3f} s an iteration  norm {value:.4f}  device memory held {held:6.2f} GiB"
        )
    ours, base = rows["host snapshot (ours)"], rows["device clone (baseline)"]
    memory = ours[2] / max(base[2], 1)
    print(f"time ours / baseline {ours[0] / base[0]:.2f}x; device memory ours / baseline {memory:.3f}x")


if __name__ == "__main__":
    main()
