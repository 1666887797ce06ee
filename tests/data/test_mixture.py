"""Data recipes: every registered recipe builds; seeded shuffles and splits are deterministic;
held-out rows never train in any recipe; weights resample rows by the stated arithmetic."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

import data_recipes  # noqa: F401  (registers the shipped recipes)
from posttrain.data.mixture import (
    DATA_RECIPES,
    MixtureSource,
    Recipe,
    build_mixture,
    is_eval_row,
    weighted_indices,
)
from posttrain.registry import RegistryError


@pytest.mark.parametrize("name", list(DATA_RECIPES))
def test_every_registered_recipe_builds_disjoint_splits(name):
    mixture = build_mixture(name, seed=0)
    train, held_out = set(mixture.train["uid"]), set(mixture.eval["uid"])
    assert train and held_out and not train & held_out
    assert mixture.report.kept > 0 and sum(mixture.report.skipped.values()) == 0
    assert set(mixture.train.column_names) == {"uid", "domain", "effort", "record", "source"}


def test_same_seed_same_mixture_other_seed_other_order():
    first, again, other = (build_mixture("agent_sft", seed=s) for s in (0, 0, 1))
    assert first.train["uid"] == again.train["uid"] and first.eval["uid"] == again.eval["uid"]
    assert first.train["uid"] != other.train["uid"]
    assert set(first.eval["uid"]) != set(other.eval["uid"])


def test_held_out_rows_are_the_same_in_every_recipe():
    plain, agentic = build_mixture("agent_sft", seed=3), build_mixture("agent_sft_agentic", seed=3)
    assert set(plain.eval["uid"]) == set(agentic.eval["uid"])
    assert not set(agentic.train["uid"]) & set(plain.eval["uid"])
    fraction = len(plain.eval) / (len(plain.eval) + len(plain.train))
    assert 0.05 < fraction < 0.15


def test_weights_resample_each_source():
    plain, agentic = build_mixture("agent_sft", seed=0), build_mixture("agent_sft_agentic", seed=0)
    plain_domains, agentic_domains = Counter(plain.train["domain"]), Counter(agentic.train["domain"])
    assert agentic_domains["agent"] == 2 * plain_domains["agent"]
    assert agentic_domains["general"] == plain_domains["general"]
    repeats = Counter(agentic.train["uid"])
    for uid, domain in zip(agentic.train["uid"], agentic.train["domain"], strict=True):
        assert repeats[uid] == (2 if domain == "agent" else 1)


def test_weighted_indices_arithmetic():
    rng = random.Random(0)
    assert weighted_indices(10, 1.0, rng) == list(range(10))
    half = weighted_indices(10, 0.5, rng)
    assert len(half) == 5 and len(set(half)) == 5
    one_and_half = Counter(weighted_indices(10, 1.5, rng))
    assert sum(one_and_half.values()) == 15 and set(one_and_half.values()) == {1, 2}
    assert weighted_indices(0, 3.0, rng) == []


def test_eval_membership_depends_on_seed_and_uid_only():
    flags = [is_eval_row(f"row-{i}", 7, 0.25) for i in range(4000)]
    assert 0.22 < sum(flags) / len(flags) < 0.28
    assert flags == [is_eval_row(f"row-{i}", 7, 0.25) for i in range(4000)]


def test_recipe_and_source_errors_are_clear(tmp_path):
    with pytest.raises(RegistryError, match="unknown data recipe 'agent_stf'; did you mean 'agent_sft'"):
        build_mixture("agent_stf")
    with pytest.raises(ValueError, match="weight must be a positive finite number"):
        MixtureSource("x.jsonl", weight=0.0)
    with pytest.raises(ValueError, match="eval_fraction must be in"):
        Recipe(sources=(MixtureSource("x.jsonl"),), eval_fraction=1.0)
    row = {
        "uid": "a",
        "domain": "general",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
    }
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="no rows of domains \\['coding'\\]"):
        build_mixture(Recipe(sources=(MixtureSource(str(path), domains=("coding",)),)))


def test_a_registered_recipe_that_returns_no_recipe_is_named():
    # A plug-in's recipe returning the path it meant to wrap; registered here, after collection,
    # so the parametrized test above never builds it.
    name = "test_recipe_returning_a_path"
    if name not in DATA_RECIPES:
        DATA_RECIPES.register(name)(lambda: "data_recipes/data/agent_sft.jsonl")
    with pytest.raises(TypeError, match=f"data recipe '{name}' returned str, not Recipe; return Recipe"):
        build_mixture(name)
