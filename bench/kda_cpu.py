"""Is `chunk_kda` fast enough to train on a CPU? Times its forward+backward against the token-by-token
spec `naive_recurrent_kda` on the same inputs and prints the ratio (issue 2 aims for >= 20x).

Usage: python bench/kda_cpu.py [--T 2048] [--H 4] [--K 64] [--V 64] [--repeats 3] [--threads 1]

One thread by default: on a CPU shared with other jobs, OpenMP's second thread mostly waits for a
busy core, which makes small ops (both paths are made of them) erratically slow.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from posttrain.ops.kda import chunk_kda, kda_gate, naive_recurrent_kda


def make_inputs(B: int, T: int, H: int, K: int, V: int, seed: int = 0) -> list[torch.Tensor]:
    """Leaf tensors shaped like a K3 KDA layer's: unit q, k; g from K3's bounded gate."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = kda_gate(torch.randn(B, T, H * K, generator=gen), torch.zeros(H), torch.zeros(H * K))
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta, h0)]


def time_forward_backward(fn: Callable, inputs: list[torch.Tensor], repeats: int) -> float:
    """Median seconds of one forward + backward through output and final state."""
    times = []
    for _ in range(repeats):
        for x in inputs:
            x.grad = None
        start = time.perf_counter()
        o, final_state = fn(*inputs[:5], initial_state=inputs[5], output_final_state=True)
        (o.square().sum() + final_state.square().sum()).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--K", type=int, default=64)
    parser.add_argument("--V", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    inputs = make_inputs(args.B, args.T, args.H, args.K, args.V)
    print(
        f"shape B={args.B} T={args.T} H={args.H} K={args.K} V={args.V}, float32, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}"
    )
    time_forward_backward(chunk_kda, inputs, 1)  # warm-up: first-call allocations
    chunk_s = time_forward_backward(chunk_kda, inputs, args.repeats)
    chunk_grads = [x.grad.clone() for x in inputs]
    naive_s = time_forward_backward(naive_recurrent_kda, inputs, args.repeats)
    max_rel = max(
        ((a - x.grad).norm() / x.grad.norm()).item() for a, x in zip(chunk_grads, inputs, strict=True)
    )
    print(f"chunk_kda            fwd+bwd: {chunk_s * 1e3:9.1f} ms")
    print(f"naive_recurrent_kda  fwd+bwd: {naive_s * 1e3:9.1f} ms")
    print(f"max relative gradient difference: {max_rel:.2e}")
    print(f"chunk_kda is {naive_s / chunk_s:.1f}x faster than naive_recurrent_kda")


if __name__ == "__main__":
    main()
