"""The K3 model's forward: packing, left padding, the attention-residual schedule, checkpoints,
gradients, QAT hooks and activation checkpointing."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from posttrain.model import KimiK3Config, KimiK3ForCausalLM, save_released
from posttrain.model.moe import KimiK3Experts, KimiK3MoEGate
from posttrain.ops.attn_res import naive_attn_res

TOL = dict(atol=2e-5, rtol=1e-4)


def logits(model: KimiK3ForCausalLM, ids: torch.Tensor, **kw) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False, **kw).logits


def test_packed_documents_equal_separate_documents(tiny_model: KimiK3ForCausalLM) -> None:
    torch.manual_seed(1)
    docs = [torch.randint(3, 2048, (1, n)) for n in (9, 1, 6, 3)]
    bounds = torch.tensor([0, 9, 10, 16, 19])
    packed = logits(tiny_model, torch.cat(docs, 1), cu_seqlens=bounds)
    for i, doc in enumerate(docs):
        torch.testing.assert_close(packed[:, bounds[i] : bounds[i + 1]], logits(tiny_model, doc), **TOL)


def test_packed_loss_ignores_cross_document_predictions(tiny_model: KimiK3ForCausalLM) -> None:
    torch.manual_seed(2)
    docs = [torch.randint(3, 2048, (1, n)) for n in (7, 5)]
    ids = torch.cat(docs, 1)
    with torch.no_grad():
        loss = tiny_model(ids, cu_seqlens=torch.tensor([0, 7, 12]), labels=ids, use_cache=False).loss
    per_doc = [F.cross_entropy(logits(tiny_model, d)[0, :-1], d[0, 1:], reduction="sum") for d in docs]
    torch.testing.assert_close(loss, sum(per_doc) / (6 + 4), **TOL)


def test_left_padding_does_not_change_real_tokens(tiny_model: KimiK3ForCausalLM) -> None:
    torch.manual_seed(3)
    rows = [torch.randint(3, 2048, (n,)) for n in (11, 4, 8)]
    T = 11
    ids = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, T - len(row) :] = row
        mask[r, T - len(row) :] = 1
    batch = logits(tiny_model, ids, attention_mask=mask)
    assert torch.isfinite(batch).all()
    for r, row in enumerate(rows):
        torch.testing.assert_close(batch[r, T - len(row) :], logits(tiny_model, row[None])[0], **TOL)


def test_padding_is_excluded_from_router_statistics(tiny_model: KimiK3ForCausalLM) -> None:
    ids = torch.randint(3, 2048, (2, 6))
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    tiny_model.train()
    tiny_model(ids, attention_mask=mask)
    gates = [m for m in tiny_model.modules() if hasattr(m, "balancer")]
    assert gates and all(g.balancer.num_tokens == 9 for g in gates)


@pytest.mark.parametrize("block_size", [2, 3, None])
def test_block_attention_residual_schedule_matches_spec(tiny_config: KimiK3Config, make_model, block_size):
    """Record every sublayer's input and output; rebuild each input from the spec: a mix of
    [embedding, sum of each block's outputs so far] (blocks of `block_size` layers)."""
    tiny_config.attn_res_block_size = block_size
    model = make_model(tiny_config)
    seen: list[tuple[str, torch.Tensor]] = []
    hooks = [model.model.embed_tokens.register_forward_hook(lambda m, a, o: seen.append(("emb", o)))]
    for i, layer in enumerate(model.model.layers):
        ffn = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe
        hooks += [
            layer.input_layernorm.register_forward_pre_hook(
                lambda m, a, i=i: seen.append((f"in_a{i}", a[0]))
            ),
            layer.self_attn.register_forward_hook(lambda m, a, o, i=i: seen.append((f"out_a{i}", o))),
            layer.post_attention_layernorm.register_forward_pre_hook(
                lambda m, a, i=i: seen.append((f"in_m{i}", a[0]))
            ),
            ffn.register_forward_hook(lambda m, a, o, i=i: seen.append((f"out_m{i}", o))),
        ]
    hooks.append(model.model.norm.register_forward_pre_hook(lambda m, a: seen.append(("final", a[0]))))
    logits(model, torch.randint(3, 2048, (2, 7)))
    for h in hooks:
        h.remove()
    rec = dict(seen)
    emb = rec["emb"]
    layers = model.model.layers
    outputs: list[tuple[int, torch.Tensor]] = []  # (layer, output) in execution order

    def expected(norm, query) -> torch.Tensor:
        if block_size is None:
            return emb + sum(o for _, o in outputs)
        blocks: dict[int, torch.Tensor] = {}
        for layer_idx, out in outputs:
            b = layer_idx // block_size
            blocks[b] = blocks[b] + out if b in blocks else out
        return naive_attn_res([emb, *blocks.values()], norm.weight, query.weight[0], norm.eps)

    for i, layer in enumerate(layers):
        a_norm = getattr(layer, "self_attention_res_norm", None)
        m_norm = getattr(layer, "mlp_res_norm", None)
        torch.testing.assert_close(
            rec[f"in_a{i}"], expected(a_norm, getattr(layer, "self_attention_res_proj", None)), **TOL
        )
        outputs.append((i, rec[f"out_a{i}"]))
        torch.testing.assert_close(
            rec[f"in_m{i}"], expected(m_norm, getattr(layer, "mlp_res_proj", None)), **TOL
        )
        outputs.append((i, rec[f"out_m{i}"]))
    final = expected(
        getattr(model.model, "output_attn_res_norm", None), getattr(model.model, "output_attn_res_proj", None)
    )
    torch.testing.assert_close(rec["final"], final, **TOL)


def test_save_load_round_trip_uses_released_names(tiny_model: KimiK3ForCausalLM, tmp_path) -> None:
    ids = torch.randint(3, 2048, (2, 9))
    tiny_model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    # released layout: per-expert routed weights, the selection bias inside the gate
    layer1 = "model.layers.1.block_sparse_moe."
    assert {f"{layer1}experts.{e}.{w}.weight" for e in range(8) for w in ("w1", "w2", "w3")} <= names
    assert {f"{layer1}gate.weight", f"{layer1}gate.e_score_correction_bias"} <= names
    kda = {
        "q_proj",
        "k_proj",
        "v_proj",
        "q_conv1d",
        "k_conv1d",
        "v_conv1d",
        "f_a_proj",
        "f_b_proj",
        "b_proj",
        "g_proj",
        "o_norm",
        "o_proj",
    }
    assert {f"model.layers.0.self_attn.{n}.weight" for n in kda} <= names
    assert {"model.layers.0.self_attn.A_log", "model.layers.0.self_attn.dt_bias"} <= names
    mla = {
        "q_a_proj",
        "q_a_layernorm",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_a_layernorm",
        "kv_b_proj",
        "g_proj",
        "o_proj",
    }
    assert {f"model.layers.3.self_attn.{n}.weight" for n in mla} <= names
    assert {
        "model.output_attn_res_proj.weight",
        "model.layers.2.mlp_res_proj.weight",
        "lm_head.weight",
    } <= names
    assert AutoConfig.from_pretrained(tmp_path).model_type == "kimi_k3"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, KimiK3ForCausalLM)
    torch.testing.assert_close(logits(loaded, ids), logits(tiny_model, ids), atol=0, rtol=0)
    bias = "model.layers.2.block_sparse_moe.gate.e_score_correction_bias"
    assert torch.equal(loaded.state_dict()[bias], tiny_model.state_dict()[bias])


def test_every_parameter_gets_a_gradient(tiny_model: KimiK3ForCausalLM) -> None:
    tiny_model.train()
    ids = torch.randint(3, 2048, (2, 10))
    tiny_model(ids, labels=ids).loss.backward()
    no_grad = {n for n, p in tiny_model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0}
    # layer 0's attention input mixes a single source (the embedding): its softmax is constant 1
    assert no_grad == {
        "model.layers.0.self_attention_res_norm.weight",
        "model.layers.0.self_attention_res_proj.weight",
    }
    assert all(b.grad is None for _, b in tiny_model.named_buffers())


def test_qat_hooks_see_expert_weights_and_activations(tiny_model: KimiK3ForCausalLM) -> None:
    ids = torch.randint(3, 2048, (1, 8))
    zeroed = copy.deepcopy(tiny_model)
    calls: list[tuple[str, tuple[int, ...]]] = []

    def weight_hook(w: torch.Tensor) -> torch.Tensor:
        calls.append(("w", tuple(w.shape)))
        return torch.zeros_like(w)

    def act_hook(a: torch.Tensor) -> torch.Tensor:
        calls.append(("a", tuple(a.shape)))
        return a

    experts = [m for m in tiny_model.modules() if isinstance(m, KimiK3Experts)]
    assert len(experts) == 3 and all(type(m).__name__.endswith("Experts") for m in experts)
    for m in experts:
        m.weight_fake_quant, m.act_fake_quant = weight_hook, act_hook
    with torch.no_grad():
        for m in zeroed.modules():
            if isinstance(m, KimiK3Experts):
                for w in (m.w1, m.w2, m.w3):
                    w.zero_()
    torch.testing.assert_close(logits(tiny_model, ids), logits(zeroed, ids), atol=0, rtol=0)
    weight_shapes = {s for kind, s in calls if kind == "w"}
    assert weight_shapes == {(8, 64, 32), (8, 32, 64)}
    assert sum(kind == "w" for kind, _ in calls) == 3 * 3
    act_widths = {s[-1] for kind, s in calls if kind == "a"}
    assert act_widths == {32, 64}  # latent tokens into w1/w3, SiTU output into w2


def test_activation_checkpointing_same_gradients_and_counts_once(tiny_config: KimiK3Config, make_model):
    ids = torch.randint(3, 2048, (2, 9))
    grads = []
    for checkpointing in (False, True):
        model = make_model(tiny_config).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        gates = [m for m in model.modules() if hasattr(m, "balancer")]
        assert all(g.balancer.num_tokens == 18 for g in gates)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], **TOL)


def test_released_layout_has_the_wrapper_header(tiny_model: KimiK3ForCausalLM, tmp_path, vllm_config_keys):
    out = save_released(tiny_model, tmp_path / "released")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "kimi_k3"
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"]
    text = config["text_config"]
    assert text["model_type"] == "kimi_linear" and "vision_config" in config
    # every key vLLM's KimiLinearConfig reads is there (rope_parameters: K3 has no rotary)
    assert vllm_config_keys - {"model_type", "rope_parameters"} <= set(text)
    assert text["linear_attn_config"] == tiny_model.config.linear_attn_config
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "language_model.model.layers.3.block_sparse_moe.experts.7.w2.weight" in names
    assert "language_model.lm_head.weight" in names and all(n.startswith("language_model.") for n in names)


def test_config_variants_keep_documents_separate(tiny_config: KimiK3Config, make_model) -> None:
    """The non-K3 switches (low-rank KDA output gate, full-rank q, experts at full width, grouped
    routing) build the layers their names say and keep packed == separate."""
    tiny_config.linear_attn_config["use_full_rank_gate"] = False
    tiny_config.q_lora_rank = None
    tiny_config.routed_expert_hidden_size = None
    tiny_config.num_expert_group, tiny_config.topk_group = 2, 1
    model = make_model(tiny_config)
    names = {n for n, _ in model.named_parameters()}
    assert {"model.layers.0.self_attn.g_a_proj.weight", "model.layers.0.self_attn.g_b_proj.weight"} <= names
    assert "model.layers.3.self_attn.q_proj.weight" in names
    assert not any("routed_expert_down_proj" in n for n in names)
    docs = [torch.randint(3, 2048, (1, n)) for n in (5, 8)]
    packed = logits(model, torch.cat(docs, 1), cu_seqlens=torch.tensor([0, 5, 13]))
    torch.testing.assert_close(packed[:, :5], logits(model, docs[0]), **TOL)
    torch.testing.assert_close(packed[:, 5:], logits(model, docs[1]), **TOL)


def test_grouped_routing_picks_within_the_best_groups(tiny_config: KimiK3Config) -> None:
    tiny_config.num_expert_group, tiny_config.topk_group = 4, 1
    gate = KimiK3MoEGate(tiny_config).eval()
    torch.nn.init.normal_(gate.weight)
    topk_idx, topk_weight = gate(torch.randn(50, 64))
    assert (topk_idx[:, 0] // 2 == topk_idx[:, 1] // 2).all()  # both picks from one group of 2
    torch.testing.assert_close(topk_weight.sum(-1), torch.ones(50))  # renormalised, scale 1.0
