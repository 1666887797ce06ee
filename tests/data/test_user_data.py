"""A user's own data named directly under a stage file's `data.recipes`: a .jsonl file (broken lines
skipped and counted under strict: false), a parquet file, a `datasets` folder with a split, and a
real SFT stage trained on a user's JSONL through the CLI."""

from __future__ import annotations

import json
import logging
import re
import textwrap
from pathlib import Path

import datasets
import pytest

from posttrain.data.loading import load_trajectories
from posttrain.data.mixture import build_mixture, recipe_for
from posttrain.data.trajectory import BadTrajectoryError
from posttrain.registry import RegistryError
from posttrain.trainers.sft_data import DataConfig, load_sft_data

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


def test_a_line_in_another_encoding_is_one_broken_line(tmp_path: Path) -> None:
    """A latin-1 byte failed the whole file with a UnicodeDecodeError naming neither file nor line;
    lines are decoded one by one, so it is that line's broken_line (strict: the usual error)."""
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in shipped_rows(10)]
    lines[7] = json.dumps({**shipped_rows(8)[7], "uid": "caf\u00e9"}, ensure_ascii=False).encode("latin-1")
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    rows, report = load_trajectories(data)
    assert len(rows) == 9 and dict(report.skipped) == {"broken_line": 1}
    assert f"{data} line 8: not UTF-8 text" in report.first_example["broken_line"]
    with pytest.raises(BadTrajectoryError, match=r"latin1\.jsonl line 8: broken_line: not UTF-8 text"):
        load_trajectories(data, strict=True)


def test_file_suffixes_any_case_and_messages_that_name_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`.JSONL` is read (alone or in a directory); an existing file of another type says which
    formats are read; a directory's errors name its file; a missing local-looking path is "no
    such file or directory", never a hub id lookup."""
    rows = shipped_rows(20)
    upper = tmp_path / "upper.JSONL"
    upper.write_text("".join(json.dumps(r) + "\n" for r in rows[:10]))
    assert len(load_trajectories(upper)[0]) == 10
    folder = tmp_path / "dir"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[10:]) + "{cut\n")
    (folder / "b.JSONL").write_text("".join(json.dumps(r) + "\n" for r in rows[:10]))
    mixture = build_mixture(str(folder))
    assert len(mixture.train) + len(mixture.eval) == 20
    assert f"{folder / 'a.jsonl'} line 11: not one JSON object" in mixture.report.first_example["broken_line"]
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "only.jsonl").write_text(json.dumps(rows[0]) + "\n{cut\n")
    assert f"{alone / 'only.jsonl'} line 2" in load_trajectories(alone)[1].first_example["broken_line"]

    gz = tmp_path / "traces.jsonl.gz"
    gz.write_bytes(b"\x1f\x8b")
    with pytest.raises(
        ValueError, match=r"traces\.jsonl\.gz: a \.gz file is not read .* \.jsonl, \.json or \.parquet"
    ):
        build_mixture(str(gz))
    monkeypatch.chdir(tmp_path)
    for missing in ("./traces_dir", "../traces_dir", "~/no-such-traces", "nowhere/x.JSONL"):
        with pytest.raises(FileNotFoundError, match="no such file or directory"):
            recipe_for(missing)
        with pytest.raises(FileNotFoundError, match="no such file or directory"):
            load_trajectories(missing)


def test_rows_without_uids_in_same_named_files_get_distinct_uids(
    tmp_path: Path, renderer, caplog: pytest.LogCaptureFixture
) -> None:
    """Generated uids were `<stem>-<index>`: two train.jsonl files in two directories gave their rows
    the same uids, so the second file's held-out rows were neither trained nor evaluated. They now
    carry a hash of the row's content (the same wherever the file lies); explicit uids shared by
    different rows are warned about."""
    rows = [{k: v for k, v in r.items() if k != "uid"} for r in shipped_rows(80)]
    for name, part in (("a", rows[:40]), ("b", rows[40:])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    config = DataConfig(
        recipes={str(tmp_path / "a" / "train.jsonl"): 1.0, str(tmp_path / "b" / "train.jsonl"): 1.0}
    )
    data = load_sft_data(config, renderer, seed=0, max_length=512, log=logging.getLogger("test"))
    assert len(data.train) + len(data.eval) == 80 and len({d.uid for d in data.train + data.eval}) == 80
    moved = tmp_path / "moved" / "traces.jsonl"
    moved.parent.mkdir()
    moved.write_text((tmp_path / "a" / "train.jsonl").read_text())
    again = load_sft_data(
        DataConfig(recipes={str(moved): 1.0}, eval_fraction=0.5),
        renderer,
        seed=0,
        max_length=512,
        log=logging.getLogger("t"),
    )
    first = load_sft_data(
        DataConfig(recipes={str(tmp_path / "a" / "train.jsonl"): 1.0}, eval_fraction=0.5),
        renderer,
        seed=0,
        max_length=512,
        log=logging.getLogger("t"),
    )
    # the same rows in another file elsewhere: the same uids, so the same split
    assert [d.uid for d in again.eval] == [d.uid for d in first.eval] and len(again.eval) > 0
    assert "uids are given to more than one" not in caplog.text

    (tmp_path / "c.jsonl").write_text(
        "".join(json.dumps({**r, "uid": f"row-{i}"}) + "\n" for i, r in enumerate(rows[:40]))
    )
    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps({**r, "uid": f"row-{i}"}) + "\n" for i, r in enumerate(rows[40:]))
    )
    config = DataConfig(recipes={str(tmp_path / "c.jsonl"): 1.0, str(tmp_path / "d.jsonl"): 2.0})
    with caplog.at_level(logging.WARNING):
        load_sft_data(config, renderer, seed=0, max_length=512, log=logging.getLogger("test"))
    assert re.search(
        rf"40 uids are given to more than one different row, e.g. 'row-\d+' in "
        rf"{re.escape(str(tmp_path / 'c.jsonl'))} and in ",
        caplog.text,
    )
