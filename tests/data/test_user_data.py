"""A user's own data named directly under a stage file's `data.recipes`: a .jsonl file (broken lines
skipped and counted under strict: false), a parquet file, a `datasets` folder with a split, and a
real SFT stage trained on a user's JSONL through the CLI."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import datasets
import pytest

from posttrain.data.mixture import build_mixture, recipe_for
from posttrain.registry import RegistryError

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "data_recipes" / "data" / "agent_sft.jsonl"


def shipped_rows(count: int) -> list[dict]:
    with open(SHIPPED, encoding="utf-8") as handle:
        return [json.loads(next(handle)) for _ in range(count)]


def test_a_registered_name_is_still_its_recipe() -> None:
    assert recipe_for("agent_sft").sources[0].path.endswith("agent_sft.jsonl")
    with pytest.raises(RegistryError, match=r"did you mean 'agent_sft'.*\.jsonl/\.json/\.parquet file"):
        recipe_for("agent_stf")
    with pytest.raises(FileNotFoundError, match=r"data.recipes: missing\.jsonl: no such file"):
        recipe_for("missing.jsonl")


def test_jsonl_parquet_and_a_datasets_split(tmp_path: Path) -> None:
    rows = shipped_rows(40)
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows[:20]) + "{broken\n")
    mixture = build_mixture(str(jsonl))
    assert len(mixture.train) + len(mixture.eval) == 20 and mixture.report.skipped["broken_line"] == 1
    assert "mine.jsonl line 21" in mixture.report.first_example["broken_line"]

    parquet = tmp_path / "mine.parquet"
    datasets.Dataset.from_list(rows[:20]).to_parquet(str(parquet))
    assert len(build_mixture(str(parquet)).train) + len(build_mixture(str(parquet)).eval) == 20

    folder = tmp_path / "dataset"
    folder.mkdir()
    datasets.Dataset.from_list(rows[:30]).to_parquet(str(folder / "train.parquet"))
    datasets.Dataset.from_list(rows[30:]).to_parquet(str(folder / "test.parquet"))
    test_split = build_mixture(f"{folder}:test")
    assert len(test_split.train) + len(test_split.eval) == 10
    assert {s.split for s in recipe_for(f"{folder}:test").sources} == {"test"}


def test_sft_trains_on_a_users_jsonl_with_a_broken_line(posttrain, tmp_path: Path) -> None:
    data = tmp_path / "my data.jsonl"
    lines = [json.dumps(r) for r in shipped_rows(60)]
    lines.insert(4, '{"uid": "cut-off", "messages": [')
    data.write_text("\n".join(lines) + "\n")
    stage = tmp_path / "sft.yaml"
    stage.write_text(
        textwrap.dedent(
            f"""
        stage: sft
        kind: sft
        model: {REPO / "data_recipes" / "base"}
        resources: {{cpus: 1}}
        data:
          recipes: {{"{data}": 1.0}}
          strict: false
        train: {{steps: 2, micro_batch_tokens: 512, lr: 1.0e-3}}
        checkpoint_every: 2
        eval: {{tool_prompts: 0}}
        """
        )
    )
    code, out, err = posttrain("run", stage, "--run-dir", tmp_path / "run")
    assert code == 0, out + err
    manifest = json.loads((tmp_path / "run" / "sft" / "manifest.json").read_text())
    assert manifest["metrics"]["data/kept"] == 60 and manifest["metrics"]["data/skipped/broken_line"] == 1
    assert any("as broken_line" in w and "my data.jsonl line 5" in w for w in manifest["warnings"])

    code, out, err = posttrain("run", stage, "--run-dir", tmp_path / "strict", "sft.data.strict=true")
    assert code == 1
    error = json.loads((tmp_path / "strict" / "sft" / "manifest.json").read_text())["error"]
    assert "my data.jsonl line 5: broken_line" in error
