"""bench/outcomes.py --kept-samples: the mopd_keeps_90 claims judged on the pairs' replays
(bench/kept_replay.py), the stage's one-episode value kept beside them, the other claims untouched."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from orchestration.outcomes import claim

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))  # outcomes imports its sibling kept_replay
_spec = importlib.util.spec_from_file_location("bench_outcomes", REPO / "bench" / "outcomes.py")
bench_outcomes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_outcomes)


def test_kept_claims_are_judged_on_the_replay(tmp_path: Path) -> None:
    for stage, model_hash in (("rl-general-max", "aaaa"), ("mopd", "bbbb")):
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "manifest.json").write_text(json.dumps({"model_hash": model_hash}))
    replayed = {"kept": 0.95, "kept_se": 0.02, "specialist": 0.45}
    cache = {"mopd/general-max/8/aaaa/bbbb": replayed}  # what kept_replay.kept_share stored
    (tmp_path / "kept_replay.json").write_text(json.dumps(cache))
    claims = {
        "mopd_keeps_90/general-max": {**claim(0.79, 0.1, ">=0.9"), "teacher_accuracy": 0.35},
        "max_beats_sft/general": claim(0.17, 0.05, "z>=2"),
    }
    out = bench_outcomes.replay_kept_shares(tmp_path, claims, 8)
    kept = out["mopd_keeps_90/general-max"]
    assert kept["value"] == 0.95 and kept["se"] == 0.02 and kept["holds"]
    assert kept["one_episode"] == 0.79 and kept["samples"] == 8 and kept["teacher_accuracy"] == 0.45
    assert out["max_beats_sft/general"] == claims["max_beats_sft/general"]
    assert not claims["mopd_keeps_90/general-max"]["holds"]  # the caller's claims are not changed
    # no cached replay of 4 episodes a prompt: it plays one, and this run has no specialist to play
    with pytest.raises(SystemExit, match="rl-general-max/eval.json is missing"):
        bench_outcomes.replay_kept_shares(tmp_path, claims, 4)
