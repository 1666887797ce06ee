"""The sampling rules every engine shares: config validation, truncation, the keyed random stream,
and how much of max_tokens a paused sample has spent."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from posttrain.data.sample import Sample
from posttrain.engines import ENGINES, Engine
from posttrain.engines.base import (
    SamplingConfig,
    sampling_key,
    score_from_prompt_logprobs,
    tokens_already_generated,
)
from posttrain.engines.sampling import draw_tokens, gumbel_noise, sample_tokens, stream_key, truncate_logits


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"max_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_tokens": 4, "top_k": -2}, "top_k"),
        ({"max_tokens": 4, "logprobs": "scaled"}, "logprobs"),
        ({"max_tokens": 4, "stop_token_ids": (5, 6), "tool_call_token_ids": (6,)}, r"\[6\]"),
    ],
)
def test_sampling_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_finish_reason_for_stop_and_tool_call_ids():
    config = SamplingConfig(max_tokens=4, stop_token_ids=[7], tool_call_token_ids=[9])
    assert config.finish_reason_for(7) == "stop"
    assert config.finish_reason_for(9) == "tool_call"
    assert config.finish_reason_for(8) is None
    assert config.all_stop_token_ids == {7, 9}


def test_truncate_logits_top_k_and_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(truncate_logits(logits, 2, 1.0)).tolist() == [[True, True, False, False]]
    # nucleus: keep the fewest most likely tokens whose mass reaches top_p
    assert torch.isfinite(truncate_logits(logits, 0, 0.5)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(truncate_logits(logits, 0, 0.75)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(truncate_logits(logits, 0, 0.85)).tolist() == [[True, True, True, False]]


def test_keyed_draws_follow_the_distribution():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = torch.log(probs)[None].repeat(4000, 1)
    noise = noise_for([(0, f"u{i}", 3) for i in range(4000)], 4)
    tokens, logprobs = sample_tokens(logits, SamplingConfig(max_tokens=1), noise)
    frequency = torch.bincount(tokens, minlength=4).float() / 4000
    assert (frequency - probs).abs().max() < 0.03
    torch.testing.assert_close(logprobs, torch.log(probs)[tokens])


def test_processed_logprobs_follow_temperature_and_truncation():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    noise = noise_for([(1, "x", 0)], 4)
    sampling = SamplingConfig(max_tokens=1, temperature=0.5, top_k=2, logprobs="processed")
    token, logprob = sample_tokens(logits, sampling, noise)
    kept = torch.tensor([0.5, 0.3]) ** 2
    assert int(token) in (0, 1)
    assert math.isclose(float(logprob), math.log(float(kept[int(token)] / kept.sum())), rel_tol=1e-5)


def test_random_stream_is_keyed_by_seed_uid_and_position():
    assert sampling_key(0, "a", 5) == sampling_key(0, "a", 5)
    keys = {
        sampling_key(0, "a", 5),
        sampling_key(1, "a", 5),
        sampling_key(0, "b", 5),
        sampling_key(0, "a", 6),
    }
    assert len(keys) == 4
    torch.testing.assert_close(noise_for([(0, "a", 5)], 16), noise_for([(0, "a", 5)], 16))
    # the embedded engine's device-side stream: each of seed, uid and position changes every draw
    rows = noise_for([(0, "a", 5), (1, "a", 5), (0, "b", 5), (0, "a", 6)], 64)
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.isclose(rows[i], rows[j]).any()
    # a row's noise does not depend on the rows beside it
    torch.testing.assert_close(rows[2:3], noise_for([(0, "b", 5)], 64))


def test_device_noise_is_gumbel_and_independent_across_the_vocabulary():
    """60k draws from the hash stream: Gumbel(0, 1) quantiles and mean, no correlation between
    neighbouring vocabulary entries or neighbouring positions of one stream."""
    noise = noise_for([(3, "u", position) for position in range(600)], 100)
    gumbel_cdf = torch.exp(-torch.exp(-noise.double()))  # uniform if the noise is Gumbel
    quantiles = torch.quantile(gumbel_cdf.flatten(), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    torch.testing.assert_close(
        quantiles, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64), atol=0.01, rtol=0
    )
    assert abs(float(noise.mean()) - 0.5772) < 0.02  # Euler-Mascheroni: the Gumbel mean
    flat = gumbel_cdf - 0.5
    assert abs(float((flat[:, 1:] * flat[:, :-1]).mean() / flat.var())) < 0.02
    assert abs(float((flat[1:] * flat[:-1]).mean() / flat.var())) < 0.02


def test_draw_bans_a_token_but_records_the_models_raw_logprob():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    allowed = logits.clone()
    allowed[:, 0] = float("-inf")
    greedy = SamplingConfig(max_tokens=1, temperature=0)
    token, logprob = draw_tokens(logits, allowed, greedy, None)
    assert int(token) == 1 and math.isclose(float(logprob), math.log(0.2), rel_tol=1e-5)
    processed = SamplingConfig(max_tokens=1, temperature=1.0, logprobs="processed")
    token, logprob = draw_tokens(logits, allowed, processed, noise_for([(0, "x", 0)], 3))
    assert int(token) in (1, 2)
    assert math.isclose(float(logprob), math.log([0, 2 / 3, 1 / 3][int(token)]), rel_tol=1e-5)


def noise_for(draws: list[tuple[int, str, int]], vocab: int) -> torch.Tensor:
    """Noise rows for (seed, uid, position) draws, as the embedded engine asks for them."""
    streams = torch.tensor([stream_key(seed, uid) for seed, uid, _ in draws], dtype=torch.long)
    positions = torch.tensor([position for _, _, position in draws], dtype=torch.long)
    return gumbel_noise(streams, positions, vocab)


def test_tokens_already_generated_counts_only_the_paused_turn():
    sample = Sample(
        uid="s",
        tokens=[1, 2],
        prompt_length=2,
        loss_mask=[0, 0],
        rollout_logprobs=[0.0, 0.0],
        policy_version=[-1, -1],
    )
    sample.append([3, 4], generated=True, logprobs=[-1.0, -1.0])
    sample.append([5], generated=False)  # a tool result ends that turn
    sample.append([6, 7, 8], generated=True, logprobs=[-1.0] * 3)
    sample.finish_reason = "paused"
    assert tokens_already_generated(sample) == 3
    sample.finish_reason = "aborted"  # a failed server left the turn unfinished
    assert tokens_already_generated(sample) == 3
    sample.finish_reason = "tool_call"
    assert tokens_already_generated(sample) == 0


def test_score_alignment_puts_zero_first_and_rejects_gaps():
    assert score_from_prompt_logprobs([4, 5, 6], [None, -1.5, -0.5]) == [0.0, -1.5, -0.5]
    with pytest.raises(ValueError, match="position 2"):
        score_from_prompt_logprobs([4, 5, 6], [None, -1.5, None])


def test_every_registered_engine_implements_the_interface():
    names = [name for name, _ in ENGINES.items()]
    assert {"embedded", "vllm", "vllm_server", "trl_vllm"} <= set(names)
    for name, engine_class in ENGINES.items():
        assert issubclass(engine_class, Engine) and not inspect.isabstract(engine_class), name
