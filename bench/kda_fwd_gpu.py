"""On a CUDA GPU: our forward-only Triton KDA (`chunk_kda(backend="triton")`) against fla's chunk_kda
forward, both under torch.no_grad(), at K3's head shape (B=1, T=8192, H=96, K=V=128, bf16 inputs,
float32 gate and state). Prints each one's milliseconds (our intra-tile kernel and scan apart, and
ours with precise=True), fla_ms / ours_ms, peak memory, and the max abs / relative error of ours
against fla's output and final state. Asserts nothing.

Usage: python bench/kda_fwd_gpu.py [--T 8192 --H 96 --K 128 --V 128 --docs 1 --iters 20]
       python bench/kda_fwd_gpu.py --sweep [intra|scan]    (also times the intra-tile kernel's
            variants (INTRA_SWEEP), each alone and in the whole forward with its error against fla,
            and / or a few scan block sizes / warps / stages (SWEEP))
       python bench/kda_fwd_gpu.py --intra-heads 2    (ours with another IntraConfig: also
            --intra-tiles, --intra-precision, --intra-wu-precision, --intra-inverse,
            --intra-warps, --intra-maxnreg, --intra-no-stack; the scan's --scan-block-v,
            --scan-warps, --scan-stages, --scan-prefetch)
Needs CUDA; fla optional (pip install flash-linear-attention): without it only ours is timed.
"""

from __future__ import annotations

import argparse
import itertools
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F

from posttrain.ops.kda import chunk_kda, kda_gate
from posttrain.ops.kda.chunk import _fla_chunk_kda
from posttrain.ops.kda.triton_fwd import PRECISIONS, IntraConfig, intra_terms, tile_tables, triton_chunk_kda

START = time.perf_counter()
SWEEP = [  # (block_v, num_warps, num_stages, prefetch) of the scan kernel; prefetch None: the default (0)
    *(
        (bv, warps, stages, None)
        for bv, warps in ((16, 1), (16, 2), (16, 4), (32, 2), (32, 4), (32, 8), (64, 4), (64, 8), (128, 8))
        for stages in (1, 2, 3)
    ),
    *(
        (bv, warps, stages, None)
        for bv, warps, stages in ((64, 4, 4), (64, 4, 5), (64, 8, 4), (32, 4, 4), (32, 4, 5))
    ),
    # The first version's scan: u and the decay loaded in their own tile (prefetch 0); other distances.
    *((bv, warps, stages, 0) for bv, warps, stages in ((64, 4, 2), (64, 4, 3), (32, 4, 2), (32, 4, 3))),
    *((bv, warps, stages, 2) for bv, warps, stages in ((64, 4, 2), (32, 4, 2))),
]


INTRA_SWEEP = [  # IntraConfig variants of the intra-tile kernel
    # heads 1, bf16x3, 4 warps is the default: 1.90 ms on an H200 (2026-12-02, bench/RESULTS.md).
    *(
        IntraConfig(heads=heads, precision=precision, num_warps=warps)
        for precision in ("bf16x3", "tf32x3", "tf32", "bf16", "ieee")
        for heads, warps in ((1, 2), (1, 4), (1, 8), (2, 4), (2, 8), (4, 8))
    ),
    # Several tiles a program, each loading the next (more registers: see the registers caps).
    *(IntraConfig(tiles=tiles, maxnreg=maxnreg) for tiles in (2, 4, 8) for maxnreg in (None, 168, 128)),
    *(
        IntraConfig(precision="bf16", tiles=tiles, maxnreg=maxnreg)
        for tiles in (2, 4)
        for maxnreg in (None, 128)
    ),
    IntraConfig(heads=2, num_warps=8, tiles=4),
    # Register caps for the wider configs (4 warps: 2 programs an SM above 168, 3 up to 168, 4 up to 128).
    IntraConfig(maxnreg=128),
    IntraConfig(precision="tf32x3", maxnreg=168),
    IntraConfig(precision="tf32x3", maxnreg=128),
    IntraConfig(heads=2, num_warps=8, maxnreg=128),
    *(
        IntraConfig(precision=a, wu_precision=b)
        for a, b in (("bf16x3", "tf32"), ("bf16x3", "bf16"), ("tf32x3", "tf32"), ("tf32", "bf16"))
    ),
    IntraConfig(inverse="substitution"),
    IntraConfig(stack=False),
]


def make_inputs(args: argparse.Namespace) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, K, V = args.B, args.T, args.H, args.K, args.V
    dtype = getattr(torch, args.dtype)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, device="cuda"), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, device="cuda"), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, device="cuda")
    f = 4 * torch.randn(B, T, H * K, generator=gen, device="cuda")
    g = kda_gate(
        f, torch.randn(H, generator=gen, device="cuda"), torch.randn(H * K, generator=gen, device="cuda")
    )
    beta = torch.rand(B, T, H, generator=gen, device="cuda")
    cu_seqlens = None
    N = B
    if args.docs > 1:  # documents of uneven lengths packed into the one row
        if B != 1:
            raise SystemExit("--docs > 1 packs documents into one row: use --B 1")
        cuts = torch.randperm(T - 1, generator=torch.Generator().manual_seed(1))[: args.docs - 1] + 1
        cu_seqlens = torch.tensor([0, *sorted(cuts.tolist()), T], device="cuda")
        N = args.docs
    h0 = torch.randn(N, H, K, V, generator=gen, device="cuda")
    return dict(
        q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta.to(dtype),
        initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens,
    )  # fmt: skip


def time_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Mean milliseconds per call over `iters` back-to-back calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def peak_mib(fn: Callable[[], object]) -> float:
    """Peak memory one call allocates beyond what is held before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def errors(ours: tuple, ref: tuple) -> str:
    parts = []
    for name, a, b in zip(("o", "final_state"), ours, ref, strict=True):
        diff = (a.double() - b.double()).flatten()
        rel = (diff.norm() / b.double().norm().clamp_min(1e-30)).item()
        parts.append(f"{name}: max abs {diff.abs().max().item():.2e}, rel {rel:.2e}")
    return "; ".join(parts)


def short(config: IntraConfig) -> str:
    """The config's fields that differ from IntraConfig()'s, e.g. "IntraConfig(tiles=4)"."""
    default = IntraConfig()
    changed = {k: v for k, v in vars(config).items() if v != getattr(default, k)}
    return f"IntraConfig({', '.join(f'{k}={v!r}' for k, v in changed.items())})"


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:.0f}s] {message}", flush=True)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("B", 1), ("T", 8192), ("H", 96), ("K", 128), ("V", 128), ("docs", 1)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--sweep", nargs="?", const="all", choices=["all", "intra", "scan"],
        help="also time INTRA_SWEEP's (intra) and / or SWEEP's (scan) configs",
    )  # fmt: skip
    default = IntraConfig()
    parser.add_argument("--intra-heads", type=int, default=default.heads)
    parser.add_argument("--intra-tiles", type=int, default=default.tiles)
    parser.add_argument("--intra-precision", default=default.precision, choices=PRECISIONS)
    parser.add_argument("--intra-wu-precision", default=None, choices=PRECISIONS)
    parser.add_argument("--intra-maxnreg", type=int, default=default.maxnreg)
    parser.add_argument("--intra-inverse", default=default.inverse, choices=["doubling", "substitution"])
    parser.add_argument("--intra-warps", type=int, default=default.num_warps)
    parser.add_argument("--intra-no-stack", action="store_true", help="IntraConfig(stack=False)")
    for name in ("block-v", "warps", "stages", "prefetch"):  # the scan's; default: triton_chunk_kda's
        parser.add_argument(f"--scan-{name}", type=int, default=None)
    args = parser.parse_args()
    intra = IntraConfig(
        heads=args.intra_heads, tiles=args.intra_tiles,
        precision=args.intra_precision, wu_precision=args.intra_wu_precision, inverse=args.intra_inverse,
        num_warps=args.intra_warps, maxnreg=args.intra_maxnreg, stack=not args.intra_no_stack,
    )  # fmt: skip
    scan = dict(
        block_v=args.scan_block_v,
        num_warps=args.scan_warps,
        num_stages=args.scan_stages,
        prefetch=args.scan_prefetch,
    )

    if not torch.cuda.is_available():
        raise SystemExit("bench/kda_fwd_gpu.py needs a CUDA GPU")
    import triton

    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(
        f"B={args.B} T={args.T} H={args.H} K={args.K} V={args.V} {args.dtype} docs={args.docs}, "
        f"mean of {args.iters} calls after {args.warmup} warmup; intra: {short(intra)}, scan: {scan}",
        flush=True,
    )
    inputs = make_inputs(args)

    def ours(**config) -> tuple:
        return triton_chunk_kda(**inputs, **{"intra": intra, **scan, **config})

    out = ours()  # compiles
    torch.cuda.synchronize()
    log("ours compiled")
    ours_ms = time_ms(ours, args.warmup, args.iters)
    scale = args.K**-0.5
    bounds = (
        tuple(b * args.T for b in range(args.B + 1))
        if inputs["cu_seqlens"] is None
        else tuple(inputs["cu_seqlens"].tolist())
    )
    tiles = tile_tables(bounds, inputs["q"].device)
    intra_args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    intra_ms = time_ms(lambda: intra_terms(*intra_args, scale, tiles, intra), args.warmup, args.iters)
    log(
        f"ours: {ours_ms:.3f} ms (intra-tile kernel {intra_ms:.3f} ms, scan ~{ours_ms - intra_ms:.3f} ms), "
        f"peak {peak_mib(ours):.0f} MiB"
    )
    # Is the intra-tile kernel at the memory roof, and what does one sequential tile step of the
    # scan cost? (Its programs may run in more than one wave: see the sweep's block sizes.)
    tokens = args.B * args.T * args.H
    size = inputs["q"].element_size()
    read = tokens * (2 * args.K * size + args.V * size + 4 * args.K + size)  # q, k, v, g (fp32), beta
    written = tokens * ((3 * args.K + args.V) * size + 16 * 4)  # w, q and k factors, u; A_qk rows
    steps = max(b - a for a, b in itertools.pairwise(bounds)) / 16
    moved = read + written
    log(
        f"intra-tile kernel moves {moved / 1e9:.2f} GB: {moved / intra_ms / 1e6:.0f} GB/s; "
        f"scan: {(ours_ms - intra_ms) * 1e3 / steps:.2f} us per tile step ({steps:.0f} steps)"
    )

    precise = ours(precise=True)
    precise_ms = time_ms(lambda: ours(precise=True), args.warmup, args.iters)
    log(f"ours precise=True (fp32 state / delta operands, TF32 products): {precise_ms:.3f} ms")

    fla_ms = None
    if _fla_chunk_kda() is None:
        print("fla not importable (pip install flash-linear-attention): only ours was timed")
        log(f"ours vs ours precise=True: {errors(out, precise)}")
    else:
        try:

            def fla() -> tuple:
                return chunk_kda(**inputs, backend="fla")

            ref = fla()  # compiles / autotunes
            torch.cuda.synchronize()
            log("fla compiled")
            fla_ms = time_ms(fla, args.warmup, args.iters)
            log(f"fla:  {fla_ms:.3f} ms, peak {peak_mib(fla):.0f} MiB")
            log(f"fla_ms / ours_ms = {fla_ms / ours_ms:.2f} (precise=True: {fla_ms / precise_ms:.2f})")
            log(f"ours vs fla: {errors(out, ref)}")
            log(f"ours precise=True vs fla: {errors(precise, ref)}")
        except Exception:  # a bench reports what failed and carries on
            traceback.print_exc()

    if args.sweep in ("all", "intra"):
        # The intra-tile kernel's variants: alone (ms, GB/s), then in the whole forward (with the
        # default scan), and the whole forward's error against fla (or, without fla, against ours
        # with the configured intra kernel).
        ref_out = ref if fla_ms is not None else out
        best_intra = (intra_ms, short(intra))
        for config in INTRA_SWEEP:
            try:
                intra_terms(*intra_args, scale, tiles, config)
                ms = time_ms(
                    lambda config=config: intra_terms(*intra_args, scale, tiles, config),
                    args.warmup,
                    args.iters,
                )
                whole = ours(intra=config)
                whole_ms = time_ms(lambda config=config: ours(intra=config), args.warmup, args.iters)
            except Exception as error:  # e.g. out of shared memory / registers for this config
                log(f"intra sweep {short(config)}: failed: {type(error).__name__}: {str(error)[:200]}")
                continue
            ratio = f", fla_ms / ours_ms = {fla_ms / whole_ms:.2f}" if fla_ms else ""
            against = "fla" if fla_ms is not None else "ours"
            log(
                f"intra sweep {short(config)}: intra {ms:.3f} ms ({moved / ms / 1e6:.0f} GB/s), "
                f"whole {whole_ms:.3f} ms{ratio}; vs {against}: {errors(whole, ref_out)}"
            )
            best_intra = min(best_intra, (ms, short(config)))
        log(f"best intra: {best_intra[1]} at {best_intra[0]:.3f} ms")

    if args.sweep in ("all", "scan"):
        best = (ours_ms, "default")
        for block_v, warps, stages, prefetch in SWEEP:
            if block_v > max(16, triton.next_power_of_2(args.V)):
                continue
            config = dict(block_v=block_v, num_warps=warps, num_stages=stages, prefetch=prefetch)
            try:
                ours(**config)
                ms = time_ms(lambda config=config: ours(**config), args.warmup, args.iters)
            except Exception as error:  # e.g. out of shared memory / registers for this config
                log(f"sweep {config}: failed: {type(error).__name__}: {str(error)[:200]}")
                continue
            ratio = f", fla_ms / ours_ms = {fla_ms / ms:.2f}" if fla_ms else ""
            log(f"sweep {config}: {ms:.3f} ms{ratio}")
            best = min(best, (ms, str(config)))
        log(f"best: {best[1]} at {best[0]:.3f} ms")


if __name__ == "__main__":
    main()
