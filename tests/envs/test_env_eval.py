"""The held-out evaluation's statistics: standard errors of a mean and of a paired change, checked
against hand-computed values, and the refusal to pair evaluations of different episodes."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from posttrain.envs.env_eval import (
    eval_family,
    family_sums,
    paired_changes,
    prompt_means,
    summary,
)
from posttrain.stats import mean_standard_error, paired_ratio, paired_standard_error


def test_mean_standard_error_is_the_sample_sd_over_root_n():
    # values 0, 1, 1, 0: mean 0.5, sample variance 1/3, se sqrt(1/3 / 4)
    assert mean_standard_error([0.0, 1.0, 1.0, 0.0]) == pytest.approx(math.sqrt(1 / 12))
    assert mean_standard_error([3.0, 3.0, 3.0]) == 0.0
    assert mean_standard_error([1.0]) == 0.0 and mean_standard_error([]) == 0.0


def test_paired_error_is_the_error_of_the_differences_and_ignores_shared_difficulty():
    before = [0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    after = [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    # differences 1, 0, 0, 0, 1, 0: mean 1/3, sample variance (4/9*2 + 1/9*4)/5 = 4/15
    assert paired_standard_error(before, after) == pytest.approx(math.sqrt(4 / 15 / 6))
    # a uniform shift has no error, although each evaluation's own error is large
    shifted = [b + 2.0 for b in before]
    assert paired_standard_error(before, shifted) == 0.0 and mean_standard_error(before) > 0
    with pytest.raises(ValueError, match="equal lengths"):
        paired_standard_error([1.0], [1.0, 2.0])


def test_paired_ratio_is_the_ratio_of_sums_with_the_delta_method_error_over_units():
    student, teacher = [1.0, 0.0, 0.5, 1.0, 0.25], [1.0, 0.5, 0.5, 1.0, 0.5]
    ratio, se = paired_ratio(student, teacher)
    assert ratio == pytest.approx(2.75 / 3.5)
    # residuals s - R t; their sample sd over root 5, divided by mean(t) = 0.7
    residual = [s - ratio * t for s, t in zip(student, teacher, strict=True)]
    mean = sum(residual) / 5
    sd = math.sqrt(sum((r - mean) ** 2 for r in residual) / 4)
    assert se == pytest.approx(sd / math.sqrt(5) / 0.7)
    # what both share (a prompt's difficulty) cancels: a uniform 0.9 has no error, though the
    # prompts' accuracies spread from 0.1 to 1 (taken as independent its error would be ~0.3)
    uniform = [0.1, 0.4, 1.0, 0.7]
    assert paired_ratio([0.9 * t for t in uniform], uniform) == pytest.approx((0.9, 0.0))
    with pytest.raises(ValueError, match="undefined"):
        paired_ratio([0.0, 0.0], [0.0, 0.0])
    with pytest.raises(ValueError, match="paired units"):
        paired_ratio([1.0], [1.0, 0.5])


def test_paired_changes_and_summary_on_episode_rows():
    before = {"uid": ["a", "b", "c"], "reward": [0.0, 1.0, 0.0], "tokens": [10.0, 20.0, 30.0]}
    after = {"uid": ["a", "b", "c"], "reward": [1.0, 1.0, 0.0], "tokens": [12.0, 20.0, 25.0]}
    changes = paired_changes(before, after)
    assert changes["accuracy_change"] == pytest.approx(1 / 3)
    assert changes["mean_response_tokens_change"] == pytest.approx(-1.0)
    assert changes["accuracy_change_se"] == pytest.approx(paired_standard_error([0, 1, 0], [1, 1, 0]))
    assert changes["mean_response_tokens_change_se"] == pytest.approx(mean_standard_error([2.0, 0.0, -5.0]))
    stats = summary(after, "after")
    assert stats["accuracy_after"] == pytest.approx(2 / 3)
    assert stats["mean_response_tokens_se_after"] == pytest.approx(mean_standard_error([12.0, 20.0, 25.0]))
    with pytest.raises(ValueError, match="different episodes"):
        paired_changes(before, {**after, "uid": ["a", "b", "d"]})


def test_episodes_of_one_prompt_are_one_unit_of_the_standard_error():
    # two prompts, two episodes each: prompt a solved 2 of 2, prompt b 0 of 2
    rows = {
        "uid": ["eval/g/x-a/max/0", "eval/g/x-a/max/1", "eval/g/x-b/max/0", "eval/g/x-b/max/1"],
        "reward": [1.0, 1.0, 0.0, 0.0],
        "tokens": [4.0, 6.0, 8.0, 8.0],
    }
    assert prompt_means(rows, "reward") == [1.0, 0.0] and prompt_means(rows, "tokens") == [5.0, 8.0]
    stats = summary(rows, "x")
    assert stats["accuracy_x"] == 0.5
    # over the two prompt means (0.5), not the four episodes as if independent (sqrt(1/12))
    assert stats["accuracy_se_x"] == pytest.approx(0.5)
    after = {**rows, "reward": [1.0, 0.0, 1.0, 1.0]}  # a -0.5, b +1.0
    changes = paired_changes(rows, after)
    assert changes["accuracy_change"] == 0.25
    assert changes["accuracy_change_se"] == pytest.approx(mean_standard_error([-0.5, 1.0]))


def test_eval_family_reads_the_family_from_episode_and_group_uids():
    assert eval_family("eval/general/ordering-677fd05656/max/0") == "general/ordering"
    assert eval_family("eval/general/ordering-677fd05656/0") == "general/ordering"  # before 2026-12-03
    assert eval_family("eval/agent/order_total-0f3a170d35") == "agent/order_total"


def test_family_sums_add_a_column_per_family_and_in_all():
    rows = {
        "uid": [
            "eval/general/lookup-1a/max/0",
            "eval/general/ordering-2b/max/0",
            "eval/general/lookup-3c/max/0",
        ],
        "reward": [1.0, 0.0, 1.0],
        "tokens": [10.0, 20.0, 5.0],
    }
    assert family_sums(rows) == {"all": 2.0, "general/lookup": 2.0, "general/ordering": 0.0}
    assert family_sums(rows, "tokens") == {"all": 35.0, "general/lookup": 15.0, "general/ordering": 20.0}


def test_a_sampled_evaluation_draws_the_same_episodes_again_and_pairs_them_exactly(
    renderer, tiny_k3_engine, tmp_path
):
    from posttrain.envs.env_eval import EvalConfig, eval_episodes, evaluate
    from posttrain.envs.environments import EnvironmentConfig, make_environment

    config = EvalConfig(prompts=5, temperature=0.6, samples_per_prompt=2)
    harness = EnvironmentConfig(max_tokens_per_turn=12, max_turns=1)
    with make_environment("general", renderer, harness, sandbox_dir=tmp_path) as env:
        prompts = env.prompts("eval", config.prompts, config.seed)
        (_, first), (_, again) = (
            evaluate(env, tiny_k3_engine, prompts, "max", config, 0, when) for when in ("before", "after")
        )
        # the engine's noise is a function of (seed, uid, position): the same weights draw the same
        # episodes, so an unchanged policy's change is exactly 0 with no error
        assert first == again
        assert first["uid"][:2] == [f"eval/{prompts[0].uid}/max/0", f"eval/{prompts[0].uid}/max/1"]
        changes = paired_changes(first, again)
        assert changes["accuracy_change"] == changes["accuracy_change_se"] == 0.0
        # ... and the tokens drawn are the seed's: another seed draws other episodes
        played = {}
        for seed in (0, 0, 1):
            samples = eval_episodes(env, prompts, "max", 1)
            env.play(tiny_k3_engine, samples, env.turn_sampling(0.6, seed))
            played.setdefault(seed, []).append([s.tokens for s in samples])
        assert played[0][0] == played[0][1] and played[1][0] != played[0][0]


def test_eval_subsets_are_played_by_their_domain_and_bad_ones_name_the_fix(renderer, tmp_path):
    from posttrain.envs.env_eval import EvalConfig, domain_subsets, subset_config
    from posttrain.envs.environments import EnvironmentConfig, make_environment

    config = EvalConfig(
        prompts=4,
        temperature=0.6,
        subsets={
            "routes": {
                "families": ["general/unit_cost", "general/arithmetic"],
                "prompts": 6,
                "samples_per_prompt": 3,
            },
            "orders": {"families": ["agent/order_cost"]},  # the agent stages' subset
        },
    )
    harness = EnvironmentConfig(max_tokens_per_turn=12, max_turns=1)
    with make_environment("general", renderer, harness, sandbox_dir=tmp_path) as env:
        subsets = domain_subsets(config, env)
        assert list(subsets) == ["routes"]
        prompts = env.prompts("eval", 6, config.seed, families=subsets["routes"].families)
        # the families in turn, and only them; a pure function of the arguments
        assert [p.task["family"] for p in prompts] == ["general/unit_cost", "general/arithmetic"] * 3
        assert [p.uid for p in prompts] == [
            p.uid for p in env.prompts("eval", 6, config.seed, families=subsets["routes"].families)
        ]
        settings = subset_config(config, subsets["routes"])
        assert (settings.samples_per_prompt, settings.temperature, settings.subsets) == (3, 0.6, {})
        with pytest.raises(ValueError, match=r"\['general/visual'\] are not among the offered families"):
            env.prompts("eval", 2, 0, families=["general/visual"])
        # a subset spanning domains, or naming no family, is refused with the stage file (plan)
        with pytest.raises(ValidationError, match=r"subsets.both.families\n.*split it into one subset per"):
            EvalConfig(subsets={"both": {"families": ["general/lookup", "agent/order_cost"]}})
        with pytest.raises(ValidationError, match="unknown task family 'general/lookpu'; did you mean"):
            EvalConfig(subsets={"typo": {"families": ["general/lookpu"]}})
        # the nearest among its known neighbours' domain, whose families are listed, not all 16
        with pytest.raises(ValidationError) as error:
            EvalConfig(subsets={"typo": {"families": ["coding/crate_cost", "coding/fix_fucntion"]}})
        assert (
            "unknown task family 'coding/fix_fucntion'; did you mean 'coding/fix_function'? (the coding "
            "domain's: coding/arithmetic, coding/crate_cost, coding/fix_function, coding/unit_convert, "
            "coding/write_function)"
        ) in str(error.value) and "general/" not in str(error.value)
        with pytest.raises(ValidationError, match=r"'nowhere/else' \(docs/data.md describes the shipped"):
            EvalConfig(subsets={"typo": {"families": ["nowhere/else"]}})
        with pytest.raises(ValidationError, match="general/lookup listed more than once; prompts come from"):
            EvalConfig(subsets={"twice": {"families": ["general/lookup", "general/lookup"]}})
        visual = EvalConfig(subsets={"visual": {"families": ["general/visual"]}})  # opt-in, not offered
        with pytest.raises(
            ValueError, match="eval.subsets.visual: .*list them under environments.general.families"
        ):
            domain_subsets(visual, env)
