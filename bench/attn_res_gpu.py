"""One Block Attention Residual mix on a GPU, forward + backward: the Triton kernels
(`posttrain.ops.attn_res.triton_mix`) against the compiled region they replace (baseline:
`fused.mix_by_sources` under torch.compile, what `compile_regions` ran before), and the eager
`_AttnResMix` for reference. A K3 training step runs 33 mixes, so this is ~8% of issue #18's step.

Shape: M = 16384 tokens, D = 2048, S = 2..5 sources (a float32 embedding first, bf16 block sums
after it, bf16 grad_out), as in bench/train_step_gpu.py. Prints medians (triton.testing.do_bench: as
launched from Python, so a path's launch cost shows where it exceeds its GPU time; and
do_bench_cudagraph: replayed as a CUDA graph, the GPU time alone), the ratios and the graphed
bandwidth against the traffic lower bound (forward reads every source and writes the mix; backward
reads every source and grad_out and writes every gradient); asserts nothing.

Usage: python bench/attn_res_gpu.py [--tokens 16384] [--dim 2048]
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench, do_bench_cudagraph

from posttrain.ops.attn_res.fused import _AttnResMix, mix_by_sources
from posttrain.ops.attn_res.triton_mix import TritonAttnResMix
from posttrain.ops.fusion import compiled


def bench_sources(M: int, D: int, S: int) -> None:
    """Time each path at S sources (float32 first, bf16 after) and print the ratio."""
    dtypes = [torch.float32] + [torch.bfloat16] * (S - 1)
    sources = [
        (torch.randn(M, D, device="cuda") * (1 + i)).to(dt).requires_grad_() for i, dt in enumerate(dtypes)
    ]
    norm_weight = (1 + 0.1 * torch.randn(D, device="cuda")).requires_grad_()
    query = (0.05 * torch.randn(D, device="cuda")).requires_grad_()
    grad_out = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    inputs = (*sources, norm_weight, query)
    source_bytes = sum(s.numel() * s.element_size() for s in sources)
    lower_bound = 3 * source_bytes + 2 * grad_out.numel() * grad_out.element_size()
    paths = {
        "triton": lambda: TritonAttnResMix.apply(norm_weight, query, 1e-5, *sources),
        "compiled (baseline)": lambda: compiled(mix_by_sources)(tuple(sources), norm_weight, query, 1e-5),
        "eager _AttnResMix": lambda: _AttnResMix.apply(norm_weight, query, 1e-5, *sources),
    }
    times = {}
    for name, fn in paths.items():
        step = lambda fn=fn: torch.autograd.grad(fn(), inputs, grad_out)  # noqa: E731
        launched = do_bench(step, warmup=50, rep=200)
        try:  # the GPU time alone: replayed as a CUDA graph, without the Python launch cost
            graphed = do_bench_cudagraph(step, rep=200)
        except Exception as error:  # noqa: BLE001  (a path that cannot be captured still prints)
            graphed = float("nan")
            print(f"  S={S} {name}: no CUDA graph ({type(error).__name__})")
        times[name] = (launched, graphed)
        print(
            f"  S={S} {name:20s} launched {launched * 1e3:7.1f} us, graphed {graphed * 1e3:7.1f} us"
            f" = {lower_bound / graphed / 1e6:5.0f} GB/s of the lower bound",
            flush=True,
        )
    (tl, tg), (cl, cg) = times["triton"], times["compiled (baseline)"]
    print(f"  S={S} compiled / triton: launched {cl / tl:.2f}x, graphed {cg / tg:.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=2048)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(
        f"M={args.tokens} D={args.dim}, forward + backward per mix; bandwidth against the traffic lower bound"
    )
    for S in range(2, 6):
        bench_sources(args.tokens, args.dim, S)


if __name__ == "__main__":
    main()
