"""How long the command line takes before it does anything: this checkout against an older one.

Times, in fresh processes, `posttrain --help`, `posttrain status RUN_DIR` and `posttrain run` of a
one-stage pipeline whose stage does nothing (a stage kind from a plug-in file written here), so
what is left is the CLI's imports, the stage-file validation, the stage process's start and the
report. The baseline is another checkout of this repository (`--baseline DIR`, e.g. a `git
worktree` of an older commit), run by the same interpreter with that checkout first on
PYTHONPATH. Prints each command's median wall seconds for both, and the ratio baseline / ours.

    python bench/cli_start.py --baseline /tmp/old-checkout [--repeats 5] [--out /tmp/cli_start]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from outcomes import cpu_model

REPO = Path(__file__).resolve().parents[1]
PLUGIN = '''"""A stage kind that does nothing: what is timed is everything around it."""
from pydantic import BaseModel, ConfigDict

from posttrain.stages import stage_kind


class Idle(BaseModel):
    model_config = ConfigDict(extra="forbid")


@stage_kind("idle", config=Idle)
def run_idle(ctx):
    (ctx.output_dir / "done.txt").write_text("idle")  # a stage publishes what it made
    return {"done": 1.0}
'''
STAGE = 'stage: idle\nkind: idle\nplugins: ["{plugin}"]\nresources: {{cpus: 1, gpus: 0}}\n'
CLI = "import sys; from posttrain.cli import main; sys.exit(main())"


def timed(tree: Path, args: list[str], cwd: Path) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CLI, *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        command = " ".join(args)
        raise SystemExit(f"{tree}: posttrain {command} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout of this repository")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("/tmp/cli_start"))
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    (args.out / "idle_kind.py").write_text(PLUGIN)
    stage = args.out / "idle.yaml"
    stage.write_text(STAGE.format(plugin=args.out / "idle_kind.py"))
    trees = {"ours": REPO, "baseline": args.baseline.resolve()}
    commands = {
        "--help": lambda run: ["--help"],
        "run (one idle stage)": lambda run: ["run", str(stage), "--run-dir", str(run)],
        "status": lambda run: ["status", str(run)],
    }
    seconds: dict[str, dict[str, list[float]]] = {name: {t: [] for t in trees} for name in commands}
    for repeat in range(args.repeats):
        for who, tree in trees.items():  # alternated, so drift on the machine hits both alike
            run = args.out / f"run-{who}-{repeat}"
            for name, argv in commands.items():
                seconds[name][who].append(timed(tree, argv(run), args.out))
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs, python {platform.python_version()}")
    print(f"ours: {REPO}   baseline: {trees['baseline']}   medians of {args.repeats}")
    print(f"{'command':24s} {'ours s':>8s} {'baseline s':>11s} {'baseline/ours':>14s}")
    for name, by_tree in seconds.items():
        ours, base = statistics.median(by_tree["ours"]), statistics.median(by_tree["baseline"])
        print(f"{name:24s} {ours:8.2f} {base:11.2f} {base / ours:13.2f}x")


if __name__ == "__main__":
    main()
