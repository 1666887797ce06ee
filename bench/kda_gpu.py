"""On a CUDA GPU: is our plain-PyTorch `chunk_kda` right there, does the fla dispatch agree with it,
and how much faster is fla's Triton kernel at long T? Prints errors and times; asserts nothing.

Usage: python bench/kda_gpu.py [--repeats 5]   (needs CUDA; fla optional: pip install
flash-linear-attention). On a fresh machine fla's Triton kernels compile and autotune on first use:
on an H200 the sections up to the bf16 comparison took most of a 10-minute run.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback

import torch
import torch.nn.functional as F

from posttrain.ops.kda import chunk_kda, fused_recurrent_kda, kda_gate, naive_recurrent_kda
from posttrain.ops.kda.chunk import _fla_chunk_kda

NAMES = ["q", "k", "v", "g", "beta", "initial_state"]
START = time.perf_counter()


def make_inputs(B, T, H, K, V, dtype, seed=0, device="cuda") -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, device=device), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, device=device), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, device=device)
    f = 4 * torch.randn(B, T, H * K, generator=gen, device=device)
    g = kda_gate(
        f, torch.randn(H, generator=gen, device=device), torch.randn(H * K, generator=gen, device=device)
    )
    beta = torch.rand(B, T, H, generator=gen, device=device)
    h0 = torch.randn(B, H, K, V, generator=gen, device=device)
    inputs = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta.to(dtype), initial_state=h0)
    return {name: x.requires_grad_() for name, x in inputs.items()}


def run(fn, inputs, **kwargs) -> dict[str, torch.Tensor]:
    args = {name: inputs[name] for name in NAMES[:5]}
    o, final_state = fn(**args, initial_state=inputs["initial_state"], output_final_state=True, **kwargs)
    gen = torch.Generator(device=o.device).manual_seed(1)
    loss = (o.float() * torch.randn(o.shape, generator=gen, device=o.device)).sum()
    loss = loss + (final_state * torch.randn(final_state.shape, generator=gen, device=o.device)).sum()
    grads = torch.autograd.grad(loss, list(inputs.values()))
    return {"o": o, "final_state": final_state} | {f"d{n}": g for n, g in zip(inputs, grads, strict=True)}


def report(label: str, actual: dict, expected: dict) -> None:
    parts = []
    for name, ref in expected.items():
        diff = (actual[name].double() - ref.double()).flatten()
        rel = (diff.norm() / ref.double().norm().clamp_min(1e-30)).item()
        parts.append(f"{name} rel {rel:.1e} max {diff.abs().max().item():.1e}")
    print(f"[{time.perf_counter() - START:.0f}s] {label}:\n    " + "\n    ".join(parts))


def time_ms(fn, inputs, repeats, **kwargs) -> float:
    """Median milliseconds of forward + backward."""
    args = [inputs[n] for n in NAMES[:5]]

    def step():
        o, final_state = fn(*args, initial_state=inputs["initial_state"], output_final_state=True, **kwargs)
        torch.autograd.backward([o, final_state], [torch.ones_like(o), torch.ones_like(final_state)])

    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/kda_gpu.py needs a CUDA GPU")
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    try:
        import fla
        from fla.ops.kda import chunk_kda as _  # noqa: F401

        print(f"fla {fla.__version__} imported; chunk_kda dispatches to it: {_fla_chunk_kda() is not None}")
        have_fla = True
    except ImportError:
        traceback.print_exc()
        print("fla not importable: only the torch path is checked")
        have_fla = False

    small = make_inputs(2, 100, 4, 64, 48, torch.float32, seed=1)
    naive = run(naive_recurrent_kda, small)
    report(
        "torch chunk_kda vs naive, fp32 B=2 T=100 H=4 K=64 V=48",
        run(chunk_kda, small, backend="torch"),
        naive,
    )
    decode = make_inputs(8, 1, 4, 64, 48, torch.float32, seed=5)
    report(
        "fused_recurrent_kda vs naive, fp32 decode B=8 T=1",
        run(fused_recurrent_kda, decode),
        run(naive_recurrent_kda, decode),
    )
    if not have_fla:
        return
    # Ordered so the bf16 kernels fla compiles for the comparison serve the timings right after;
    # each fla step is guarded so one failing kernel does not hide the other numbers.
    attempt(
        lambda: report("fla chunk_kda vs naive, fp32 B=2 T=100 H=4 K=64 V=48", run(chunk_kda, small), naive)
    )
    bf16 = make_inputs(2, 2048, 4, 128, 128, torch.bfloat16, seed=2)
    attempt(lambda: compare_fla_torch("bf16 B=2 T=2048 H=4 K=V=128", bf16))
    for T in (4096, 8192):
        attempt(lambda T=T: time_fla_torch(T, args.repeats))
    fp32 = make_inputs(2, 2048, 4, 128, 128, torch.float32, seed=2)
    attempt(lambda: compare_fla_torch("fp32 B=2 T=2048 H=4 K=V=128", fp32))
    bounds = [0, 300, 301, 1000, 1500]
    packed = make_inputs(1, bounds[-1], 4, 128, 128, torch.float32, seed=3)
    packed["initial_state"] = torch.randn(len(bounds) - 1, 4, 128, 128, device="cuda").requires_grad_()
    cu_seqlens = torch.tensor(bounds, device="cuda")
    attempt(lambda: compare_fla_torch(f"fp32 packed cu_seqlens={bounds}", packed, cu_seqlens=cu_seqlens))


def attempt(step) -> None:
    try:
        step()
    except Exception:  # a bench reports what failed and carries on with the other measurements
        traceback.print_exc()


def compare_fla_torch(label: str, inputs: dict, **kwargs) -> None:
    """`chunk_kda` on CUDA dispatches to fla by default; the reference is our torch path."""
    report(
        f"fla (auto dispatch) vs torch chunk_kda, {label}",
        run(chunk_kda, inputs, **kwargs),
        run(chunk_kda, inputs, backend="torch", **kwargs),
    )


def time_fla_torch(T: int, repeats: int) -> None:
    # B, H, K, V and dtypes as in the bf16 comparison: fla's Triton autotuner keys on them, and a
    # new key means minutes of re-tuning on a fresh machine.
    inputs = make_inputs(2, T, 4, 128, 128, torch.bfloat16, seed=4)
    fla_ms = time_ms(chunk_kda, inputs, repeats, backend="fla")
    torch_ms = time_ms(chunk_kda, inputs, repeats, backend="torch")
    print(
        f"[{time.perf_counter() - START:.0f}s] fwd+bwd bf16 B=2 T={T} H=4 K=V=128: "
        f"fla {fla_ms:.2f} ms, torch chunk {torch_ms:.2f} ms, "
        f"fla is {torch_ms / fla_ms:.1f}x faster",
        flush=True,
    )


if __name__ == "__main__":
    main()
