"""count_parameters: the released config reproduces the published totals; tiny is exact."""

from __future__ import annotations

from posttrain.model import KimiK3Config, KimiK3ForCausalLM, count_parameters


def test_full_k3_reproduces_published_totals(full_config: KimiK3Config) -> None:
    counts = count_parameters(full_config)
    # published: 2.78T total, 104.2B active per token (vision encoder excluded)
    assert round(counts["total"] / 1e12, 2) == 2.78
    assert round(counts["active"] / 1e9, 1) == 104.2


def test_tiny_counts_match_the_instantiated_model(tiny_config: KimiK3Config) -> None:
    model = KimiK3ForCausalLM(tiny_config)
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    embedding = params["model.embed_tokens.weight"].numel()
    routed = sum(p.numel() for n, p in params.items() if ".experts.w" in n)
    E, k = tiny_config.num_experts, tiny_config.num_experts_per_token
    assert count_parameters(tiny_config) == {
        "total": total,
        "active": total - embedding - routed * (E - k) // E,
    }


def test_tied_embeddings_are_counted_once_and_active(tiny_config: KimiK3Config) -> None:
    untied = count_parameters(tiny_config)
    tiny_config.tie_word_embeddings = True
    tied = count_parameters(tiny_config)
    head = tiny_config.vocab_size * tiny_config.hidden_size
    assert tied["total"] == untied["total"] - head
    assert tied["active"] == untied["active"]
