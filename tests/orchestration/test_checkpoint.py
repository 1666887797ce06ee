"""CheckpointManager: everything round-trips exactly, damaged checkpoints are skipped with a
warning, old ones are pruned; MetricsLogger rewinds to a restored step."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from posttrain.checkpoint import CheckpointManager, capture_rng_state, restore_rng_state
from posttrain.data.sample import Sample
from posttrain.files import atomic_write_text, new_dir
from posttrain.metrics import MetricsLogger, read_metrics


def make_state(
    seed: int,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Dropout(0.3), torch.nn.Linear(7, 3))
    model.register_buffer("router_bias", torch.randn(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(8, 5)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def draws() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(3)


def paused(uid: str) -> Sample:
    sample = Sample(uid=uid, domain="agent", effort="max", messages=[{"role": "user", "content": "hi"}])
    sample.append([1, 2, 3], generated=False)
    sample.append([7, 8], generated=True, logprobs=[-0.5, -1.25], version=3)
    sample.prompt_length, sample.finish_reason = 3, "paused"
    return sample


def test_round_trip_restores_every_piece_of_state(tmp_path: Path) -> None:
    model, optimizer, scheduler = make_state(0)
    train(model, optimizer, scheduler, 3)
    manager = CheckpointManager(tmp_path / "ckpt")
    extra = {"cursor": 17, "router": {"bias": torch.arange(4.0)}, "order": [3, 1, 2], "name": "shard-2"}
    manager.save(
        3,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        extra=extra,
        samples={"rollout_queue": [paused("p0-1"), paused("p4-0")]},
    )
    after_save = draws()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_optimizer = optimizer.state_dict()

    fresh_model, fresh_optimizer, fresh_scheduler = make_state(1)
    draws()
    checkpoint = CheckpointManager(tmp_path / "ckpt").load(
        model=fresh_model, optimizer=fresh_optimizer, scheduler=fresh_scheduler
    )
    assert checkpoint is not None and checkpoint.step == 3
    replay = draws()
    assert replay[:2] == after_save[:2] and torch.equal(replay[2], after_save[2])
    for name, value in fresh_model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    for index, state in saved_optimizer["state"].items():
        for key, value in state.items():
            assert torch.equal(fresh_optimizer.state_dict()["state"][index][key], value)
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    assert checkpoint.extra["cursor"] == 17 and checkpoint.extra["order"] == [3, 1, 2]
    assert torch.equal(checkpoint.extra["router"]["bias"], torch.arange(4.0))
    queue = checkpoint.samples["rollout_queue"]
    assert [s.to_dict() for s in queue] == [paused("p0-1").to_dict(), paused("p4-0").to_dict()]


def test_rng_helpers_replay_the_same_draws() -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = capture_rng_state()
    first = draws()
    draws()
    restore_rng_state(state)
    second = draws()
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])


def test_keeps_the_last_k_and_points_latest_at_the_newest(tmp_path: Path) -> None:
    model, _, _ = make_state(0)
    manager = CheckpointManager(tmp_path, keep=2)
    for step in range(1, 6):
        manager.save(step, model=model, extra={"step": step})
    assert manager.steps() == [4, 5]
    assert (tmp_path / "latest").read_text().strip() == "step-5"
    assert manager.load(model=model).extra == {"step": 5}


def test_keep_zero_writes_nothing_and_a_load_starts_from_scratch(tmp_path: Path) -> None:
    model, _, _ = make_state(0)
    manager = CheckpointManager(tmp_path, keep=0)
    assert manager.save(3, model=model, extra={"step": 3}) is None
    assert manager.steps() == [] and manager.latest_step() is None
    assert manager.load(model=model) is None
    with pytest.raises(ValueError, match="keep must be >= 0"):
        CheckpointManager(tmp_path, keep=-1)


def test_damaged_checkpoint_falls_back_to_the_previous_one_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, _, _ = make_state(0)
    manager = CheckpointManager(tmp_path, keep=3)
    weights = {}
    for step in (2, 4, 6):
        model[0].weight.data.fill_(float(step))
        manager.save(step, model=model, extra={"step": step})
        weights[step] = model[0].weight.detach().clone()
    blob = tmp_path / "step-6" / "model.safetensors"
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="posttrain.checkpoint"):
        checkpoint = CheckpointManager(tmp_path).load(model=model)
    assert checkpoint is not None and checkpoint.step == 4
    assert torch.equal(model[0].weight, weights[4])
    assert "step-6 is damaged (model.safetensors does not match its sha256); resuming from" in caplog.text


def test_half_written_and_missing_checkpoints_are_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, _, _ = make_state(0)
    manager = CheckpointManager(tmp_path)
    manager.save(1, model=model, extra={"step": 1})
    manager.save(2, model=model, extra={"step": 2})
    (tmp_path / "step-2" / "extra.pt").unlink()  # a file lost after the rename
    half = tmp_path / ".tmp-step-3-999-abcd"  # a kill during the write: never renamed
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"\x00" * 10)
    (tmp_path / "step-9").mkdir()  # a dir without a manifest
    with caplog.at_level(logging.WARNING, logger="posttrain.checkpoint"):
        manager = CheckpointManager(tmp_path)
        checkpoint = manager.load(model=model)
    assert not half.exists()
    assert checkpoint is not None and checkpoint.extra == {"step": 1}
    assert "step-2 is damaged (extra.pt is missing)" in caplog.text

    manager.save(2, model=model, extra={"step": 2})  # the run goes on from step 1
    assert manager.steps() == [1, 2], "the damaged step-2 is replaced and the abandoned step-9 removed"
    assert manager.load(model=model).extra == {"step": 2}


def test_no_intact_checkpoint_means_start_from_scratch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "step-4").mkdir()
    (tmp_path / "latest").write_text("step-4\n")
    rewound = []
    with caplog.at_level(logging.WARNING, logger="posttrain.checkpoint"):
        assert CheckpointManager(tmp_path, on_restore=rewound.append).load() is None
    assert rewound == [0]
    assert "no intact checkpoint" in caplog.text


def test_extra_state_that_cannot_be_loaded_safely_is_refused_at_save(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    with pytest.raises(TypeError, match=r"extra\['data'\]\['rows'\]: ndarray cannot be stored"):
        manager.save(1, extra={"data": {"rows": np.zeros(3)}})
    assert manager.steps() == [] and not list(tmp_path.glob(".tmp-*"))


def test_checkpoint_manifest_lists_every_file_with_its_hash(tmp_path: Path) -> None:
    model, optimizer, scheduler = make_state(0)
    path = CheckpointManager(tmp_path).save(
        7,
        model={"student": model},
        optimizer=optimizer,
        scheduler=scheduler,
        write_files=lambda d: (d / "engine.json").write_text('{"policy_version": 3}'),
    )
    manifest = json.loads((path / "checkpoint.json").read_text())
    assert manifest["step"] == 7
    assert sorted(manifest["files"]) == [
        "engine.json",
        "model-student.safetensors",
        "optimizer.pt",
        "rng.pt",
        "scheduler.pt",
    ]
    assert all(len(h) == 64 for h in manifest["files"].values())


def test_load_cuts_metrics_back_to_what_was_logged_at_the_checkpoint(tmp_path: Path) -> None:
    model, _, _ = make_state(0)
    metrics = MetricsLogger(tmp_path, tensorboard=False)
    manager = CheckpointManager(tmp_path / "ckpt", metrics=metrics)
    metrics.log(0, {"eval_loss_before": 2.0})
    for step in range(1, 6):
        metrics.log(step, {"response_length/low": step * 10.0}, loss=1.0 / step)
        if step == 3:
            manager.save(step, model=model)
    metrics.log(5, eval_loss_after=0.5)
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 6, "lo')  # the process was killed mid-line
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5, 5]

    resumed = MetricsLogger(tmp_path, tensorboard=False)
    assert CheckpointManager(tmp_path / "ckpt", metrics=resumed).load(model=model).step == 3
    resumed.log(4, loss=0.25)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert records[0] == {**records[0], "eval_loss_before": 2.0}
    assert records[3]["response_length/low"] == 30.0 and records[4]["loss"] == 0.25

    (tmp_path / "ckpt" / "latest").unlink()
    for path in (tmp_path / "ckpt").glob("step-*/checkpoint.json"):
        path.unlink()
    CheckpointManager(tmp_path / "ckpt", metrics=resumed).load(model=model)
    assert read_metrics(tmp_path / "metrics.jsonl") == [], "a stage that starts over starts its metrics over"


def test_a_write_that_fills_the_disk_keeps_the_old_file_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch
) -> None:
    """A manifest written on a full disk left a `.manifest.json.<pid>.<id>.tmp` per attempt and an
    error naming no file; now the old content stays, alone, and the error names the file."""
    path = tmp_path / "manifest.json"
    atomic_write_text(path, "old")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as error:
        atomic_write_text(path, "new")
    assert error.value.errno == errno.ENOSPC and error.value.filename == str(path)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_new_dir_removes_what_a_killed_writer_left_and_keeps_a_running_writers(tmp_path: Path) -> None:
    """A SIGKILLed export left its `.NAME.tmp-HOST-PID` dir (7-14 GB for a 3.5B model) forever;
    the next writer of NAME now removes it, and leaves a writer that is still running alone."""
    out = tmp_path / "model"
    writer = (
        "import sys, time\nfrom pathlib import Path\nfrom posttrain.files import new_dir\n"
        "with new_dir(Path(sys.argv[1])) as tmp:\n"
        "    (tmp / 'half.safetensors').write_bytes(b'x' * 1000)\n"
        "    print('writing', flush=True)\n"
        "    time.sleep(600)\n"
    )
    killed, running = (
        subprocess.Popen([sys.executable, "-c", writer, str(out)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    )
    try:
        for process in (killed, running):
            assert process.stdout.readline() == "writing\n"
        killed.kill()
        killed.wait()
        prefix = f".model.tmp-{socket.gethostname()}-"
        assert {p.name for p in tmp_path.iterdir()} == {f"{prefix}{killed.pid}", f"{prefix}{running.pid}"}
        with new_dir(out) as tmp:
            (tmp / "model.safetensors").write_bytes(b"y")
        assert {p.name for p in tmp_path.iterdir()} == {"model", f"{prefix}{running.pid}"}
        assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    finally:
        running.kill()
        running.wait()
