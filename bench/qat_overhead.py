"""What does MX QAT cost per training step? Times one step (forward, backward, AdamW, router-bias
update) of a small K3 with `qat: {scheme: k3}` against `scheme: none` in the same process, on the
same batch, alternating the two so machine load hits both alike, and prints the medians and the
ratio (baseline: scheme none).

Usage: python bench/qat_overhead.py [--model stages/models/tiny.yaml] [--batch 4] [--seq 256]
                                     [--steps 10] [--warmup 2] [--device cpu] [--threads 0]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

from posttrain.model import KimiK3ForCausalLM, load_model_config
from posttrain.qat import QATConfig, apply_qat

REPO = Path(__file__).resolve().parents[1]


def train_step(
    model: KimiK3ForCausalLM, optimizer: torch.optim.Optimizer, ids: torch.Tensor
) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) for one full training step. On a shared CPU the CPU
    time is the steadier number: other processes' load stretches wall time, not ours."""
    if ids.is_cuda:
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.update_router_bias()
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "stages" / "models" / "tiny.yaml"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per scheme")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per scheme first")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    config = load_model_config(args.model)
    torch.manual_seed(0)
    base = KimiK3ForCausalLM(config).to(args.device).train()
    runs = {}
    for scheme in ("none", "k3"):
        model = copy.deepcopy(base)
        apply_qat(model, QATConfig(scheme=scheme))
        runs[scheme] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), [])
    ids = torch.randint(
        3, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)
    )
    ids = ids.to(args.device)

    for step in range(args.warmup + args.steps):
        for model, optimizer, times in runs.values():
            seconds = train_step(model, optimizer, ids)
            if step >= args.warmup:
                times.append(seconds)

    print(
        f"model {Path(args.model).name}, batch {args.batch} x seq {args.seq}, device {args.device}, "
        f"threads {torch.get_num_threads()}, {args.steps} timed steps each (after {args.warmup} warm-up)"
    )
    medians = {}
    for scheme, (_, _, times) in runs.items():
        medians[scheme] = [statistics.median(t[i] for t in times) for i in (0, 1)]
        wall, cpu = medians[scheme]
        print(f"  scheme {scheme:<4} median step: wall {wall * 1e3:9.1f} ms, cpu {cpu * 1e3:9.1f} ms")
    wall_ratio = medians["k3"][0] / medians["none"][0]
    cpu_ratio = medians["k3"][1] / medians["none"][1]
    print(f"  qat overhead k3 / none: wall {wall_ratio:.3f}x, cpu {cpu_ratio:.3f}x")


if __name__ == "__main__":
    main()
