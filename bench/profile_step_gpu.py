"""Where the GPU time of one training step of bench/train_step_gpu.py's K3 (or Llama) goes.

Builds the same model, AdamW and step as `train_step_gpu.py`, warms up (the first K3 step compiles
the regions and fla's kernels), times a few steps, then profiles one and prints its CUDA kernels
summed by name and its operators by input shape: the table that says which tensor a copy_, add_
or mul is. Use it to pick what to fuse next; `train_step_gpu.py` gives the ratio against Llama.

Usage: python bench/profile_step_gpu.py [k3|llama] [--steps 6] [--top 60]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_step_gpu as bench  # noqa: E402  (this folder's benchmark: same model, optimizer and step)

from posttrain.model import KimiK3ForCausalLM  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", choices=("k3", "llama"), default="k3")
    parser.add_argument("--steps", type=int, default=6, help="timed steps after 3 warm-up steps")
    parser.add_argument("--top", type=int, default=60, help="rows of each table")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, bench.VOCAB, (8, 2048), generator=gen).cuda()
    torch.manual_seed(0)
    if args.model == "k3":
        model = KimiK3ForCausalLM(bench.k3_config(None)).cuda().train()
    else:
        model = bench.LlamaForCausalLM(bench.llama_config()).cuda().train()
    optimizer = bench.adamw(model)
    step = lambda: bench.train_step(model, optimizer, ids)
    for i in range(3):
        print(f"warm-up step {i}: {bench.timed(step):.2f} s", flush=True)
    times = [bench.timed(step) for _ in range(args.steps)]
    print(f"{args.model}: median step {statistics.median(times) * 1e3:.1f} ms over {args.steps}", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    print(f"{len(kernels)} kernels, {sum(e.device_time for e in kernels) / 1e3:.1f} ms of GPU time")
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        entry = by_name.setdefault(e.name[:110], [0, 0.0])
        entry[0] += 1
        entry[1] += e.device_time
    print("== kernels by name (ms, launches) ==")
    for name, (count, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"{us / 1e3:8.2f} {count:5d}  {name}")
    print("== operators by input shape ==")
    table = prof.key_averages(group_by_input_shape=True)
    print(table.table(sort_by="self_device_time_total", row_limit=args.top, max_shapes_column_width=110))


if __name__ == "__main__":
    main()
