"""Memory, FLOP, bandwidth and time arithmetic for full K3: every number docs/scaling.md quotes.

Why: the scale path (ZeRO-3 / FSDP2 trainers, vLLM engines as Ray actors, expert parallelism) cannot
run on the machines this repo is tested on, so it is planned on paper, from numbers computed here out
of the model config (`load_model_config`, cross-checked against `count_parameters`) and the
assumptions in `Hardware`, `Assumptions` and `ClusterPlan`. Change one and rerun to update the doc.

Usage: PYTHONPATH=. python bench/scaling_arithmetic.py [--config stages/models/k3-full.yaml]
Units: decimal SI (1 GB = 1e9 B); a multiply-add is 2 FLOP.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FULL_CONFIG = REPO / "stages" / "models" / "k3-full.yaml"

# Bits per element; OCP MX v1.0 adds one E8M0 scale byte per block of 32 elements.
MXFP4_BITS = 4 + 8 / 32  # routed-expert weights, as released and served
MXFP8_BITS = 8 + 8 / 32  # routed-expert input activations (an MXFP8 dispatch)
BF16_BYTES = 2
FP32_BYTES = 4
# Trainer state per parameter, all of it sharded over the N ranks; both layouts total 16 bytes.
ZERO3_BYTES = {"bf16 weight": 2, "bf16 grad": 2, "fp32 master": 4, "fp32 Adam m": 4, "fp32 Adam v": 4}
FSDP2_BYTES = {"fp32 weight shard": 4, "fp32 grad shard": 4, "fp32 Adam m": 4, "fp32 Adam v": 4}
TRAIN_STATE_BYTES = sum(ZERO3_BYTES.values())
# With the optimizer offloaded to host RAM, only bf16 weight + grad shards stay on the GPU.
OFFLOADED_BYTES = ZERO3_BYTES["fp32 master"] + ZERO3_BYTES["fp32 Adam m"] + ZERO3_BYTES["fp32 Adam v"]


@dataclass(frozen=True)
class Hardware:
    """One GPU kind. For H200: bf16_flops (dense bf16 matmul) and hbm_bandwidth (device copy) were
    measured on the lent H200 (../shared/ENVIRONMENT.md); hbm_bytes is nominal; network_bandwidth
    (per GPU, between nodes) assumes one 400 Gb/s NIC per GPU at line rate."""

    name: str
    bf16_flops: float  # FLOP/s
    hbm_bytes: float
    hbm_bandwidth: float  # B/s
    network_bandwidth: float  # B/s
    gpus_per_node: int


H200 = Hardware(
    "H200", bf16_flops=790e12, hbm_bytes=141e9, hbm_bandwidth=4.3e12, network_bandwidth=50e9, gpus_per_node=8
)


@dataclass(frozen=True)
class Assumptions:
    """Efficiencies and workloads that are chosen, not measured (the K3 sources give no
    post-training token counts)."""

    train_mfu: float = 0.30  # of bf16 peak, counting 6 x active FLOP/token + attention
    prefill_mfu: float = 0.40  # teacher scoring
    decode_flop_efficiency: float = 0.40  # of bf16 peak when a decode step is compute-bound
    decode_bandwidth_efficiency: float = 0.60  # of HBM bandwidth when it is memory-bound
    trainer_reserve_bytes: float = 40e9  # per trainer GPU beyond sharded state
    serving_memory_fraction: float = 0.90  # of HBM an engine fills with weights + cache
    kda_chunk: int = 64  # fla's chunk_kda (our torch chunk_kda uses 16)
    engine_tp: int = 8  # attention / shared experts tensor-parallel inside one node
    micro_batch_tokens: int = 16384  # tokens per trainer GPU per micro-batch
    sft_tokens: float = 10e9
    sft_seq_len: int = 32768
    rl_iterations: int = 200
    rl_trajectories: int = 4096  # 512 prompts x 8 samples per iteration
    rl_lengths: tuple[tuple[str, int], ...] = (("low", 8192), ("high", 32768), ("max", 65536))
    mopd_iterations: int = 300
    mopd_length: int = 32768


@dataclass(frozen=True)
class ClusterPlan:
    gpus: int
    trainer_gpus: int
    engine_gpus: int  # one rollout engine (expert parallel over all of them)
    teacher_gpus: int  # one MOPD teacher engine


PLAN_1024 = ClusterPlan(gpus=1024, trainer_gpus=512, engine_gpus=64, teacher_gpus=16)


# -- parameters --------------------------------------------------------------------------------


def layer_counts(cfg) -> dict[str, int]:
    """{"kda", "mla", "moe", "dense"}: how many decoder layers of each kind."""
    L = cfg.num_hidden_layers
    kda = sum(cfg.is_kda_layer(i) for i in range(L))
    moe = sum(cfg.is_moe_layer(i) for i in range(L))
    return {"kda": kda, "mla": L - kda, "moe": moe, "dense": L - moe}


def kda_layer_parameters(cfg) -> int:
    """One KDA layer: q/k/v projections and short convs, forget pair f_a/f_b, A_log, dt_bias, b_proj,
    output gate (full rank or a low-rank pair), o_norm, o_proj."""
    D, lac = cfg.hidden_size, cfg.linear_attn_config
    H, K, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    P = H * K
    gate = D * P if lac.get("use_full_rank_gate", True) else D * K + K * P
    return 3 * D * P + 3 * P * W + D * K + K * P + H + P + D * H + gate + K + P * D


def mla_layer_parameters(cfg) -> int:
    """One MLA layer: q (low rank + norm, or full), kv latent + shared key part + norm, kv_b, gate, o."""
    D, H, rq, rkv = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = D * H * qk if rq is None else D * rq + rq + rq * H * qk
    kv = D * (rkv + cfg.qk_rope_head_dim) + rkv + rkv * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    gate = D * H * cfg.v_head_dim if cfg.mla_use_output_gate else 0
    return q + kv + gate + H * cfg.v_head_dim * D


def expert_width(cfg) -> int:
    """The width routed experts run at: the LatentMoE latent, or hidden_size without one."""
    return cfg.routed_expert_hidden_size or cfg.hidden_size


def expert_parameters(cfg) -> int:
    """One routed expert of one layer: w1, w3 [I, Dl] and w2 [Dl, I]."""
    return 3 * cfg.moe_intermediate_size * expert_width(cfg)


def latent_parameters(cfg) -> int:
    """One layer's routed_expert_down_proj + up_proj (+ routed_expert_norm)."""
    Dl = cfg.routed_expert_hidden_size
    return 0 if Dl is None else 2 * cfg.hidden_size * Dl + (Dl if cfg.latent_moe_use_norm else 0)


def shared_expert_parameters(cfg) -> int:
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * (cfg.num_shared_experts or 0)


def component_parameters(cfg) -> dict[str, int]:
    """Parameters of KimiK3ForCausalLM(cfg) by component; they sum to count_parameters' total."""
    D, V, L, E = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers, cfg.num_experts
    n = layer_counts(cfg)
    res = cfg.attn_res_block_size is not None
    return {
        "embed_tokens": V * D,
        "lm_head": 0 if cfg.tie_word_embeddings else V * D,
        "kda_attention": n["kda"] * kda_layer_parameters(cfg),
        "mla_attention": n["mla"] * mla_layer_parameters(cfg),
        "dense_mlp": n["dense"] * 3 * D * cfg.intermediate_size,
        "router": n["moe"] * E * D,
        "latent_projections": n["moe"] * latent_parameters(cfg),
        "routed_experts": n["moe"] * E * expert_parameters(cfg),
        "shared_experts": n["moe"] * shared_expert_parameters(cfg),
        # per layer: input/post-attention norms, + two (res_norm, res_proj) pairs; final norm (+ pair)
        "norms_and_attn_res": L * (2 * D + (4 * D if res else 0)) + D + (2 * D if res else 0),
    }


def active_parameters(cfg) -> int:
    """Parameters one token touches: all but the embedding lookup and the unpicked routed experts."""
    comps = component_parameters(cfg)
    E, k = cfg.num_experts, cfg.num_experts_per_token
    embedding = 0 if cfg.tie_word_embeddings else comps["embed_tokens"]
    return sum(comps.values()) - embedding - comps["routed_experts"] * (E - k) // E


def total_parameters(cfg) -> int:
    return sum(component_parameters(cfg).values())


# -- memory ------------------------------------------------------------------------------------


def serving_weight_bytes(cfg) -> dict[str, float]:
    """The released storage: routed experts MXFP4, everything else bf16, router bias fp32 (a buffer)."""
    comps = component_parameters(cfg)
    routed = comps["routed_experts"]
    return {
        "routed": routed * MXFP4_BITS / 8,
        "rest": (sum(comps.values()) - routed) * BF16_BYTES,
        "router_bias": layer_counts(cfg)["moe"] * cfg.num_experts * FP32_BYTES,
    }


def trainer_bytes_per_gpu(parameters: float, gpus: int, per_param: float = TRAIN_STATE_BYTES) -> float:
    """Persistent trainer state per GPU when all of it is sharded over `gpus` ranks."""
    return parameters * per_param / gpus


def min_trainer_gpus(parameters: float, hw: Hardware, reserve_bytes: float) -> int:
    """Fewest GPUs, in whole nodes, each holding its 16 B/param shard within HBM - reserve_bytes."""
    gpus = math.ceil(parameters * TRAIN_STATE_BYTES / (hw.hbm_bytes - reserve_bytes))
    return math.ceil(gpus / hw.gpus_per_node) * hw.gpus_per_node


def largest_layer_parameters(cfg, expert_parallel: int) -> float:
    """Parameters a rank gathers for the largest decoder layer (the ZeRO-3 / FSDP2 unit is
    KimiK3DecoderLayer) when routed experts are split over `expert_parallel` ranks."""
    n = layer_counts(cfg)
    kda = kda_layer_parameters(cfg) if n["kda"] else 0
    attention = max(kda, mla_layer_parameters(cfg) if n["mla"] else 0)
    moe_rest = cfg.num_experts * cfg.hidden_size + latent_parameters(cfg) + shared_expert_parameters(cfg)
    return attention + moe_rest + cfg.num_experts * expert_parameters(cfg) / expert_parallel


def checkpointed_activation_bytes_per_token(cfg) -> int:
    """bf16 activations kept per token with a checkpoint at every decoder layer: each layer's residual
    input plus the attention-residual sources (embedding and completed block sums, kept once)."""
    L, bs = cfg.num_hidden_layers, cfg.attn_res_block_size
    return (L + (0 if bs is None else math.ceil(L / bs))) * cfg.hidden_size * BF16_BYTES


def moe_routed_activation_bytes_per_token(cfg) -> int:
    """bf16 routed intermediates of one MoE layer per token (k latent inputs, gate and up outputs,
    SiTU output): what that layer's recompute + backward holds."""
    return cfg.num_experts_per_token * (expert_width(cfg) + 3 * cfg.moe_intermediate_size) * BF16_BYTES


def kda_chunk_state_bytes_per_token(cfg, chunk: int) -> float:
    """One KDA layer's fp32 chunk-boundary states [T/C, H, K, V], per token, if kept for backward."""
    lac = cfg.linear_attn_config
    return lac["num_heads"] * lac["head_dim"] ** 2 * FP32_BYTES / chunk


def kda_state_bytes(cfg) -> int:
    """One sequence, one KDA layer: recurrent state [H, K, V] fp32 + conv state [3HK, W-1] bf16, the
    layout of KimiK3Cache. Fixed, whatever the context length."""
    lac = cfg.linear_attn_config
    H, K, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    return H * K * K * FP32_BYTES + 3 * H * K * (W - 1) * BF16_BYTES


def mla_cache_bytes_per_token(cfg) -> int:
    """One token, one MLA layer: the normalised kv latent + the shared key part, bf16."""
    return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * BF16_BYTES


def per_head_kv_bytes_per_token(cfg) -> int:
    """One token, one layer, if keys and values were cached per head (what the latent avoids)."""
    dims = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    return cfg.num_attention_heads * dims * BF16_BYTES


def sequence_cache_bytes(cfg, context: float) -> float:
    """Serving state of one sequence: fixed KDA state + MLA latent cache growing with `context`."""
    n = layer_counts(cfg)
    return n["kda"] * kda_state_bytes(cfg) + n["mla"] * context * mla_cache_bytes_per_token(cfg)


# -- FLOP --------------------------------------------------------------------------------------


def mla_attention_flops(cfg, keys: float) -> float:
    """Forward FLOP of one query's scores and weighted values over `keys` keys, all MLA layers."""
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    return layer_counts(cfg)["mla"] * 2 * cfg.num_attention_heads * (qk + cfg.v_head_dim) * keys


def mla_absorbed_decode_flops(cfg, keys: float) -> float:
    """Decode MLA with kv_b absorbed into q and o (as MLA decode kernels run it): each head scores the
    latent + shared key part and reads the latent back."""
    R = cfg.kv_lora_rank
    return layer_counts(cfg)["mla"] * 2 * cfg.num_attention_heads * (2 * R + cfg.qk_rope_head_dim) * keys


def kda_flops_per_token(cfg, chunk: int) -> float:
    """Forward FLOP of the KDA recurrence per token, all KDA layers (estimate): per head 3 K x V
    state products (read, correction, write) + ~C (K + V) in-chunk work."""
    lac = cfg.linear_attn_config
    H, K = lac["num_heads"], lac["head_dim"]
    return layer_counts(cfg)["kda"] * 2 * H * (3 * K * K + chunk * 2 * K)


def train_flops_per_token(cfg, seq_len: int, chunk: int) -> float:
    """3 x forward (backward = 2 x forward): matmuls 2 x active, causal attention (seq_len / 2 keys
    on average), KDA recurrence."""
    return 3 * prefill_flops_per_token(cfg, seq_len, chunk)


def prefill_flops_per_token(cfg, seq_len: int, chunk: int) -> float:
    """Forward only, over a sequence of seq_len tokens (teacher scoring)."""
    attention = mla_attention_flops(cfg, seq_len / 2) + kda_flops_per_token(cfg, chunk)
    return 2 * active_parameters(cfg) + attention


def decode_flops_per_token(cfg, context: float) -> float:
    """One generated token with `context` tokens of history."""
    return 2 * active_parameters(cfg) + mla_absorbed_decode_flops(cfg, context) + kda_flops_per_token(cfg, 0)


# -- expert parallel, communication, time ------------------------------------------------------


def expert_slots_per_rank(num_experts: int, ranks: int) -> int:
    """Whole routed experts per rank per layer; MoonEP's bound allows as many duplicates again."""
    return math.ceil(num_experts / ranks)


def experts_touched_fraction(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected share of a layer's experts picked by at least one of `tokens`, routing uniform (what
    Quantile Balancing drives loads toward)."""
    return 1.0 - (1.0 - top_k / num_experts) ** tokens


def dispatch_combine_bytes_per_token(cfg) -> float:
    """One token, one MoE layer: k latent vectors out in MXFP8, k latent results back in bf16."""
    return cfg.num_experts_per_token * expert_width(cfg) * (MXFP8_BITS / 8 + BF16_BYTES)


def compute_seconds(flop: float, gpus: int, hw: Hardware, efficiency: float) -> float:
    return flop / (gpus * hw.bf16_flops * efficiency)


def transfer_seconds(num_bytes: float, links: int, bandwidth: float) -> float:
    """`num_bytes` over `links` parallel links of `bandwidth` B/s each."""
    return num_bytes / (links * bandwidth)


def engine_weight_bytes(cfg, engine_gpus: int, tp: int) -> float:
    """One engine's weights: routed experts once (expert parallel), the rest once per TP group."""
    w = serving_weight_bytes(cfg)
    return w["routed"] + (w["rest"] + w["router_bias"]) * (engine_gpus // tp)


def max_decode_batch(cfg, hw: Hardware, a: Assumptions, engine_gpus: int, context: int) -> int:
    """Sequences of `context` tokens one engine's HBM holds after its weights."""
    weights = engine_weight_bytes(cfg, engine_gpus, a.engine_tp)
    free = engine_gpus * hw.hbm_bytes * a.serving_memory_fraction - weights
    return max(0, int(free // sequence_cache_bytes(cfg, context)))


@dataclass(frozen=True)
class DecodeStep:
    batch: int
    flop_s: float
    memory_s: float
    all_to_all_s: float

    @property
    def seconds(self) -> float:
        # roofline: compute and memory traffic overlap; the all-to-all is counted as not overlapped
        return max(self.flop_s, self.memory_s) + self.all_to_all_s


def decode_step(
    cfg, hw: Hardware, a: Assumptions, engine_gpus: int, batch: int, context: float
) -> DecodeStep:
    """One decoding step of `batch` sequences at `context` on one engine: FLOP time, HBM traffic
    time (weights of touched experts + per-TP-group rest, KDA state read and written, MLA cache read)
    and all-to-all time (every dispatch priced at the inter-node link)."""
    w, n = serving_weight_bytes(cfg), layer_counts(cfg)
    touched = experts_touched_fraction(cfg.num_experts, cfg.num_experts_per_token, batch)
    weights = w["routed"] * touched + (w["rest"] + w["router_bias"]) * (engine_gpus // a.engine_tp)
    state = batch * (
        2 * n["kda"] * kda_state_bytes(cfg) + n["mla"] * context * mla_cache_bytes_per_token(cfg)
    )
    remote = (engine_gpus - 1) / engine_gpus
    a2a_per_gpu = batch / engine_gpus * n["moe"] * dispatch_combine_bytes_per_token(cfg) * remote
    bandwidth = engine_gpus * hw.hbm_bandwidth * a.decode_bandwidth_efficiency
    flop = batch * decode_flops_per_token(cfg, context)
    return DecodeStep(
        batch,
        compute_seconds(flop, engine_gpus, hw, a.decode_flop_efficiency),
        (weights + state) / bandwidth,
        transfer_seconds(a2a_per_gpu, 1, hw.network_bandwidth),
    )


def rollout_seconds(
    cfg, hw: Hardware, a: Assumptions, gpus: int, engine_gpus: int, trajectories: int, length: int
) -> tuple[float, DecodeStep]:
    """Decode `trajectories` of `length` tokens on gpus / engine_gpus engines, in waves of the largest
    batch that fits at full length; each step priced at the mean context length / 2."""
    per_engine = math.ceil(trajectories / (gpus // engine_gpus))
    batch = min(per_engine, max_decode_batch(cfg, hw, a, engine_gpus, length))
    if batch == 0:
        raise ValueError(f"a {engine_gpus}-GPU engine cannot hold one {length}-token sequence: use more GPUs")
    step = decode_step(cfg, hw, a, engine_gpus, batch, length / 2)
    return math.ceil(per_engine / batch) * length * step.seconds, step


def train_seconds(cfg, hw: Hardware, a: Assumptions, gpus: int, tokens: float, seq_len: int) -> float:
    return compute_seconds(tokens * train_flops_per_token(cfg, seq_len, a.kda_chunk), gpus, hw, a.train_mfu)


@dataclass(frozen=True)
class StageTime:
    """Seconds per iteration of one stage on a ClusterPlan, and how many iterations it runs."""

    rollout: float
    teacher: float
    train: float
    sync: float
    iterations: int

    @property
    def serial(self) -> float:
        return self.iterations * (self.rollout + self.teacher + self.train + self.sync)

    @property
    def overlapped(self) -> float:
        # engines sample the next batch (one policy version behind) while the trainer steps
        return self.iterations * (max(self.rollout + self.teacher, self.train) + self.sync)


def stage_times(cfg, hw: Hardware, a: Assumptions, plan: ClusterPlan) -> dict[str, StageTime]:
    """SFT (every GPU trains), one RL stage per effort (trainer + rollout engines) and MOPD (trainer,
    student engines, nine teacher engines). Weight sync: each engine GPU receives its 1/engine_gpus
    share of the served weights over its own link."""
    sync = transfer_seconds(sum(serving_weight_bytes(cfg).values()), plan.engine_gpus, hw.network_bandwidth)
    rollout_gpus = plan.gpus - plan.trainer_gpus
    times = {"sft": StageTime(0, 0, train_seconds(cfg, hw, a, plan.gpus, a.sft_tokens, a.sft_seq_len), 0, 1)}
    for effort, length in a.rl_lengths:
        roll, _ = rollout_seconds(cfg, hw, a, rollout_gpus, plan.engine_gpus, a.rl_trajectories, length)
        train = train_seconds(cfg, hw, a, plan.trainer_gpus, a.rl_trajectories * length, length)
        times[f"rl-{effort}"] = StageTime(roll, 0, train, sync, a.rl_iterations)
    teachers = 9 * plan.teacher_gpus
    student = (rollout_gpus - teachers) // plan.engine_gpus * plan.engine_gpus
    if student < plan.engine_gpus:
        raise ValueError(f"{plan}: no GPUs left for one student engine; lower trainer_gpus or teacher_gpus")
    tokens = a.rl_trajectories * a.mopd_length
    roll, _ = rollout_seconds(cfg, hw, a, student, plan.engine_gpus, a.rl_trajectories, a.mopd_length)
    teach_flop = tokens * prefill_flops_per_token(cfg, a.mopd_length, a.kda_chunk)
    train = train_seconds(cfg, hw, a, plan.trainer_gpus, tokens, a.mopd_length)
    teach = compute_seconds(teach_flop, teachers, hw, a.prefill_mfu)
    times["mopd"] = StageTime(roll, teach, train, sync, a.mopd_iterations)
    return times


# -- report ------------------------------------------------------------------------------------

Rows = list[tuple[object, ...]]  # (label, values...); a label starting with "==" is a section title


def _si(x: float, unit: str = "B") -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _t(seconds: float) -> str:
    hours = seconds / 3600
    return f"{seconds:.3g} s" if seconds < 600 else f"{hours:.3g} h" if hours < 1000 else f"{hours:,.0f} h"


def _fl(flop: float) -> str:
    return _si(flop, "FLOP")


def parameter_rows(cfg) -> Rows:
    comps, n, E, k = component_parameters(cfg), layer_counts(cfg), cfg.num_experts, cfg.num_experts_per_token
    total, active, w = sum(comps.values()), active_parameters(cfg), serving_weight_bytes(cfg)
    one, mla_params = expert_parameters(cfg), mla_layer_parameters(cfg)
    routed = n["moe"] * k * one
    rows: Rows = [(f"== parameters: {n['kda']} KDA + {n['mla']} MLA, {n['dense']} dense + {n['moe']} MoE",)]
    rows += [(name, f"{c:>17,d}  {c / total:7.3%}") for name, c in [*comps.items(), ("total", total)]]
    return rows + [
        ("active per token", f"{active:>17,d}  {active / total:7.3%}"),
        ("active: routed experts | the rest", f"{routed:,d}", f"{active - routed:,d}"),
        ("attention: one KDA layer | one MLA layer", f"{kda_layer_parameters(cfg):,d}", f"{mla_params:,d}"),
        ("one expert | one layer's experts", f"{one:,d}", f"{E * one:,d}"),
        ("== weight bytes",),
        ("experts MXFP4 | rest bf16 | router bias fp32", *(_si(w[key]) for key in w)),
        ("served total | all bf16 | all fp32", _si(sum(w.values())), _si(2 * total), _si(4 * total)),
    ]


def memory_rows(cfg, hw: Hardware, a: Assumptions, plan: ClusterPlan) -> Rows:
    total, n, mb = total_parameters(cfg), layer_counts(cfg), a.micro_batch_tokens
    reserve = a.trainer_reserve_bytes
    split = " / ".join("+".join(map(str, d.values())) for d in (ZERO3_BYTES, FSDP2_BYTES))
    rows: Rows = [(f"== trainer state: 16 B/param sharded (ZeRO-3 / FSDP2 bytes: {split})",)]
    rows.append(("total", _si(total * TRAIN_STATE_BYTES)))
    for N in (256, 512, 1024):
        gpu, host = (
            total * (TRAIN_STATE_BYTES - OFFLOADED_BYTES) / N,
            total * OFFLOADED_BYTES / (N // hw.gpus_per_node),
        )
        rows.append(
            (f"N={N}: GPU | offload: GPU, host/node", _si(total * 16 / N), f"{_si(gpu)}, {_si(host)}")
        )
    rows.append((f"fewest GPUs, {_si(reserve)} reserve", min_trainer_gpus(total, hw, reserve)))
    for ep in (1, 32, 64):
        p = largest_layer_parameters(cfg, ep)
        rows.append((f"largest layer, EP={ep}: params | bf16 | x3", _si(p, ""), _si(2 * p), _si(6 * p)))
    ckpt, moe = checkpointed_activation_bytes_per_token(cfg), moe_routed_activation_bytes_per_token(cfg)
    left = hw.hbm_bytes - 16 * total / plan.trainer_gpus - 6 * largest_layer_parameters(cfg, 64) - moe * mb
    chunk_states = [_si(kda_chunk_state_bytes_per_token(cfg, c)) for c in (64, 16)]
    rows += [
        ("== training activations",),
        ("checkpointed, per token, all layers", _si(ckpt)),
        (f"one MoE layer: per token | {mb} tokens", _si(moe), _si(moe * mb)),
        ("KDA chunk states per token per layer, C=64 | 16", *chunk_states),
        (f"N={plan.trainer_gpus}, EP=64: HBM left for checkpoints", _si(left)),
    ]
    for seq in (32768, 131072, 1048576):
        cp = 2 ** math.ceil(math.log2(max(1.0, ckpt * seq / left)))
        rows.append((f"one {seq}-token sequence: checkpoints | CP", _si(ckpt * seq), cp))
    kda_seq, mla_tok = n["kda"] * kda_state_bytes(cfg), n["mla"] * mla_cache_bytes_per_token(cfg)
    head_kv, latent = per_head_kv_bytes_per_token(cfg), mla_cache_bytes_per_token(cfg)
    even = kda_seq / mla_tok
    rows += [
        ("== serving cache",),
        ("KDA state per sequence: one layer | all", _si(kda_state_bytes(cfg)), _si(kda_seq)),
        ("MLA latent per token: one layer | all", _si(latent), _si(mla_tok)),
        ("per-head K/V per token per layer | ratio", _si(head_kv), f"{head_kv / latent:.3g}x"),
        ("context where MLA = KDA: capacity | traffic", f"{even:,.0f}", f"{2 * even:,.0f}"),
    ]
    for ctx in (32768, 131072, 1048576):
        all_mla = cfg.num_hidden_layers * ctx * latent
        rows.append((f"context {ctx}: sequence | all-MLA", _si(sequence_cache_bytes(cfg, ctx)), _si(all_mla)))
    return rows


def flop_and_expert_rows(cfg, a: Assumptions) -> Rows:
    active, n, E, k = active_parameters(cfg), layer_counts(cfg), cfg.num_experts, cfg.num_experts_per_token
    rows: Rows = [
        ("== FLOP per token",),
        ("2 x active | 6 x active", _fl(2 * active), _fl(6 * active)),
        (f"KDA recurrence forward, C={a.kda_chunk}", _fl(kda_flops_per_token(cfg, a.kda_chunk))),
    ]
    for seq in (8192, 32768, 131072):
        train, mla = train_flops_per_token(cfg, seq, a.kda_chunk), mla_attention_flops(cfg, seq / 2)
        rows.append((f"train at {seq} | its MLA attention forward", _fl(train), _fl(mla)))
    rows += [(f"decode at context {c}", _fl(decode_flops_per_token(cfg, c))) for c in (32768, 1048576)]
    rows.append((f"== expert parallel: {E} experts, {k} per token",))
    fp4 = expert_parameters(cfg) * MXFP4_BITS / 8 * n["moe"]
    for R in (32, 64, 128, 256):
        s = expert_slots_per_rank(E, R)
        rows.append(
            (f"EP={R}: /rank, slots, MXFP4 | +dups", f"{E / R:g}, {s}, {_si(s * fp4)}", _si(2 * s * fp4))
        )
    a2a = dispatch_combine_bytes_per_token(cfg)
    rows += [
        ("all-to-all per token: MoE layer | all layers", _si(a2a), _si(a2a * n["moe"])),
        ("same at full width in bf16, per layer", _si(k * cfg.hidden_size * 2 * BF16_BYTES)),
    ]
    return rows + [
        (f"share of experts {b} tokens touch", f"{experts_touched_fraction(E, k, b):.1%}") for b in (8, 64)
    ]


def plan_rows(cfg, hw: Hardware, a: Assumptions, plan: ClusterPlan) -> Rows:
    total, gpus, length = total_parameters(cfg), plan.gpus - plan.trainer_gpus, dict(a.rl_lengths)["high"]
    rows: Rows = [(f"== decode engines on {gpus} GPUs, {a.rl_trajectories} x {length} tokens",)]
    for g in (16, 32, 64, 128, 256):
        t, s = rollout_seconds(cfg, hw, a, gpus, g, a.rl_trajectories, length)
        parts = "/".join(f"{x * 1e3:.3g}" for x in (s.flop_s, s.memory_s, s.all_to_all_s))
        tok_s = f"{a.rl_trajectories * length / t / gpus:.3g}"
        step = f"{s.seconds * 1e3:.3g} ({parts})"
        rows.append((f"{g}-GPU: batch | step ms (flop/mem/a2a) | tok/s/GPU", s.batch, step, tok_s))
    state = 16 * total / plan.trainer_gpus
    engine = engine_weight_bytes(cfg, plan.engine_gpus, a.engine_tp) / plan.engine_gpus
    teacher = engine_weight_bytes(cfg, plan.teacher_gpus, a.engine_tp) / plan.teacher_gpus
    served, bw, E_g = sum(serving_weight_bytes(cfg).values()), hw.network_bandwidth, plan.engine_gpus
    rows += [
        (f"== plan: {plan.gpus} {hw.name}, trainer {plan.trainer_gpus}, {E_g}-GPU engines",),
        ("per GPU: trainer state | engine | teacher", _si(state), _si(engine), _si(teacher)),
        (f"sync {_si(served)}: 1/{E_g} per GPU | all per GPU", _t(served / (E_g * bw)), _t(served / bw)),
        (f"sync all bf16 {_si(2 * total)}, all per GPU", _t(2 * total / bw)),
        ("stage: rollout | teacher | train | sync, iterations", "serial", "overlapped"),
    ]
    times = stage_times(cfg, hw, a, plan)
    for name, st in times.items():
        parts = " | ".join(_t(x) for x in (st.rollout, st.teacher, st.train, st.sync))
        rows.append((f"{name}: {parts}, x{st.iterations}", _t(st.serial), _t(st.overlapped)))
    recipe = [times["sft"], *(times[f"rl-{e}"] for e, _ in a.rl_lengths for _ in range(3)), times["mopd"]]
    n_min = min_trainer_gpus(total, hw, a.trainer_reserve_bytes)
    sft_256 = train_seconds(cfg, hw, a, 256, a.sft_tokens, a.sft_seq_len)
    return rows + [
        ("SFT, 9 RL in turn, MOPD", _t(sum(t.serial for t in recipe)), _t(sum(t.overlapped for t in recipe))),
        (f"nine RL at once need >= 9 x ({n_min} + {E_g}) GPUs", 9 * (n_min + E_g)),
        ("SFT on 256 GPUs (offloaded Adam not timed)", _t(sft_256)),
    ]


def report(
    cfg, hw: Hardware = H200, a: Assumptions = Assumptions(), plan: ClusterPlan = PLAN_1024
) -> list[str]:
    """Every line the script prints after the count_parameters check."""
    rows = parameter_rows(cfg) + memory_rows(cfg, hw, a, plan) + flop_and_expert_rows(cfg, a)
    rows += plan_rows(cfg, hw, a, plan)
    return [str(r[0]) if len(r) == 1 else f"  {r[0]:<50} " + " | ".join(map(str, r[1:])) for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=FULL_CONFIG, help="model preset (yaml/json)")
    args = parser.parse_args()
    from posttrain.model import count_parameters, load_model_config

    cfg = load_model_config(args.config)
    counted = count_parameters(cfg)
    mine = {"total": total_parameters(cfg), "active": active_parameters(cfg)}
    verdict = "equal to" if counted == mine else f"DIFFERENT FROM {mine}"
    print(f"config {args.config.name}: count_parameters {counted} is {verdict} the formulas below")
    print("\n".join(report(cfg)))


if __name__ == "__main__":
    main()
