"""Every built-in reward is registered under the name stage files and trainers use, each entry
honours the registry's contract (a documented callable from the rewards package, duplicates
rejected), and the engine's typed lookups return the plug-in bound to a stage's config."""

import pytest

import rewards.budget
import rewards.genrm
from posttrain.config.rewards import BudgetRewardConfig, GenRMConfig
from posttrain.data.sample import Sample
from posttrain.engines import SamplingConfig
from posttrain.registry import RegistryError
from posttrain.rewards_registry import REWARDS, BudgetOutcome, budget_reward, generative_reward_model

BUILT_IN = {
    "budget": rewards.budget.AnnealedBudgetReward,
    "genrm": rewards.genrm.GenRM,
}
THINK, END_THINK = 900, 901


def test_built_in_rewards_are_registered_by_name():
    assert sorted(REWARDS) == sorted(BUILT_IN)
    for name, entry in BUILT_IN.items():
        assert REWARDS.get(name) is entry


def test_every_entry_is_a_documented_callable_of_the_rewards_package():
    for name, entry in REWARDS.items():
        assert callable(entry), name
        assert (entry.__doc__ or "").strip(), f"reward {name} has no docstring"
        assert entry.__module__.startswith("rewards."), f"{name} from {entry.__module__}"


def test_duplicate_names_are_rejected():
    with pytest.raises(RegistryError, match="reward 'budget' is registered twice"):
        REWARDS.register("budget")(lambda: None)


def thinking_trajectory(thinking: int, group: str = "p") -> Sample:
    """A general-domain trajectory at low effort that thinks `thinking` tokens, then answers."""
    sample = Sample(uid=f"t{thinking}", domain="general", effort="low", group=group)
    sample.append([1, 2, 3], generated=False)
    sample.prompt_length = 3
    sample.append([THINK, *range(10, 10 + thinking), END_THINK, 42], generated=True)
    return sample


def test_the_budget_lookup_binds_the_stage_config_and_thinking_markers():
    config = BudgetRewardConfig(
        tau={
            "low": {"tau_start": 1.0, "tau_end": 0.5},
            "high": {"tau_start": 1.5, "tau_end": 1.0},
            "max": {"tau_start": 2.0, "tau_end": 2.0},
        }
    )
    reward = budget_reward(config, (THINK, END_THINK))
    assert isinstance(reward, rewards.budget.AnnealedBudgetReward)
    # b0: median of the successful cold-start samples' thinking tokens (4 and 6; 20 failed)
    cold = [thinking_trajectory(n) for n in (4, 6, 20)]
    assert reward.base_budget(cold, [True, True, False]).tokens == 5.0
    # tau of low effort anneals 1.0 -> 0.5: 4 thinking tokens fit b0 = 4 at step 0, not at the end
    assert reward.tau("low", 0, 10) == 1.0 and reward.tau("low", 10, 10) == 0.5
    assert reward.outcome(thinking_trajectory(4), 0.8, 4.0, 0, 10) == BudgetOutcome(0.8, 4, 4.0, False)
    assert reward.outcome(thinking_trajectory(4), 0.8, 4.0, 10, 10) == BudgetOutcome(-1.0, 4, 2.0, True)


def test_the_genrm_lookup_builds_the_registered_judge_with_its_output_cap():
    def build(max_judge_tokens: int):
        return generative_reward_model(
            object(),  # the judge engine; never asked to generate here
            object(),
            GenRMConfig(rubric="r", max_judge_tokens=max_judge_tokens),
            render_prompt=list,
            sampling=SamplingConfig(max_tokens=8),
        )

    judge = build(8)
    assert isinstance(judge, rewards.genrm.GenRM) and judge.config.max_judge_tokens == 8
    with pytest.raises(ValueError, match=r"max_tokens is 8; set it to at most max_judge_tokens \(4\)"):
        build(4)
