"""QAT inside the tiny K3: the routed-expert forward provably sees MX values, it still learns, and
nothing outside the routed experts is quantised.

The probe: put one weight element exactly on the MXFP4 grid (1.0 x its block scale 2^s, not the
block's largest element, so the scale cannot move) and nudge it by +-0.2 x 2^s. The neighbours of
1.0 on the E2M1 grid are 0.5 and 1.5, so half a step either side is 0.25 x 2^s: a quantised forward
cannot see the nudge, a full-precision one must.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.model import KimiK3ForCausalLM
from posttrain.qat import (
    MXFakeQuant,
    QATConfig,
    apply_qat,
    mx_scale_exponents,
    quantize_dequantize,
    routed_expert_modules,
)

NUDGE = 0.2  # of the block scale; half a quantisation step around 1.0 is 0.25
ROW = 3


def put_on_grid(param: torch.Tensor) -> list[tuple[tuple[int, ...], int]]:
    """For each leading index (each expert of a 3-D weight, or the matrix itself), set row ROW's
    element in block 0 that is not the block's amax to exactly 2^s. Returns (index, s) pairs."""
    sites = []
    leading = [()] if param.dim() == 2 else [(e,) for e in range(param.shape[0])]
    for lead in leading:
        block = param[(*lead, ROW)][:32]
        s = int(mx_scale_exponents(block, "mxfp4"))
        col = 1 if int(block.abs().argmax()) == 0 else 0
        param[(*lead, ROW, col)] = 2.0**s
        sites.append(((*lead, ROW, col), s))
    return sites


def nudge(param: torch.Tensor, sites: list[tuple[tuple[int, ...], int]], factor: float) -> None:
    for index, s in sites:
        param[index] = factor * 2.0**s


def expert_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [getattr(m, w) for m in routed_expert_modules(model).values() for w in ("w1", "w2", "w3")]


@torch.no_grad()
def test_routed_expert_forward_uses_quantised_weights(tiny_model, token_ids):
    weights = expert_weights(tiny_model)
    assert len(weights) == 9  # 3 MoE layers x (w1, w2, w3)
    sites = [(w, put_on_grid(w)) for w in weights]
    before = [w.clone() for w in weights]

    apply_qat(tiny_model, QATConfig(scheme="k3"))
    base = tiny_model(token_ids).logits
    for factor in (1 + NUDGE, 1 - NUDGE):
        for w, s in sites:
            nudge(w, s, factor)
        for w, original in zip(weights, before, strict=True):
            assert not torch.equal(w, original)  # the master weights did change ...
            assert torch.equal(quantize_dequantize(w, "mxfp4"), quantize_dequantize(original, "mxfp4"))
        assert torch.equal(tiny_model(token_ids).logits, base)  # ... and the output did not

    apply_qat(tiny_model, QATConfig(scheme="none"))
    for w, s in sites:
        nudge(w, s, 1.0)
    base_none = tiny_model(token_ids).logits
    for w, s in sites:
        nudge(w, s, 1 + NUDGE)
    assert (tiny_model(token_ids).logits - base_none).abs().max() > 0


NON_EXPERT = [
    "model.layers.0.self_attn.q_proj.weight",  # KDA
    "model.layers.0.mlp.gate_proj.weight",  # dense first layer
    "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",  # MLA latent projection
    "model.layers.3.self_attn.o_proj.weight",
    "model.layers.1.block_sparse_moe.gate.weight",  # router
    "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight",  # LatentMoE projections
    "model.layers.1.block_sparse_moe.routed_expert_up_proj.weight",
    "model.layers.2.block_sparse_moe.shared_experts.down_proj.weight",
    "lm_head.weight",
]


@torch.no_grad()
def test_non_expert_parameters_stay_high_precision(tiny_model, token_ids):
    state_before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    names = apply_qat(tiny_model, QATConfig(scheme="k3"))
    assert names == [f"model.layers.{i}.block_sparse_moe.experts" for i in (1, 2, 3)]
    # apply_qat changes no parameter or buffer, and sets hooks on the routed experts only.
    after = tiny_model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in state_before.items())
    hooked = {n for n, m in tiny_model.named_modules() if getattr(m, "weight_fake_quant", None) is not None}
    assert hooked == set(names)

    params = dict(tiny_model.named_parameters())
    sites = {name: put_on_grid(params[name]) for name in NON_EXPERT}
    embed = params["model.embed_tokens.weight"]
    token = int(token_ids[0, 0])
    embed[token, 0] = 2.0 ** int(mx_scale_exponents(embed[token, :32], "mxfp4"))
    base = tiny_model(token_ids).logits
    for name in NON_EXPERT:
        nudge(params[name], sites[name], 1 + NUDGE)
        nudged = tiny_model(token_ids).logits
        assert (nudged - base).abs().max() > 0, f"{name} looks quantised: a sub-step change was invisible"
        nudge(params[name], sites[name], 1.0)
    embed[token, 0] *= 1 + NUDGE
    assert (tiny_model(token_ids).logits - base).abs().max() > 0


def test_training_with_qat_lowers_the_loss(tiny_config):
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(tiny_config).train()
    apply_qat(model, QATConfig(scheme="k3"))
    ids = torch.randint(3, 2048, (2, 24), generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    experts = routed_expert_modules(model)["model.layers.1.block_sparse_moe.experts"]
    losses = []
    for _ in range(10):
        loss = model(ids, labels=ids).loss
        loss.backward()
        # straight-through: the full-precision expert weights get gradients through the quantiser
        assert experts.w1.grad.abs().max() > 0 and experts.w2.grad.abs().max() > 0
        optimizer.step()
        optimizer.zero_grad()
        model.update_router_bias()
        losses.append(loss.item())
    # Memorising one batch: 10 AdamW steps at 3e-3 take the loss from ~7.6 (ln 2048) to ~5.
    assert losses[-1] < 0.8 * losses[0], losses
    # Master weights stay full precision: after training they are off the MXFP4 grid.
    assert not torch.equal(quantize_dequantize(experts.w1.detach(), "mxfp4"), experts.w1.detach())


@torch.no_grad()
def test_hooks_carry_the_configured_formats_and_see_expert_inputs(tiny_model, token_ids):
    cfg = QATConfig(activation_scale_rule="floor")
    apply_qat(tiny_model, cfg)
    experts = routed_expert_modules(tiny_model)["model.layers.1.block_sparse_moe.experts"]
    assert experts.weight_fake_quant == MXFakeQuant("mxfp4", "floor", 32)
    assert experts.act_fake_quant == MXFakeQuant("mxfp8_e4m3", "floor", 32)
    seen = []

    def recording_quantiser(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[-1])
        return cfg_quant(x)

    cfg_quant = experts.act_fake_quant
    experts.act_fake_quant = recording_quantiser
    with_act = tiny_model(token_ids).logits
    # Tokens entering w1/w3 (latent width 32) and SiTU outputs entering w2 (moe_intermediate_size 64).
    assert set(seen) == {32, 64}
    experts.act_fake_quant = None
    assert (tiny_model(token_ids).logits - with_act).abs().max() > 0


def test_scheme_none_and_non_k3_models(tiny_model):
    apply_qat(tiny_model, QATConfig(scheme="k3"))
    assert apply_qat(tiny_model, {"scheme": "none"}) == apply_qat(tiny_model, None)
    assert all(
        m.weight_fake_quant is None and m.act_fake_quant is None
        for m in routed_expert_modules(tiny_model).values()
    )
    with pytest.raises(ValueError, match=r"Linear has no routed-experts module.*scheme: none"):
        apply_qat(torch.nn.Linear(32, 32), QATConfig())
    assert apply_qat(torch.nn.Linear(32, 32), QATConfig(scheme="none")) == []


def test_expert_width_not_a_multiple_of_32_is_a_config_error(tiny_config):
    tiny_config.moe_intermediate_size = 48
    model = KimiK3ForCausalLM(tiny_config)
    with pytest.raises(ValueError, match=r"experts\.w2 has shape \(8, 32, 48\).*moe_intermediate_size"):
        apply_qat(model, QATConfig())


def test_qat_config_defaults_and_errors():
    cfg = QATConfig()
    assert (cfg.scheme, cfg.weight_format, cfg.activation_format) == ("k3", "mxfp4", "mxfp8_e4m3")
    assert (cfg.weight_scale_rule, cfg.activation_scale_rule, cfg.block_size) == ("floor", "rceil", 32)
    with pytest.raises(ValueError, match="weight_scale_rul"):
        QATConfig.model_validate({"weight_scale_rul": "floor"})
    with pytest.raises(ValueError, match="scheme"):
        QATConfig(scheme="mxfp4")
    with pytest.raises(ValueError, match="block_size"):
        QATConfig(block_size=16)


def test_inference_weight_cache_follows_in_place_updates():
    """The no_grad cache of quantised expert weights must never serve a stale copy: an optimizer-
    style in-place update or a load_state_dict changes the output exactly as without the cache."""
    from posttrain.qat.apply import MXFakeQuant

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 8, 64))
    cached = MXFakeQuant("mxfp4", "floor", cache_inference=True)
    plain = MXFakeQuant("mxfp4", "floor")
    with torch.no_grad():
        first = cached(w)
        assert cached(w) is first  # reused while unchanged
        w.mul_(3.0)  # in place, like an optimizer step
        assert torch.equal(cached(w), plain(w))
        assert not torch.equal(cached(w), first)
        w.copy_(torch.randn(4, 8, 64))  # like load_state_dict
        assert torch.equal(cached(w), plain(w))
    # with grad enabled nothing is cached and gradients pass straight through
    out = cached(w)
    out.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))
    import pickle

    assert pickle.loads(pickle.dumps(cached)) == cached
