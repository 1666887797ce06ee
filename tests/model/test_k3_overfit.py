"""The tiny K3 learns: a few fixed sequences are memorised on CPU within a small step budget, with
Quantile Balancing updating the router bias after every optimizer step as trainers do."""

from __future__ import annotations

import torch

from posttrain.model import KimiK3Config, KimiK3ForCausalLM

MAX_STEPS = 40
TARGET_LOSS = 0.5  # from ~7.6 (ln 2048) at initialisation


def test_tiny_k3_overfits_four_sequences(tiny_config: KimiK3Config) -> None:
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(tiny_config).train()
    ids = torch.randint(3, tiny_config.vocab_size, (4, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(MAX_STEPS):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        metrics = model.update_router_bias()
        losses.append(loss.item())
        if losses[-1] < TARGET_LOSS:
            break
    assert losses[0] > 7.0
    assert losses[-1] < TARGET_LOSS, f"loss after {len(losses)} steps: {losses[-1]:.3f}"
    assert metrics["router_bias_abs_max"] > 0  # the bias moved, outside the gradient
    assert all(b.grad is None for n, b in model.named_buffers() if "e_score_correction_bias" in n)
