"""report.md and its plots over metrics the real stage kinds logged: recorded_run/ holds the
metrics.jsonl and final metrics of a real sft, two rl and a mopd stage (a shrunk default DAG and
the RL resume test, 2026-12-01), laid out as the shipped pipeline's run dir."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from orchestration.console import _metrics_text
from orchestration.pipeline import load_pipeline
from orchestration.report import PLOTS, _protocol, draw, plot_groups, write_report

REPO = Path(__file__).resolve().parents[2]
RECORDED = Path(__file__).resolve().parent / "recorded_run"
TRAINERS = REPO / "posttrain" / "trainers"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    run_dir = tmp_path_factory.mktemp("report") / "run"
    shutil.copytree(RECORDED, run_dir)
    return load_pipeline(REPO / "stages" / "mopd.yaml"), run_dir


def row(report: str, stage: str) -> str:
    return next(line for line in report.splitlines() if line.startswith(f"| {stage} |"))


def test_the_rl_specialists_are_in_every_curve(run) -> None:
    pipeline, run_dir = run
    rl = {"rl-general-low", "rl-agent-high"}
    reward = {sid for series in plot_groups(pipeline, run_dir, "reward").values() for sid, *_ in series}
    assert rl | {"mopd"} <= reward
    lengths = plot_groups(pipeline, run_dir, "response_length")
    assert {s[0] for s in lengths["low"]} >= {"rl-general-low", "mopd"}
    assert {s[0] for s in lengths["high"]} >= {"rl-agent-high", "mopd"}
    loss = plot_groups(pipeline, run_dir, "loss")
    # one axis per kind: MOPD's loss (about 0 with its baseline) is not drawn on SFT's scale
    assert {g: {s[0] for s in series} for g, series in loss.items()} == {
        "sft": {"sft"},
        "rl": {"rl-agent-high"},
        "mopd": {"mopd"},
    }


def test_plotted_names_are_the_ones_the_trainers_log() -> None:
    """The names the report looks for are literals where the stages log them (the trainers, the
    policy loss, RL's budget-reward metrics), so a rename there fails here."""
    source = (
        "".join(p.read_text() for p in TRAINERS.glob("*.py"))
        + (REPO / "posttrain" / "algos" / "policy_loss.py").read_text()
        + (REPO / "posttrain" / "rewards" / "budget.py").read_text()
    )
    for stem, (_, names) in PLOTS.items():
        for name in names:
            assert f'"{name}' in source or f"{name}=" in source, (stem, name)


def test_steps_get_integer_ticks(run) -> None:
    pipeline, run_dir = run
    figure = draw(plot_groups(pipeline, run_dir, "reward"), "Reward")
    figure.canvas.draw()
    for axis in figure.axes:
        assert all(float(t).is_integer() for t in axis.get_xticks()), axis.get_xticks()


def test_table_leads_with_what_tells_whether_the_recipe_worked(run) -> None:
    pipeline, run_dir = run
    report = write_report(pipeline, run_dir).read_text()
    rl = row(report, "rl-general-low")
    assert "reward_mean=" in rl and "accuracy_after=" in rl
    assert "eval_s_" not in rl and "budget/cold_start_s" not in rl  # timings stay in the manifest
    sft = row(report, "sft")
    assert "eval_loss_after=" in sft and "data/skipped" not in sft  # zero breakdowns are left out
    assert "data/kept=1800" in sft
    assert row(report, "mopd").split("| ")[-1].startswith("kl_after=")
    for stem in ("loss", "reward", "response_length", "mopd_kl"):
        assert (run_dir / "plots" / f"{stem}.png").is_file()


def test_summary_shows_headline_metrics_first() -> None:
    metrics = {"eval_s_after": 1.3, "eval_s_before": 2.2, "accuracy_after": 0.5, "reward_mean": 0.25}
    assert _metrics_text(metrics, limit=2).startswith("reward_mean=0.25, accuracy_after=0.5")


def test_the_report_shows_each_evaluation_with_its_errors_and_the_claims(run) -> None:
    """recorded_run holds eval.json files of a real shrunk DAG (rl-general-low, rl-agent-high,
    mopd): each RL row shows its accuracies ± errors and the paired change; the MOPD table one row
    per pair; the claims those files support are listed (a domain needs all three efforts)."""
    pipeline, run_dir = run
    report = write_report(pipeline, run_dir).read_text()
    # written before the eval.json files named their protocol: greedy, as they were played
    assert "Held-out prompts, greedy; ± one standard error over prompts" in report
    rl = row(report.split("## RL evaluations")[1], "rl-general-low")
    cells = [c.strip() for c in rl.strip("|").split("|")]
    assert cells[1] == "6" and all("±" in c for c in cells[2:])
    mopd = report.split("## MOPD evaluation: mopd")[1].split("##")[0]
    assert sum(line.startswith("| general-") for line in mopd.splitlines()) == 3
    claims = report.split("## Claims of the default recipe (this run)")[1]
    assert "| mopd_kl_down/coding-max |" in claims and "max_beats_sft" not in claims


def test_an_eval_subset_is_a_row_under_its_stage(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(RECORDED, run_dir)
    path = run_dir / "rl-general-low" / "eval.json"
    report = json.loads(path.read_text())
    subset = {
        k: report[k]
        for k in ("accuracy", "accuracy_se", "sft", "mean_response_tokens", "mean_response_tokens_se")
    }
    change = {"accuracy_change": 0.25, "accuracy_change_se": 0.05}
    changes = {**change, "mean_response_tokens_change": 1.0, "mean_response_tokens_change_se": 0.5}
    report["subsets"] = {"visual": {**subset, **changes, "prompts": 300}}
    path.write_text(json.dumps(report))
    text = write_report(load_pipeline(REPO / "stages" / "mopd.yaml"), run_dir).read_text()
    rows = [
        line
        for line in text.split("## RL evaluations")[1].splitlines()
        if line.startswith("| rl-general-low")
    ]
    assert [r.split("|")[1].strip() for r in rows] == ["rl-general-low", "rl-general-low (visual)"]
    assert "| 300 |" in rows[1] and "+0.250 ± 0.050, z +5.0" in rows[1]


def test_the_rl_table_names_how_its_episodes_were_played() -> None:
    assert _protocol({"temperature": 0.0, "samples_per_prompt": 1}) == "greedy"
    sampled = "sampled at temperature 0.6, 1 episode a prompt"
    assert _protocol({"temperature": 0.6, "samples_per_prompt": 1}) == sampled
    assert _protocol({"temperature": 1.0, "samples_per_prompt": 4}).endswith("1, 4 episodes a prompt")


@pytest.mark.parametrize("damaged", ["rl-agent-high/eval.json", "mopd/eval.json"])
def test_a_damaged_eval_file_is_named_in_the_report_not_a_traceback(tmp_path: Path, damaged: str) -> None:
    """`posttrain run` writes the report after its stages: an eval.json cut short (a full disk)
    ended the run in a JSONDecodeError; the report now names the file and the stage to rerun."""
    run_dir = tmp_path / "run"
    shutil.copytree(RECORDED, run_dir)
    path = run_dir / damaged
    path.write_text(path.read_text()[:200])
    text = write_report(load_pipeline(REPO / "stages" / "mopd.yaml"), run_dir).read_text()
    assert f"Not shown: {path} is damaged" in text
    assert f"--restart {path.parent.name}" in text
    assert "| rl-agent-high | rl |" in text  # the stage table is still there


def test_a_stage_that_did_not_finish_shows_no_evaluation(tmp_path: Path) -> None:
    """A stage that evaluated and then failed (the publishing guard refused its weights) vouches for
    no numbers: its eval.json used to be shown, and counted in the claims, as a finished stage's."""
    run_dir = tmp_path / "run"
    shutil.copytree(RECORDED, run_dir)
    path = run_dir / "mopd" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "status": "failed"}))
    text = write_report(load_pipeline(REPO / "stages" / "mopd.yaml"), run_dir).read_text()
    assert "## RL evaluations" in text and "| rl-general-low |" in text
    assert "## MOPD evaluation" not in text and "mopd_kl_down" not in text


@pytest.mark.parametrize("written", ["report.md", "plots/loss.png"])
def test_the_report_and_its_plots_are_replaced_whole(tmp_path: Path, monkeypatch, written: str) -> None:
    """report.md and the plots were written in place, every run: a kill or a full disk mid-write
    left a truncated file. Now a write that fails leaves report.md as it was, and no plot (the old
    ones are removed first, as always)."""
    from orchestration_support import fail_fsync_of

    run_dir = tmp_path / "run"
    shutil.copytree(RECORDED, run_dir)
    path = run_dir / written
    path.parent.mkdir(exist_ok=True)
    path.write_text("old")
    fail_fsync_of(monkeypatch, path.name)
    with pytest.raises(OSError):
        write_report(load_pipeline(REPO / "stages" / "mopd.yaml"), run_dir)
    if written == "report.md":
        assert path.read_text() == "old"
    else:
        assert not path.exists() and list(path.parent.iterdir()) == []


def test_a_damaged_stage_is_shown_damaged_as_status_shows_it(tmp_path: Path) -> None:
    """A done stage whose model/ no longer matches its manifest, and a manifest.json that does not
    read, were shown done and pending; `posttrain status` calls both damaged, and so does the report."""
    run_dir = tmp_path / "run"
    shutil.copytree(RECORDED, run_dir)
    path = run_dir / "sft" / "manifest.json"
    (run_dir / "sft" / "model").mkdir()
    (run_dir / "sft" / "model" / "model.safetensors").write_bytes(b"changed")
    path.write_text(
        json.dumps({**json.loads(path.read_text()), "model_files": {"model.safetensors": "0" * 64}})
    )
    (run_dir / "rl-agent-high" / "manifest.json").write_text('{"status": "do')  # cut short
    text = write_report(load_pipeline(REPO / "stages" / "mopd.yaml"), run_dir).read_text()
    assert "| sft | sft | damaged |" in text and "| rl-agent-high | rl | damaged |" in text
    assert "| rl-general-low | rl | done |" in text
