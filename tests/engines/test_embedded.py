"""EmbeddedEngine on the tiny K3: scoring is the model's own forward, generation is resumable,
batch-independent, weight updates take effect, QAT numbers are the training numbers."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_contract import assert_response_logprobs, assert_scores_match, assert_token_ends_turn

from posttrain.data.sample import Sample
from posttrain.engines import EmbeddedEngine, SamplingConfig
from posttrain.engines.base import tokens_already_generated
from posttrain.engines.testing import prompt_sample, reference_logprobs, tiny_k3
from posttrain.model import KimiK3ForCausalLM
from posttrain.qat import QATConfig, apply_qat


@pytest.fixture(scope="module")
def model() -> KimiK3ForCausalLM:
    return tiny_k3(0, init_scale=4.0).eval()


def prompts() -> list[Sample]:
    return [
        prompt_sample("a", [11, 12, 13]),
        prompt_sample("b", [21, 22, 23, 24, 25, 26]),
        prompt_sample("c", [31, 32, 33, 34]),
    ]


def forward_logprobs(model: torch.nn.Module, tokens: list[int]) -> list[float]:
    return reference_logprobs(model, tokens).tolist()


def test_score_equals_forward_log_softmax(model):
    samples = prompts()
    scores = EmbeddedEngine(model).score(samples)
    assert all(
        len(score) == len(sample.tokens) and score[0] == 0.0
        for sample, score in zip(samples, scores, strict=True)
    )
    assert_scores_match(model, samples, scores, atol=1e-5)


def test_next_token_logprobs_are_the_full_forward_log_softmax_and_score_picks_from_them(model):
    samples = prompts()
    engine = EmbeddedEngine(model)
    full = engine.next_token_logprobs(samples)
    scores = engine.score(samples)
    for sample, rows, score in zip(samples, full, scores, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([sample.tokens])).logits.float()[0, :-1]
        assert rows.shape == (len(sample.tokens) - 1, logits.shape[-1])
        torch.testing.assert_close(rows, torch.log_softmax(logits, -1), atol=1e-5, rtol=0)
        picked = rows.gather(-1, torch.tensor(sample.tokens[1:])[:, None]).squeeze(-1)
        assert score == [0.0, *picked.tolist()]


def test_generation_logprobs_are_the_models_and_alignment_holds(model):
    samples = EmbeddedEngine(model).generate(prompts(), SamplingConfig(max_tokens=5, seed=3, top_k=40))
    for sample in samples:
        sample.check()
        assert sample.finish_reason == "length" and sample.response_length == 5
        assert sample.loss_mask[sample.prompt_length :] == [1] * 5
        assert sample.policy_version[sample.prompt_length :] == [0] * 5
        assert_response_logprobs(sample, reference_logprobs(model, sample.tokens), atol=1e-5)


def test_paused_and_resumed_equals_uninterrupted(model):
    sampling = SamplingConfig(max_tokens=6, seed=7, temperature=0.9, top_p=0.95)
    engine = EmbeddedEngine(model)
    straight = engine.generate(prompts(), sampling)

    checks = {"n": 0}

    def pause_after_two_steps(_samples: list[Sample]) -> bool:
        checks["n"] += 1
        return checks["n"] == 3  # checked once before the batch, then after each decoding step

    resumed = engine.generate(prompts(), sampling, pause_when=pause_after_two_steps)
    assert [s.finish_reason for s in resumed] == ["paused"] * 3
    assert [s.response_length for s in resumed] == [2, 2, 2]
    assert [tokens_already_generated(s) for s in resumed] == [2, 2, 2]
    engine.generate(resumed, sampling)
    for a, b in zip(straight, resumed, strict=True):
        assert b.tokens == a.tokens and b.finish_reason == a.finish_reason == "length"
        torch.testing.assert_close(
            torch.tensor(b.rollout_logprobs), torch.tensor(a.rollout_logprobs), atol=1e-5, rtol=0
        )


def test_batched_generation_equals_one_by_one(model):
    sampling = SamplingConfig(max_tokens=5, seed=11)
    batched = EmbeddedEngine(model).generate(prompts(), sampling)
    single = [EmbeddedEngine(model, max_batch_size=1).generate([s], sampling)[0] for s in prompts()]
    for a, b in zip(batched, single, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(
            torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-5, rtol=0
        )


def test_finish_reasons_stop_tool_call_and_length(model):
    engine = EmbeddedEngine(model)
    free = assert_token_ends_turn(engine, lambda: prompt_sample("g", [5, 6, 7]), 2, ("stop", "tool_call"))
    generated = free.tokens[3:]
    assert free.finish_reason == "length" and len(generated) == 6
    short = engine.generate([prompt_sample("g", [5, 6, 7])], SamplingConfig(max_tokens=2, temperature=0.0))[0]
    assert short.finish_reason == "length" and short.tokens[3:] == generated[:2]


def test_update_weights_switches_to_the_new_models_logprobs(model, tmp_path):
    engine = EmbeddedEngine(copy.deepcopy(model))
    new_model = tiny_k3(1, init_scale=4.0).eval()
    before = engine.score(prompts())
    engine.update_weights(new_model.state_dict())
    assert engine.policy_version == 1
    after = engine.score(prompts())
    for sample, old, new in zip(prompts(), before, after, strict=True):
        expected = torch.tensor(forward_logprobs(new_model, sample.tokens))
        torch.testing.assert_close(torch.tensor(new), expected, atol=1e-5, rtol=0)
        assert (torch.tensor(old) - expected).abs().max() > 1e-2
    generated = engine.generate([prompt_sample("v", [1, 2, 3])], SamplingConfig(max_tokens=2))[0]
    assert generated.policy_version == [-1, -1, -1, 1, 1]

    model.save_pretrained(tmp_path / "ckpt")
    loaded = EmbeddedEngine.from_pretrained(tmp_path / "ckpt")
    assert_scores_match(model, prompts(), loaded.score(prompts()), atol=1e-5)
    engine.update_weights(tmp_path / "ckpt")
    assert engine.policy_version == 2
    assert_scores_match(model, prompts(), engine.score(prompts()), atol=1e-5)
    with pytest.raises(ValueError, match="unexpected"):
        engine.update_weights({**model.state_dict(), "not.a.weight": torch.zeros(1)})


def test_qat_fake_quant_is_active_in_generation_and_scoring(model):
    quantized = copy.deepcopy(model)
    assert apply_qat(quantized, QATConfig(scheme="k3"))
    engine = EmbeddedEngine(quantized)
    sample = engine.generate([prompt_sample("q", [3, 4, 5, 6])], SamplingConfig(max_tokens=4, seed=2))[0]
    with_qat = forward_logprobs(quantized, sample.tokens)
    without_qat = forward_logprobs(model, sample.tokens)
    assert_response_logprobs(sample, with_qat, atol=1e-5)
    torch.testing.assert_close(
        torch.tensor(engine.score([sample])[0]), torch.tensor(with_qat), atol=1e-5, rtol=0
    )
    assert max(abs(a - b) for a, b in zip(with_qat, without_qat, strict=True)) > 1e-4


def test_decoding_leaves_the_trained_module_trainable_with_unchanged_gradients(model):
    """The engine decodes and scores with the trainer's own module (RL's embedded rollouts): what it
    caches meanwhile (the MX weight copies, kept row caches) must not reach a later training
    forward, whose loss and gradients equal a twin's that never decoded."""
    trained, twin = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    for policy in (trained, twin):
        assert apply_qat(policy, QATConfig(scheme="k3"))
    engine = EmbeddedEngine(trained)
    sample = engine.generate([prompt_sample("t", [5, 6, 7, 8])], SamplingConfig(max_tokens=6, seed=4))[0]
    engine.score([sample])
    assert trained.training and not any(p.is_inference() for p in trained.parameters())

    def loss_and_grads(policy: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        policy.zero_grad()
        logits = policy(input_ids=torch.tensor([sample.tokens])).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], torch.tensor(sample.tokens[1:]))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in policy.parameters() if p.grad is not None]

    loss, grads = loss_and_grads(trained)
    twin_loss, twin_grads = loss_and_grads(twin)
    assert torch.equal(loss, twin_loss) and len(grads) == len(twin_grads) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads, twin_grads, strict=True))
