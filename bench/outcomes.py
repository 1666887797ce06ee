"""The default recipe over several seeds: does each claim hold in the seed mean, and in how many seeds?

Runs `posttrain run stages/mopd.yaml seed=S` (SFT, the nine RL specialists, MOPD: every stage's
seed is S, so each seed has its own SFT model) into OUT/seed-S for each seed, as separate
processes (`--parallel` at once, each given `--cpus` threads and stages), then reads every run's
eval.json files (orchestration.outcomes) and prints, per claim: the seed mean, its standard error
(the larger of the seeds' spread and their pooled evaluation errors), how many seeds hold and
whether the mean holds; with more than three seeds also how many of their three-seed subsets hold
in the mean (how often a three-seed rerun would). The held-out prompts are the eval seed's, the
same in every run, so the spread measures what training's seed changes. A seed already finished
is read, not rerun (posttrain's resume: a killed benchmark continues where it stopped);
`--only STAGE` runs just that stage of each seed, whose needs must be done there already.

    python bench/outcomes.py --seeds 0 1 2 --out runs/outcomes             # one at a time
    python bench/outcomes.py --seeds 0 1 2 --parallel 3 --cpus 5 --out DIR  # a 16-core machine
    python bench/outcomes.py --seeds 0 1 2 3 4 5 --report-only --out DIR    # runs already there
    python bench/outcomes.py --seeds 0 1 2 --report-only --kept-samples 8 --out DIR

With `--kept-samples K` each mopd_keeps_90 claim is judged on a replay of its pair with K episodes a
held-out prompt (bench/kept_replay.py: the stages' own evaluation, the specialist and the student
sharing their sampling noise), where the stage's evaluation plays each prompt once and a general
pair's kept share has an error near 0.1 around a bound of 0.9. The replays of all seeds' pairs run in
`--cpus` processes of one thread each, storing into each run dir's cache under a lock.

Before reading them it checks each seed's run dir: one that holds no run, whose pipeline.json is
damaged (rerunning the seed writes it again), or whose last run was another stage file or other
overrides (pipeline.json: the file's name and the overrides; the stages it planned and the config
hash each started stage ran with, against what the stage file plans now: a run of
stages/vision/mopd.yaml is not one of stages/mopd.yaml), stops it (exit 2) rather than mixing or
dropping seeds; stages not done are named under the table (their claims are missing, not misses).
Writes, atomically (a failed write leaves the last report whole), OUT/outcomes.json ({"commit",
"machine", "stage_file", "overrides", "kept_samples",
"unfinished": {seed: {stage: status}}, "seed_commits": {seed: [commits]}, "seed_machines": {seed:
[machines]}, "runs": {seed: claims},
"summary": per claim, "subsets_of_3": per claim [held, subsets]}) and OUT/outcomes.md, both naming
the checkout's commit and the machines as a RESULTS.md entry does. Each seed's run records the
commit it was started at in OUT/commits.json and the machine it ran on (with the ATen kernel level
torch used, which `ATEN_CPU_CAPABILITY` can lower) in OUT/machines.json; the report names a seed
run (or resumed) at another commit than its own, the machines that ran the seeds, and the machine
that read them where it is another (`--report-only`: "seed_machines" and "machine" in
outcomes.json). Exits 1 after the report where a seed's run did not exit 0.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kept_replay import ReplayError, kept_share, one_thread  # noqa: E402

from orchestration.outcomes import (  # noqa: E402
    DamagedEvalError,
    claim,
    run_claims,
    seed_summary,
    subset_pass_rates,
    subsets_all_holding,
)
from orchestration.pipeline import Pipeline, load_pipeline  # noqa: E402
from orchestration.rundir import (  # noqa: E402
    DAMAGED_PIPELINE,
    PIPELINE,
    pipeline_damaged,
    planned_stages,
    read_json,
    read_manifest,
    read_pipeline,
)
from posttrain.config.errors import ConfigError  # noqa: E402
from posttrain.files import atomic_write_text  # noqa: E402

SUBSET_SIZE = 3  # the benchmark's default seed count: with more seeds, how often would three pass?
COMMITS_FILE = "commits.json"  # in OUT: per seed, the commits its runs were started at, in order
MACHINES_FILE = "machines.json"  # in OUT: per seed, the machines its runs were started on, in order


def run_seed(
    seed: int, out: Path, cpus: int, stage_file: Path, extra: list[str], only: list[str]
) -> tuple[int, float, int]:
    """One seed of the default run, logged to OUT/seed-S.log; returns (seed, seconds, exit code)."""
    run_dir = out / f"seed-{seed}"
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [sys.executable, "-m", "posttrain.cli", "run", str(stage_file), f"seed={seed}", *extra]
    command += ["--run-dir", str(run_dir), "--max-parallel", str(cpus), *(f"--only={s}" for s in only)]
    started = time.perf_counter()
    with open(out / f"seed-{seed}.log", "a") as log:
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    return seed, time.perf_counter() - started, code


def cpu_model() -> str:
    """The CPU's name, family/model and whether it has AVX-512 (Linux's /proc/cpuinfo): 2-core VMs of
    one kind ran a seed in 16 to 51 minutes by these alone (bench/RESULTS.md), with the same results
    wherever the float path (torch's AVX2 or AVX-512 kernels) was the same."""
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        return platform.processor() or "unknown CPU"
    fields: dict[str, str] = {}
    for line in info.read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    avx512 = "avx512f" in fields.get("flags", "").split()
    return (
        f"{fields.get('model name', 'unknown CPU')} (family {fields.get('cpu family', '?')} model "
        f"{fields.get('model', '?')}, {'AVX-512' if avx512 else 'no AVX-512'})"
    )


def replay_kept_shares(
    runs: dict[Path, dict[str, dict]], samples: int, lanes: int = 1
) -> dict[Path, dict[str, dict]]:
    """Each run's mopd_keeps_90 claims judged on a replay of its pair with `samples` episodes a
    held-out prompt (bench/kept_replay.py, cached in the run dir), the stage's one-episode value kept
    beside it. The replays run in `lanes` processes of one torch thread each: on the small model a
    second thread in one process gives 1.24x, a second process nearly 2x (bench/RESULTS.md)."""
    pairs = [
        (run, name) for run, claims in runs.items() for name in claims if name.startswith("mopd_keeps_90/")
    ]
    out = {run: dict(claims) for run, claims in runs.items()}
    spawn = multiprocessing.get_context("spawn")  # not fork: the parent's OpenMP state is not fork-safe
    with ProcessPoolExecutor(lanes, mp_context=spawn, initializer=one_thread) as pool:
        jobs = {
            pool.submit(kept_share, run, name.split("/", 1)[1], samples): (run, name) for run, name in pairs
        }
        for job in as_completed(jobs):
            run, name = jobs[job]
            row = job.result()
            print(
                f"{run.name}: {name}'s kept share on {samples} episodes a prompt: {row['kept']:.3f}",
                flush=True,
            )
            out[run][name] = {
                **claim(row["kept"], row["kept_se"], runs[run][name]["rule"]),
                "teacher_accuracy": row["specialist"],
                "samples": samples,
                "one_episode": runs[run][name]["value"],
            }
    return out


def markdown(
    summary: dict,
    runs: dict[int, dict],
    subsets: dict[str, tuple[int, int]],
    all_holding: tuple[int, int] | None = None,
) -> list[str]:
    seeds = sorted(runs)
    extra = f" {SUBSET_SIZE}-seed subsets holding |" if subsets else ""
    head = (
        "| claim | rule | "
        + " | ".join(f"seed {s}" for s in seeds)
        + " | mean ± se | seeds holding | mean holds |"
        + extra
    )
    lines = [head, "| --- | --- |" + " ---: |" * len(seeds) + " --- | ---: | --- |" + " ---: |" * bool(extra)]
    for name, row in summary.items():
        values = [f"{runs[s][name]['value']:.4g}" if name in runs[s] else "" for s in seeds]
        rate = " {}/{} |".format(*subsets[name]) if name in subsets else " |"  # blank: too few seeds
        lines.append(
            f"| {name} | {row['rule']} | " + " | ".join(values) + f" | {row['mean']:.4g} ± {row['se']:.2g} "
            f"| {row['seeds_holding']}/{row['seeds']} | {'yes' if row['holds_mean'] else 'no'} |"
            + (rate if extra else "")
        )
    held = sum(r["holds_mean"] for r in summary.values())
    verdict = f"{held} of {len(summary)} claims hold in the seed mean."
    short = [name for name, row in summary.items() if row["seeds"] < len(seeds)]
    if short:  # a seed whose stage failed or never ran: its claims are missing, not held
        verdict += f" {len(short)} of them come from fewer than the {len(seeds)} seeds run (a blank cell)."
    if subsets:
        verdict += (
            f" The last column: of the {SUBSET_SIZE}-seed subsets of the seeds with that claim, how many hold"
            f" in their mean (how often a {SUBSET_SIZE}-seed rerun on this machine would)."
        )
    if all_holding:
        verdict += " All claims hold together in {} of the {} {}-seed subsets.".format(
            *all_holding, SUBSET_SIZE
        )
    return [*lines, "", verdict]


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Arguments that would crash later or mix runs: an argparse error (exit 2) naming the argument
    and its fix, before anything runs or is written."""
    if args.parallel < 1 or args.cpus < 1:
        parser.error(f"--parallel {args.parallel} --cpus {args.cpus}: each must be at least 1")
    if args.kept_samples < 0:
        parser.error(f"--kept-samples {args.kept_samples}: pass K >= 1 episodes a prompt, or 0 for none")
    repeated = sorted({s for s in args.seeds if args.seeds.count(s) > 1})
    if repeated:  # two processes of one seed would write the same run dir at once
        parser.error(f"--seeds repeats {repeated}: name each seed once")
    # the runs' processes start in the repo (cwd=REPO), the report reads from here: one path for both
    args.out, args.stage_file = args.out.resolve(), args.stage_file.resolve()
    seeded = [o for o in args.overrides if o.partition("=")[0].strip() == "seed"]
    if seeded:  # posttrain takes the last of seed=S and it: every seed would run the same seed
        parser.error(f"override {seeded[0]}: --seeds sets each run's seed; pass the seeds there")
    if not args.stage_file.is_file():
        parser.error(
            f"--stage-file {args.stage_file} does not exist; pass a stage file (default stages/mopd.yaml)"
        )
    above = next((p for p in (args.out, *args.out.parents) if p.exists()), None)
    if above is not None and not above.is_dir():
        parser.error(f"--out {args.out}: {above} is a file; name a directory for the runs")
    for name, what in ((COMMITS_FILE, "commit"), (MACHINES_FILE, "machine")):
        started = args.out / name
        if started.exists() and read_json(started) is None:  # read as none, a run would write it afresh
            parser.error(
                f"{started} is damaged (not a JSON mapping): remove it, and the report no longer names "
                f"the {what} each seed was started at"
            )


def checkout() -> str:
    """This checkout's commit (short hash), "+changes" where its tracked files differ from it: the
    commit a RESULTS.md entry names for the numbers."""
    git = ["git", "-C", str(REPO)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode:
        return "unknown commit (not a git checkout)"
    changed = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return head.stdout.strip() + (" +changes" if changed.stdout.strip() else "")


def record_start(out: Path, name: str, seeds: list[int], value: str) -> dict[str, list[str]]:
    """Add `value` (this checkout's commit, or this machine) to each seed's list in OUT/`name` (once
    per change): a seed resumed at another commit or on another machine keeps the stages finished
    at the earlier one, so its claims may mix two commits' code or two float paths, which the report
    then says."""
    started = read_json(out / name) or {}
    for seed in map(str, seeds):
        if started.get(seed, [None])[-1] != value:
            started[seed] = [*started.get(seed, []), value]
    atomic_write_text(out / name, json.dumps(started, indent=1))
    return started


def read_started(out: Path, name: str, seeds: list[int]) -> dict[str, list[str]]:
    """OUT/`name` as `record_start` wrote it, for `seeds` only."""
    return {s: values for s, values in (read_json(out / name) or {}).items() if int(s) in seeds}


def machine_footer(seed_machines: dict[str, list[str]], seeds: list[int], here: str) -> str:
    """Which machines ran the seeds (a seed resumed elsewhere lists both), and this one where it only
    read them: a report read on one machine of runs made on another named the reader alone."""
    by_machines: dict[str, list[str]] = {}
    for seed in seeds:
        by_machines.setdefault(" then ".join(seed_machines.get(str(seed), [])), []).append(str(seed))
    parts = [
        f"seed{'s' * (len(s) > 1)} {', '.join(s)} " + (f"ran on {m}" if m else "machine not recorded")
        for m, s in by_machines.items()
    ]
    return "; ".join(parts) + ("" if list(by_machines) == [here] else f"; read on {here}")


def recipe_mismatch(run_dir: Path, plan: dict, asked: Pipeline) -> str:
    """How the run in `run_dir` (its pipeline.json, `plan`) differs from the recipe `asked`
    plans, or "": its stages (ids, kinds, needs) and the config hash each stage it started ran
    with (its manifest's: what decides the stage's result, orchestration.pipeline.config_hash)."""
    planned = planned_stages(asked)
    if plan["stages"] != planned:
        return f"its stages are {', '.join(plan['stages'])}, the stage file's {', '.join(planned)}"
    for sid, stage in asked.stages.items():
        ran = (read_manifest(run_dir / sid) or {}).get("config_hash")
        if ran is not None and ran != stage.config_hash:
            return f"its stage {sid} ran another configuration (config hash {ran}, here {stage.config_hash})"
    return ""


def unfinished_stages(
    parser: argparse.ArgumentParser,
    out: Path,
    seed: int,
    stage_file: Path,
    overrides: list[str],
    commit: str,
    started: list[str],
) -> dict[str, str]:
    """Seed's run dir checked before its claims are read: an argparse error (exit 2) where it holds
    no run or its last run was another stage file or other overrides (another recipe's numbers:
    `recipe_mismatch`; where the seed was started (`started`: its commits.json list) at another commit
    than this checkout's, it names that commit: the data and the hash's definition change between
    commits, so a run matches only the code that ran it);
    else its stages that are not done, with their status (their claims are missing, not held)."""
    run_dir = out / f"seed-{seed}"
    if pipeline_damaged(run_dir):  # a run is there, and rerunning the seed rewrites its record
        parser.error(
            f"{run_dir / PIPELINE} {DAMAGED_PIPELINE}: run the seed without --report-only, which writes "
            "it again (finished stages are not run again)"
        )
    plan = read_pipeline(run_dir)
    if plan is None:
        parser.error(
            f"{run_dir} holds no run (no pipeline.json; log {out}/seed-{seed}.log): run the seed "
            "without --report-only, or leave it out of --seeds"
        )
    asked = [stage_file.name, f"seed={seed}", *overrides]
    found = [Path(plan["file"]).name, *plan["overrides"]]
    # The name alone passes stages/vision/mopd.yaml's run as stages/mopd.yaml's: the stages it
    # planned and the configurations they ran must be the ones the stage file plans.
    try:
        mismatch = found == asked and recipe_mismatch(run_dir, plan, load_pipeline(stage_file, asked[1:]))
    except ConfigError as error:
        parser.error(f"--stage-file {stage_file}: {error}")
    if mismatch and started and commit not in started:
        mismatch += (
            f"; seed {seed} was started at {', '.join(started)} and this checkout is {commit}: read it "
            "with bench/outcomes.py --report-only in a checkout of that commit"
        )
    if found != asked or mismatch:
        parser.error(
            f"{run_dir}/pipeline.json: its run was {plan['file']} {' '.join(found[1:])}, not "
            f"{stage_file} {' '.join(asked[1:])}{': ' + mismatch if mismatch else ''}; pass that "
            "stage file and those overrides, or another --out for this recipe"
        )
    status = {
        stage: (read_manifest(run_dir / stage) or {}).get("status", "not started") for stage in plan["stages"]
    }
    return {stage: state for stage, state in status.items() if state != "done"}


def shown(stage_file: Path) -> str:
    """The stage file as the report names it: from the repo root (stages/vision/mopd.yaml, not
    mopd.yaml, which is also the default recipe's name), or whole when it lies elsewhere."""
    return str(stage_file.relative_to(REPO)) if stage_file.is_relative_to(REPO) else str(stage_file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "outcomes")
    parser.add_argument("--parallel", type=int, default=1, help="seeds running at once")
    parser.add_argument("--cpus", type=int, default=2, help="stages at once (one thread each) per seed")
    parser.add_argument("--stage-file", type=Path, default=REPO / "stages" / "mopd.yaml")
    parser.add_argument("--report-only", action="store_true", help="read the runs in OUT, run nothing")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="STAGE",
        help="run only this stage of each seed (repeatable)",
    )
    parser.add_argument(
        "--kept-samples",
        type=int,
        default=0,
        metavar="K",
        help="judge mopd_keeps_90 on a replay of each pair with K episodes a held-out prompt "
        "(bench/kept_replay.py, in --cpus one-thread processes); 0: on the stage's own one-episode "
        "evaluation",
    )
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides passed to every run")
    args = parser.parse_args()
    check_arguments(parser, args)
    args.out.mkdir(parents=True, exist_ok=True)
    machine = (
        f"{platform.node()} {os.cpu_count()} cores, {cpu_model()}, python {platform.python_version()}, "
        f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()} kernels)"
    )
    commit = checkout()
    print(f"machine: {machine}\ncommit: {commit}")
    failed = []
    if not args.report_only:
        record_start(args.out, COMMITS_FILE, args.seeds, commit)
        record_start(args.out, MACHINES_FILE, args.seeds, machine)
        with ThreadPoolExecutor(args.parallel) as pool:
            jobs = [
                pool.submit(run_seed, s, args.out, args.cpus, args.stage_file, args.overrides, args.only)
                for s in args.seeds
            ]
            for job in jobs:
                seed, seconds, code = job.result()
                failed += [seed] * bool(code)
                print(
                    f"seed {seed}: exit {code} after {seconds / 60:.1f} min (log {args.out}/seed-{seed}.log)"
                )
    seed_commits = read_started(args.out, COMMITS_FILE, args.seeds)
    unfinished = {
        s: stages
        for s in args.seeds
        if (
            stages := unfinished_stages(
                parser, args.out, s, args.stage_file, args.overrides, commit, seed_commits.get(str(s), [])
            )
        )
    }
    try:
        runs = {s: run_claims(args.out / f"seed-{s}") for s in args.seeds}
    except DamagedEvalError as error:  # its claims cannot be read, and leaving them out would hide it
        parser.error(str(error))
    if args.kept_samples:
        try:  # raised in a replay process, re-raised here by its future
            replayed = replay_kept_shares(
                {args.out / f"seed-{s}": c for s, c in runs.items()}, args.kept_samples, args.cpus
            )
        except (DamagedEvalError, ReplayError) as error:
            parser.error(str(error))
        runs = {s: replayed[args.out / f"seed-{s}"] for s in runs}
    found = [c for c in runs.values() if c]
    summary = seed_summary(found)
    subsets = subset_pass_rates(found, SUBSET_SIZE) if len(found) > SUBSET_SIZE else {}
    all_holding = subsets_all_holding(found, SUBSET_SIZE) if subsets else None
    lines = markdown(summary, runs, subsets, all_holding)
    if args.kept_samples:
        lines += [f"mopd_keeps_90 on {args.kept_samples} episodes a held-out prompt (bench/kept_replay.py)."]
    for seed, stages in unfinished.items():  # their claims are blank cells or missing rows, not misses
        listed = ", ".join(f"{stage} ({state})" for stage, state in stages.items())
        lines += [f"Seed {seed}'s stages not done, their claims left out: {listed}."]
    for seed, commits in seed_commits.items():
        if commits != [commit]:
            lines += [
                f"Seed {seed}'s runs were started at {', '.join(commits)}, this report's checkout is "
                f"{commit}: its stages may come from any of them (a resumed run keeps finished stages)."
            ]
    seed_machines = read_started(args.out, MACHINES_FILE, list(runs))
    lines += [
        f"Commit {commit}; {shown(args.stage_file)} {' '.join(args.overrides)}".rstrip()
        + f"; {machine_footer(seed_machines, sorted(runs), machine)}."
    ]
    print("\n".join(lines))
    report = {
        "commit": commit,
        "machine": machine,
        "stage_file": shown(args.stage_file),
        "overrides": args.overrides,
        "kept_samples": args.kept_samples,
        "unfinished": unfinished,
        "seed_commits": seed_commits,
        "seed_machines": seed_machines,
        "runs": runs,
        "summary": summary,
        f"subsets_of_{SUBSET_SIZE}": subsets,
    }
    if all_holding:
        report[f"subsets_of_{SUBSET_SIZE}_all_holding"] = all_holding
    # atomic: a full disk or a kill while writing leaves the last report whole, not a truncated one
    atomic_write_text(args.out / "outcomes.json", json.dumps(report, indent=1))
    atomic_write_text(args.out / "outcomes.md", "\n".join(lines) + "\n")
    if failed:
        raise SystemExit(f"seeds {failed} failed (exit code not 0): see {args.out}/seed-S.log")


if __name__ == "__main__":
    main()
