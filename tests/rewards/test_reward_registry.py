"""Every built-in reward is registered under the name stage files use, and each entry honours the
registry's contract: a documented callable from the rewards package, duplicates rejected."""

import pytest

import rewards.budget
import rewards.genrm
import rewards.mopd
import rewards.verifiers
from posttrain.registry import RegistryError
from rewards.registry import REWARDS

BUILT_IN = {
    "mopd": rewards.mopd.mopd_token_rewards,
    "budget": rewards.budget.budget_reward,
    "genrm": rewards.genrm.GenRM,
    "exact_match": rewards.verifiers.exact_match_reward,
    "unit_tests": rewards.verifiers.UnitTestVerifier,
}


def test_built_in_rewards_are_registered_by_name():
    for name, entry in BUILT_IN.items():
        assert REWARDS.get(name) is entry


def test_every_entry_is_a_documented_callable_of_the_rewards_package():
    for name, entry in REWARDS.items():
        assert callable(entry), name
        assert (entry.__doc__ or "").strip(), f"reward {name} has no docstring"
        assert entry.__module__.startswith("rewards."), f"{name} from {entry.__module__}"


def test_duplicate_names_are_rejected():
    with pytest.raises(RegistryError, match="reward 'mopd' is registered twice"):
        REWARDS.register("mopd")(lambda: None)
