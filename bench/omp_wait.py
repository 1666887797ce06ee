"""How a stage's idle OpenMP threads wait, measured on the default run's SFT stage.

`posttrain run` leaves OMP_WAIT_POLICY to the user (orchestration/executors.py): unset, libgomp's
threads spin briefly between torch's parallel regions, then sleep; PASSIVE makes them sleep at once.
Both give the same bits. This runs the shipped SFT stage (stages/sft.yaml, 2 torch threads) for
`--steps` steps in the foreground runner under each policy, alone and beside one busy process
(a Python loop: "other work on the machine"), and prints the training seconds (the stage log's
before- and after-training lines), the ratio PASSIVE / default, and the final eval loss (equal
under both policies, or the comparison is void).

    python bench/omp_wait.py [--steps 60] [--repeats 2] [--out /tmp/omp_wait]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
POLICIES = {"default (unset)": None, "PASSIVE": "PASSIVE"}


def prepare(out: Path, steps: int) -> None:
    """One normal run writes the stage request the foreground runner replays."""
    command = [
        sys.executable,
        "-m",
        "posttrain.cli",
        "run",
        str(REPO / "stages/sft.yaml"),
        "--run-dir",
        str(out),
    ]
    command += [f"train.steps={steps}", "eval.tool_prompts=0", "eval_every=0", "checkpoint_every=100000"]
    subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def train_seconds(out: Path, policy: str | None) -> tuple[float, str]:
    """Rerun the SFT stage from scratch under `policy`; (training seconds, final eval loss)."""
    request = out / "sft" / "stage.json"
    body = json.loads(request.read_text())
    body["restart"] = True
    request.write_text(json.dumps(body))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    command = [sys.executable, "-m", "orchestration.runner", str(out), "sft"]
    subprocess.run(
        command, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    lines = (out / "run.log").read_text().splitlines()
    before = [line for line in lines if "before training:" in line][-1]
    after = [line for line in lines if "after training:" in line][-1]
    stamp = [datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f") for line in (before, after)]
    return (stamp[1] - stamp[0]).total_seconds(), after.split("eval_loss_after=")[1].split(",")[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/omp_wait"))
    args = parser.parse_args()
    prepare(args.out, args.steps)
    print(f"SFT stage, {args.steps} steps x 512 tokens, 2 torch threads, {os.cpu_count()} CPUs")
    print("| beside | policy | seconds (each) | median | eval loss |")
    print("| --- | --- | --- | ---: | --- |")
    medians: dict[tuple[str, str], float] = {}
    for beside in ("nothing", "one busy process"):
        busy = None
        if beside != "nothing":
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:  # the policies alternate within each repeat, so a drift in the machine hits both
            runs: dict[str, list[float]] = {name: [] for name in POLICIES}
            losses: dict[str, set[str]] = {name: set() for name in POLICIES}
            for _ in range(args.repeats):
                for name, policy in POLICIES.items():
                    seconds, loss = train_seconds(args.out, policy)
                    runs[name].append(seconds)
                    losses[name].add(loss)
            for name in POLICIES:
                medians[beside, name] = statistics.median(runs[name])
                each = ", ".join(f"{s:.1f}" for s in runs[name])
                loss = ", ".join(sorted(losses[name]))
                print(f"| {beside} | {name} | {each} | {medians[beside, name]:.1f} | {loss} |")
        finally:
            if busy:
                busy.kill()
                busy.wait()
    for beside in ("nothing", "one busy process"):
        ratio = medians[beside, "PASSIVE"] / medians[beside, "default (unset)"]
        print(f"beside {beside}: PASSIVE / default = {ratio:.2f}x the training time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
