"""Memory, FLOP, bandwidth and time arithmetic for full K3: every number docs/scaling.md quotes.

Why this exists: the scale path (ZeRO-3 / FSDP2 trainers, vLLM engines as Ray actors, expert
parallelism) cannot run on the machines this repo is tested on, so it is planned on paper. The plan
is only as good as its numbers, so they are computed here from the model config (the same
`load_model_config` the code uses, cross-checked against `count_parameters`) and from a short list of
assumptions named below; change a config key or an assumption and rerun to update the doc.

Usage: python bench/scaling_arithmetic.py [--config stages/models/k3-full.yaml]
Units: bytes and FLOP in decimal SI (1 GB = 1e9 B, 1 TB = 1e12 B); "B params" = 1e9 parameters.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FULL_CONFIG = REPO / "stages" / "models" / "k3-full.yaml"

# Storage formats, in bits per element (OCP MX v1.0: one E8M0 scale byte per block of 32).
MXFP4_BITS = 4 + 8 / 32  # routed-expert weights as served and as synced in packed form
MXFP8_BITS = 8 + 8 / 32  # routed-expert input activations (what an MXFP8 dispatch would send)
BF16_BYTES = 2
FP32_BYTES = 4
# Trainer state per parameter, every piece sharded over the N ranks. Both add up to 16 bytes.
ZERO3_BYTES = {"bf16 weight": 2, "bf16 grad": 2, "fp32 master": 4, "fp32 Adam m": 4, "fp32 Adam v": 4}
FSDP2_BYTES = {"fp32 weight shard": 4, "fp32 grad shard": 4, "fp32 Adam m": 4, "fp32 Adam v": 4}
TRAIN_STATE_BYTES = sum(ZERO3_BYTES.values())
OFFLOADED_STATE_BYTES = ZERO3_BYTES["fp32 master"] + ZERO3_BYTES["fp32 Adam m"] + ZERO3_BYTES["fp32 Adam v"]


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links. The H200 figures marked 'measured' were measured on the lent machine."""

    name: str
    bf16_flops: float  # dense bf16 matmul, FLOP/s
    hbm_bytes: float
    hbm_bandwidth: float  # B/s
    network_bandwidth: float  # B/s per GPU between nodes
    gpus_per_node: int


H200 = Hardware(
    name="H200",
    bf16_flops=790e12,  # measured: bf16 matmul (docs: ../shared/ENVIRONMENT.md)
    hbm_bytes=141e9,  # nominal HBM3e capacity
    hbm_bandwidth=4.3e12,  # measured: device-to-device copy
    network_bandwidth=50e9,  # assumed: one 400 Gb/s NIC per GPU at line rate
    gpus_per_node=8,
)


@dataclass(frozen=True)
class Assumptions:
    """Efficiencies and workloads that are chosen, not measured: each one is stated in the doc."""

    train_mfu: float = 0.30  # model FLOP utilisation of a training step (6 x active FLOP/token)
    prefill_mfu: float = 0.40  # teacher scoring (prefill only)
    decode_flop_efficiency: float = 0.40  # share of bf16 peak a decode step reaches when compute-bound
    decode_bandwidth_efficiency: float = 0.60  # share of HBM bandwidth when memory-bound
    trainer_reserve_bytes: float = 40e9  # per trainer GPU: activations, gathered layers, NCCL buffers
    serving_memory_fraction: float = 0.90  # of HBM an engine may use (weights + KDA state + MLA cache)
    kda_chunk: int = 64  # fla's chunk_kda chunk (our torch path uses 16)
    engine_tp: int = 8  # tensor parallel for attention / shared experts inside one node
    # workloads (the K3 sources give no post-training token counts)
    sft_tokens: float = 10e9
    sft_seq_len: int = 32768
    rl_iterations: int = 200
    rl_trajectories: int = 4096  # 512 prompts x 8 samples per iteration
    rl_tokens_per_trajectory: tuple[tuple[str, int], ...] = (("low", 8192), ("high", 32768), ("max", 65536))
    mopd_iterations: int = 300
    mopd_tokens_per_trajectory: int = 32768


@dataclass(frozen=True)
class ClusterPlan:
    """How a cluster's GPUs are split between trainer and engines (one engine = `replica_gpus`)."""

    gpus: int
    trainer_gpus: int
    rollout_gpus: int
    replica_gpus: int
    teacher_replica_gpus: int


PLAN_1024 = ClusterPlan(
    gpus=1024, trainer_gpus=512, rollout_gpus=512, replica_gpus=32, teacher_replica_gpus=16
)


# -- parameters --------------------------------------------------------------------------------


def layer_counts(cfg) -> dict[str, int]:
    """{"kda": KDA layers, "mla": MLA layers, "moe": LatentMoE layers, "dense": dense-MLP layers}."""
    L = cfg.num_hidden_layers
    kda = sum(cfg.is_kda_layer(i) for i in range(L))
    moe = sum(cfg.is_moe_layer(i) for i in range(L))
    return {"kda": kda, "mla": L - kda, "moe": moe, "dense": L - moe}


def kda_layer_parameters(cfg) -> int:
    """One KimiK3DeltaAttention: q/k/v, their short convs, forget low-rank pair, A_log, dt_bias,
    beta, output gate, o_norm, o_proj."""
    D = cfg.hidden_size
    lac = cfg.linear_attn_config
    H, K, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    P = H * K
    gate = D * P if lac.get("use_full_rank_gate", True) else D * K + K * P
    return 3 * D * P + 3 * P * W + D * K + K * P + H + P + D * H + gate + K + P * D


def mla_layer_parameters(cfg) -> int:
    """One KimiK3MLAAttention: low-rank q (or full q_proj), kv latent + shared key part, kv_b, gate, o."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    rq, rkv = cfg.q_lora_rank, cfg.kv_lora_rank
    q = D * H * qk if rq is None else D * rq + rq + rq * H * qk
    kv = D * (rkv + cfg.qk_rope_head_dim) + rkv + rkv * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    gate = D * H * cfg.v_head_dim if cfg.mla_use_output_gate else 0
    return q + kv + gate + H * cfg.v_head_dim * D


def expert_width(cfg) -> int:
    """The width routed experts run at: the latent width (LatentMoE) or hidden_size."""
    return cfg.routed_expert_hidden_size or cfg.hidden_size


def expert_parameters(cfg) -> int:
    """One routed expert of one layer: w1, w3 [I, Dl] and w2 [Dl, I]."""
    return 3 * cfg.moe_intermediate_size * expert_width(cfg)


def moe_block_nonexpert_parameters(cfg) -> int:
    """One LatentMoE block without its routed experts: router, latent down/up (+ norm), shared experts."""
    D, Dl = cfg.hidden_size, cfg.routed_expert_hidden_size
    latent = 0 if Dl is None else 2 * D * Dl + (Dl if cfg.latent_moe_use_norm else 0)
    shared = 3 * D * cfg.moe_intermediate_size * (cfg.num_shared_experts or 0)
    return cfg.num_experts * D + latent + shared


def component_parameters(cfg) -> dict[str, int]:
    """Parameters of KimiK3ForCausalLM(cfg) by component; the values sum to count_parameters' total."""
    D, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    n = layer_counts(cfg)
    D_l = cfg.routed_expert_hidden_size
    attn_res = cfg.attn_res_block_size is not None
    # input/post-attention norms, plus two (norm, query) pairs per layer with attention residuals
    per_layer_norms = 2 * D + (4 * D if attn_res else 0)
    final = D + (2 * D if attn_res else 0)
    return {
        "embed_tokens": V * D,
        "lm_head": 0 if cfg.tie_word_embeddings else V * D,
        "kda_attention": n["kda"] * kda_layer_parameters(cfg),
        "mla_attention": n["mla"] * mla_layer_parameters(cfg),
        "dense_mlp": n["dense"] * 3 * D * cfg.intermediate_size,
        "router": n["moe"] * cfg.num_experts * D,
        "latent_projections": n["moe"]
        * (0 if D_l is None else 2 * D * D_l + (D_l if cfg.latent_moe_use_norm else 0)),
        "routed_experts": n["moe"] * cfg.num_experts * expert_parameters(cfg),
        "shared_experts": n["moe"] * 3 * D * cfg.moe_intermediate_size * (cfg.num_shared_experts or 0),
        "norms_and_attn_res": L * per_layer_norms + final,
    }


def active_parameters(cfg, components: dict[str, int]) -> int:
    """Parameters one token touches: all but the embedding lookup and the unpicked routed experts."""
    E, k = cfg.num_experts, cfg.num_experts_per_token
    embedding = 0 if cfg.tie_word_embeddings else components["embed_tokens"]
    idle = components["routed_experts"] * (E - k) // E
    return sum(components.values()) - embedding - idle


# -- memory ------------------------------------------------------------------------------------


def serving_weight_bytes(cfg, components: dict[str, int]) -> dict[str, float]:
    """The released storage: routed experts MXFP4, everything else bf16, router bias fp32 (a buffer)."""
    routed = components["routed_experts"]
    rest = sum(components.values()) - routed
    return {
        "routed experts, MXFP4": routed * MXFP4_BITS / 8,
        "everything else, bf16": rest * BF16_BYTES,
        "router bias buffers, fp32": layer_counts(cfg)["moe"] * cfg.num_experts * FP32_BYTES,
    }


def trainer_bytes_per_gpu(
    total_parameters: int, gpus: int, bytes_per_parameter: float = TRAIN_STATE_BYTES
) -> float:
    """Persistent trainer state per GPU when all of it is sharded over `gpus` ranks (ZeRO-3 / FSDP2)."""
    return total_parameters * bytes_per_parameter / gpus


def min_trainer_gpus(total_parameters: int, hw: Hardware, reserve_bytes: float) -> int:
    """Fewest GPUs, in whole nodes, whose HBM minus `reserve_bytes` each holds the sharded state."""
    gpus = math.ceil(total_parameters * TRAIN_STATE_BYTES / (hw.hbm_bytes - reserve_bytes))
    return math.ceil(gpus / hw.gpus_per_node) * hw.gpus_per_node


def largest_layer_parameters(cfg, expert_parallel: int) -> int:
    """Parameters of the largest decoder layer one rank gathers under ZeRO-3 / FSDP2 (the wrap unit is
    KimiK3DecoderLayer) when routed experts are split over `expert_parallel` ranks."""
    attention = max(kda_layer_parameters(cfg) if layer_counts(cfg)["kda"] else 0, mla_layer_parameters(cfg))
    experts = cfg.num_experts * expert_parameters(cfg) / expert_parallel
    return int(attention + moe_block_nonexpert_parameters(cfg) + experts)


def checkpointed_activation_bytes_per_token(cfg) -> int:
    """bf16 activations kept per token with activation checkpointing at every decoder layer: each
    layer's residual input, plus the attention-residual sources (embedding + completed block sums)."""
    L = cfg.num_hidden_layers
    sources = 0 if cfg.attn_res_block_size is None else math.ceil(L / cfg.attn_res_block_size)
    return (L + sources) * cfg.hidden_size * BF16_BYTES


def moe_routed_activation_bytes_per_token(cfg) -> int:
    """bf16 routed-expert intermediates of one MoE layer per token (k copies of the latent input, gate
    and up outputs, SiTU output): what one layer's recompute + backward holds."""
    return cfg.num_experts_per_token * (expert_width(cfg) + 3 * cfg.moe_intermediate_size) * BF16_BYTES


def kda_chunk_state_bytes_per_token(cfg, chunk: int) -> float:
    """fp32 chunk-boundary states [T/C, H, K, V] of one KDA layer, per token, if kept for backward."""
    lac = cfg.linear_attn_config
    return lac["num_heads"] * lac["head_dim"] ** 2 * FP32_BYTES / chunk


def kda_state_bytes(cfg) -> int:
    """One sequence, one KDA layer: recurrent state [H, K, V] fp32 + conv state [3P, W-1] bf16. Fixed
    size whatever the context length."""
    lac = cfg.linear_attn_config
    H, K, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    return H * K * K * FP32_BYTES + 3 * H * K * (W - 1) * BF16_BYTES


def mla_cache_bytes_per_token(cfg) -> int:
    """One token, one MLA layer: the normalised kv latent + the shared key part, bf16."""
    return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * BF16_BYTES


def per_head_kv_bytes_per_token(cfg) -> int:
    """What one token would cost one layer if keys and values were cached per head (no latent)."""
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    return cfg.num_attention_heads * (qk + cfg.v_head_dim) * BF16_BYTES


def sequence_cache_bytes(cfg, context: int) -> int:
    """Serving state of one sequence of `context` tokens: fixed KDA state + growing MLA latent cache."""
    n = layer_counts(cfg)
    return n["kda"] * kda_state_bytes(cfg) + n["mla"] * context * mla_cache_bytes_per_token(cfg)


# -- FLOP --------------------------------------------------------------------------------------


def mla_attention_flops(cfg, keys: float) -> float:
    """Forward FLOP of one query token's scores and weighted values against `keys` keys, all MLA layers."""
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    return layer_counts(cfg)["mla"] * 2 * cfg.num_attention_heads * (qk + cfg.v_head_dim) * keys


def mla_absorbed_decode_flops(cfg, keys: float) -> float:
    """Decode-time MLA with kv_b absorbed into q and o (what MLA decode kernels do): every head scores
    and reads the latent + shared key part directly."""
    R = cfg.kv_lora_rank
    return layer_counts(cfg)["mla"] * 2 * cfg.num_attention_heads * (2 * R + cfg.qk_rope_head_dim) * keys


def kda_flops_per_token(cfg, chunk: int) -> float:
    """Forward FLOP of the KDA recurrence per token, all KDA layers, chunked form (estimate): state
    read, correction and write (3 K x V products per head) plus in-chunk work ~ C (K + V) per head."""
    lac = cfg.linear_attn_config
    H, K = lac["num_heads"], lac["head_dim"]
    return layer_counts(cfg)["kda"] * 2 * H * (3 * K * K + chunk * 2 * K)


def train_flops_per_token(cfg, active: int, seq_len: int, chunk: int) -> float:
    """Forward + backward (3x forward) of the matmuls (2 x active) and of attention over a causal
    sequence (mean key count seq_len / 2)."""
    return 3 * (2 * active + mla_attention_flops(cfg, seq_len / 2) + kda_flops_per_token(cfg, chunk))


def prefill_flops_per_token(cfg, active: int, seq_len: int, chunk: int) -> float:
    """Forward only: teacher scoring of a trajectory of seq_len tokens."""
    return 2 * active + mla_attention_flops(cfg, seq_len / 2) + kda_flops_per_token(cfg, chunk)


def decode_flops_per_token(cfg, active: int, context: float) -> float:
    """One generated token at `context` tokens of history."""
    return 2 * active + mla_absorbed_decode_flops(cfg, context) + kda_flops_per_token(cfg, chunk=0)


# -- expert parallel and communication ---------------------------------------------------------


def expert_slots_per_rank(num_experts: int, ranks: int) -> int:
    """Routed experts each rank hosts per layer (whole experts; a remainder leaves spare slots)."""
    return math.ceil(num_experts / ranks)


def moonep_duplicate_bound(num_experts: int, ranks: int) -> int:
    """MoonEP's bound: at most E/R duplicate experts per rank make every rank's load exactly S x K."""
    return math.ceil(num_experts / ranks)


def experts_touched_fraction(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected share of a layer's experts that at least one of `tokens` picks, under uniform routing
    (what Quantile Balancing drives loads toward)."""
    return 1.0 - (1.0 - top_k / num_experts) ** tokens


def dispatch_combine_bytes_per_token(cfg) -> float:
    """One token, one MoE layer: k latent vectors out in MXFP8, k latent results back in bf16."""
    k, Dl = cfg.num_experts_per_token, expert_width(cfg)
    return k * Dl * (MXFP8_BITS / 8 + BF16_BYTES)


# -- time --------------------------------------------------------------------------------------


def compute_seconds(flop: float, gpus: int, hw: Hardware, efficiency: float) -> float:
    return flop / (gpus * hw.bf16_flops * efficiency)


def transfer_seconds(num_bytes: float, streams: int, bandwidth: float) -> float:
    """`num_bytes` moved over `streams` links of `bandwidth` B/s each, in parallel."""
    return num_bytes / (streams * bandwidth)


@dataclass(frozen=True)
class DecodeStep:
    batch: int
    flop_seconds: float
    memory_seconds: float
    all_to_all_seconds: float

    @property
    def seconds(self) -> float:
        # compute and memory overlap (roofline); the all-to-all is counted as not overlapped
        return max(self.flop_seconds, self.memory_seconds) + self.all_to_all_seconds


def replica_weight_bytes(cfg, components: dict[str, int], replica_gpus: int, tp: int) -> float:
    """Weights of one engine spanning `replica_gpus`: routed experts once (expert parallel), the rest
    once per tensor-parallel group of `tp` GPUs."""
    served = serving_weight_bytes(cfg, components)
    routed = served["routed experts, MXFP4"]
    return routed + (sum(served.values()) - routed) * (replica_gpus // tp)


def max_decode_batch(cfg, components, hw: Hardware, a: Assumptions, replica_gpus: int, context: int) -> int:
    """Sequences of `context` tokens one engine holds in the HBM its weights leave free."""
    free = replica_gpus * hw.hbm_bytes * a.serving_memory_fraction
    free -= replica_weight_bytes(cfg, components, replica_gpus, a.engine_tp)
    return max(0, int(free // sequence_cache_bytes(cfg, context)))


def decode_step(
    cfg, components, active: int, hw: Hardware, a: Assumptions, replica_gpus: int, batch: int, context: float
) -> DecodeStep:
    """One decoding step of `batch` sequences at mean `context` on one engine (roofline estimate)."""
    served = serving_weight_bytes(cfg, components)
    routed = served["routed experts, MXFP4"]
    touched = experts_touched_fraction(cfg.num_experts, cfg.num_experts_per_token, batch)
    weights_read = routed * touched + (sum(served.values()) - routed) * (replica_gpus // a.engine_tp)
    n = layer_counts(cfg)
    # KDA state is read and written back every step; the MLA latent cache is read
    state_traffic = batch * (
        2 * n["kda"] * kda_state_bytes(cfg) + n["mla"] * context * mla_cache_bytes_per_token(cfg)
    )
    a2a_per_gpu = (
        batch
        / replica_gpus
        * n["moe"]
        * dispatch_combine_bytes_per_token(cfg)
        * (replica_gpus - 1)
        / replica_gpus
    )
    return DecodeStep(
        batch=batch,
        flop_seconds=compute_seconds(
            batch * decode_flops_per_token(cfg, active, context), replica_gpus, hw, a.decode_flop_efficiency
        ),
        memory_seconds=(weights_read + state_traffic)
        / (replica_gpus * hw.hbm_bandwidth * a.decode_bandwidth_efficiency),
        all_to_all_seconds=transfer_seconds(a2a_per_gpu, 1, hw.network_bandwidth),
    )


def rollout_seconds(
    cfg, components, active, hw, a, rollout_gpus, replica_gpus, trajectories, length
) -> tuple[float, DecodeStep]:
    """Time to decode `trajectories` of `length` tokens on rollout_gpus / replica_gpus engines, in
    waves of the largest batch that fits at full length; every step is priced at mean context."""
    replicas = rollout_gpus // replica_gpus
    per_replica = math.ceil(trajectories / replicas)
    batch = min(per_replica, max_decode_batch(cfg, components, hw, a, replica_gpus, length))
    if batch == 0:
        raise ValueError(f"one {replica_gpus}-GPU engine cannot hold a single {length}-token sequence")
    step = decode_step(cfg, components, active, hw, a, replica_gpus, batch, length / 2)
    return math.ceil(per_replica / batch) * length * step.seconds, step


# -- report ------------------------------------------------------------------------------------


def _si(x: float, unit: str = "") -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _hours(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds < 600 else f"{seconds / 3600:.3g} h"


def report(
    cfg,
    hw: Hardware = H200,
    a: Assumptions = Assumptions(),
    plan: ClusterPlan = PLAN_1024,
    counted: dict[str, int] | None = None,
) -> list[str]:
    """The lines the script prints; `counted` is count_parameters(cfg), checked against the formulas."""
    out: list[str] = []
    comps = component_parameters(cfg)
    total, active = sum(comps.values()), active_parameters(cfg, comps)
    n = layer_counts(cfg)
    E, k = cfg.num_experts, cfg.num_experts_per_token

    out.append("== parameters ==")
    out.append(f"layers: {n['kda']} KDA + {n['mla']} MLA; {n['dense']} dense MLP + {n['moe']} LatentMoE")
    for name, count in comps.items():
        out.append(f"  {name:<20} {count:>16,d}  {count / total:7.3%}")
    out.append(f"  {'total':<20} {total:>16,d}")
    out.append(f"  {'active per token':<20} {active:>16,d}")
    if counted is not None:
        same = counted == {"total": total, "active": active}
        out.append(
            f"count_parameters: total {counted['total']:,d}, active {counted['active']:,d}"
            f" -> {'equal to' if same else 'DIFFERENT FROM'} the formulas"
        )
    out.append(
        f"per layer: KDA attention {kda_layer_parameters(cfg):,d}; MLA attention {mla_layer_parameters(cfg):,d};"
        f" MoE block without routed experts {moe_block_nonexpert_parameters(cfg):,d};"
        f" one routed expert {expert_parameters(cfg):,d}; {E} routed experts {E * expert_parameters(cfg):,d}"
    )
    active_routed = n["moe"] * k * expert_parameters(cfg)
    out.append(
        f"active split: routed experts {active_routed:,d} ({active_routed / active:.1%}),"
        f" everything else {active - active_routed:,d}"
    )

    out.append("== weight bytes ==")
    served = serving_weight_bytes(cfg, comps)
    for name, b in served.items():
        out.append(f"  {name:<28} {_si(b, 'B')}")
    out.append(f"  served total (MXFP4 experts) {_si(sum(served.values()), 'B')}")
    out.append(f"  all bf16                     {_si(total * BF16_BYTES, 'B')}")
    out.append(f"  all fp32                     {_si(total * FP32_BYTES, 'B')}")

    out.append("== trainer state (16 B/param sharded: ZeRO-3 2+2+4+4+4, FSDP2 4+4+4+4) ==")
    out.append(f"  total {_si(total * TRAIN_STATE_BYTES, 'B')}")
    for gpus in (256, 512, 1024):
        per_gpu = trainer_bytes_per_gpu(total, gpus)
        offload_gpu = trainer_bytes_per_gpu(total, gpus, TRAIN_STATE_BYTES - OFFLOADED_STATE_BYTES)
        offload_host = trainer_bytes_per_gpu(total, gpus // hw.gpus_per_node, OFFLOADED_STATE_BYTES)
        out.append(
            f"  N={gpus:<5} {_si(per_gpu, 'B')}/GPU (HBM {_si(hw.hbm_bytes, 'B')});"
            f" optimizer offloaded: {_si(offload_gpu, 'B')}/GPU + {_si(offload_host, 'B')} host RAM/node"
        )
    n_min = min_trainer_gpus(total, hw, a.trainer_reserve_bytes)
    out.append(f"  fewest GPUs holding it with {_si(a.trainer_reserve_bytes, 'B')} reserve: {n_min}")
    for ep in (1, 32, 64):
        layer = largest_layer_parameters(cfg, ep)
        out.append(
            f"  largest decoder layer, EP={ep:<3}: {_si(layer)} params = {_si(layer * BF16_BYTES, 'B')} bf16"
            f" gathered; x3 (current + prefetch + grad) {_si(3 * layer * BF16_BYTES, 'B')}"
        )

    out.append("== activations (training) ==")
    ckpt = checkpointed_activation_bytes_per_token(cfg)
    out.append(
        f"  checkpointed, all layers: {_si(ckpt, 'B')}/token; 32K-token sequence {_si(ckpt * 32768, 'B')};"
        f" 128K {_si(ckpt * 131072, 'B')}"
    )
    moe_act = moe_routed_activation_bytes_per_token(cfg)
    out.append(
        f"  one MoE layer's routed intermediates: {_si(moe_act, 'B')}/token; 16K tokens {_si(moe_act * 16384, 'B')}"
    )
    for chunk in (64, 16):
        out.append(
            f"  KDA chunk states, C={chunk}: {_si(kda_chunk_state_bytes_per_token(cfg, chunk), 'B')}/token/layer"
        )

    out.append("== serving cache ==")
    out.append(
        f"  KDA: {_si(kda_state_bytes(cfg), 'B')} per sequence per layer (fixed);"
        f" x{n['kda']} layers = {_si(n['kda'] * kda_state_bytes(cfg), 'B')}"
    )
    out.append(
        f"  MLA: {mla_cache_bytes_per_token(cfg)} B per token per layer (latent + shared key);"
        f" per-head K/V would be {per_head_kv_bytes_per_token(cfg):,d} B"
        f" ({per_head_kv_bytes_per_token(cfg) / mla_cache_bytes_per_token(cfg):.3g}x)"
    )
    for context in (32768, 131072, 1048576):
        mla = n["mla"] * context * mla_cache_bytes_per_token(cfg)
        all_mla = cfg.num_hidden_layers * context * mla_cache_bytes_per_token(cfg)
        out.append(
            f"  context {context:>7,d}: per sequence {_si(sequence_cache_bytes(cfg, context), 'B')}"
            f" (MLA {_si(mla, 'B')}); if all {cfg.num_hidden_layers} layers were MLA {_si(all_mla, 'B')}"
        )

    out.append("== FLOP per token ==")
    out.append(f"  6 x active {_si(6 * active, 'FLOP')}; 2 x active {_si(2 * active, 'FLOP')}")
    out.append(
        f"  KDA recurrence fwd (C={a.kda_chunk}): {_si(kda_flops_per_token(cfg, a.kda_chunk), 'FLOP')}"
    )
    for seq in (8192, 32768, 131072):
        out.append(
            f"  train, {seq:>6,d}-token sequences: {_si(train_flops_per_token(cfg, active, seq, a.kda_chunk), 'FLOP')}"
            f" (MLA attention fwd {_si(mla_attention_flops(cfg, seq / 2), 'FLOP')})"
        )
    for ctx in (32768, 1048576):
        out.append(f"  decode at context {ctx:>9,d}: {_si(decode_flops_per_token(cfg, active, ctx), 'FLOP')}")

    out.append(f"== expert parallel: {E} experts, {k} per token ==")
    one_expert_fp4 = expert_parameters(cfg) * MXFP4_BITS / 8
    for ranks in (32, 64, 128, 256):
        slots = expert_slots_per_rank(E, ranks)
        dup = moonep_duplicate_bound(E, ranks)
        out.append(
            f"  EP={ranks:<4} {E / ranks:g} experts/rank -> {slots} slots, MoonEP adds <= {dup} duplicates;"
            f" MXFP4 per rank, {n['moe']} layers: {_si(n['moe'] * slots * one_expert_fp4, 'B')}"
            f" (+ duplicates {_si(n['moe'] * (slots + dup) * one_expert_fp4, 'B')})"
        )
    a2a = dispatch_combine_bytes_per_token(cfg)
    a2a_full = k * cfg.hidden_size * 2 * BF16_BYTES
    out.append(
        f"  all-to-all per token per MoE layer: {_si(a2a, 'B')} (MXFP8 out, bf16 back, latent {expert_width(cfg)});"
        f" bf16 both ways at hidden {cfg.hidden_size}: {_si(a2a_full, 'B')}; x{n['moe']} layers {_si(a2a * n['moe'], 'B')}"
    )
    for b in (8, 64, 256):
        out.append(f"  experts touched per layer by {b} tokens: {experts_touched_fraction(E, k, b):.1%}")

    out.append(
        f"== plan: {plan.gpus} {hw.name}: trainer {plan.trainer_gpus}, rollouts {plan.rollout_gpus}"
        f" ({plan.rollout_gpus // plan.replica_gpus} engines x {plan.replica_gpus} GPUs, TP {a.engine_tp}) =="
    )
    peak = plan.trainer_gpus * hw.bf16_flops * a.train_mfu
    out.append(
        f"  trainer: {_si(trainer_bytes_per_gpu(total, plan.trainer_gpus), 'B')}/GPU state;"
        f" {_si(peak, 'FLOP')}/s at MFU {a.train_mfu:g}"
    )
    engine_w = replica_weight_bytes(cfg, comps, plan.replica_gpus, a.engine_tp)
    out.append(
        f"  engine weights: {_si(engine_w, 'B')} over {plan.replica_gpus} GPUs"
        f" = {_si(engine_w / plan.replica_gpus, 'B')}/GPU"
    )
    sft_s = compute_seconds(
        a.sft_tokens * train_flops_per_token(cfg, active, a.sft_seq_len, a.kda_chunk),
        plan.gpus,
        hw,
        a.train_mfu,
    )
    out.append(
        f"  SFT: {_si(a.sft_tokens)} tokens at {a.sft_seq_len} on all {plan.gpus} GPUs: {_hours(sft_s)}"
    )
    sync_bytes = sum(served.values())
    sync_full = transfer_seconds(sync_bytes, 1, hw.network_bandwidth)
    sync_sharded = transfer_seconds(sync_bytes, plan.replica_gpus, hw.network_bandwidth)
    sync_bf16 = transfer_seconds(total * BF16_BYTES, 1, hw.network_bandwidth)
    rl_total = 0.0
    for effort, length in a.rl_tokens_per_trajectory:
        roll_s, step = rollout_seconds(
            cfg, comps, active, hw, a, plan.rollout_gpus, plan.replica_gpus, a.rl_trajectories, length
        )
        tokens = a.rl_trajectories * length
        train_s = compute_seconds(
            tokens * train_flops_per_token(cfg, active, length, a.kda_chunk),
            plan.trainer_gpus,
            hw,
            a.train_mfu,
        )
        it = roll_s + train_s + sync_sharded
        rl_total += 3 * a.rl_iterations * it
        out.append(
            f"  RL {effort:<4} ({length} tok/traj, {_si(tokens)} tok/iter): decode batch {step.batch}/engine,"
            f" step {step.seconds * 1e3:.3g} ms (flop {step.flop_seconds * 1e3:.3g}, memory"
            f" {step.memory_seconds * 1e3:.3g}, all-to-all {step.all_to_all_seconds * 1e3:.3g});"
            f" {tokens / roll_s / plan.rollout_gpus:.3g} tok/s/GPU"
        )
        out.append(
            f"      per iteration: rollout {_hours(roll_s)} + train {_hours(train_s)} + sync {_hours(sync_sharded)}"
            f" = {_hours(it)}; {a.rl_iterations} iterations {_hours(a.rl_iterations * it)}"
        )
    out.append(f"  nine RL specialists one after another: {_hours(rl_total)}")
    per_stage = n_min + plan.replica_gpus
    out.append(
        f"  nine at once need >= 9 x ({n_min} trainer + {plan.replica_gpus} engine) = {9 * per_stage} GPUs;"
        f" {plan.gpus} GPUs fit {plan.gpus // per_stage} at a time"
    )

    length = a.mopd_tokens_per_trajectory
    teacher_gpus = 9 * plan.teacher_replica_gpus
    student_gpus = plan.gpus - plan.trainer_gpus - teacher_gpus
    student_gpus -= student_gpus % plan.replica_gpus
    tokens = a.rl_trajectories * length
    roll_s, _ = rollout_seconds(
        cfg, comps, active, hw, a, student_gpus, plan.replica_gpus, a.rl_trajectories, length
    )
    teach_s = compute_seconds(
        tokens * prefill_flops_per_token(cfg, active, length, a.kda_chunk), teacher_gpus, hw, a.prefill_mfu
    )
    train_s = compute_seconds(
        tokens * train_flops_per_token(cfg, active, length, a.kda_chunk), plan.trainer_gpus, hw, a.train_mfu
    )
    it = roll_s + teach_s + train_s + sync_sharded
    t_w = replica_weight_bytes(cfg, comps, plan.teacher_replica_gpus, a.engine_tp)
    out.append(
        f"  MOPD: 9 teachers x {plan.teacher_replica_gpus} GPUs ({_si(t_w / plan.teacher_replica_gpus, 'B')}"
        f" weights/GPU), student engines {student_gpus} GPUs; per iteration rollout {_hours(roll_s)}"
        f" + teacher prefill {_hours(teach_s)} + train {_hours(train_s)} + sync {_hours(sync_sharded)}"
        f" = {_hours(it)}; {a.mopd_iterations} iterations {_hours(a.mopd_iterations * it)}"
    )
    out.append(f"  whole recipe, RL sequential: {_hours(sft_s + rl_total + a.mopd_iterations * it)}")

    out.append(f"== weight sync per iteration at {_si(hw.network_bandwidth, 'B')}/s per GPU link ==")
    out.append(
        f"  MXFP4 experts + bf16 rest: {_si(sync_bytes, 'B')}; every engine GPU receives all of it:"
        f" {_hours(sync_full)}; each receives only its 1/{plan.replica_gpus} shard: {_hours(sync_sharded)}"
    )
    out.append(
        f"  all bf16 (dequantised experts): {_si(total * BF16_BYTES, 'B')}; every GPU receives all: {_hours(sync_bf16)}"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=FULL_CONFIG, help="model preset (yaml/json)")
    args = parser.parse_args()
    from posttrain.model import count_parameters, load_model_config

    cfg = load_model_config(args.config)
    print(f"config: {args.config.relative_to(REPO) if args.config.is_relative_to(REPO) else args.config}")
    print("\n".join(report(cfg, counted=count_parameters(cfg))))


if __name__ == "__main__":
    main()
