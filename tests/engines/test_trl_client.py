"""`TRLVLLMClient` (TRL's own VLLMClient underneath) against the server `trl vllm-serve` runs:
TRL's `build_command` flags (dev mode, NCCL weight-transfer engine, processed log-probs,
unlimited logprobs), started through vLLM's OpenAI entry point because the CPU wheel's
distribution name breaks `vllm serve` itself. NCCL weight sync needs CUDA and is not run here."""

from __future__ import annotations

import pytest
import torch
from engine_contract import assert_response_logprobs, assert_scores_match, assert_token_ends_turn

from posttrain.engines import SamplingConfig
from posttrain.engines.testing import perturbed_llama_state_dict, reference_logprobs, start_trl_server
from posttrain.engines.trl_client import TRLVLLMClient

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def client(tiny_llama_dir, tmp_path_factory):
    server = start_trl_server(tiny_llama_dir, tmp_path_factory.mktemp("trl") / "server.log")
    assert "--weight-transfer-config" in server.command and "processed_logprobs" in server.command
    client = TRLVLLMClient(server.url, weights_dir=tmp_path_factory.mktemp("trl-weights"))
    yield client
    client.close()
    server.stop()


def test_score_is_the_models_log_softmax(client, tiny_llama, make_prompts):
    prompts = make_prompts("s")
    assert_scores_match(tiny_llama, prompts, client.score(prompts))


def test_generate_records_processed_logprobs_of_the_sampling_distribution(client, tiny_llama, make_prompts):
    plain = client.generate(make_prompts("g"), SamplingConfig(max_tokens=6, seed=1))
    for sample in plain:  # temperature 1, no truncation: processed == the model's log-probs
        sample.check()
        assert sample.finish_reason == "length" and sample.response_length == 6
        assert_response_logprobs(sample, reference_logprobs(tiny_llama, sample.tokens))
    hot = client.generate(
        make_prompts("h"), SamplingConfig(max_tokens=4, seed=1, temperature=2.0, logprobs="processed")
    )
    for sample in hot:
        with torch.no_grad():
            logits = tiny_llama(input_ids=torch.tensor([sample.tokens])).logits[0, :-1] / 2.0
        picked = (
            torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample.tokens[1:])[:, None]).squeeze(-1)
        )
        torch.testing.assert_close(
            torch.tensor(sample.rollout_logprobs[sample.prompt_length :]),
            picked[sample.prompt_length - 1 :],
            atol=1e-4,
            rtol=0,
        )


def test_tool_call_token_ends_the_turn(client, make_prompts):
    assert_token_ends_turn(client, lambda: make_prompts("f")[0], 2, ("tool_call",))


def test_pause_before_sending_returns_untouched_paused_samples(client, make_prompts):
    samples = client.generate(make_prompts("p"), SamplingConfig(max_tokens=4), pause_when=lambda _: True)
    assert all(s.finish_reason == "paused" and s.response_length == 0 for s in samples)


def test_weight_update_by_reload(client, tiny_llama, tiny_llama_dir, make_prompts):
    new_state = perturbed_llama_state_dict(tiny_llama_dir, seed=3)
    new_model = type(tiny_llama).from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    new_model.load_state_dict(new_state)
    client.update_weights(new_state)
    assert client.policy_version == 1
    prompts = make_prompts("w")
    assert_scores_match(new_model, prompts, client.score(prompts))
