"""The `posttrain` front end: commands, flags and exit codes (0 ok, 2 user error), with messages
that name the mistake and the fix."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_console_script_points_at_main() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["posttrain"] == "posttrain.cli:main"


@pytest.mark.parametrize("argv", [[], ["--help"], ["-h"]])
def test_usage(posttrain, argv: list[str]) -> None:
    code, out, _ = posttrain(*argv)
    assert code == 0
    assert "posttrain run FILE" in out and "posttrain plan FILE" in out and "posttrain status DIR" in out


def test_unknown_command_suggests_the_nearest(posttrain) -> None:
    code, _, err = posttrain("rnu", "stages/mopd.yaml")
    assert code == 2 and "unknown command 'rnu'; did you mean 'run'?" in err


def test_bad_flags_are_usage_errors(posttrain, tmp_path: Path) -> None:
    code, _, err = posttrain("run", tmp_path / "a.yaml", "--executor", "slurm")
    assert code == 2 and "invalid choice: 'slurm'" in err
    code, _, err = posttrain("plan")  # the optional KEY=VALUE is not listed as missing
    assert code == 2 and err.rstrip().endswith("the following arguments are required: file")


def test_missing_stage_file_and_run_dir(posttrain, tmp_path: Path) -> None:
    (tmp_path / "mopd.yaml").write_text("kind: x\n")
    code, _, err = posttrain("plan", tmp_path / "mpod.yaml")
    assert code == 2 and "mpod.yaml: stage file does not exist (did you mean 'mopd.yaml'?)" in err
    code, _, err = posttrain("status", tmp_path / "runs" / "nope")
    assert code == 2 and "run dir does not exist" in err
    assert "cannot show the status" in err and "stage configuration" not in err


@pytest.mark.parametrize("command", ["plan", "report"])
def test_a_run_dir_given_as_the_stage_file_names_the_stage_file(
    posttrain, tmp_path: Path, command: str
) -> None:
    """`posttrain status DIR` takes the run dir; `plan`/`report` given one (the same habit) said
    "stage file does not exist" of a dir that does. Now the hint is the command with the stage
    file its pipeline.json names."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "pipeline.json").write_text('{"file": "/stages/mopd.yaml", "overrides": [], "stages": {}}')
    code, out, err = posttrain(command, run)
    assert code == 2 and "Traceback" not in out + err
    assert (
        f"{run}: is a directory, not a stage file (posttrain {command} /stages/mopd.yaml --run-dir {run})"
        in err
    )


def test_stage_flags_name_real_stages(posttrain, tmp_path: Path) -> None:
    stage = tmp_path / "sft.yaml"
    stage.write_text("kind: x\n")
    code, _, err = posttrain("run", stage, "--only", "stf", "--run-dir", tmp_path / "run")
    assert code == 2 and "--only stf: no such stage" in err and "did you mean 'sft'?" in err
    code, _, err = posttrain("run", stage, "--max-parallel", "0", "--run-dir", tmp_path / "run")
    assert code == 2 and "--max-parallel 0: must be at least 1" in err
    assert not (tmp_path / "run").exists()


def test_default_run_dir_is_runs_slash_file_stem(
    posttrain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "sft.yaml").write_text("kind: x\n")
    monkeypatch.chdir(tmp_path)
    code, out, _ = posttrain("plan", "stages/sft.yaml")
    assert code == 0 and f"run dir {Path('runs') / 'sft'}: 1 pending" in out


def test_a_profile_file_adds_its_overrides(tmp_path: Path) -> None:
    """`@FILE` reads one argument per line, comments and blank lines skipped; the shipped one-GPU
    profile puts every stage of the default DAG on the GPU with the 1B preset as SFT's model."""
    from orchestration.pipeline import load_pipeline
    from posttrain.cli import _parser

    profile = tmp_path / "p.args"
    profile.write_text("# a comment\n\nseed=3   # trailing note\nrl-*.train.steps=1\n")
    args = _parser("run").parse_intermixed_args(["stages/mopd.yaml", f"@{profile}", "sft.train.steps=2"])
    assert args.overrides == ["seed=3", "rl-*.train.steps=1", "sft.train.steps=2"]

    shipped = _parser("plan").parse_intermixed_args(["x.yaml", f"@{REPO / 'stages/profiles/one-gpu.args'}"])
    pipeline = load_pipeline(REPO / "stages/mopd.yaml", shipped.overrides)
    assert Path(pipeline.stages["sft"].model) == REPO / "stages/models/k3-1b.yaml"
    for stage in pipeline.stages.values():
        assert stage.resources["gpus"] == 1 and stage.body["accelerate"]["mixed_precision"] == "bf16"


@pytest.mark.parametrize(
    ("command", "advice"),
    [
        ("run", "rerun the same command to resume"),
        ("export", "nothing was written to --out"),
        ("report", "rerun the same command to write the report"),
    ],
)
def test_a_stopped_command_says_what_rerunning_does(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str, advice: str
) -> None:
    """An export starts over when rerun (it renames its --out into place at the end), and a report
    is written anew; they used to say, as `run` does, that rerunning resumes."""
    from posttrain import cli

    def stopped(args, console) -> int:
        raise cli.Terminated()

    monkeypatch.setitem(cli.COMMANDS, command, stopped)
    argv = (
        [command, "x.yaml"]
        if command in ("run", "report")
        else [command, "RUN/sft", "--format", "bf16", "--out", "o"]
    )
    assert cli.main(argv) == 143
    err = capsys.readouterr().err
    assert err.startswith(f"terminated; {advice}") and ("resume" in err) == (command == "run")
