"""Real vLLM OpenAI-compatible server (a subprocess), through `VLLMServerEngine`: parity with
transformers, weight reloads, pause mid-stream, and a server SIGKILLed mid-batch.

One server for the module; the death tests restart it (owned) or leave it dead (external URL),
so they run last.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from engine_contract import assert_response_logprobs, assert_scores_match, assert_token_ends_turn

from posttrain.engines import EngineError, SamplingConfig
from posttrain.engines.base import tokens_already_generated
from posttrain.engines.testing import perturbed_llama_state_dict, reference_logprobs
from posttrain.engines.vllm_server import VLLMServer, VLLMServerEngine

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    server = VLLMServer(model=tiny_llama_dir, log_path=tmp_path_factory.mktemp("server") / "vllm.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def engine(server):
    engine = VLLMServerEngine(server)
    yield engine
    engine.close()


# Long enough that a loaded machine's server cannot stream every sample to the end before the
# client first reads (seen at 48 tokens under load: the kill then landed after generation).
LONG = 400


def kill_server_when_streaming(server: VLLMServer, seen: dict):
    """A pause_when hook that never pauses: it SIGKILLs the server once tokens are streaming."""

    def hook(samples):
        if not seen and any(generated_tokens(s) >= 2 for s in samples):
            seen.update({s.uid: s.response_length for s in samples})
            os.killpg(server.process.pid, signal.SIGKILL)
        return False

    return hook


def generated_tokens(sample) -> int:
    return sum(sample.loss_mask[sample.prompt_length :])


def test_score_and_generation_match_transformers(engine, tiny_llama, make_prompts):
    prompts = make_prompts("s")
    assert_scores_match(tiny_llama, prompts, engine.score(prompts))
    samples = engine.generate(make_prompts("g"), SamplingConfig(max_tokens=6, seed=3))
    for sample in samples:
        sample.check()
        assert sample.finish_reason == "length" and sample.response_length == 6
        assert_response_logprobs(sample, reference_logprobs(tiny_llama, sample.tokens))


def test_stop_token_ends_the_turn(engine, make_prompts):
    assert_token_ends_turn(engine, lambda: make_prompts("f")[0], 3, ("tool_call",))


def test_pause_mid_stream_keeps_tokens_and_resumes(engine, make_prompts):
    # LONG, not 40: on a fast machine the server streamed all 40 tokens before the first check.
    sampling = SamplingConfig(max_tokens=LONG, seed=6)

    def pause_once_streaming(samples):
        return any(generated_tokens(s) >= 3 for s in samples)

    samples = engine.generate(make_prompts("p"), sampling, pause_when=pause_once_streaming)
    assert all(s.finish_reason in ("paused", "length") for s in samples)
    assert any(s.finish_reason == "paused" and 3 <= tokens_already_generated(s) < LONG for s in samples)
    engine.generate(samples, sampling)
    for sample, score in zip(samples, engine.score(samples), strict=True):
        sample.check()
        assert sample.finish_reason == "length" and sample.response_length == LONG
        assert_response_logprobs(sample, score)


def test_update_weights_reloads_on_the_server(engine, tiny_llama, tiny_llama_dir, make_prompts):
    prompts = make_prompts("w")
    new_state = perturbed_llama_state_dict(tiny_llama_dir, seed=8)
    new_model = type(tiny_llama).from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    new_model.load_state_dict(new_state)
    engine.update_weights(new_state)
    assert engine.policy_version == 1 and (engine.weights_path / "model.safetensors").exists()
    assert_scores_match(new_model, prompts, engine.score(prompts))


def test_owned_server_killed_mid_batch_is_restarted_and_no_sample_is_lost(
    engine, server, tiny_llama_dir, tiny_llama, make_prompts
):
    # after the previous test the server holds the perturbed weights: a restart must bring them back
    new_model = type(tiny_llama).from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    new_model.load_state_dict(perturbed_llama_state_dict(tiny_llama_dir, seed=8))
    old_pid, seen = server.process.pid, {}
    samples = make_prompts("k")
    engine.generate(
        samples, SamplingConfig(max_tokens=LONG, seed=9), pause_when=kill_server_when_streaming(server, seen)
    )
    assert seen, "the server was never killed mid-batch"
    assert server.process.pid != old_pid and server.starts == 2 and engine.restarts == 1
    assert any(0 < seen[s.uid] < LONG for s in samples)  # cut mid-generation (seen holds response lengths)
    for sample, score in zip(samples, engine.score(samples), strict=True):
        sample.check()
        assert sample.finish_reason == "length" and sample.response_length == LONG
        assert sample.policy_version[sample.prompt_length :] == [1] * LONG
        assert_response_logprobs(sample, reference_logprobs(new_model, sample.tokens))
        assert_scores_match(new_model, [sample], [score])


def test_external_server_killed_mid_batch_names_the_failed_samples(server, make_prompts):
    external = VLLMServerEngine(server.url)  # not owned: it cannot restart what it did not start
    seen: dict = {}
    samples = make_prompts("e")
    with pytest.raises(EngineError) as failure:
        external.generate(
            samples,
            SamplingConfig(max_tokens=LONG, seed=10),
            pause_when=kill_server_when_streaming(server, seen),
        )
    assert seen
    unfinished = [s.uid for s in samples if s.finish_reason != "length"]
    assert sorted(failure.value.failed_uids) == sorted(unfinished) and unfinished
    for sample in samples:
        sample.check()  # streamed tokens kept, aligned
        assert sample.finish_reason in ("length", "aborted")
        assert sample.response_length >= seen[sample.uid] - sample.prompt_length
