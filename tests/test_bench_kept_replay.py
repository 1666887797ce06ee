"""bench/kept_replay.py: a replay that is the RL stage's own evaluation (its first episode of each
prompt the stage's, the same noise for any model). The kept share's paired error is
posttrain.envs.env_eval.paired_ratio (tests/envs/test_env_eval.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))  # kept_replay imports its sibling stage_policy
# A plain import: one kept_replay module however many tests import it (bench/outcomes.py, tested
# beside this, sends kept_replay.kept_share by reference to its replay processes).
import kept_replay  # noqa: E402


def _rl_stage(root: Path, domain: str, effort: str, prompts: int) -> Path:
    """An RL stage dir as a run leaves it (model and stage.json), the shipped base as its model."""
    stage = root / f"rl-{domain}-{effort}"
    stage.mkdir(parents=True)
    (stage / "model").symlink_to(REPO / "data_recipes" / "base")
    body = {
        "domain": domain,
        "effort": effort,
        "eval": {"prompts": prompts, "temperature": 0.6},
        "environments": {domain: {"max_turns": 2, "max_tokens_per_turn": 24}},
    }
    (stage / "stage.json").write_text(json.dumps({"stage": {"seed": 3, "body": body}}))
    return stage


def test_a_replay_plays_the_stage_eval_and_its_first_copies_are_the_stages(tmp_path: Path) -> None:
    stage = _rl_stage(tmp_path, "general", "max", prompts=3)
    seed, cfg, harness, domain, effort = kept_replay.stage_settings(stage)
    assert (seed, cfg.prompts, cfg.temperature, harness.max_tokens_per_turn) == (3, 3, 0.6, 24)
    rows = kept_replay.replay(stage / "model", stage, samples=2)
    prompts = sorted({uid.rsplit("/", 1)[0] for uid in rows["uid"]})
    assert len(prompts) == 3 and all(p.endswith("/max") for p in prompts)
    assert sorted(uid.rsplit("/", 1)[1] for uid in rows["uid"]) == ["0", "0", "0", "1", "1", "1"]
    # Same uids, seed and policy: the same episodes (what lets two models share their noise).
    assert kept_replay.replay(stage / "model", stage, samples=2) == rows
    first = [i for i, uid in enumerate(rows["uid"]) if uid.endswith("/0")]
    recorded = {key: [rows[key][i] for i in first] for key in ("uid", "reward", "tokens")}
    assert kept_replay.first_copies_agree(rows, recorded) == "3/3"
    recorded["tokens"][1] += 1.0  # the stage's episode ran otherwise: the check says so
    assert kept_replay.first_copies_agree(rows, recorded) == "2/3"
    assert kept_replay.first_copies_agree(rows, None) == "-"


def _finished(stage: Path, model_hash: str) -> None:
    """The manifest a done stage leaves (read_eval reads the evaluations of done stages only)."""
    (stage / "manifest.json").write_text(json.dumps({"model_hash": model_hash, "status": "done"}))


def _finished_pair(root: Path) -> tuple[Path, Path]:
    """rl-general-max (3 held-out prompts) and mopd, both done (model hashes aaaa and bbbb)."""
    stage = _rl_stage(root, "general", "max", prompts=3)
    student = root / "mopd"
    student.mkdir()
    _finished(stage, "aaaa")
    _finished(student, "bbbb")
    return stage, student


def test_kept_share_reads_its_cache_only_for_the_same_models(tmp_path: Path) -> None:
    """A replay is cached in the run dir under the two models' hashes: read again while they are
    the ones replayed, played again once a stage has run again (a new model hash)."""
    stage = _rl_stage(tmp_path, "general", "max", prompts=3)
    student = tmp_path / "mopd"
    student.mkdir()
    (student / "model").symlink_to(REPO / "data_recipes" / "base")
    _finished(stage, "aaaa")
    _finished(student, "bbbb")
    (stage / "eval.json").write_text(
        json.dumps({"episodes": {"after": {"uid": [], "reward": [], "tokens": []}}})
    )
    cached = {"kept": 0.93, "kept_se": 0.02, "specialist": 0.4}
    key = "mopd/general-max/8/aaaa/bbbb"
    (tmp_path / kept_replay.CACHE_FILE).write_text(json.dumps({key: cached}))
    assert kept_replay.kept_share(tmp_path, "general-max", 8) == cached
    # the student's stage ran again: replayed, and the untrained base solves none of the prompts
    _finished(student, "cccc")
    with pytest.raises(kept_replay.ReplayError, match="solved none of its prompts"):
        kept_replay.kept_share(tmp_path, "general-max", 2)
    assert json.loads((tmp_path / kept_replay.CACHE_FILE).read_text()) == {key: cached}
    (student / "manifest.json").unlink()
    with pytest.raises(kept_replay.ReplayError, match="mopd/manifest.json is missing"):
        kept_replay.kept_share(tmp_path, "general-max", 8)


def test_a_missing_stage_record_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(kept_replay.ReplayError, match="rl-general-max/stage.json is missing"):
        kept_replay.stage_settings(tmp_path / "rl-general-max")


def test_a_replay_stored_by_another_process_meanwhile_is_kept(tmp_path: Path, monkeypatch) -> None:
    """bench/outcomes.py replays a run's pairs in parallel processes: one that stores its replay
    after another stored one since its start must keep that one (it reads the cache again under a
    lock, not its first read)."""
    stage, student = _finished_pair(tmp_path)
    (stage / "eval.json").write_text(
        json.dumps({"episodes": {"after": {"uid": [], "reward": [], "tokens": []}}})
    )
    other = {"mopd/agent-low/8/cccc/bbbb": {"kept": 0.97}}  # the other process's pair

    def play_while_another_stores(model_dir: Path, stage_dir: Path, samples: int) -> dict[str, list]:
        kept_replay.store(tmp_path / kept_replay.CACHE_FILE, *next(iter(other.items())))
        return {"uid": ["p/max/0", "q/max/0"], "reward": [1.0, 0.0], "tokens": [5.0, 6.0]}

    monkeypatch.setattr(kept_replay, "replay", play_while_another_stores)
    row = kept_replay.kept_share(tmp_path, "general-max", 8)
    assert row["kept"] == 1.0 and row["prompts"] == 2
    cache = json.loads((tmp_path / kept_replay.CACHE_FILE).read_text())
    assert cache == {**other, "mopd/general-max/8/aaaa/bbbb": row}


def test_a_stage_not_done_is_not_replayed_nor_read_from_the_cache(tmp_path: Path) -> None:
    """A MOPD stage that failed after a finished attempt keeps a manifest (and a cached replay under
    its hash): its kept share is refused, not the cached one of a model the run no longer vouches for."""
    stage = _rl_stage(tmp_path, "general", "max", prompts=3)
    student = tmp_path / "mopd"
    student.mkdir()
    _finished(stage, "aaaa")
    (student / "manifest.json").write_text(json.dumps({"model_hash": "bbbb", "status": "failed"}))
    key = "mopd/general-max/8/aaaa/bbbb"
    (tmp_path / kept_replay.CACHE_FILE).write_text(json.dumps({key: {"kept": 0.93}}))
    with pytest.raises(kept_replay.ReplayError, match="mopd is failed, not done.*--only mopd"):
        kept_replay.kept_share(tmp_path, "general-max", 8)


def test_a_pair_that_cannot_be_replayed_exits_2_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A student stage not finished is the user's to finish: exit 2 with the stage and the command,
    as argparse does for bad input, not exit 1."""
    stage = _rl_stage(tmp_path, "general", "max", prompts=3)
    _finished(stage, "aaaa")
    monkeypatch.setattr(sys, "argv", ["kept_replay.py", str(tmp_path), "--samples", "2"])
    with pytest.raises(SystemExit) as exit_:
        kept_replay.main()
    assert exit_.value.code == 2 and f"{tmp_path}/mopd/manifest.json is missing" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--samples", "0"], ["--threads", "0"]])
def test_zero_samples_or_threads_exit_2_before_playing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["kept_replay.py", str(tmp_path), *argv])
    with pytest.raises(SystemExit) as exit_:
        kept_replay.main()
    assert exit_.value.code == 2 and f"{' '.join(argv)}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("damaged", "stage"),
    [("rl-general-max/eval.json", "rl-general-max"), ("mopd/eval_episodes.json", "mopd")],
)
def test_a_damaged_eval_file_exits_2_naming_it_before_playing(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    damaged: str,
    stage: str,
) -> None:
    """The stages' evaluation files are read by orchestration.outcomes.read_eval: a damaged one
    (a disk that filled) exits 2 naming it and the stage to evaluate again, not a traceback."""
    rl, student = _finished_pair(tmp_path)
    (rl / "eval.json").write_text(
        json.dumps({"episodes": {"after": {"uid": [], "reward": [], "tokens": []}}})
    )
    (student / "eval_episodes.json").write_text(json.dumps({}))
    (tmp_path / damaged).write_text('{"episodes": {"aft')
    monkeypatch.setattr(sys, "argv", ["kept_replay.py", str(tmp_path), "--samples", "2"])
    with pytest.raises(SystemExit) as exit_:
        kept_replay.main()
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and f"{tmp_path / damaged} is damaged" in error
    assert f"--restart {stage}" in error


def test_a_damaged_manifest_is_named(tmp_path: Path) -> None:
    stage = _rl_stage(tmp_path, "general", "max", prompts=3)
    (stage / "manifest.json").write_text('{"model_ha')
    with pytest.raises(kept_replay.ReplayError, match="rl-general-max/manifest.json is damaged"):
        kept_replay.model_hash(stage)


def test_a_damaged_stage_record_or_replay_cache_is_named(tmp_path: Path) -> None:
    """Before: a JSONDecodeError traceback for either."""
    stage = _rl_stage(tmp_path, "general", "max", prompts=3)
    (stage / "stage.json").write_text('{"stage": {"se')
    with pytest.raises(
        kept_replay.ReplayError, match="rl-general-max/stage.json is damaged.*--restart rl-general-max"
    ):
        kept_replay.stage_settings(stage)
    student = tmp_path / "mopd"
    student.mkdir()
    _finished(stage, "aaaa")
    _finished(student, "bbbb")
    (tmp_path / kept_replay.CACHE_FILE).write_text('{"mopd/general-max/8/aaaa/bbbb": {"kept": 0.9')
    with pytest.raises(kept_replay.ReplayError, match="kept_replay.json is damaged.*remove it"):
        kept_replay.kept_share(tmp_path, "general-max", 8)
