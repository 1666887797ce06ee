"""KimiK3Cache and generation: cached decoding reproduces the full forward, token for token."""

from __future__ import annotations

import pytest
import torch

from posttrain.model import KimiK3Cache, KimiK3ForCausalLM

TOL = dict(atol=2e-5, rtol=1e-4)


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r) :] = r
        mask[i, T - len(r) :] = 1
    return ids, mask


@torch.no_grad()
def test_incremental_decode_logits_equal_full_forward(tiny_model: KimiK3ForCausalLM, tiny_config) -> None:
    torch.manual_seed(4)
    rows = [torch.randint(3, 2048, (n,)) for n in (13, 6)]
    ids, mask = left_padded(rows)
    full = tiny_model(ids, attention_mask=mask, use_cache=False).logits
    cache = KimiK3Cache(tiny_config)
    pieces = [
        tiny_model(ids[:, :5], attention_mask=mask[:, :5], past_key_values=cache, use_cache=True).logits
    ]
    for t in range(5, 9):  # one token at a time, mask over all positions so far
        pieces.append(
            tiny_model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache).logits
        )
    # a multi-token continuation, mask over the new positions only
    pieces.append(tiny_model(ids[:, 9:], attention_mask=mask[:, 9:], past_key_values=cache).logits)
    assert cache.get_seq_length() == 13
    stepwise = torch.cat(pieces, dim=1)
    real = mask.bool()
    torch.testing.assert_close(stepwise[real], full[real], **TOL)


@torch.no_grad()
def test_generate_with_cache_gives_the_uncached_tokens(tiny_model: KimiK3ForCausalLM) -> None:
    torch.manual_seed(5)
    ids, mask = left_padded([torch.randint(3, 2048, (n,)) for n in (7, 3, 5)])
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    cached = tiny_model.generate(ids, use_cache=True, **kw)
    uncached = tiny_model.generate(ids, use_cache=False, **kw)
    assert cached.shape == (3, 7 + 6)
    assert torch.equal(cached, uncached)


@torch.no_grad()
def test_select_drops_finished_rows(tiny_model: KimiK3ForCausalLM, tiny_config) -> None:
    torch.manual_seed(6)
    rows = [torch.randint(3, 2048, (n,)) for n in (5, 8, 6)]
    ids, mask = left_padded(rows)
    cache = KimiK3Cache(tiny_config)
    tiny_model(ids, attention_mask=mask, past_key_values=cache)
    cache.select(torch.tensor([2, 0]))
    assert cache.batch_size == 2
    nxt = torch.randint(3, 2048, (2, 1))
    got = tiny_model(nxt, past_key_values=cache).logits[:, -1]
    for out_row, src in enumerate((2, 0)):
        alone = torch.cat([rows[src], nxt[out_row]])[None]
        torch.testing.assert_close(got[out_row], tiny_model(alone, use_cache=False).logits[0, -1], **TOL)


def test_cache_cannot_crop(tiny_config) -> None:
    with pytest.raises(NotImplementedError, match="recurrent state"):
        KimiK3Cache(tiny_config).crop(1)


@torch.no_grad()
def test_bad_masks_and_packing_are_errors(tiny_model: KimiK3ForCausalLM) -> None:
    with pytest.raises(ValueError, match=r"attention_mask has 3 positions; expected 5"):
        tiny_model(torch.randint(3, 2048, (1, 5)), attention_mask=torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="expected batch size 1"):
        tiny_model(torch.randint(3, 2048, (2, 5)), cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="without past_key_values or use_cache"):
        tiny_model(torch.randint(3, 2048, (1, 5)), cu_seqlens=torch.tensor([0, 2, 5]), use_cache=True)
    # packed rows in eval mode: no cache is made up for them
    packed = tiny_model(torch.randint(3, 2048, (1, 5)), cu_seqlens=torch.tensor([0, 2, 5]))
    assert packed.past_key_values is None
