"""Fixtures for the interchange tests: a small SFT recipe over the shipped agent trajectories (two
per task family), so a real `sft` stage runs in seconds (its body: `interchange_stages.sft_body`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "data_recipes" / "data" / "agent_sft.jsonl"


@pytest.fixture(scope="session")
def sft_recipe(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The name of a registered recipe over two shipped trajectories per task family."""
    from posttrain.data.mixture import DATA_RECIPES, MixtureSource, Recipe

    by_family: dict[str, list[dict]] = {}
    for line in SHIPPED.read_text().splitlines():
        row = json.loads(line)
        by_family.setdefault(row["task"]["family"], []).append(row)
    rows = [row for family in sorted(by_family) for row in by_family[family][:2]]
    path = tmp_path_factory.mktemp("interchange-data") / "small.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    name = f"test-interchange-{path.parent.name}"
    DATA_RECIPES.register(name)(lambda: Recipe(sources=(MixtureSource(str(path)),), eval_fraction=0.25))
    return name
