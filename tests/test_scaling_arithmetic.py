"""bench/scaling_arithmetic.py: its parameter formulas against the model the code builds, and every
other formula against small cases worked out by hand (tiny K3 and round toy hardware numbers)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from posttrain.model import KimiK3ForCausalLM, count_parameters, load_model_config

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("scaling_arithmetic", REPO / "bench" / "scaling_arithmetic.py")
sa = importlib.util.module_from_spec(_spec)
sys.modules["scaling_arithmetic"] = sa  # dataclasses resolve their module by name
_spec.loader.exec_module(sa)

# tiny.yaml by hand: D 64, V 2048, 4 layers (KDA 1-3, MLA 4), layer 0 dense (I 128), 3 MoE layers
# (E 8, k 2, I 64, latent 32, 1 shared), KDA 2 heads x 32, MLA 2 heads (q 32, kv 32, nope 32,
# rope 16, v 32), attention-residual blocks of 2.
KDA_LAYER = 3 * 64 * 64 + 3 * 64 * 4 + 64 * 32 + 32 * 64 + 2 + 64 + 64 * 2 + 64 * 64 + 32 + 64 * 64  # 25570
MLA_LAYER = 64 * 32 + 32 + 32 * 2 * 48 + 64 * 48 + 32 + 32 * 2 * 64 + 64 * 2 * 32 + 2 * 32 * 64  # 20544
TINY_BY_HAND = {
    "embed_tokens": 2048 * 64,
    "lm_head": 2048 * 64,
    "kda_attention": 3 * KDA_LAYER,
    "mla_attention": MLA_LAYER,
    "dense_mlp": 3 * 64 * 128,
    "router": 3 * 8 * 64,
    "latent_projections": 3 * (2 * 64 * 32 + 32),
    "routed_experts": 3 * 8 * 3 * 64 * 32,
    "shared_experts": 3 * 3 * 64 * 64,
    "norms_and_attn_res": 4 * 6 * 64 + 3 * 64,
}
TINY_TOTAL = 583_942
TINY_ACTIVE = TINY_TOTAL - 2048 * 64 - 3 * 6 * 3 * 64 * 32  # embedding and 6 of 8 experts idle: 342_278
TINY_ROUTED_BYTES = 3 * 8 * 3 * 64 * 32 * 4.25 / 8  # 78_336
TINY_REST_BYTES = (TINY_TOTAL - 3 * 8 * 3 * 64 * 32) * 2  # 872_972
TINY_KDA_STATE = 2 * 32 * 32 * 4 + 3 * 64 * 3 * 2  # fp32 state + bf16 conv state: 9_344
TINY_LATENT = (32 + 16) * 2  # 96 bytes per token per MLA layer
TOY = sa.Hardware(
    "toy", bf16_flops=1e6, hbm_bytes=1e9, hbm_bandwidth=1e6, network_bandwidth=1e3, gpus_per_node=8
)
EXACT = sa.Assumptions(decode_flop_efficiency=1.0, decode_bandwidth_efficiency=1.0, engine_tp=8)


@pytest.fixture
def tiny():
    return load_model_config(REPO / "stages" / "models" / "tiny.yaml")


def components_of_built_model(cfg) -> dict[str, int]:
    """Sum the numel of a meta-device KimiK3ForCausalLM's parameters by component, from their names."""
    with torch.device("meta"):
        model = KimiK3ForCausalLM(cfg)
    parts = dict.fromkeys(TINY_BY_HAND, 0)
    for name, p in model.named_parameters():
        if name.startswith("model.embed_tokens."):
            key = "embed_tokens"
        elif name.startswith("lm_head."):
            key = "lm_head"
        elif ".self_attn." in name:
            layer = int(name.split(".")[2])
            key = "kda_attention" if cfg.is_kda_layer(layer) else "mla_attention"
        elif ".mlp." in name:
            key = "dense_mlp"
        elif ".block_sparse_moe.gate." in name:
            key = "router"
        elif ".block_sparse_moe.routed_expert_" in name:
            key = "latent_projections"
        elif ".block_sparse_moe.experts." in name:
            key = "routed_experts"
        elif ".block_sparse_moe.shared_experts." in name:
            key = "shared_experts"
        else:
            key = "norms_and_attn_res"
        parts[key] += p.numel()
    return parts


def test_tiny_components_match_hand_count_and_built_model(tiny) -> None:
    assert KDA_LAYER == 25_570 and MLA_LAYER == 20_544
    assert sa.component_parameters(tiny) == TINY_BY_HAND
    assert components_of_built_model(tiny) == TINY_BY_HAND
    assert sa.total_parameters(tiny) == TINY_TOTAL == sum(TINY_BY_HAND.values())
    assert sa.active_parameters(tiny) == TINY_ACTIVE == 342_278
    assert count_parameters(tiny) == {"total": TINY_TOTAL, "active": TINY_ACTIVE}


@pytest.mark.parametrize(
    "override",
    [
        {"linear_attn_config": {"use_full_rank_gate": False}},
        {"tie_word_embeddings": True},
        {"q_lora_rank": None},
        {"attn_res_block_size": None},
        {"routed_expert_hidden_size": None},
        {"mla_use_output_gate": False, "latent_moe_use_norm": False, "num_shared_experts": 0},
    ],
)
def test_formulas_follow_config_variants(tiny, override) -> None:
    data = tiny.to_dict()
    for key, value in override.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    cfg = type(tiny)(**data)
    assert sa.component_parameters(cfg) == components_of_built_model(cfg)
    counted = count_parameters(cfg)
    assert (sa.total_parameters(cfg), sa.active_parameters(cfg)) == (counted["total"], counted["active"])


def test_full_k3_formulas_equal_count_parameters() -> None:
    cfg = load_model_config(REPO / "stages" / "models" / "k3-full.yaml")
    counted = count_parameters(cfg)
    assert counted == {"total": sa.total_parameters(cfg), "active": sa.active_parameters(cfg)}
    assert round(counted["total"] / 1e12, 2) == 2.78 and round(counted["active"] / 1e9, 1) == 104.2
    # 92 MoE layers x 896 experts x 3 x 3072 x 3584
    assert sa.component_parameters(cfg)["routed_experts"] == 92 * 896 * 3 * 3072 * 3584


def test_weight_and_trainer_bytes(tiny) -> None:
    assert 32 * sa.MXFP4_BITS / 8 == 17  # 32 E2M1 nibbles + one E8M0 byte
    assert sa.serving_weight_bytes(tiny) == {
        "routed": TINY_ROUTED_BYTES,
        "rest": TINY_REST_BYTES,
        "router_bias": 3 * 8 * 4,
    }
    assert sa.TRAIN_STATE_BYTES == sum(sa.FSDP2_BYTES.values()) == 16
    assert sa.trainer_bytes_per_gpu(1000, 8) == 2000
    assert sa.trainer_bytes_per_gpu(1000, 8, sa.TRAIN_STATE_BYTES - sa.OFFLOADED_BYTES) == 500
    hw = sa.Hardware("toy", 1.0, hbm_bytes=100.0, hbm_bandwidth=1.0, network_bandwidth=1.0, gpus_per_node=8)
    assert sa.min_trainer_gpus(1000, hw, reserve_bytes=20.0) == 200  # 16000 B / 80 B per GPU
    assert sa.min_trainer_gpus(1001, hw, reserve_bytes=20.0) == 208  # 201 GPUs, rounded up to whole nodes


def test_layer_gather_and_activation_bytes(tiny) -> None:
    moe_rest = 8 * 64 + (2 * 64 * 32 + 32) + 3 * 64 * 64  # router, latent pair + norm, shared expert
    assert sa.largest_layer_parameters(tiny, 1) == KDA_LAYER + moe_rest + 8 * 3 * 64 * 32
    assert sa.largest_layer_parameters(tiny, 4) == KDA_LAYER + moe_rest + 2 * 3 * 64 * 32
    assert sa.checkpointed_activation_bytes_per_token(tiny) == (4 + 2) * 64 * 2  # 4 layers + 2 sources
    assert sa.moe_routed_activation_bytes_per_token(tiny) == 2 * (32 + 3 * 64) * 2
    assert sa.kda_chunk_state_bytes_per_token(tiny, 16) == 2 * 32 * 32 * 4 / 16


def test_serving_cache_bytes(tiny) -> None:
    assert sa.kda_state_bytes(tiny) == TINY_KDA_STATE == 9_344
    assert sa.mla_cache_bytes_per_token(tiny) == TINY_LATENT
    assert sa.per_head_kv_bytes_per_token(tiny) == 2 * (32 + 16 + 32) * 2
    assert sa.sequence_cache_bytes(tiny, 100) == 3 * 9_344 + 100 * 96  # 37_632
    assert sa.sequence_cache_bytes(tiny, 0) == 3 * 9_344  # KDA state exists from the first token


def test_flops_per_token(tiny) -> None:
    assert sa.mla_attention_flops(tiny, 10) == 2 * 2 * (48 + 32) * 10
    assert sa.mla_absorbed_decode_flops(tiny, 5) == 2 * 2 * (2 * 32 + 16) * 5
    assert sa.kda_flops_per_token(tiny, 16) == 3 * 2 * 2 * (3 * 32 * 32 + 16 * 64)  # 49_152
    assert sa.kda_flops_per_token(tiny, 0) == 3 * 2 * 2 * 3 * 32 * 32  # 36_864
    assert sa.prefill_flops_per_token(tiny, 20, 16) == 2 * TINY_ACTIVE + 3_200 + 49_152
    assert sa.train_flops_per_token(tiny, 20, 16) == 3 * (2 * TINY_ACTIVE + 3_200 + 49_152)  # 2_210_724
    assert sa.decode_flops_per_token(tiny, 10) == 2 * TINY_ACTIVE + 2 * 2 * 80 * 10 + 36_864  # 724_620


def test_expert_parallel_arithmetic(tiny) -> None:
    assert sa.expert_slots_per_rank(896, 64) == 14
    assert sa.expert_slots_per_rank(896, 256) == 4  # 3.5 experts per rank: whole slots, room to spare
    assert sa.experts_touched_fraction(8, 2, 1) == 0.25
    assert sa.experts_touched_fraction(8, 2, 2) == pytest.approx(1 - 0.75**2)  # 0.4375
    assert sa.dispatch_combine_bytes_per_token(tiny) == 2 * 32 * (8.25 / 8 + 2)  # 194
    assert sa.engine_weight_bytes(tiny, 16, 8) == TINY_ROUTED_BYTES + 2 * (TINY_REST_BYTES + 96)


def test_time_helpers() -> None:
    assert sa.transfer_seconds(100e9, 4, 50e9) == 0.5
    assert sa.compute_seconds(790e12 * 10, 2, sa.H200, 0.5) == pytest.approx(10.0)
    step = sa.StageTime(rollout=2.0, teacher=1.0, train=4.0, sync=0.5, iterations=10)
    assert step.serial == 75.0  # 10 x (2 + 1 + 4 + 0.5)
    assert step.overlapped == 45.0  # 10 x (max(2 + 1, 4) + 0.5)


def test_decode_step_by_hand(tiny) -> None:
    step = sa.decode_step(tiny, TOY, EXACT, engine_gpus=8, batch=2, context=10)
    flop = 2 * 724_620
    weights = TINY_ROUTED_BYTES * 0.4375 + (TINY_REST_BYTES + 96) * 1  # one TP group of 8
    state = 2 * (2 * 3 * TINY_KDA_STATE + 10 * TINY_LATENT)  # KDA read + written, MLA read
    a2a = 2 / 8 * 3 * 194 * 7 / 8  # per GPU: its tokens x MoE layers x bytes x remote share
    assert step.batch == 2
    assert step.flop_s == pytest.approx(flop / (8 * 1e6))
    assert step.memory_s == pytest.approx((weights + state) / (8 * 1e6))
    assert step.all_to_all_s == pytest.approx(a2a / 1e3)
    assert step.seconds == pytest.approx(max(flop, weights + state) / 8e6 + a2a / 1e3)


def test_rollout_runs_in_waves_of_what_fits(tiny) -> None:
    weights = sa.engine_weight_bytes(tiny, 8, 8)
    one_sequence = 3 * TINY_KDA_STATE + 20 * TINY_LATENT
    # HBM for the weights plus 1.5 sequences of 20 tokens: one fits at a time
    hbm = (weights + 1.5 * one_sequence) / (8 * EXACT.serving_memory_fraction)
    hw = sa.Hardware("toy", 1e6, hbm_bytes=hbm, hbm_bandwidth=1e6, network_bandwidth=1e3, gpus_per_node=8)
    assert sa.max_decode_batch(tiny, hw, EXACT, 8, 20) == 1
    seconds, step = sa.rollout_seconds(tiny, hw, EXACT, gpus=16, engine_gpus=8, trajectories=5, length=20)
    assert step.batch == 1
    # 2 engines, 3 trajectories each, one at a time, 20 steps each at mean context 10
    assert seconds == pytest.approx(3 * 20 * sa.decode_step(tiny, hw, EXACT, 8, 1, 10).seconds)
    small = sa.Hardware(
        "toy", 1e6, hbm_bytes=weights / 8, hbm_bandwidth=1e6, network_bandwidth=1e3, gpus_per_node=8
    )
    with pytest.raises(ValueError, match="cannot hold one 20-token sequence"):
        sa.rollout_seconds(tiny, small, EXACT, gpus=16, engine_gpus=8, trajectories=5, length=20)


def test_stage_times_compose_the_pieces(tiny) -> None:
    plan = sa.ClusterPlan(gpus=256, trainer_gpus=64, engine_gpus=8, teacher_gpus=8)
    a, hw = sa.Assumptions(), sa.H200
    times = sa.stage_times(tiny, hw, a, plan)
    assert list(times) == ["sft", "rl-low", "rl-high", "rl-max", "mopd"]
    assert times["sft"].train == sa.train_seconds(tiny, hw, a, 256, a.sft_tokens, a.sft_seq_len)
    served = TINY_ROUTED_BYTES + TINY_REST_BYTES + 96
    assert times["rl-high"].sync == pytest.approx(served / (8 * 50e9))
    tokens = a.rl_trajectories * 32768
    assert times["rl-high"].train == pytest.approx(
        tokens * sa.train_flops_per_token(tiny, 32768, 64) / (64 * 790e12 * 0.3)
    )
    # 192 engine-side GPUs: 9 x 8 for teachers, 120 (15 engines) for the student
    teacher_flop = a.rl_trajectories * a.mopd_length * sa.prefill_flops_per_token(tiny, a.mopd_length, 64)
    assert times["mopd"].teacher == pytest.approx(teacher_flop / (72 * 790e12 * 0.4))
    assert (
        times["mopd"].rollout == sa.rollout_seconds(tiny, hw, a, 120, 8, a.rl_trajectories, a.mopd_length)[0]
    )
    with pytest.raises(ValueError, match="no GPUs left for one student engine"):
        sa.stage_times(tiny, hw, a, sa.ClusterPlan(gpus=256, trainer_gpus=184, engine_gpus=8, teacher_gpus=8))


def test_report_prints_the_tiny_numbers(tiny) -> None:
    lines = sa.report(tiny)
    assert any(line.split()[:2] == ["total", "583,942"] for line in lines)
    assert any(line.split()[:3] == ["active", "per", "token"] and "342,278" in line for line in lines)
    assert "== parameters: 3 KDA + 1 MLA, 1 dense + 3 MoE" in lines
    served = TINY_ROUTED_BYTES + TINY_REST_BYTES + 96  # 951_404 B
    assert any(line.startswith(f"  sync {served / 1e3:.3g} kB: 1/64 per GPU") for line in lines)
