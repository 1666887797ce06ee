"""On a CUDA GPU: does the K3 model run there (the GPU image has torch 2.11), do its CUDA logits
match the CPU ones, is cached generation equal to uncached, and how much faster is a training step
when KDA dispatches to fla's Triton kernel than with our plain-PyTorch `chunk_kda`?

Baseline: the same model and step with `chunk_kda(backend="torch")`. Prints errors, times and the
ratio; asserts nothing. Usage: python bench/k3_gpu.py [--seq 2048] [--batch 4] [--steps 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

import torch

import posttrain.model.kda as kda_layer
from posttrain.model import KimiK3Config, KimiK3ForCausalLM, load_model_config
from posttrain.ops.kda import chunk_kda

REPO = Path(__file__).resolve().parent.parent
START = time.perf_counter()


def say(text: str) -> None:
    print(f"[{time.perf_counter() - START:.0f}s] {text}", flush=True)


def small_config() -> KimiK3Config:
    """A K3 with the full model's per-head shapes (KDA and MLA head_dim 128, kv_lora_rank 512)
    at 8 layers and 1024 width, so kernel choices are the ones full K3 would see."""
    tiny = load_model_config(REPO / "stages" / "models" / "tiny.yaml").to_dict()
    tiny.update(
        hidden_size=1024,
        num_hidden_layers=8,
        intermediate_size=2048,
        num_attention_heads=8,
        q_lora_rank=256,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=16,
        num_experts_per_token=4,
        moe_intermediate_size=512,
        routed_expert_hidden_size=512,
        attn_res_block_size=4,
    )
    tiny["linear_attn_config"] = dict(
        tiny["linear_attn_config"],
        kda_layers=[1, 2, 3, 5, 6, 7],
        full_attn_layers=[4, 8],
        num_heads=8,
        head_dim=128,
    )
    for key in ("model_type", "transformers_version", "architectures"):
        tiny.pop(key, None)
    return KimiK3Config(**tiny)


def check_tiny() -> None:
    config = load_model_config(REPO / "stages" / "models" / "tiny.yaml")
    torch.manual_seed(0)
    cpu = KimiK3ForCausalLM(config).eval()
    gpu = KimiK3ForCausalLM(config).eval()
    gpu.load_state_dict(cpu.state_dict())
    gpu = gpu.cuda()
    ids = torch.randint(3, config.vocab_size, (2, 75))
    with torch.no_grad():
        ref = cpu(ids).logits
        out = gpu(ids.cuda()).logits.cpu()
    rel = ((out - ref).norm() / ref.norm()).item()
    say(f"tiny K3 fp32 logits, CUDA vs CPU: relative error {rel:.2e}, max abs {(out - ref).abs().max():.2e}")
    prompt = ids[:, :20].cuda()
    with torch.no_grad():
        cached = gpu.generate(prompt, max_new_tokens=24, do_sample=False, use_cache=True)
        uncached = gpu.generate(prompt, max_new_tokens=24, do_sample=False, use_cache=False)
    say(f"tiny K3 greedy generate on CUDA, cached == uncached: {torch.equal(cached, uncached)}")


def time_step(model: KimiK3ForCausalLM, ids: torch.Tensor, steps: int) -> float:
    times = []
    for i in range(steps + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times) * 1e3


def bench_step(batch: int, seq: int, steps: int) -> None:
    config = small_config()
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(config).cuda().to(torch.bfloat16)
    ids = torch.randint(3, config.vocab_size, (batch, seq), device="cuda")
    say(f"small K3 bf16 ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params), B={batch} T={seq}")
    original = kda_layer.chunk_kda
    kda_layer.chunk_kda = functools.partial(chunk_kda, backend="torch")
    torch_ms = time_step(model, ids, steps)
    say(f"train step fwd+bwd, chunk_kda backend=torch (baseline): {torch_ms:.1f} ms")
    kda_layer.chunk_kda = functools.partial(chunk_kda, backend="fla")
    fla_ms = time_step(model, ids, steps)
    kda_layer.chunk_kda = original
    say(f"train step fwd+bwd, chunk_kda backend=fla: {fla_ms:.1f} ms")
    say(f"fla dispatch makes the K3 train step {torch_ms / fla_ms:.2f}x faster than the torch chunk_kda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    say(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    check_tiny()
    bench_step(args.batch, args.seq, args.steps)


if __name__ == "__main__":
    main()
