"""bench/kept_by_family.py: a run's evaluation files are read through orchestration.outcomes'
reader, so a damaged one exits 2 naming it and the stage to evaluate again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import kept_by_family  # noqa: E402

EPISODES = {"uid": ["eval/general/lookup-0/max/0"], "reward": [1.0], "tokens": [7.0]}


def _run(root: Path) -> Path:
    """A finished run's pair general-max: the RL stage's eval.json and MOPD's eval_episodes.json."""
    for stage in ("rl-general-max", "mopd"):
        (root / stage).mkdir(parents=True)
        (root / stage / "manifest.json").write_text(json.dumps({"status": "done", "model_hash": "aa"}))
    (root / "rl-general-max" / "eval.json").write_text(
        json.dumps({"episodes": {"before": EPISODES, "after": EPISODES}})
    )
    (root / "mopd" / "eval_episodes.json").write_text(
        json.dumps({"general-max": {"after": {"accuracy": EPISODES}}})
    )
    return root


@pytest.mark.parametrize(
    ("damaged", "stage"),
    [("rl-general-max/eval.json", "rl-general-max"), ("mopd/eval_episodes.json", "mopd")],
)
def test_a_damaged_eval_file_exits_2_naming_it_and_the_stage_to_rerun(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    damaged: str,
    stage: str,
) -> None:
    run = _run(tmp_path)
    monkeypatch.setattr(sys, "argv", ["kept_by_family.py", str(run)])
    kept_by_family.main()  # the intact run reads
    assert "general-max:" in capsys.readouterr().out
    (run / damaged).write_text('{"episodes": {"bef')  # a disk that filled
    with pytest.raises(SystemExit) as exit_:  # before: a JSONDecodeError (DamagedEvalError) traceback
        kept_by_family.main()
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and f"{run / damaged} is damaged" in error and f"--restart {stage}" in error


def test_a_specialist_not_done_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A failed RL stage keeps its eval.json: its numbers are not vouched for (read_eval); before,
    its episodes were counted."""
    run = _run(tmp_path)
    (run / "rl-general-max" / "manifest.json").write_text(json.dumps({"status": "failed"}))
    monkeypatch.setattr(sys, "argv", ["kept_by_family.py", str(run)])
    with pytest.raises(SystemExit, match="rl-general-max/eval.json is missing.*did not finish"):
        kept_by_family.main()
    assert "general-max:" not in capsys.readouterr().out
