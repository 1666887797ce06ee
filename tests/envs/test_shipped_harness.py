"""The shipped stage files' harness against the shipped demonstrations: an environment that allows
fewer assistant turns than a demonstration of its domain takes cuts that behaviour off in every RL
and MOPD episode. That happened: coding's `max_turns: 2` cut fix_function's three-turn max-effort
demonstration (run the code, run the fix, answer), the SFT model scored 0.48 instead of 0.80 there,
and coding's max specialist "beat" it by learning to answer a turn early (bench/RESULTS.md, #21).
Likewise a tool set the harness declares that no demonstration declared: with `read_file` offered
beside the agent tools, one SFT seed's model called coding's run_python in most agent episodes."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import yaml

import data_recipes  # noqa: F401  (registers the task families)
from posttrain.envs.environments import EnvironmentConfig
from posttrain.envs.tasks import TASK_FAMILIES

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_ROWS = ROOT / "data_recipes" / "data" / "agent_sft.jsonl"
STAGE_FILES = ["stages/rl.yaml", "stages/mopd.yaml", "stages/vision/rl.yaml", "stages/vision/mopd.yaml"]


def longest_demonstrations() -> dict[str, tuple[int, str]]:
    """Per domain: the most assistant turns of a shipped SFT row, and that row's uid and effort."""
    longest: dict[str, tuple[int, str]] = defaultdict(lambda: (0, ""))
    for line in SHIPPED_ROWS.read_text().splitlines():
        row = json.loads(line)
        turns = sum(m["role"] == "assistant" for m in row["messages"])
        if turns > longest[row["domain"]][0]:
            longest[row["domain"]] = (turns, f"{row['uid']} ({row['effort']})")
    return dict(longest)


@pytest.mark.parametrize("stage_file", STAGE_FILES)
def test_every_environment_allows_its_longest_demonstration(stage_file):
    environments = yaml.safe_load((ROOT / stage_file).read_text())["environments"]
    longest = longest_demonstrations()
    checked = [domain for domain in environments if domain in longest]
    assert checked, f"{stage_file}: no environment of a domain the shipped rows demonstrate"
    for domain in checked:
        turns, example = longest[domain]
        allowed = EnvironmentConfig(**environments[domain]).max_turns  # the stage's own default where unset
        assert allowed >= turns, (
            f"{stage_file}: environments.{domain}.max_turns is {allowed}, but the shipped "
            f"demonstration {example} takes {turns} assistant turns"
        )


def declared_extra_tool_sets() -> dict[str, Counter]:
    """Per domain: how many shipped SFT rows declare each set of tools beyond their family's own."""
    own: dict[str, list[str]] = {}  # the rows' families only: other tests register families of their own
    extra: dict[str, Counter] = defaultdict(Counter)
    for line in SHIPPED_ROWS.read_text().splitlines():
        row = json.loads(line)
        names = [tool["function"]["name"] for tool in row["tools"]]
        family = row["task"]["family"]
        if family not in own:
            own[family] = list(TASK_FAMILIES.get(family)().toolset())
        family_tools = own[family]
        # the extras come after the family's tools, as the harness appends them
        assert names[: len(family_tools)] == family_tools, row["uid"]
        extra[row["domain"]][frozenset(names[len(family_tools) :])] += 1
    return dict(extra)


@pytest.mark.parametrize("stage_file", STAGE_FILES)
def test_the_demonstrations_declare_the_tool_sets_the_harness_offers(stage_file):
    environments = yaml.safe_load((ROOT / stage_file).read_text())["environments"]
    declared = declared_extra_tool_sets()
    for domain, environment in environments.items():
        offered = {frozenset(s) for s in EnvironmentConfig(**environment).harness.tool_sets}
        rows = sum(declared[domain].values())
        assert set(declared[domain]) == offered, (
            f"{stage_file}: environments.{domain}.harness.tool_sets offers {sorted(map(sorted, offered))}, "
            f"the shipped SFT rows declare {sorted(map(sorted, declared[domain]))} beside their family's "
            "tools (data_recipes/agent_tasks/generate.py SFT_HARNESS)"
        )
        for tool_set in offered:  # each drawn as often as the harness draws it, about 1/len
            assert declared[domain][tool_set] >= rows / (2 * len(offered)), (domain, sorted(tool_set))
