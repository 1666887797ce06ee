"""The key tables of docs/rl.md and docs/mopd.md are generated from the stage kinds' pydantic
schemas (posttrain.stages.keys_table), never kept by hand beside them: a field added, renamed or
re-described without regenerating the table fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import posttrain.trainers  # noqa: F401  (registers the stage kinds)
from posttrain.stages import STAGE_KINDS, keys_table

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize(("page", "kind"), [("rl.md", "rl"), ("mopd.md", "mopd")])
def test_the_docs_key_table_is_the_schemas(page, kind):
    text = (DOCS / page).read_text()
    found = re.search(rf"<!-- keys:{kind} -->\n(.*?)<!-- /keys -->", text, re.S)
    assert found, f"docs/{page} has no <!-- keys:{kind} --> block"
    expected = keys_table(STAGE_KINDS.get(kind).config)
    assert found.group(1) == expected, f"regenerate with: python -m posttrain.stages {kind}"
