"""A real run of a three-stage DAG through the CLI: manifests, skip of done stages, staleness after
a config change, --restart / --from / --only, failures, report and status."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest

STAGES = ("a", "b", "c")


def manifest(run: Path, stage: str) -> dict:
    return json.loads((run / stage / "manifest.json").read_text())


def started(run: Path) -> dict[str, float]:
    return {s: manifest(run, s)["started"] for s in STAGES}


def value(run: Path, stage: str) -> int:
    return int((run / stage / "model" / "value.txt").read_text())


def plan_rows(out: str) -> dict[str, str]:
    """stage -> status column of `posttrain plan` output."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) > 4 and cells[1] not in ("", "stage"):
            rows[cells[1]] = cells[4]
    return rows


def write_dag(write, b_value: int = 3) -> Path:
    toy = 'kind: toy-sum\nplugins: ["{toy}"]\n'
    write("a.yaml", toy, "value: 2\n")
    write("b.yaml", toy, f"needs: [a.yaml]\nvalue: {b_value}\n")
    return write("c.yaml", toy, "needs: [b.yaml]\nvalue: 4\ntrain: {steps: 5}\n")


def test_run_skip_stale_restart_from_only(write, posttrain, tmp_path: Path) -> None:
    dag, run = write_dag(write), tmp_path / "run"
    code, out, err = posttrain("run", dag, "--run-dir", run)
    assert code == 0, out + err
    assert [value(run, s) for s in STAGES] == [2, 5, 9]
    c = manifest(run, "c")
    assert c["status"] == "done" and c["attempts"] == 1 and c["metrics"] == {"total": 9.0, "loss": 0.2}
    assert c["inputs"] == {"b": manifest(run, "b")["model_hash"]} and c["run_seconds"] > 0
    assert [r["step"] for r in map(json.loads, (run / "c" / "metrics.jsonl").read_text().splitlines())] == [
        1,
        2,
        3,
        4,
        5,
    ]
    assert list((run / "a" / "tensorboard").glob("events.out.tfevents.*"))
    assert "stage a starting" in (run / "run.log").read_text()
    first = started(run)

    code, out, _ = posttrain("run", dag, "--run-dir", run)
    assert code == 0 and "all 3 stages in scope are done" in out
    assert started(run) == first

    assert plan_rows(posttrain("plan", dag, "--run-dir", run)[1]) == {"a": "done", "b": "done", "c": "done"}
    assert plan_rows(posttrain("plan", dag, "--run-dir", run, "b.value=6")[1]) == {
        "a": "done",
        "b": "stale",
        "c": "stale",
    }
    write_dag(write, b_value=6)
    assert posttrain("run", dag, "--run-dir", run)[0] == 0
    now = started(run)
    assert now["a"] == first["a"] and now["b"] > first["b"] and now["c"] > first["c"]
    assert [value(run, s) for s in STAGES] == [2, 8, 12]

    # a rerun that reproduces the same weights leaves its dependants done
    before = now
    assert posttrain("run", dag, "--run-dir", run, "--restart", "a")[0] == 0
    now = started(run)
    assert now["a"] > before["a"] and (now["b"], now["c"]) == (before["b"], before["c"])

    before = now
    assert posttrain("run", dag, "--run-dir", run, "--from", "b")[0] == 0
    now = started(run)
    assert now["a"] == before["a"] and now["b"] > before["b"] and now["c"] > before["c"]

    # a stage to rerun that --only leaves out is refused, not silently skipped
    for flags in (("--restart", "a"), ("--from", "a")):
        code, out, err = posttrain("run", dag, "--run-dir", run, "--only", "b", *flags)
        assert code == 2 and f"{' '.join(flags)} is outside --only b (add --only a, or drop --only)" in err
    assert started(run) == now
    code, _, err = posttrain("run", dag, "--run-dir", run, "--only", "c", "b.value=3")
    assert code == 2 and "--only c: its need b is stale (config changed)" in err and "add --only b" in err
    before = now
    assert posttrain("run", dag, "--run-dir", run, "--only", "c", "--restart", "c")[0] == 0
    now = started(run)
    assert (now["a"], now["b"]) == (before["a"], before["b"]) and now["c"] > before["c"]

    code, out, _ = posttrain("status", run)
    assert code == 0
    assert all(f"│ {s}" in out for s in STAGES) and out.count("done") == 3 and "total=12" in out


def test_an_edited_data_file_makes_its_stage_stale(write, posttrain, tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    data.write_text("10")
    toy = 'kind: toy-sum\nplugins: ["{toy}"]\n'
    write("a.yaml", toy, f"value: 2\ndata: {data}\n")
    dag = write("b.yaml", toy, "needs: [a.yaml]\nvalue: 3\n")
    run = tmp_path / "run"
    assert posttrain("run", dag, "--run-dir", run)[0] == 0
    assert [value(run, s) for s in ("a", "b")] == [12, 15]
    assert manifest(run, "a")["inputs"] == {f"file:{data.resolve()}": content_digest(data)}
    assert plan_rows(posttrain("plan", dag, "--run-dir", run)[1]) == {"a": "done", "b": "done"}

    data.write_text("20")  # same config, other data: the finished stage no longer vouches for it
    code, out, _ = posttrain("plan", dag, "--run-dir", run)
    assert plan_rows(out) == {"a": "stale", "b": "stale"} and f"input {data.resolve()}" in out
    assert posttrain("run", dag, "--run-dir", run)[0] == 0
    assert [value(run, s) for s in ("a", "b")] == [22, 25]

    # A manifest written before data files were hashed lists none: its stage stays done.
    a = manifest(run, "a")
    (run / "a" / "manifest.json").write_text(json.dumps({**a, "inputs": {}}))
    data.write_text("30")
    assert plan_rows(posttrain("plan", dag, "--run-dir", run)[1]) == {"a": "done", "b": "done"}


def test_data_files_are_read_again_only_when_their_size_or_mtime_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`plan`, `status` and `run` hash a stage's data on every call: a file as recorded (size and
    mtime) is not read again, a touched one is, and one written in the last seconds is not recorded
    (a same-size edit within a coarse mtime could keep its old digest)."""
    import posttrain.files as files
    from orchestration.rundir import content_hash

    data = tmp_path / "shards"
    data.mkdir()
    (data / "a.jsonl").write_text("one")
    (data / "b.jsonl").write_text("two")
    old = time.time_ns() - 10**10
    for path in data.iterdir():
        os.utime(path, ns=(old, old))
    known: dict[str, list] = {}
    digest = content_hash(data, known)
    assert sorted(known) == [str(data / "a.jsonl"), str(data / "b.jsonl")]

    read = []
    real = files.sha256_file
    monkeypatch.setattr(files, "sha256_file", lambda path: read.append(path.name) or real(path))
    assert content_hash(data, known) == digest and read == []
    (data / "b.jsonl").write_text("TWO")  # same size, new mtime (now): read, and not recorded
    assert content_hash(data, known) != digest and read == ["b.jsonl"]
    assert content_hash(data, known) != digest and read == ["b.jsonl", "b.jsonl"]


def content_digest(path: Path) -> str:
    from posttrain.files import sha256_file

    return sha256_file(path)


def test_report_has_every_stage_and_the_curves_that_were_logged(write, posttrain, tmp_path: Path) -> None:
    toy = 'kind: toy-sum\nplugins: ["{toy}"]\n'
    write("sft.yaml", toy)
    dag = write("rl.yaml", toy, "needs: [sft.yaml]\nmatrix: {effort: [low, max]}\nvalue: 2\n")
    run = tmp_path / "run"
    assert posttrain("run", dag, "--run-dir", run)[0] == 0
    report = (run / "report.md").read_text()
    for row in (
        "| sft | toy-sum | done | 1 |",
        "| rl-low | toy-sum | done | 1 |",
        "| rl-max | toy-sum | done | 1 |",
    ):
        assert row in report
    assert "total=3" in report and "loss=0.3333" in report
    for plot in ("loss", "reward", "response_length"):
        assert f"![{plot}](plots/{plot}.png)" in report
        assert (run / "plots" / f"{plot}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (run / "plots" / "mopd_kl.png").exists(), "no stage logged a KL"


def test_failed_stage_blocks_dependants_and_resumes_after_the_fix(write, posttrain, tmp_path: Path) -> None:
    toy = 'kind: toy-sum\nplugins: ["{toy}"]\n'
    write("a.yaml", toy)
    write("f.yaml", toy, "needs: [a.yaml]\nfail: true\n")
    dag = write("g.yaml", toy, "needs: [f.yaml]\n")
    run = tmp_path / "run"
    code, out, _ = posttrain("run", dag, "--run-dir", run)
    assert code == 1
    assert manifest(run, "a")["status"] == "done"
    failed = manifest(run, "f")
    assert failed["status"] == "failed" and failed["error"] == "RuntimeError: toy stage asked to fail"
    assert failed["warnings"] == [] and "warning f:" not in out, "the failure is not also a warning"
    assert not (run / "f" / "model").exists() and not (run / "g").exists()
    assert "blocked" in out and "toy stage asked to fail" in out
    assert "| g | toy-sum | blocked | 0 |" in (run / "report.md").read_text()
    assert "Traceback" in (run / "f" / "stage.log").read_text()
    assert plan_rows(posttrain("plan", dag, "--run-dir", run)[1]) == {
        "a": "done",
        "f": "failed",
        "g": "pending",
    }

    a_started = manifest(run, "a")["started"]
    assert posttrain("run", dag, "--run-dir", run, "f.fail=false")[0] == 0
    assert manifest(run, "a")["started"] == a_started
    assert value(run, "g") == 3 and manifest(run, "f")["attempts"] == 1


def test_what_a_kill_left_while_deleting_is_removed_by_the_next_run(write, posttrain, tmp_path: Path) -> None:
    """A kill after a stage's manifest said done, before its checkpoints were deleted, left them
    (42 GB each at 3.5B) for good: a done stage is only skipped. So did a kill in the middle of
    any deletion (remove_tree's `.trash-*`). The next run removes both."""
    toy = 'kind: toy-sum\nplugins: ["{toy}"]\n'
    write("a.yaml", toy)
    dag = write("f.yaml", toy, "needs: [a.yaml]\nfail: true\n")
    run = tmp_path / "run"
    assert posttrain("run", dag, "--run-dir", run)[0] == 1
    leftovers = [
        run / "a" / "checkpoints" / "step-3" / "model.safetensors",
        run / "a" / ".trash-checkpoints-0123abcd" / "step-2" / "model.safetensors",
        run / "f" / ".trash-model-0123abcd" / "model.safetensors",  # f is not done: its next attempt
    ]
    for path in leftovers:
        path.parent.mkdir(parents=True)
        path.write_bytes(b"weights")
    code, out, _ = posttrain("run", dag, "--run-dir", run)
    assert code == 1 and manifest(run, "a")["status"] == "done" and manifest(run, "f")["attempts"] == 2
    assert [path for path in leftovers if path.parent.exists()] == []


def test_independent_stages_run_concurrently_up_to_max_parallel(write, posttrain, tmp_path: Path) -> None:
    toy = 'kind: toy-sum\nplugins: ["{toy}"]\n'
    write("sft.yaml", toy)
    meeting = tmp_path / "meeting"
    dag = write("rl.yaml", toy, f"needs: [sft.yaml]\nmatrix: {{effort: [low, max]}}\nrendezvous: {meeting}\n")
    code, out, err = posttrain("run", dag, "--run-dir", tmp_path / "run", "--max-parallel", "2")
    assert code == 0, out + err
    assert sorted(p.name for p in meeting.iterdir()) == ["rl-low", "rl-max"]
    assert int((tmp_path / "run" / "rl-max" / "model" / "value.txt").read_text()) == 2


def test_local_stages_run_together_while_their_cpus_fit_the_machine(write, posttrain, tmp_path: Path) -> None:
    # No --max-parallel: stages asking for no CPUs always fit, so the rendezvous (which only
    # completes when both run at once) succeeds.
    toy = 'kind: toy-sum\nplugins: ["{toy}"]\n'
    write("sft.yaml", toy)
    meeting = tmp_path / "meeting"
    dag = write(
        "rl.yaml",
        toy,
        f"needs: [sft.yaml]\nmatrix: {{effort: [low, max]}}\nrendezvous: {meeting}\nresources: {{cpus: 0}}\n",
    )
    code, out, err = posttrain("run", dag, "--run-dir", tmp_path / "run")
    assert code == 0, out + err
    assert sorted(p.name for p in meeting.iterdir()) == ["rl-low", "rl-max"]


def test_local_stages_that_each_want_every_cpu_run_one_at_a_time(write, posttrain, tmp_path: Path) -> None:
    toy = 'kind: toy-sum\nplugins: ["{toy}"]\n'
    write("sft.yaml", toy)
    every_cpu = f"resources: {{cpus: {os.cpu_count()}}}\n"
    dag = write("rl.yaml", toy, f"needs: [sft.yaml]\nmatrix: {{effort: [low, max]}}\n{every_cpu}")
    run = tmp_path / "run"
    code, out, err = posttrain("run", dag, "--run-dir", run)
    assert code == 0, out + err
    low, high = sorted((manifest(run, s) for s in ("rl-low", "rl-max")), key=lambda m: m["started"])
    assert high["started"] >= low["finished"]


def test_local_stages_get_their_own_gpus_and_wait_for_free_ones(
    write, posttrain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a machine showing GPUs 3 and 5: two 1-GPU stages run at once (the rendezvous) on one
    GPU each; 2-GPU stages run one after another, each seeing both; a stage asking for none sees
    none; asking for more than the machine has is refused before anything runs."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    toy = 'kind: toy-sum\nplugins: ["{toy}"]\nresources: {cpus: 0, gpus: 0}\n'
    write("sft.yaml", toy)
    meeting = tmp_path / "meeting"
    one = write(
        "one.yaml",
        'kind: toy-sum\nplugins: ["{toy}"]\n',
        f"needs: [sft.yaml]\nmatrix: {{effort: [low, max]}}\nrendezvous: {meeting}\n",
        "resources: {cpus: 0, gpus: 1}\n",
    )
    code, out, err = posttrain("run", one, "--run-dir", tmp_path / "one")
    assert code == 0, out + err
    seen = {
        s: (tmp_path / "one" / s / "model" / "gpus.txt").read_text() for s in ("sft", "one-low", "one-max")
    }
    assert seen["sft"] == "" and sorted([seen["one-low"], seen["one-max"]]) == ["3", "5"]

    two = write(
        "two.yaml",
        'kind: toy-sum\nplugins: ["{toy}"]\n',
        "needs: [sft.yaml]\nmatrix: {effort: [low, max]}\nresources: {cpus: 0, gpus: 2}\n",
    )
    run = tmp_path / "two"
    code, out, err = posttrain("run", two, "--run-dir", run)
    assert code == 0, out + err
    assert all((run / s / "model" / "gpus.txt").read_text() == "3,5" for s in ("two-low", "two-max"))
    low, high = sorted((manifest(run, s) for s in ("two-low", "two-max")), key=lambda m: m["started"])
    assert high["started"] >= low["finished"]

    three = write(
        "three.yaml",
        'kind: toy-sum\nplugins: ["{toy}"]\n',
        "needs: [sft.yaml]\nresources: {cpus: 0, gpus: 3}\n",
    )
    code, out, err = posttrain("run", three, "--run-dir", tmp_path / "three")
    assert (
        code == 2
        and "resources.gpus: stage three asks for 3 GPU(s) but this machine has 2 visible" in out + err
    )
    assert not (tmp_path / "three" / "sft" / "model").exists()


def test_too_many_gpus_is_refused_before_the_run_dir_is_written(
    write, posttrain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The error points where the value was set (the override, else the file's line), and neither
    a fresh --run-dir nor an existing one (its pipeline.json is what `status` reads) is touched."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    dag, fresh = write_dag(write), tmp_path / "fresh"
    code, _, err = posttrain("run", dag, "--run-dir", fresh, "b.resources.gpus=2")
    assert code == 2 and (
        "command line override 'b.resources.gpus=2': resources.gpus: stage b asks for 2 GPU(s) "
        "but this machine has 1 visible" in err
    )
    assert not fresh.exists()

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "pipeline.json").write_text('{"file": "earlier.yaml"}')
    greedy = write("g.yaml", 'kind: toy-sum\nplugins: ["{toy}"]\n', "value: 1\nresources:\n  gpus: 2\n")
    code, _, err = posttrain("run", greedy, "--run-dir", existing)
    assert code == 2 and "g.yaml:5: resources.gpus: stage g asks for 2 GPU(s) but this machine has 1" in err
    assert [p.name for p in existing.iterdir()] == ["pipeline.json"]
    assert (existing / "pipeline.json").read_text() == '{"file": "earlier.yaml"}'


def test_execute_refuses_more_gpus_than_the_machine_shows(
    write, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A program calling `execute` without the CLI's checks gets the error instead of a driver
    that waits forever for a third GPU."""
    from orchestration.executors import execute
    from orchestration.pipeline import load_pipeline
    from posttrain.config.errors import ConfigError

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    greedy = write("g.yaml", 'kind: toy-sum\nplugins: ["{toy}"]\n', "value: 1\nresources:\n  gpus: 3\n")
    pipeline = load_pipeline(greedy, [])
    with pytest.raises(ConfigError, match="g.yaml:5: resources.gpus: stage g asks for 3 GPU"):
        execute(pipeline, tmp_path / "run", ["g"], set())
    assert not (tmp_path / "run").exists()


def test_the_foreground_runner_names_a_damaged_request_as_damaged(tmp_path: Path, capsys) -> None:
    """`python -m orchestration.runner DIR STAGE` called a damaged stage.json missing, in a traceback."""
    from orchestration.runner import main

    run = tmp_path / "run"
    path = run / "a" / "stage.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"stage": {"id"')  # cut short
    assert main([str(run), "a"]) == 2
    err = capsys.readouterr().err
    assert f"{path} is damaged" in err and f"--run-dir {run} --only a" in err
    path.write_text(json.dumps({"stage": {"id": "a"}, "inputs": {}, "restart": False}))  # fields missing
    assert main([str(run), "a"]) == 2 and f"{path} is damaged" in capsys.readouterr().err
    path.unlink()
    assert main([str(run), "a"]) == 2 and f"{path} is missing" in capsys.readouterr().err


@pytest.mark.parametrize("record", ["pipeline.json", "stage.json"])
def test_records_rewritten_every_run_are_replaced_whole(
    write, posttrain, tmp_path: Path, monkeypatch, record: str
) -> None:
    """pipeline.json and stage.json were written in place: a kill or a full disk mid-write left a
    truncated file. Now a write that fails leaves the old file as it was."""
    from orchestration_support import fail_fsync_of

    from orchestration.pipeline import load_pipeline
    from orchestration.runner import write_request

    stage = write("a.yaml", 'kind: toy-sum\nplugins: ["{toy}"]\n')
    run = tmp_path / "run"
    path = run / record if record == "pipeline.json" else run / "a" / record
    path.parent.mkdir(parents=True)
    path.write_text("old")
    fail_fsync_of(monkeypatch, record)
    if record == "pipeline.json":
        code, _, err = posttrain("run", stage, "--run-dir", run)
        assert code == 2 and f"{path}: No space left on device" in err, err
    else:
        with pytest.raises(OSError):
            write_request(load_pipeline(stage), run, "a", restart=False)
    assert path.read_text() == "old"


def test_report_writes_the_report_of_a_run_that_did_not_end(write, posttrain, tmp_path: Path) -> None:
    """report.md was written only at the end of `posttrain run`: a run killed, or one still going,
    had none. `posttrain report` writes it from the run dir as it is, each stage as `status` reads
    it: running while its process holds its lock, pending where a killed worker's manifest still
    says running, blocked behind a failed need."""
    from orchestration.pipeline import load_pipeline
    from orchestration.rundir import StageLock, write_manifest, write_pipeline

    toy = 'kind: toy-sum\nplugins: ["{toy}"]\n'
    write("a.yaml", toy)
    write("b.yaml", toy, "needs: [a.yaml]\n")
    write("c.yaml", toy, "needs: [a.yaml]\n")
    write("f.yaml", toy, "needs: [a.yaml]\n")
    write("g.yaml", toy, "needs: [f.yaml]\n")
    dag = write("dag.yaml", toy, "needs: [b.yaml, c.yaml, g.yaml]\n")
    run = tmp_path / "run"
    # A run as it is while b runs (without training anything): a done, c's worker killed, f
    # failed, g and dag not started.
    for sid, record in {
        "a": {"status": "done", "attempts": 1, "metrics": {"total": 1.0}},
        "b": {"status": "running", "attempts": 1},
        "c": {"status": "running", "attempts": 1},
        "f": {"status": "failed", "attempts": 1, "error": "RuntimeError: boom"},
    }.items():
        (run / sid).mkdir(parents=True)
        write_manifest(run / sid, record)
    (run / "a" / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n')
    write_pipeline(run, load_pipeline(dag), [])
    running = StageLock(run / "b")
    assert running.acquire(wait_s=0)
    try:
        code, out, err = posttrain("report", dag, "--run-dir", run)
    finally:
        running.release()
    assert code == 0, err
    assert f"report: {run / 'report.md'}" in out
    assert f"run dir {run}: 1 done, 1 pending, 1 running, 1 failed, 2 blocked" in out
    report = (run / "report.md").read_text()
    for row in ("| a | toy-sum | done | 1 |", "| b | toy-sum | running |", "| c | toy-sum | pending |"):
        assert row in report
    assert "| f | toy-sum | failed |" in report
    assert "| g | toy-sum | blocked |" in report and "| dag | toy-sum | blocked |" in report
    assert "total=1" in report and "![loss](plots/loss.png)" in report


def test_report_refuses_a_dir_that_holds_no_run_of_the_stage_file(write, posttrain, tmp_path: Path) -> None:
    """Exit 2 naming the dir (or its pipeline.json) and the fix, and no report.md written into it."""
    toy = 'kind: toy-sum\nplugins: ["{toy}"]\n'
    stage = write("a.yaml", toy)
    run = tmp_path / "run"
    (tmp_path / "run-of-a").mkdir()
    (tmp_path / "run-of-a" / "a").mkdir()
    (tmp_path / "run-of-a" / "a" / "manifest.json").write_text("{}")
    code, _, err = posttrain("report", stage, "--run-dir", tmp_path / "run-of-a" / "a")
    assert code == 2 and f"is a stage dir of the run {tmp_path / 'run-of-a'}" in err
    assert f"--run-dir {tmp_path / 'run-of-a'})" in err
    cases = [("run dir does not exist", f"posttrain run {stage} --run-dir {run}")]
    cases.append((f"{run / 'pipeline.json'}: is missing: this dir holds no run", "start one"))
    cases.append((f"{run / 'pipeline.json'}: is damaged (not the JSON record", "writes it again"))
    other = tmp_path / "other.yaml"
    cases.append(
        (f"the run in {run} was made by {other}, not {stage}", f"posttrain report {other} --run-dir")
    )
    for index, (problem, fix) in enumerate(cases):
        if index == 1:
            run.mkdir()
        if index == 2:
            (run / "pipeline.json").write_text('{"file": "a.ya')  # cut short by hand
        if index == 3:
            (run / "pipeline.json").write_text(
                json.dumps({"file": str(other), "overrides": [], "stages": {}})
            )
        code, out, err = posttrain("report", stage, "--run-dir", run)
        assert code == 2 and problem in err and fix in err and "Traceback" not in out + err, err
        assert not (run / "report.md").exists()


def test_report_in_a_run_dir_it_may_not_write_is_a_user_error(
    write, posttrain, tmp_path: Path, monkeypatch
) -> None:
    """Another user's run dir, readable but not writable: `posttrain report` ended in a
    PermissionError traceback; it names the file and says to report on a copy."""
    import orchestration.report
    from orchestration.pipeline import load_pipeline
    from orchestration.rundir import write_pipeline

    stage = write("a.yaml", 'kind: toy-sum\nplugins: ["{toy}"]\n')
    run = tmp_path / "run"
    run.mkdir()
    write_pipeline(run, load_pipeline(stage), [])

    def read_only(path: Path, text: str) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(orchestration.report, "atomic_write_text", read_only)
    code, out, err = posttrain("report", stage, "--run-dir", run)
    assert code == 2 and "Traceback" not in out + err
    assert f"{run / 'report.md'}: permission denied" in err and "report on a copy" in err
