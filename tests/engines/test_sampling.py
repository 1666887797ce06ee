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
from posttrain.engines.embedded import gumbel_noise, sample_tokens, truncate_logits


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
    noise = torch.cat([gumbel_noise(0, f"u{i}", [3], 4) for i in range(4000)])
    tokens, logprobs = sample_tokens(logits, SamplingConfig(max_tokens=1), noise)
    frequency = torch.bincount(tokens, minlength=4).float() / 4000
    assert (frequency - probs).abs().max() < 0.03
    torch.testing.assert_close(logprobs, torch.log(probs)[tokens])


def test_processed_logprobs_follow_temperature_and_truncation():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    noise = gumbel_noise(1, "x", [0], 4)
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
    torch.testing.assert_close(gumbel_noise(0, "a", [5], 16), gumbel_noise(0, "a", [5], 16))


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
