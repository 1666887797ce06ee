"""EmbeddedEngine cache reuse: a sample's cache kept between generate calls gives the same tokens
and log-probs as prefilling the whole trajectory again, and is never used when it could be wrong
(new weights, edited tokens) or after the LRU cap dropped it."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.data.chat import tool_call_id
from posttrain.data.sample import Sample
from posttrain.engines import EmbeddedEngine, SamplingConfig
from posttrain.engines.embedded import suffix_prefill_plan
from posttrain.engines.testing import reference_logprobs, tiny_k3
from posttrain.model import KimiK3ForCausalLM
from posttrain.qat import QATConfig, apply_qat

SAMPLING = SamplingConfig(max_tokens=6, seed=7, temperature=0.9, top_p=0.95, logprobs="processed")


def peaked_k3(seed: int) -> KimiK3ForCausalLM:
    """The tiny K3 with QAT k3 as every stage trains it, peaked so a wrong log-prob shows."""
    return tiny_k3(seed, qat=QATConfig(scheme="k3"), init_scale=4.0).eval()


@pytest.fixture(scope="module")
def model() -> KimiK3ForCausalLM:
    return peaked_k3(0)


def tool_results(renderer, turn: int, content: str) -> list[int]:
    return renderer.render_tool_results(
        [{"role": "tool", "tool_call_id": tool_call_id("search", turn), "content": content}]
    )


def results_for(renderer, samples: list[Sample], turn: int) -> list[list[int]]:
    """Tool results per sample; samples 0 and 1 get the same ones, so they share a prefill forward
    (equal suffix lengths) over cached prefixes of different lengths."""
    contents = ["found 3 files", "found 3 files", f"error {turn}: no such file", "x" * (5 + turn)]
    return [tool_results(renderer, turn, contents[i % len(contents)]) for i in range(len(samples))]


def play(
    engine: EmbeddedEngine, samples: list[Sample], renderer, turns: int, sampling: SamplingConfig = SAMPLING
) -> list[Sample]:
    """An agent episode's engine side: generate a turn, append tool results, repeat."""
    for turn in range(turns):
        engine.generate(samples, sampling)
        if turn < turns - 1:
            for sample, ids in zip(samples, results_for(renderer, samples, turn), strict=True):
                sample.append(ids, generated=False)
    return samples


def assert_same_trajectories(got: list[Sample], expected: list[Sample]) -> None:
    """Same tokens, masks, versions and finish reasons; log-probs equal up to float32 rounding
    (a cache built in pieces, or another batch composition, rounds differently: up to 7e-6
    relative was seen, bench/multiturn_cache.py)."""
    for a, b in zip(got, expected, strict=True):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        assert a.loss_mask == b.loss_mask and a.policy_version == b.policy_version
        torch.testing.assert_close(
            torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-5, rtol=2e-5
        )


def test_multi_turn_episode_reuse_equals_full_prefill_and_prefills_only_new_tokens(
    model, make_prompts, renderer
):
    # Without QAT: a cache built in pieces rounds differently from a full prefill (about 1e-7), and
    # MX fake quantisation is a step function, so under QAT one activation next to a rounding
    # boundary flips to the next FP8 value and the peaked model turns that into log-probs apart
    # by up to 0.4 (seen on this 2-core machine's CPU, not on an earlier one). Reuse is exact up to
    # rounding; that is what this compares.
    plain = tiny_k3(0, init_scale=4.0).eval()
    turns = 3
    without = play(EmbeddedEngine(plain, max_cached_samples=0), make_prompts("m"), renderer, turns)
    engine = EmbeddedEngine(plain)
    with_reuse = play(engine, make_prompts("m"), renderer, turns)
    assert_same_trajectories(with_reuse, without)

    n = len(with_reuse)
    prompt_tokens = sum(s.prompt_length for s in with_reuse)
    appended = sum(len(ids) for turn in range(turns - 1) for ids in results_for(renderer, with_reuse, turn))
    # Each later turn prefills the last sampled token (never fed to the model) and the tool results.
    assert engine.cache_stats.prefill_tokens == prompt_tokens + n * (turns - 1) + appended
    assert (engine.cache_stats.reused, engine.cache_stats.prefilled) == (n * (turns - 1), n)
    assert engine.cache_stats.stale == engine.cache_stats.evicted == 0

    # QAT fake quantisation stays on in a continued turn: its log-probs (plain sampling: raw) are
    # the quantised model's own, which differ from the unquantised model's.
    quantised = EmbeddedEngine(model)
    continued = play(quantised, make_prompts("q"), renderer, turns)
    quantised.generate(continued, SamplingConfig(max_tokens=4, seed=3))
    unquantised = copy.deepcopy(model)
    apply_qat(unquantised, None)
    for sample in continued:
        assert sample.finish_reason == "length" and quantised.cache_stats.reused == n * turns
        last_turn = torch.tensor(sample.rollout_logprobs[-4:])
        torch.testing.assert_close(
            last_turn, reference_logprobs(model, sample.tokens)[-4:], atol=1e-5, rtol=0
        )
        assert (last_turn - reference_logprobs(unquantised, sample.tokens)[-4:]).abs().max() > 1e-4


def test_fresh_and_continuing_samples_in_one_batch(model, make_prompts, renderer):
    engines = {"off": EmbeddedEngine(model, max_cached_samples=0), "on": EmbeddedEngine(model)}
    out = {}
    for name, engine in engines.items():
        old = make_prompts("o")[:2]
        engine.generate(old, SAMPLING)
        for sample, ids in zip(old, results_for(renderer, old, 0), strict=True):
            sample.append(ids, generated=False)
        new = make_prompts("n")[2:]
        out[name] = engine.generate([new[0], old[0], new[1], old[1]], SAMPLING)
    assert_same_trajectories(out["on"], out["off"])
    assert (engines["on"].cache_stats.reused, engines["on"].cache_stats.prefilled) == (2, 4)


def test_suffix_prefill_plan_feeds_every_row_its_tokens_in_the_fewest_forwards():
    # 5 distinct lengths; binary digits 8, 4, 2, 1 -> 4 forwards
    assert suffix_prefill_plan([3, 5, 6, 7, 12]) == [
        (8, [4]),
        (4, [1, 2, 3, 4]),
        (2, [0, 2, 3]),
        (1, [0, 1, 3]),
    ]
    # 3 distinct lengths; binary digits 4, 2, 1 -> 3 forwards: a tie keeps one forward per length
    assert suffix_prefill_plan([5, 3, 5, 1]) == [(1, [3]), (3, [1]), (5, [0, 2])]
    assert suffix_prefill_plan([1, 1, 1]) == [(1, [0, 1, 2])]


def test_rows_continuing_with_different_suffix_lengths_equal_full_prefill(model, make_prompts):
    lengths = [8, 9, 10, 11]  # the last sampled token and 7..10 appended tokens
    assert len(suffix_prefill_plan(lengths)) == 3  # the binary plan: rows share forwards
    out = {}
    for name, capacity in (("off", 0), ("on", 256)):
        engine = EmbeddedEngine(model, max_cached_samples=capacity)
        samples = engine.generate(make_prompts("s"), SAMPLING)
        for sample, n in zip(samples, lengths, strict=True):
            sample.append([100 + 7 * i for i in range(n - 1)], generated=False)
        out[name] = (engine, engine.generate(samples, SAMPLING))
    assert_same_trajectories(out["on"][1], out["off"][1])
    assert out["on"][0].cache_stats.reused == len(lengths)


def test_paused_and_resumed_with_reuse_equals_uninterrupted(model, make_prompts):
    sampling = SamplingConfig(max_tokens=8, seed=5, temperature=0.8)
    straight = EmbeddedEngine(model, max_cached_samples=0).generate(make_prompts("p"), sampling)

    engine = EmbeddedEngine(model)
    checks = {"n": 0}

    def pause_after_three_steps(_samples: list[Sample]) -> bool:
        checks["n"] += 1
        return checks["n"] == 4  # checked once before the batch, then after each decoding step

    resumed = engine.generate(make_prompts("p"), sampling, pause_when=pause_after_three_steps)
    assert [s.finish_reason for s in resumed] == ["paused"] * len(resumed)
    assert [s.response_length for s in resumed] == [3] * len(resumed)
    engine.generate(resumed, sampling)
    assert_same_trajectories(resumed, straight)
    assert engine.cache_stats.reused == len(resumed)
    # the resumed call fed each row only its last sampled token
    assert engine.cache_stats.prefill_tokens == sum(s.prompt_length for s in resumed) + len(resumed)


def test_update_weights_drops_kept_caches(model, make_prompts, renderer):
    new_model = peaked_k3(1)
    engine = EmbeddedEngine(copy.deepcopy(model))
    samples = engine.generate(make_prompts("u"), SAMPLING)
    for sample, ids in zip(samples, results_for(renderer, samples, 0), strict=True):
        sample.append(ids, generated=False)
    before_update = copy.deepcopy(samples)

    # the two policies disagree on these tokens, so reusing the old cache would show
    old_scores, new_scores = EmbeddedEngine(model).score(samples), EmbeddedEngine(new_model).score(samples)
    assert (torch.tensor(old_scores[0]) - torch.tensor(new_scores[0])).abs().max() > 1e-2

    engine.update_weights(new_model.state_dict())
    engine.generate(samples, SAMPLING)
    fresh = EmbeddedEngine(new_model)
    fresh.policy_version = 1
    assert_same_trajectories(samples, fresh.generate(before_update, SAMPLING))
    assert engine.cache_stats.reused == 0 and engine.cache_stats.prefilled == 2 * len(samples)


def test_weights_changed_in_place_by_a_sharing_trainer_drop_kept_caches(make_prompts, renderer):
    model = peaked_k3(0)
    engine = EmbeddedEngine(model)
    samples = engine.generate(make_prompts("t"), SAMPLING)
    for sample, ids in zip(samples, results_for(renderer, samples, 0), strict=True):
        sample.append(ids, generated=False)
    before_step = copy.deepcopy(samples)
    # What rl.py does between iterations, except that the version bump is forgotten: the
    # parameters' version counters alone must reveal the change.
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, 0.05)
    optimizer.step()

    engine.generate(samples, SAMPLING)
    expected = EmbeddedEngine(model, max_cached_samples=0).generate(before_step, SAMPLING)
    assert_same_trajectories(samples, expected)
    assert engine.cache_stats.stale == len(samples) and engine.cache_stats.reused == 0


def test_lru_cap_evicts_oldest_and_evicted_samples_prefill_in_full(model, make_prompts, renderer):
    without = play(EmbeddedEngine(model, max_cached_samples=0), make_prompts("l"), renderer, 2)
    engine = EmbeddedEngine(model, max_cached_samples=2)
    samples = play(engine, make_prompts("l"), renderer, 2)
    assert_same_trajectories(samples, without)
    stats = engine.cache_stats
    # Turn 1: the four rows end together (length), kept in row order; the first two are dropped.
    # Turn 2: they prefill in full, the other two only their new tokens, and two are dropped again.
    assert stats.evicted == 4 and (stats.reused, stats.prefilled) == (2, 6)
    appended = results_for(renderer, samples, 0)
    full = [
        s.prompt_length + SAMPLING.max_tokens + len(ids) for s, ids in zip(samples, appended, strict=True)
    ]
    first_turn = sum(s.prompt_length for s in samples)
    assert stats.prefill_tokens == first_turn + sum(full[:2]) + sum(1 + len(ids) for ids in appended[2:])


def test_edited_sample_is_prefilled_in_full(model, make_prompts, renderer):
    def edit(samples: list[Sample]) -> None:
        first = samples[0]
        first.tokens[first.prompt_length + 1] = (first.tokens[first.prompt_length + 1] + 1) % 2048
        # a sample cut back to before its last turn does not extend its cache either
        second = samples[1]
        for name in ("tokens", "loss_mask", "rollout_logprobs", "policy_version"):
            setattr(second, name, getattr(second, name)[: second.prompt_length])

    runs = {}
    for name, capacity in (("off", 0), ("on", 256)):
        engine = EmbeddedEngine(model, max_cached_samples=capacity)
        samples = engine.generate(make_prompts("e"), SAMPLING)
        edit(samples)
        for sample, ids in zip(samples, results_for(renderer, samples, 0), strict=True):
            sample.append(ids, generated=False)
        runs[name] = (engine, engine.generate(samples, SAMPLING))
    engine, samples = runs["on"]
    assert_same_trajectories(samples, runs["off"][1])
    n = len(samples)
    stats = engine.cache_stats
    assert stats.stale == 2 and (stats.reused, stats.prefilled) == (n - 2, n + 2)


def test_models_without_a_k3_cache_always_prefill_in_full(tiny_llama, make_prompts, renderer):
    engine = EmbeddedEngine(tiny_llama)
    samples = play(engine, make_prompts("q"), renderer, 2)
    expected = play(EmbeddedEngine(tiny_llama, max_cached_samples=0), make_prompts("q"), renderer, 2)
    assert_same_trajectories(samples, expected)
    assert engine.cache_stats.reused == 0 and engine.cache_stats.prefilled == 2 * len(samples)


def test_negative_cache_capacity_is_refused(model):
    with pytest.raises(ValueError, match="max_cached_samples must be >= 0"):
        EmbeddedEngine(model, max_cached_samples=-1)
