"""How a stage's idle OpenMP threads wait is the user's choice: the local executor's stage
processes see OMP_WAIT_POLICY exactly as the driver had it (set or unset), the driver warns on a
busy machine when none is set, and how idle threads wait changes no number: a 2-thread training
step of the tiny K3 gives the same bits either way."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from orchestration import executors

REPO = Path(__file__).resolve().parents[2]
STEP = """
import hashlib, torch
from posttrain.engines.testing import tiny_k3
torch.set_num_threads(2)
torch.manual_seed(0)
model = tiny_k3(0)
ids = torch.randint(0, model.config.vocab_size, (2, 64))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(2):
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
digest = hashlib.sha256()
for name, tensor in model.state_dict().items():
    digest.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
print(digest.hexdigest())
"""


def _policy(path: str) -> None:
    Path(path).write_text(os.environ.get("OMP_WAIT_POLICY", ""))


def test_stage_processes_see_the_users_wait_policy(tmp_path):
    expected = os.environ.get("OMP_WAIT_POLICY", "")
    process = executors._fork_server().Process(target=_policy, args=(str(tmp_path / "policy"),))
    process.start()
    process.join(timeout=120)
    assert process.exitcode == 0
    assert (tmp_path / "policy").read_text() == expected


def test_busy_machine_warning_names_the_switch_only_when_needed(monkeypatch):
    monkeypatch.setattr(executors.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(executors, "busy_cpus", lambda: 1.6)
    warning = executors.busy_machine_warning(None)
    assert warning is not None and "1.6 of this machine's 2 CPU(s)" in warning
    assert "OMP_WAIT_POLICY=PASSIVE" in warning
    monkeypatch.setattr(executors, "busy_cpus", lambda: 0.3)
    assert executors.busy_machine_warning(None) is None  # idle: spinning is the fast choice

    def not_sampled() -> float:
        raise AssertionError("the machine was sampled although the user chose a policy")

    monkeypatch.setattr(executors, "busy_cpus", not_sampled)
    assert executors.busy_machine_warning("PASSIVE") is None  # the user chose: no 0.25 s sample


def test_busy_cpus_reads_the_non_idle_share_of_cpu_time(tmp_path, monkeypatch):
    """/proc/stat's first line: user nice system idle iowait ...; 300 of 400 ticks idle or
    iowait in the interval on 2 CPUs is half a CPU's worth of work."""
    stat = tmp_path / "stat"
    lines = iter(["cpu 100 0 100 700 100 0 0\n", "cpu 150 0 150 950 150 0 0\n"])
    monkeypatch.setattr(executors.time, "sleep", lambda s: stat.write_text(next(lines)))
    monkeypatch.setattr(executors.os, "cpu_count", lambda: 2)
    stat.write_text(next(lines))
    assert executors.busy_cpus(stat=stat) == 0.5


def test_busy_cpus_sees_a_busy_process():
    """Against this machine's own /proc/stat: with one spinning process running, at least most of
    a CPU is busy (whatever else runs), and never more than the machine has."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        busy = executors.busy_cpus(0.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert 0.6 <= busy <= (os.cpu_count() or 1) + 1e-6, busy


def test_the_wait_policy_changes_no_bit_of_a_two_thread_step():
    digests = {}
    for policy in ("ACTIVE", "PASSIVE"):
        env = {**os.environ, "OMP_WAIT_POLICY": policy, "PYTHONPATH": str(REPO)}
        env.pop("OMP_NUM_THREADS", None)
        out = subprocess.run(
            [sys.executable, "-c", STEP], env=env, capture_output=True, text=True, timeout=600, check=True
        )
        digests[policy] = out.stdout.split()[-1]
    assert digests["ACTIVE"] == digests["PASSIVE"]
