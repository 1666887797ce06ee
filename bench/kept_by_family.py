"""Where does MOPD's student lose a specialist's accuracy? The kept share split by task family.

`orchestration/outcomes.py` reads, per (domain, effort) pair, the share of the specialist's held-out
accuracy the distilled student keeps. Both are measured on the same episodes: the RL stage's
eval.json keeps its episodes before (the SFT model) and after (the specialist), and MOPD's
eval_episodes.json keeps the student's, before and after distillation, under the same uids; each
uid names its prompt's task family. For every pair of a run this prints, per family and in all,
the prompts solved by the SFT model, the specialist and the distilled student, and the share of the
specialist's the student keeps, so a shortfall can be traced to the families it comes from. Given
several runs (seeds), the counts are summed over them.

    PYTHONPATH=. python bench/kept_by_family.py runs/mopd --pairs general-max agent-max
"""

from __future__ import annotations

import argparse
from pathlib import Path

from orchestration.outcomes import DamagedEvalError, read_eval, student_accuracy_rows
from posttrain.envs.env_eval import family_sums
from posttrain.stages import EPISODES_FILE


def pair_counts(run: Path, pair: str, student: dict[str, list]) -> dict[str, dict[str, float]]:
    """Per role (prompts, sft, specialist, student), solved per family of one run's pair; `student`:
    its accuracy episodes after training (orchestration.outcomes.student_accuracy_rows)."""
    teacher_eval = run / f"rl-{pair}" / "eval.json"
    report = read_eval(teacher_eval)  # None too where the stage's manifest does not say done
    if report is None:
        raise SystemExit(f"{teacher_eval} is missing: pair {pair}'s specialist did not finish in {run}")
    teacher = report["episodes"]
    rows = {"sft": teacher["before"], "specialist": teacher["after"], "student": student}
    if not rows["student"]["uid"] == rows["specialist"]["uid"] == rows["sft"]["uid"]:
        raise SystemExit(
            f"{run}/mopd/{EPISODES_FILE} pair {pair}: the student's accuracy episodes are not the "
            f"specialist's ({teacher_eval}); both must come from one run of the default recipe"
        )
    uids = rows["sft"]["uid"]
    return {"prompts": family_sums({"uid": uids, "reward": [1.0] * len(uids)})} | {
        who: family_sums(r) for who, r in rows.items()
    }


def pair_lines(pair: str, counts: dict[str, dict[str, float]]) -> list[str]:
    roles = ("prompts", "sft", "specialist", "student")
    header = f"{'family':22s} {'prompts':>7s} {'sft':>5s} {'specialist':>10s} {'student':>7s} {'kept':>6s}"
    lines = [f"{pair}: {header}"]
    for family in sorted(counts["prompts"], key=lambda f: (f == "all", f)):
        c = {who: counts[who].get(family, 0.0) for who in roles}
        kept = f"{c['student'] / c['specialist']:.3f}" if c["specialist"] else "-"
        lines.append(
            f"{'':{len(pair) + 1}s} {family:22s} {c['prompts']:7.0f} {c['sft']:5.0f} "
            f"{c['specialist']:10.0f} {c['student']:7.0f} {kept:>6s}"
        )
    return lines


def family_totals(runs: list[Path], pairs: list[str] | None) -> dict[str, dict[str, dict[str, float]]]:
    """Per pair and role, solved per family summed over `runs`; `pairs` None: every pair of the runs."""
    totals: dict[str, dict[str, dict[str, float]]] = {}
    for run in runs:
        episodes_file = run / "mopd" / EPISODES_FILE
        episodes = student_accuracy_rows(episodes_file)
        if not episodes:
            raise SystemExit(
                f"{episodes_file} holds no episodes of a finished MOPD stage: the stage has not "
                "finished, or ran before it kept its episodes (rerun it with `posttrain run ... "
                "--only mopd --restart mopd`)"
            )
        for pair in pairs or sorted(episodes):
            if pair not in episodes:
                raise SystemExit(f"{episodes_file} has no pair {pair!r}; it has {sorted(episodes)}")
            for who, by_family in pair_counts(run, pair, episodes[pair]).items():
                into = totals.setdefault(pair, {}).setdefault(who, {})
                for family, n in by_family.items():
                    into[family] = into.get(family, 0.0) + n
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "runs", type=Path, nargs="+", help="finished runs of the default recipe (their rl-* and mopd dirs)"
    )
    parser.add_argument("--pairs", nargs="+", help="<domain>-<effort> pairs (default: all nine)")
    args = parser.parse_args()
    try:
        totals = family_totals(args.runs, args.pairs)
    except DamagedEvalError as error:  # a user's file to repair, not a bug: no traceback
        parser.error(str(error))
    if len(args.runs) > 1:
        print(f"summed over {len(args.runs)} runs: {' '.join(map(str, args.runs))}")
    for pair, counts in totals.items():
        print("\n".join(pair_lines(pair, counts)))


if __name__ == "__main__":
    main()
