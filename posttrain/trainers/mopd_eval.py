"""What MOPD's evaluation measures, per (domain, effort) pair, and DIR/mopd/eval.json.

Before and after training the student plays the held-out prompts of every domain at every effort:
sampled episodes (temperature 1, the student's own distribution) for the reverse KL to each pair's
teacher, by the sampled estimate and, where the engines give full distributions, the exact one;
one episode a prompt (on more prompts), played as the RL stages' evaluation plays them, for
accuracy and length. The two evaluations play the same episode uids, so the change of each estimate
gets a paired standard error. Pure functions of scored
Samples; the stage (posttrain.trainers.mopd) plays the episodes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from posttrain.algos.mopd_reward import paired_change_standard_error, reverse_kl, token_mean_standard_error
from posttrain.data.sample import Sample
from posttrain.envs.env_eval import episode_rows, paired_changes, same_episodes, summary
from posttrain.files import atomic_write_text
from posttrain.stages import EPISODES_FILE, EVAL_FILE
from posttrain.trainers.mopd_teachers import pair_name

RESULT_KEYS = (
    "kl",
    "kl_se",
    "kl_exact",
    "kl_exact_se",
    "kl_tokens",
    "accuracy",
    "accuracy_se",
    "tokens",
    "tokens_se",
)


def pair_results(samples: list[Sample], with_kl: bool = True) -> dict[str, dict[str, float]]:
    """Per pair: accuracy, the mean verifier reward (0 when unscored); tokens, the mean
    student-generated tokens per episode (tool results excluded); each with its standard error
    (accuracy_se, tokens_se) over episodes; with_kl (teacher-scored samples):
    kl, the reverse KL to its teacher (token mean over the student's tokens of
    log p_student - log p_teacher), kl_tokens, how many tokens that mean is over, and (from two
    prompts a pair) kl_se, its standard error with the prompts (Sample.group) as units."""
    results = {}
    for name, group in by_pair(samples).items():
        results[name] = row_results(episode_rows(group))
        if with_kl:
            results[name]["kl"] = reverse_kl(
                torch.tensor([x for s in group for x in s.rollout_logprobs], dtype=torch.float64),
                torch.tensor([x for s in group for x in s.teacher_logprobs or []], dtype=torch.float64),
                torch.tensor([m for s in group for m in s.generated_mask], dtype=torch.bool),
            )
            results[name]["kl_tokens"] = float(sum(sum(s.generated_mask) for s in group))
            prompts = [episode_prompt(s) for s in group]
            if len(set(prompts)) > 1:
                sums = [log_ratio_sum(s) for s in group]
                results[name]["kl_se"] = standard_error(prompts, sums, [sum(s.generated_mask) for s in group])
    return results


def row_results(rows: Mapping[str, list]) -> dict[str, float]:
    """accuracy, accuracy_se, tokens, tokens_se of one pair's episode rows (episode_rows): the RL
    stages' summary (posttrain.envs.env_eval.summary, errors over prompts) under MOPD's names."""
    stats = summary(rows, "pair")
    return {
        "accuracy": stats["accuracy_pair"],
        "accuracy_se": stats["accuracy_se_pair"],
        "tokens": stats["mean_response_tokens_pair"],
        "tokens_se": stats["mean_response_tokens_se_pair"],
    }


def played_before(stage_dirs: Iterable[Path]) -> list[tuple[str, dict, dict[str, list]]]:
    """(stage dir name, eval_protocol, episode rows) of every "before" evaluation recorded in
    the eval.json of `stage_dirs` (an RL stage's: its init model, one episode per prompt,
    posttrain.trainers.rl); what MOPD's before evaluation may take instead of replaying."""
    found = []
    for directory in stage_dirs:
        path = directory / EVAL_FILE
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        protocol = report.get("before_protocol") if isinstance(report, dict) else None
        rows = (report.get("episodes") or {}).get("before") if protocol else None
        if rows and len(rows["uid"]) == len(protocol["prompts"]):
            found.append((directory.name, protocol, rows))
    return found


def taken_rows(
    protocol: Mapping[str, Any], played: list[tuple[str, dict, dict[str, list]]]
) -> tuple[str, dict[str, list]] | None:
    """(source, rows) for an evaluation of `protocol` whose episodes one of `played`
    (played_before) already played: its first rows (the same episodes, uids included: the
    protocol digests each episode's uid with its prompt); None if none did."""
    n = len(protocol["prompts"])
    for source, recorded, rows in played:
        if same_episodes(protocol, recorded):
            return source, {key: list(rows[key][:n]) for key in ("uid", "reward", "tokens")}
    return None


def log_ratio_sum(sample: Sample) -> float:
    """Sum of log p_student - log p_teacher over one scored episode's student tokens."""
    pairs = zip(sample.rollout_logprobs, sample.teacher_logprobs or [], sample.generated_mask, strict=True)
    return sum(student - teacher for student, teacher, on in pairs if on)


def prompt_totals(
    prompts: list[str], episode_sums: list[float], episode_tokens: list[int]
) -> tuple[list[float], list[float]]:
    """Per prompt, in first-seen order, its episodes' sums and student tokens added up. A KL's
    error takes the prompts as units: the sampled episodes of one prompt share its context, and
    one prompt's copies were seen to carry most of a pair's KL together (bench/RESULTS.md), so
    with the copies as units the error came out too small. The RL evaluation's accuracy errors
    are over prompts too (posttrain.envs.env_eval.prompt_means)."""
    totals: dict[str, list[float]] = {}
    for prompt, value, tokens in zip(prompts, episode_sums, episode_tokens, strict=True):
        total = totals.setdefault(prompt, [0.0, 0.0])
        total[0] += value
        total[1] += tokens
    return [t[0] for t in totals.values()], [t[1] for t in totals.values()]


def standard_error(prompts: list[str], episode_sums: list[float], episode_tokens: list[int]) -> float:
    """token_mean_standard_error over the prompts (prompt_totals) of per-episode sums; 0.0 when no
    episode has a student token. Needs two prompts."""
    if not any(episode_tokens):
        return 0.0
    sums, tokens = prompt_totals(prompts, episode_sums, episode_tokens)
    return token_mean_standard_error(
        torch.tensor(sums, dtype=torch.float64), torch.tensor(tokens, dtype=torch.float64)
    )


def episode_prompt(sample: Sample) -> str:
    """The prompt an episode was played from, the unit of the KL's errors: its group (an
    evaluation's copies of one prompt share it), or its own uid where it has none."""
    return sample.group or sample.uid


def table_prompts(rows: Mapping[str, list]) -> list[str]:
    """Each row's prompt in an episode table; a table written before the `prompt` column existed
    has the uids, each episode its own prompt."""
    return list(rows.get("prompt", rows["uid"]))


def exact_results(table: Mapping[str, Mapping[str, list]]) -> dict[str, dict[str, float]]:
    """Per pair of an episode_table with exact sums: kl_exact, their token mean, and (from two
    prompts a pair) kl_exact_se, its standard error over prompts."""
    results = {}
    for name, rows in table.items():
        prompts = table_prompts(rows)
        results[name] = {"kl_exact": sum(rows["kl_exact"]) / max(sum(rows["tokens"]), 1)}
        if len(set(prompts)) > 1:
            results[name]["kl_exact_se"] = standard_error(prompts, rows["kl_exact"], rows["tokens"])
    return results


def episode_table(
    samples: list[Sample], exact_sums: Mapping[str, float] | None
) -> dict[str, dict[str, list]]:
    """Per pair, its teacher-scored episodes in order: uid, prompt (Sample.group: the units of the
    errors), kl (the sum of log p_student - log p_teacher over its student tokens), kl_exact (the
    exact sum, where there is one) and tokens (how many student tokens). The before and after
    evaluations play the same uids, so write_eval pairs them row by row for the error of the
    change."""
    table: dict[str, dict[str, list]] = {}
    for sample in samples:
        rows = table.setdefault(
            pair_name((sample.domain, sample.effort)),
            {
                "uid": [],
                "prompt": [],
                "kl": [],
                "tokens": [],
                **({"kl_exact": []} if exact_sums is not None else {}),
            },
        )
        rows["uid"].append(sample.uid)
        rows["prompt"].append(episode_prompt(sample))
        rows["kl"].append(log_ratio_sum(sample))
        rows["tokens"].append(sum(sample.generated_mask))
        if exact_sums is not None:
            rows["kl_exact"].append(exact_sums[sample.uid])
    return table


def by_pair(samples: list[Sample]) -> dict[str, list[Sample]]:
    """The samples grouped by their "<domain>-<effort>" pair, in order."""
    groups: dict[str, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(pair_name((sample.domain, sample.effort)), []).append(sample)
    return groups


def accuracy_rows(samples: list[Sample]) -> dict[str, dict[str, list]]:
    """Per pair, its accuracy episodes' rows (posttrain.envs.env_eval.episode_rows), in order."""
    return {name: episode_rows(group) for name, group in by_pair(samples).items()}


def write_eval(
    path: Path,
    before: Mapping[str, Mapping[str, float]],
    after: Mapping[str, Mapping[str, float]],
    before_episodes: Mapping[str, Mapping[str, list]],
    after_episodes: Mapping[str, Mapping[str, list]],
) -> dict:
    """DIR/mopd/eval.json: {"<domain>-<effort>": {kl_before, kl_after, kl_tokens_before,
    kl_tokens_after, accuracy_before, accuracy_after, tokens_before, tokens_after}}, plus
    kl_exact_before / kl_exact_after where the engines gave full distributions, the standard
    errors accuracy_se_* / tokens_se_* and, where a pair's sampled episodes span two or more
    prompts, kl_se_* / kl_exact_se_* of each estimate; kl_change_se / kl_exact_change_se of the
    KL's change (the same episodes before and after, `paired_change_standard_error` over their
    prompts' totals), accuracy_change(_se) and
    tokens_change(_se) from the accuracy episodes (`accuracy` rows of the episode tables, paired),
    and accuracy_episodes, how many (one per held-out prompt, in the RL stages' order).

    Beside it, DIR/mopd/eval_episodes.json: {"<domain>-<effort>": {"before": rows, "after": rows}},
    each evaluation's episode table of the pair (the sampled episodes' uid, prompt, kl, kl_exact, tokens;
    under "accuracy" the accuracy episodes' uid, reward, tokens), as the RL stages' eval.json keeps
    its episodes: the uids name each prompt's task family, so a pair's accuracy or the share of its
    teacher's that the student keeps can be split by family (bench/kept_by_family.py)."""
    report = {
        name: {
            f"{key}_{when}": float(values[name][key])
            for key in RESULT_KEYS
            if key in before[name] and key in after[name]
            for when, values in (("before", before), ("after", after))
        }
        for name in before
    }
    for name, values in report.items():
        rows = before_episodes[name], after_episodes[name]
        if all("accuracy" in r for r in rows):
            changes = paired_changes(rows[0]["accuracy"], rows[1]["accuracy"])
            values.update({k.replace("mean_response_tokens", "tokens"): v for k, v in changes.items()})
            values["accuracy_episodes"] = float(len(rows[1]["accuracy"]["uid"]))
        # the same uids are the same episodes, so the after table's prompts (always this run's; a
        # before table resumed from an older checkpoint has none) are the before table's too
        prompts = table_prompts(rows[1])
        if (
            rows[0]["uid"] != rows[1]["uid"]
            or len(set(prompts)) < 2
            or not all(sum(r["tokens"]) for r in rows)
        ):
            continue  # an error needs two paired prompts with student tokens
        for kl in ("kl", "kl_exact"):
            if all(kl in r for r in rows):
                totals = [prompt_totals(prompts, r[kl], r["tokens"]) for r in rows]
                columns = [torch.tensor(column, dtype=torch.float64) for total in totals for column in total]
                values[f"{kl}_change_se"] = paired_change_standard_error(*columns)
    episodes = {name: {"before": before_episodes[name], "after": after_episodes[name]} for name in report}
    atomic_write_text(path.with_name(EPISODES_FILE), json.dumps(episodes, sort_keys=True) + "\n")
    atomic_write_text(path, json.dumps(report, indent=1, sort_keys=True) + "\n")
    return report


def final_metrics(report: Mapping[str, Mapping[str, float]], retries: int, steps: int) -> dict[str, float]:
    """Means over pairs, how many pairs moved closer to their teacher (by each KL estimate),
    retries and steps."""
    keys = [k for k in next(iter(report.values())) if "_se" not in k]  # errors do not average
    final = {k: sum(r[k] for r in report.values()) / len(report) for k in keys}
    for kl in ("kl", "kl_exact"):
        if all(f"{kl}_before" in r for r in report.values()):
            improved = sum(r[f"{kl}_after"] < r[f"{kl}_before"] for r in report.values())
            final[f"pairs_{kl}_improved"] = float(improved)
    return {**final, "teacher_retries": float(retries), "steps": float(steps)}
