"""The default recipe's claims, read from a finished run's eval.json files, with their errors.

One run (one seed) gives, per claim, the estimate and its standard error from the evaluation's
episodes; several runs of the recipe with different seeds (bench/outcomes.py) give the seed mean,
the standard error of that mean and how many seeds hold. The claims (issue #21's recipe bar):

- max_beats_sft/<domain>: the max specialist's held-out accuracy minus the SFT model's at max
  effort, by at least 2 standard errors;
- low_within_5/<domain>: the low specialist loses at most 5 points of accuracy against the SFT
  model at low effort;
- length_order/<domain>: the specialists' mean response tokens low < high < max;
- <subset>_beats_sft/<domain>-<effort>: on a named eval subset of the RL stages (eval.subsets, e.g.
  the visual questions), the specialist's accuracy minus the SFT model's at its effort, by at least
  2 standard errors;
- mopd_kl_down/<domain>-<effort>: MOPD lowers the exact reverse KL (the sampled one where no exact
  one was measured) to that pair's teacher by at least 1 paired standard error;
- mopd_keeps_90/<domain>-<effort>: the student keeps at least 90% of its teacher's accuracy.

Each claim is a row {value, se, threshold, holds}; `value` and `se` are what is compared
(`holds` for one run; bench/outcomes.py re-decides on seed means, and with more seeds than three
counts the three-seed subsets that hold: how often a three-seed rerun would).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestration.rundir import read_manifest
from posttrain.stages import EPISODES_FILE
from posttrain.stats import mean_standard_error, paired_ratio

EFFORTS = ("low", "high", "max")


class DamagedEvalError(ValueError):
    """A stage's eval.json or eval_episodes.json that does not read as JSON (a disk that filled,
    a hand edit): the message names the file and the stage to rerun."""


def read_eval(path: Path) -> dict[str, Any] | None:
    """A stage's evaluation file (eval.json, eval_episodes.json), None where it has none or where
    its stage's manifest does not say done: a stage that failed after evaluating (its weights
    refused by the publishing guard, a kill while it published) vouches for no numbers."""
    manifest = read_manifest(path.parent)
    if not path.is_file() or (manifest is not None and manifest.get("status") != "done"):
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
        raise DamagedEvalError(
            f"{path} is damaged ({error}); evaluate the stage again: posttrain run FILE --restart "
            f"{path.parent.name}"
        ) from None


def claim(value: float, se: float, rule: str) -> dict[str, Any]:
    """A claim row. rule: "z>=2" (value >= 2 se, value > 0), "z<=-1" (value <= -se, value < 0),
    ">=-0.05" / ">=0.9" (a plain bound on value), "order" (value 1.0 when it holds)."""
    if rule == "z>=2":
        holds = value > 0 and value >= 2 * se
    elif rule == "z<=-1":
        holds = value < 0 and value <= -se
    elif rule.startswith(">="):
        holds = value >= float(rule[2:])
    elif rule == "order":
        holds = value == 1.0
    else:
        raise ValueError(f"unknown claim rule {rule!r}")
    return {"value": value, "se": se, "rule": rule, "holds": bool(holds)}


def rl_claims(run_dir: Path, domains: Sequence[str]) -> dict[str, dict[str, Any]]:
    """max_beats_sft, low_within_5, length_order and the eval subsets' claims per domain from
    DIR/rl-<domain>-<effort>/eval.json; each claim from the evaluations it reads, left out where one
    is not there (a failed coding-low leaves coding's max claim standing, not its length order)."""
    claims: dict[str, dict[str, Any]] = {}
    for domain in domains:
        evals = {e: read_eval(run_dir / f"rl-{domain}-{e}" / "eval.json") for e in EFFORTS}
        if (top := evals["max"]) is not None:
            claims[f"max_beats_sft/{domain}"] = claim(
                top["accuracy_change"], top["accuracy_change_se"], "z>=2"
            )
        if (low := evals["low"]) is not None:
            claims[f"low_within_5/{domain}"] = claim(
                low["accuracy_change"], low["accuracy_change_se"], ">=-0.05"
            )
        if all(v is not None for v in evals.values()):
            tokens = [evals[e]["mean_response_tokens"] for e in EFFORTS]
            ordered = float(tokens[0] < tokens[1] < tokens[2])
            claims[f"length_order/{domain}"] = {**claim(ordered, 0.0, "order"), "tokens": tokens}
        for effort, report in evals.items():
            for name, subset in (report or {}).get("subsets", {}).items():
                change, se = subset["accuracy_change"], subset["accuracy_change_se"]
                claims[f"{name}_beats_sft/{domain}-{effort}"] = claim(change, se, "z>=2")
    return claims


def mopd_claims(run_dir: Path, stage: str = "mopd") -> dict[str, dict[str, Any]]:
    """mopd_kl_down and mopd_keeps_90 per pair from DIR/<stage>/eval.json (empty without it). The
    teacher's accuracy is its RL stage's (DIR/rl-<pair>/eval.json) on the same first held-out
    prompts: the MOPD and RL evaluations draw them with the same eval seed, in the same order, and
    play them alike (the shipped files: sampled at 0.6 with the same uids and seed) under the same
    harness (stages/mopd.yaml's environments are stages/rl.yaml's). The kept share's error is paired
    by prompt (posttrain.envs.env_eval.paired_ratio) where the stage kept the student's episodes
    (DIR/<stage>/eval_episodes.json), else the two accuracies' errors taken as independent."""
    report = read_eval(run_dir / stage / "eval.json")
    student_rows = student_accuracy_rows(run_dir / stage / EPISODES_FILE)
    claims: dict[str, dict[str, Any]] = {}
    for pair, row in (report or {}).items():
        kl = "kl_exact" if "kl_exact_before" in row else "kl"
        if f"{kl}_change_se" in row:
            change = row[f"{kl}_after"] - row[f"{kl}_before"]
            claims[f"mopd_kl_down/{pair}"] = {
                **claim(change, row[f"{kl}_change_se"], "z<=-1"),
                "estimate": kl,
            }
        teacher = read_eval(run_dir / f"rl-{pair}" / "eval.json")
        if teacher is None or "accuracy_episodes" not in row:
            continue
        # MOPD plays each prompt once, with the RL evaluation's uids (eval/<prompt>/<effort>/0); an
        # RL evaluation of several episodes a prompt lists them prompt by prompt, so the teacher's
        # episodes on MOPD's prompts are its first copies, in order.
        after = teacher["episodes"]["after"]
        first = [(uid, r) for uid, r in zip(after["uid"], after["reward"], strict=True) if uid.endswith("/0")]
        first = first[: int(row["accuracy_episodes"])]
        rewards = [r for _, r in first]
        reference = sum(rewards) / len(rewards)
        if reference > 0:
            ratio = row["accuracy_after"] / reference
            rows = student_rows.get(pair, {"uid": [], "reward": []})
            student = dict(zip(rows["uid"], rows["reward"], strict=True))
            paired = all(uid in student for uid, _ in first)
            if paired:
                # Both played the same prompts with the same noise: the error paired by prompt.
                ratio, se = paired_ratio([student[uid] for uid, _ in first], rewards)
            else:  # a run without its episodes: the two accuracies taken as independent
                se = ratio * math.hypot(
                    row["accuracy_se_after"] / max(row["accuracy_after"], 1e-9),
                    mean_standard_error(rewards) / reference,
                )
            claims[f"mopd_keeps_90/{pair}"] = {
                **claim(ratio, se, ">=0.9"),
                "teacher_accuracy": reference,
                "se_paired": paired,
            }
    return claims


def student_accuracy_rows(path: Path) -> dict[str, dict[str, list]]:
    """Per pair, the student's accuracy episodes after training (their uid, reward and tokens
    lists) from a MOPD stage's eval_episodes.json (posttrain.trainers.mopd_eval.write_eval); empty
    where the file is not there or its stage is not done, DamagedEvalError where it is no JSON
    (read_eval). The one reader of that file: the claims, bench/kept_replay.py and
    bench/kept_by_family.py take these rows."""
    episodes = read_eval(path) or {}
    return {
        pair: rows["after"]["accuracy"]
        for pair, rows in episodes.items()
        if "accuracy" in rows.get("after", {})
    }


def run_claims(run_dir: Path, domains: Sequence[str] = ("general", "agent", "coding")) -> dict[str, dict]:
    """Every claim one finished (or partly finished) run of the default recipe supports."""
    return {**rl_claims(run_dir, domains), **mopd_claims(run_dir)}


def seed_summary(runs: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per claim over seeds: mean, se_seeds (the spread of the seeds' values / sqrt(n)), se_eval
    (the seeds' own errors pooled: sqrt(sum se^2) / n), the standard error used, the larger of the
    two, holds_mean (the claim's rule on mean and that error, length order: every seed) and
    seeds_holding (how many seeds hold on their own)."""
    summary: dict[str, dict[str, Any]] = {}
    for name in sorted({n for run in runs for n in run}):
        rows = [run[name] for run in runs if name in run]
        values = [r["value"] for r in rows]
        n = len(values)
        mean = sum(values) / n
        spread = mean_standard_error(values)
        pooled = math.sqrt(sum(r["se"] ** 2 for r in rows)) / n
        rule = rows[0]["rule"]
        se = max(spread, pooled)
        holds = all(r["holds"] for r in rows) if rule == "order" else claim(mean, se, rule)["holds"]
        summary[name] = {
            "mean": mean,
            "se": se,
            "se_seeds": spread,
            "se_eval": pooled,
            "rule": rule,
            "seeds": n,
            "seeds_holding": sum(r["holds"] for r in rows),
            "holds_mean": holds,
        }
    return summary


def subset_pass_rates(runs: Sequence[dict[str, dict[str, Any]]], size: int = 3) -> dict[str, tuple[int, int]]:
    """Per claim, over every `size`-seed subset of the runs that have it: (subsets whose seed mean
    holds by seed_summary, subsets). With more seeds than a benchmark runs, this is how often a rerun
    with `size` other seeds of the same machine would find the claim holding; a claim fewer than
    `size` runs have is left out."""
    rates: dict[str, tuple[int, int]] = {}
    for name in sorted({n for run in runs for n in run}):
        rows = [{name: run[name]} for run in runs if name in run]
        subsets = list(itertools.combinations(rows, size))
        if subsets:
            held = sum(seed_summary(subset)[name]["holds_mean"] for subset in subsets)
            rates[name] = (held, len(subsets))
    return rates


def subsets_all_holding(runs: Sequence[dict[str, dict[str, Any]]], size: int = 3) -> tuple[int, int]:
    """(subsets in which every claim holds in the seed mean, subsets) over every `size`-seed subset
    of the runs: how often a `size`-seed rerun of the benchmark on this machine would meet all its
    claims at once, which the per-claim rates of `subset_pass_rates` do not give (their misses can
    fall in different subsets)."""
    subsets = list(itertools.combinations(runs, size))
    held = sum(all(row["holds_mean"] for row in seed_summary(subset).values()) for subset in subsets)
    return held, len(subsets)


def claims_table(claims: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows of one run's claims: value, standard error, rule, holds."""
    lines = ["| claim | value | se | rule | holds |", "| --- | ---: | ---: | --- | --- |"]
    for name, row in claims.items():
        holds = "yes" if row["holds"] else "no"
        lines.append(f"| {name} | {row['value']:.4g} | {row['se']:.3g} | {row['rule']} | {holds} |")
    return lines
