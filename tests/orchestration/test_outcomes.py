"""The recipe's claims read from a run dir's eval.json files, and their seed summary: each claim's
rule on hand-made evaluations that hold and that fail, the seed mean's error, and how many three-seed
subsets of more seeds hold."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from orchestration.outcomes import (
    claim,
    claims_table,
    run_claims,
    seed_summary,
    subset_pass_rates,
    subsets_all_holding,
)
from posttrain.stats import mean_standard_error


def _rl(
    run: Path, domain: str, effort: str, change: float, se: float, tokens: float, subsets: dict | None = None
) -> None:
    stage = run / f"rl-{domain}-{effort}"
    stage.mkdir(parents=True)
    report = {"accuracy_change": change, "accuracy_change_se": se, "mean_response_tokens": tokens}
    if subsets:
        report["subsets"] = subsets
    # the specialist's held-out episodes, one a prompt: on the first 4 prompts it solves 2 of 4
    rewards = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    uids = [f"eval/{domain}/f-{i}/{effort}/0" for i in range(len(rewards))]
    report["episodes"] = {"after": {"uid": uids, "reward": rewards}}
    (stage / "eval.json").write_text(json.dumps(report))


def _mopd(run: Path, rows: dict) -> None:
    (run / "mopd").mkdir(parents=True)
    (run / "mopd" / "eval.json").write_text(json.dumps(rows))


def test_claims_of_one_run_hold_and_fail_by_their_rules(tmp_path):
    visual = {"visual": {"accuracy_change": 0.06, "accuracy_change_se": 0.02}}  # z 3
    weak = {"visual": {"accuracy_change": 0.03, "accuracy_change_se": 0.02}}  # z 1.5
    _rl(tmp_path, "general", "low", -0.04, 0.03, 20.0, visual)
    _rl(tmp_path, "general", "high", 0.0, 0.03, 40.0)
    _rl(tmp_path, "general", "max", 0.10, 0.04, 60.0, weak)  # z 2.5
    _rl(tmp_path, "agent", "low", -0.08, 0.03, 70.0)  # loses 8 points
    _rl(tmp_path, "agent", "high", 0.0, 0.03, 60.0)  # shorter than low: order broken
    _rl(tmp_path, "agent", "max", 0.05, 0.04, 90.0)  # z 1.25
    _rl(tmp_path, "coding", "low", 0.0, 0.03, 20.0)  # high and max missing: only the low claim
    row = {
        "kl_before": 0.05, "kl_after": 0.04, "kl_change_se": 0.02,
        "kl_exact_before": 0.05, "kl_exact_after": 0.03, "kl_exact_change_se": 0.005,
        "accuracy_after": 0.45, "accuracy_se_after": 0.05, "accuracy_episodes": 4.0,
    }  # fmt: skip
    small = {**row, "kl_exact_after": 0.048, "accuracy_after": 0.40}
    _mopd(tmp_path, {"general-low": row, "agent-high": small})
    claims = run_claims(tmp_path)
    assert claims["max_beats_sft/general"]["holds"] and not claims["max_beats_sft/agent"]["holds"]
    assert claims["low_within_5/general"]["holds"] and not claims["low_within_5/agent"]["holds"]
    assert claims["length_order/general"]["holds"] and not claims["length_order/agent"]["holds"]
    assert claims["length_order/general"]["tokens"] == [20.0, 40.0, 60.0]
    # coding's low stage alone gives its own claim; the max and length claims need what is missing
    assert [name for name in claims if name.endswith("/coding")] == ["low_within_5/coding"]
    # an eval subset's change is judged per specialist, at z >= 2
    assert (
        claims["visual_beats_sft/general-low"]["holds"]
        and not claims["visual_beats_sft/general-max"]["holds"]
    )
    assert "visual_beats_sft/general-high" not in claims
    # the exact KL is the one judged: -0.02 over a paired error of 0.005; -0.002 is within it
    assert claims["mopd_kl_down/general-low"]["value"] == pytest.approx(-0.02)
    assert claims["mopd_kl_down/general-low"]["holds"] and not claims["mopd_kl_down/agent-high"]["holds"]
    assert claims["mopd_kl_down/general-low"]["estimate"] == "kl_exact"
    kept = claims["mopd_keeps_90/general-low"]
    assert kept["teacher_accuracy"] == 0.5 and kept["value"] == pytest.approx(0.9) and kept["holds"]
    # no eval_episodes.json: the two accuracies' errors taken as independent
    assert kept["se"] == pytest.approx(0.9 * math.hypot(0.05 / 0.45, mean_standard_error([1, 0, 1, 0]) / 0.5))
    assert not kept["se_paired"]
    assert not claims["mopd_keeps_90/agent-high"]["holds"]  # 0.8 of the teacher
    table = claims_table(claims)
    assert len(table) == 2 + len(claims) and "| max_beats_sft/agent | 0.05 | 0.04 | z>=2 | no |" in table


def test_kept_share_compares_with_the_teachers_first_episode_of_each_prompt(tmp_path):
    """An RL evaluation of two episodes a prompt (eval.samples_per_prompt: 2) lists them prompt by
    prompt; MOPD plays each prompt once with the first one's uid, so the teacher's accuracy on
    MOPD's prompts is over those first episodes, not over its first rows."""
    stage = tmp_path / "rl-general-max"
    stage.mkdir(parents=True)
    uids = [f"eval/general/f-{i}/max/{k}" for i in range(4) for k in range(2)]
    rewards = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]  # first episodes 1, 1, 1, 0; second all 0
    report = {"accuracy_change": 0.1, "accuracy_change_se": 0.05, "mean_response_tokens": 60.0}
    (stage / "eval.json").write_text(
        json.dumps({**report, "episodes": {"after": {"uid": uids, "reward": rewards}}})
    )
    row = {"accuracy_after": 0.75, "accuracy_se_after": 0.05, "accuracy_episodes": 4.0}
    _mopd(tmp_path, {"general-max": row})
    kept = run_claims(tmp_path)["mopd_keeps_90/general-max"]
    assert kept["teacher_accuracy"] == 0.75 and kept["value"] == pytest.approx(1.0)


def test_kept_share_error_is_paired_by_prompt_where_the_student_episodes_were_kept(tmp_path):
    """With the MOPD stage's eval_episodes.json the student's episodes pair with the teacher's by
    uid: the error is that of the paired ratio, not of two independent accuracies."""
    _rl(tmp_path, "general", "max", 0.1, 0.04, 60.0)  # teacher's first 4 prompts: 1, 0, 1, 0
    row = {"accuracy_after": 0.5, "accuracy_se_after": 0.29, "accuracy_episodes": 4.0}
    _mopd(tmp_path, {"general-max": row})
    uids = [f"eval/general/f-{i}/max/0" for i in range(4)]
    student = {"uid": uids, "reward": [1.0, 1.0, 0.0, 0.0], "tokens": [5.0] * 4}
    episodes = {"general-max": {"after": {"accuracy": student}, "before": {"accuracy": student}}}
    (tmp_path / "mopd" / "eval_episodes.json").write_text(json.dumps(episodes))
    kept = run_claims(tmp_path)["mopd_keeps_90/general-max"]
    assert kept["value"] == pytest.approx(1.0) and kept["se_paired"]
    # residuals s - 1.0 t: 0, 1, -1, 0 (sample sd sqrt(2/3)), over root 4 and the teacher's 0.5
    assert kept["se"] == pytest.approx(math.sqrt(2 / 3) / 2 / 0.5)
    student["reward"] = [1.0, 0.0, 1.0, 0.0]  # the teacher's own episodes: nothing left to differ
    (tmp_path / "mopd" / "eval_episodes.json").write_text(json.dumps(episodes))
    kept = run_claims(tmp_path)["mopd_keeps_90/general-max"]
    assert kept["value"] == pytest.approx(1.0) and kept["se"] == 0.0
    # episodes of other prompts (another run's) do not pair: the independent error again
    student["uid"] = [uid.replace("f-", "g-") for uid in uids]
    (tmp_path / "mopd" / "eval_episodes.json").write_text(json.dumps(episodes))
    kept = run_claims(tmp_path)["mopd_keeps_90/general-max"]
    assert not kept["se_paired"] and kept["se"] > 0.5


def test_seed_summary_uses_the_larger_of_the_seed_spread_and_the_pooled_eval_error():
    runs = [{"c": claim(v, 0.02, "z>=2")} for v in (0.10, 0.06, 0.14)]
    row = seed_summary(runs)["c"]
    assert row["mean"] == pytest.approx(0.10)
    assert row["se_seeds"] == pytest.approx(0.04 / math.sqrt(3))  # sd 0.04 over 3 seeds
    assert row["se_eval"] == pytest.approx(math.sqrt(3 * 0.02**2) / 3)
    assert row["se"] == pytest.approx(row["se_seeds"]) and row["holds_mean"]  # 0.10 >= 2 x 0.023
    assert row["seeds_holding"] == 3 and row["seeds"] == 3
    noisy = seed_summary([{"c": claim(v, 0.02, "z>=2")} for v in (0.30, -0.10, 0.10)])["c"]
    assert not noisy["holds_mean"] and noisy["seeds_holding"] == 2
    # the length order must hold in every seed, not on average
    order = [{"o": claim(1.0, 0.0, "order")}, {"o": claim(0.0, 0.0, "order")}]
    assert not seed_summary(order)["o"]["holds_mean"]
    with pytest.raises(ValueError, match="unknown claim rule"):
        claim(1.0, 0.0, "z>=3")


def test_subset_pass_rates_count_the_three_seed_subsets_whose_mean_holds():
    # four seeds, one of which gains nothing: only the subset without it holds at z >= 2
    runs = [{"c": claim(v, 0.02, "z>=2")} for v in (0.20, 0.20, 0.20, -0.10)]
    runs[0]["d"] = runs[1]["d"] = claim(0.5, 0.01, "z>=2")  # in two runs only: no three-seed subset
    rates = subset_pass_rates(runs, 3)
    assert rates == {"c": (1, 4)}
    # a subset is decided as seed_summary decides the benchmark's own seeds
    for subset in itertools.combinations(runs, 3):
        values = [run["c"]["value"] for run in subset]
        assert seed_summary(list(subset))["c"]["holds_mean"] == (-0.10 not in values)


def test_subsets_all_holding_counts_subsets_where_every_claim_holds_at_once():
    # two claims, each missing in a different seed: each holds in 1 of the 4 three-seed subsets on
    # its own (the one without its bad seed), but no subset leaves out both bad seeds
    runs = [{"c": claim(0.2, 0.02, "z>=2"), "d": claim(0.2, 0.02, "z>=2")} for _ in range(4)]
    runs[0]["c"] = claim(-0.1, 0.02, "z>=2")
    runs[1]["d"] = claim(-0.1, 0.02, "z>=2")
    assert subset_pass_rates(runs, 3) == {"c": (1, 4), "d": (1, 4)}
    assert subsets_all_holding(runs, 3) == (0, 4)
    # with the second claim's bad seed fixed, the subset without seed 0 holds both
    runs[1]["d"] = claim(0.2, 0.02, "z>=2")
    assert subsets_all_holding(runs, 3) == (1, 4)
