"""The shipped stage files' harness against the shipped demonstrations: an environment that allows
fewer assistant turns than a demonstration of its domain takes cuts that behaviour off in every RL
and MOPD episode. That happened: coding's `max_turns: 2` cut fix_function's three-turn max-effort
demonstration (run the code, run the fix, answer), the SFT model scored 0.48 instead of 0.80 there,
and coding's max specialist "beat" it by learning to answer a turn early (bench/RESULTS.md, #21)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from posttrain.envs.environments import EnvironmentConfig

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
