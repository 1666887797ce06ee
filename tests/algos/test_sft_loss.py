"""sft_loss against a per-token loop written from the definition of next-token cross-entropy."""

import math

import pytest
import torch

from posttrain.algos.sft import sft_loss


def naive_token_nll(logits: list[float], target: int) -> float:
    log_z = math.log(sum(math.exp(x) for x in logits))
    return log_z - logits[target]


def naive_sft(logits: torch.Tensor, tokens: torch.Tensor, loss_mask: torch.Tensor) -> tuple[float, int]:
    total, count = 0.0, 0
    for b in range(tokens.shape[0]):
        for t in range(tokens.shape[1] - 1):
            if loss_mask[b, t + 1]:
                total += naive_token_nll(logits[b, t].tolist(), int(tokens[b, t + 1]))
                count += 1
    return total, count


def random_batch(seed: int, B: int = 3, T: int = 7, V: int = 11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.4).long()
    return logits, tokens, mask


def test_mean_and_sum_match_the_definition():
    logits, tokens, mask = random_batch(0)
    total, count = naive_sft(logits, tokens, mask)
    mean = sft_loss(logits, tokens, mask)
    summed = sft_loss(logits, tokens, mask, reduction="sum")
    assert int(mean.num_tokens) == count == int(mask[:, 1:].sum())
    assert mean.loss.item() == pytest.approx(total / count, rel=1e-9)
    assert summed.loss.item() == pytest.approx(total, rel=1e-9)


def test_first_token_is_never_a_target():
    logits, tokens, _ = random_batch(1, B=1, T=4)
    only_first = torch.tensor([[1, 0, 0, 0]])
    out = sft_loss(logits, tokens, only_first)
    assert int(out.num_tokens) == 0
    assert out.loss.item() == 0.0


def test_gradient_is_softmax_minus_onehot_on_trained_positions_only():
    logits, tokens, mask = random_batch(2)
    logits.requires_grad_(True)
    out = sft_loss(logits, tokens, mask)
    out.loss.backward()
    count = int(mask[:, 1:].sum())
    expected = torch.zeros_like(logits)
    for b in range(tokens.shape[0]):
        for t in range(tokens.shape[1] - 1):
            if mask[b, t + 1]:
                row = torch.softmax(logits[b, t].detach(), -1)
                row[tokens[b, t + 1]] -= 1
                expected[b, t] = row / count
    torch.testing.assert_close(logits.grad, expected, rtol=1e-6, atol=1e-9)


def test_accumulated_token_sums_equal_the_full_batch_mean():
    logits, tokens, mask = random_batch(3, B=4)
    full = sft_loss(logits, tokens, mask)
    parts = [
        sft_loss(logits[i : i + 1], tokens[i : i + 1], mask[i : i + 1], reduction="sum") for i in range(4)
    ]
    accumulated = sum(p.loss for p in parts) / sum(p.num_tokens for p in parts)
    assert accumulated.item() == pytest.approx(full.loss.item(), rel=1e-12)


def test_packed_row_equals_padded_documents():
    g = torch.Generator().manual_seed(4)
    V = 9
    lengths = [5, 3, 6]
    docs = [
        (torch.randn(n, V, generator=g, dtype=torch.float64), torch.randint(0, V, (n,), generator=g))
        for n in lengths
    ]
    # every token of every document is trained, including its first one, so a packed row without
    # boundaries would wrongly train the previous document's last position on it
    packed_logits = torch.cat([d[0] for d in docs]).unsqueeze(0)
    packed_tokens = torch.cat([d[1] for d in docs]).unsqueeze(0)
    packed_mask = torch.ones_like(packed_tokens)
    cu_seqlens = torch.tensor([0, 5, 8, 14])
    packed = sft_loss(packed_logits, packed_tokens, packed_mask, reduction="sum", cu_seqlens=cu_seqlens)

    expected_total, expected_count = 0.0, 0
    for logits, tokens in docs:
        total, count = naive_sft(logits.unsqueeze(0), tokens.unsqueeze(0), torch.ones(1, len(tokens)))
        expected_total += total
        expected_count += count
    assert int(packed.num_tokens) == expected_count == sum(n - 1 for n in lengths)
    assert packed.loss.item() == pytest.approx(expected_total, rel=1e-9)


def test_empty_mask_gives_zero_loss_that_still_backpropagates():
    logits, tokens, _ = random_batch(5)
    logits.requires_grad_(True)
    out = sft_loss(logits, tokens, torch.zeros_like(tokens))
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert int(out.num_tokens) == 0
    assert torch.count_nonzero(logits.grad) == 0


def test_bf16_logits_are_scored_in_fp32():
    logits, tokens, mask = random_batch(6)
    low = logits.to(torch.bfloat16)
    out = sft_loss(low, tokens, mask)
    total, count = naive_sft(low.double(), tokens, mask)
    assert out.loss.dtype == torch.float32
    assert out.loss.item() == pytest.approx(total / count, rel=1e-5)


def test_shape_and_argument_errors_name_the_problem():
    logits, tokens, mask = random_batch(7)
    with pytest.raises(ValueError, match="logits \\[B,T,V\\]"):
        sft_loss(logits, tokens[:, :-1], mask)
    with pytest.raises(ValueError, match="reduction"):
        sft_loss(logits, tokens, mask, reduction="avg")
    with pytest.raises(ValueError, match="B == 1"):
        sft_loss(logits, tokens, mask, cu_seqlens=torch.tensor([0, 7]))
