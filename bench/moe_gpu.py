"""The routed experts of one K3 MoE layer on a GPU: grouped GEMMs (`KimiK3Experts` on sm90 bf16)
against the per-expert loop it replaced (baseline: the same module's per-expert path, indexing
each expert's weights), and the fused MX fake-quant kernel against the spec quantiser.

Shape: the benchmark K3 of bench/train_step_gpu.py, one layer: 16384 tokens, 64 experts top-8,
width 768 on a 1024 latent; bf16 autocast over fp32 masters; forward + backward. Prints medians
(CUDA events, triton.testing.do_bench) and ratios; asserts nothing.

Usage: python bench/moe_gpu.py
"""

from __future__ import annotations

import torch
from triton.testing import do_bench

from posttrain.model import load_model_config
from posttrain.model.moe import KimiK3Experts
from posttrain.qat import MXFakeQuant
from posttrain.qat.mx import quantize_dequantize

N, E, K, D, I = 16384, 64, 8, 1024, 768


def main() -> None:
    config = load_model_config("stages/models/tiny.yaml")
    config.num_experts, config.num_experts_per_token, config.moe_intermediate_size = E, K, I
    torch.manual_seed(0)
    experts = KimiK3Experts(config, D).cuda()
    for w in (experts.w1, experts.w3, experts.w2):
        torch.nn.init.normal_(w, std=D**-0.5)
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(N, E, device="cuda")
    idx = logits.topk(K, dim=-1).indices
    weight = torch.rand(N, K, device="cuda")
    g = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            out = experts(x, idx, weight)
        out.backward(g)

    def looped():
        with torch.autocast("cuda", torch.bfloat16):
            flat = idx.flatten()
            order = flat.argsort(stable=True)
            out = experts._per_expert(
                x, experts.w1, experts.w3, experts.w2, flat, order // K, weight.flatten()[order], lambda a: a
            )
        out.backward(g)

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: N={N} E={E} k={K} D={D} I={I}")
    for qat in (False, True):
        experts.weight_fake_quant = MXFakeQuant("mxfp4", "floor") if qat else None
        experts.act_fake_quant = MXFakeQuant("mxfp8_e4m3", "rceil") if qat else None
        grouped_ms = do_bench(step, warmup=50, rep=300, return_mode="median")
        loop_ms = do_bench(looped, warmup=50, rep=300, return_mode="median")
        print(
            f"  experts fwd+bwd, qat {'k3  ' if qat else 'none'}: grouped {grouped_ms:.2f} ms, "
            f"per-expert loop (baseline) {loop_ms:.2f} ms, {loop_ms / grouped_ms:.1f}x"
        )
    w = experts.w1.detach()
    hook = MXFakeQuant("mxfp4", "floor")
    fused_ms = do_bench(lambda: hook(w), warmup=20, rep=200, return_mode="median")
    spec_ms = do_bench(lambda: quantize_dequantize(w, "mxfp4"), warmup=20, rep=200, return_mode="median")
    gb = w.numel() * 4 * 2 / 1e9
    print(
        f"  MXFP4 fake-quant of one fp32 weight {tuple(w.shape)}: fused {fused_ms:.3f} ms "
        f"({gb / (fused_ms / 1e3):.0f} GB/s), spec {spec_ms:.2f} ms (baseline), {spec_ms / fused_ms:.1f}x"
    )


if __name__ == "__main__":
    main()
