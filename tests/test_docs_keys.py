"""The key tables of the docs (docs/sft.md, rl.md, mopd.md: each stage kind's keys; docs/algorithms.md:
the budget reward's and GenRM's blocks) are generated from the pydantic schemas
(posttrain.stages.keys_table), never kept by hand beside them: a field added, renamed or
re-described without regenerating the table fails here. `python -m tests.test_docs_keys`, run
from the repository root, rewrites every block."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

import posttrain.trainers  # noqa: F401  (registers the stage kinds)
from posttrain.rewards.budget import BudgetConfig
from posttrain.rewards.genrm import GenRMConfig
from posttrain.stages import STAGE_KINDS, keys_table

DOCS = Path(__file__).resolve().parents[1] / "docs"


def schema(block: str) -> type[BaseModel]:
    """The schema of a docs block: a stage kind's config, or the reward block named."""
    return {"budget": BudgetConfig, "genrm": GenRMConfig}.get(block) or STAGE_KINDS.get(block).config


BLOCKS = [
    ("sft.md", "sft"),
    ("rl.md", "rl"),
    ("mopd.md", "mopd"),
    ("algorithms.md", "budget"),
    ("algorithms.md", "genrm"),
]


def block_pattern(block: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- keys:{block} -->\n)(.*?)(<!-- /keys -->)", re.S)


@pytest.mark.parametrize(("page", "block"), BLOCKS)
def test_the_docs_key_table_is_the_schemas(page, block):
    found = block_pattern(block).search((DOCS / page).read_text())
    assert found, f"docs/{page} has no <!-- keys:{block} --> block"
    assert found.group(2) == keys_table(schema(block)), "regenerate with: python -m tests.test_docs_keys"


if __name__ == "__main__":
    for page, block in BLOCKS:
        path = DOCS / page
        table = keys_table(schema(block)).replace("\\", "\\\\")  # a literal in the replacement
        path.write_text(block_pattern(block).sub(rf"\g<1>{table}\g<3>", path.read_text()))
