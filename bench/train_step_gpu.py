"""One GPU training step of a ~0.86B-active K3 against an equal-active LlamaForCausalLM, and the
cost of QAT `k3` against none on that K3, all in one process.

K3: hidden 2048, 16 layers (12 KDA + 4 MLA), 64 routed experts top-8 of width 768 on a 1024 latent,
1 shared expert, vocab 16384. Llama: 16 layers, hidden 2048, intermediate 5376, sdpa, vocab 16384.
Both: fp32 master weights, bf16 autocast, batch x seq tokens, loss + backward + grad-norm clip
+ AdamW (the param groups and flags of posttrain.trainers.common.build_optimizer on CUDA: fused)
+ zero_grad; K3 also updates its router bias, as the trainers do. Prints each median step time,
tokens/s and MFU (6 x active parameters x tokens/s over the H200's 989 TFLOP/s dense bf16 datasheet peak;
embeddings are lookups and not counted), kernel launches in one step, and the ratios.
K3 runs with its elementwise regions compiled (`compile_regions`, the CUDA default) and, with
`--eager-too`, also eager, QAT none only. Asserts nothing.

Usage: python bench/train_step_gpu.py [--batch 8] [--seq 2048] [--steps 8] [--warmup 3] [--profile 0]
       [--eager-too]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.model import KimiK3Config, KimiK3ForCausalLM, count_parameters, load_model_config
from posttrain.qat import QATConfig, apply_qat

REPO = Path(__file__).resolve().parents[1]
PEAK_FLOPS = 989e12  # H200 SXM dense bf16, datasheet
VOCAB = 16384


def k3_config(compile_regions: bool | None = None) -> KimiK3Config:
    base = load_model_config(REPO / "stages" / "models" / "tiny.yaml").to_dict()
    for key in ("model_type", "transformers_version", "architectures"):
        base.pop(key, None)
    base.update(
        vocab_size=VOCAB,
        hidden_size=2048,
        num_hidden_layers=16,
        intermediate_size=5376,
        num_attention_heads=16,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=64,
        num_experts_per_token=8,
        moe_intermediate_size=768,
        routed_expert_hidden_size=1024,
        num_shared_experts=1,
        attn_res_block_size=4,
        compile_regions=compile_regions,
    )
    base["linear_attn_config"] = dict(
        base["linear_attn_config"],
        kda_layers=[i for i in range(1, 17) if i % 4],
        full_attn_layers=[4, 8, 12, 16],
        num_heads=16,
        head_dim=128,
    )
    return KimiK3Config(**base)


def llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=2048,
        intermediate_size=5376,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )


def adamw(model: nn.Module) -> torch.optim.AdamW:
    """build_optimizer's AdamW as the stages build it on CUDA (posttrain.trainers.common imports
    datasets, absent on the GPU image): two param groups, fused, OptimConfig's defaults. Both
    models get the same optimizer."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.0},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    with torch.autocast("cuda", torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if isinstance(model, KimiK3ForCausalLM):
        model.update_router_bias()


def timed(step) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def launches(step, top: int = 0) -> int:
    """CUDA kernels launched by one step (torch profiler); with top > 0 also prints the step's
    GPU-busy time and its `top` most expensive operators."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if top:
        busy = sum(e.device_time for e in kernels) / 1e3
        print(f"  profiled step: {len(kernels)} kernels, {busy:.1f} ms of GPU kernel time")
        print(
            prof.key_averages().table(
                sort_by="self_device_time_total", row_limit=top, max_name_column_width=60
            )
        )
    return len(kernels)


def report(name: str, seconds: list[float], tokens: int, active: int) -> float:
    median = statistics.median(seconds)
    rate = tokens / median
    mfu = 6 * active * rate / PEAK_FLOPS
    print(
        f"  {name:<22} step {median * 1e3:8.1f} ms (min {min(seconds) * 1e3:.1f}, max "
        f"{max(seconds) * 1e3:.1f})  {rate / 1e3:6.1f}k tokens/s  MFU {mfu * 100:5.1f}%",
        flush=True,
    )
    return median


def bench_k3(
    ids: torch.Tensor,
    warmup: int,
    steps: int,
    top: int,
    compile_regions: bool | None,
    schemes: tuple[str, ...],
) -> tuple[dict[str, list[float]], int, int]:
    """Step times per QAT scheme (alternating, so drifts hit both alike), launches, active params."""
    config = k3_config(compile_regions)
    counts = count_parameters(config)
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(config).cuda().train()
    optimizer = adamw(model)
    print(
        f"K3 (compile_regions={compile_regions}): {counts['total'] / 1e6:.1f}M parameters, "
        f"{counts['active'] / 1e6:.1f}M active",
        flush=True,
    )
    qat = {"none": QATConfig(scheme="none"), "k3": QATConfig(scheme="k3")}
    times: dict[str, list[float]] = {scheme: [] for scheme in schemes}
    for i in range(warmup + steps):
        for scheme in schemes:
            apply_qat(model, qat[scheme])
            seconds = timed(lambda: train_step(model, optimizer, ids))
            if i >= warmup:
                times[scheme].append(seconds)
            elif i == 0:
                print(f"  first K3 step ({scheme}, compiles kernels): {seconds:.1f} s", flush=True)
    apply_qat(model, qat["none"])
    return times, launches(lambda: train_step(model, optimizer, ids), top), counts["active"]


def bench_llama(ids: torch.Tensor, warmup: int, steps: int) -> tuple[list[float], int, int]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config()).cuda().train()
    optimizer = adamw(model)
    total = sum(p.numel() for p in model.parameters())
    active = total - model.model.embed_tokens.weight.numel()
    print(f"Llama: {total / 1e6:.1f}M parameters, {active / 1e6:.1f}M active", flush=True)
    times = []
    for i in range(warmup + steps):
        seconds = timed(lambda: train_step(model, optimizer, ids))
        if i >= warmup:
            times.append(seconds)
    return times, launches(lambda: train_step(model, optimizer, ids)), active


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    parser.add_argument("--profile", type=int, default=0, help="print the K3 step's N costliest operators")
    parser.add_argument("--eager-too", action="store_true", help="also time K3 with compile_regions=False")
    args = parser.parse_args()
    tokens = args.batch * args.seq
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, batch {args.batch} x {args.seq}")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (args.batch, args.seq), generator=gen).cuda()
    eager = None
    if args.eager_too:
        eager, eager_launches, _ = bench_k3(ids, args.warmup, args.steps, 0, False, ("none",))
        torch.cuda.empty_cache()
    times, k3_launches, k3_active = bench_k3(ids, args.warmup, args.steps, args.profile, None, ("none", "k3"))
    torch.cuda.empty_cache()
    llama_times, llama_launches, llama_active = bench_llama(ids, args.warmup, args.steps)

    print(f"median of {args.steps} steps after {args.warmup} warm-up:")
    if eager is not None:
        eager_median = report("K3 eager, qat none", eager["none"], tokens, k3_active)
        print(f"  kernel launches per step, K3 eager: {eager_launches}")
    none = report("K3, qat none", times["none"], tokens, k3_active)
    with_qat = report("K3, qat k3", times["k3"], tokens, k3_active)
    base = report("Llama (baseline)", llama_times, tokens, llama_active)
    print(f"  kernel launches per step: K3 {k3_launches}, Llama {llama_launches}")
    print(f"  K3 / Llama tokens/s: {base / none:.3f}x (goal >= 0.8x)")
    print(f"  QAT k3 / none step time: {with_qat / none:.3f}x (goal <= 1.10x)")
    if eager is not None:
        print(f"  K3 eager / compiled regions step time: {eager_median / none:.3f}x")


if __name__ == "__main__":
    main()
