"""MOPD's evaluation before training takes the accuracy episodes an RL stage's own before-evaluation
already played with the same student (posttrain.envs.env_eval.eval_protocol), and what it takes
is what replaying them gives: the stage's eval.json is the same byte for byte either way, greedy
and sampled (the embedded engine draws an episode's noise from its seed, uid and positions)."""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path

import pytest

from posttrain.data.sample import DOMAINS, EFFORTS
from posttrain.engines.testing import save_tiny_k3
from posttrain.envs.env_eval import same_episodes
from posttrain.testing import TINY_RL_BODY
from posttrain.trainers.mopd_eval import played_before, taken_rows

HARNESS = {"max_tokens_per_turn": 12, "max_turns": 1}  # the RL stage's and the student's


def mopd_body(reuse: bool, temperature: float) -> dict:
    return {
        "train": {"steps": 1, "lr": 1e-4},
        "rollout": {"prompts_per_domain": 1},
        "eval": {
            "prompts_per_domain": 1,
            "accuracy_prompts_per_domain": 3,
            "samples_per_prompt": 1,
            "accuracy_temperature": temperature,
            "reuse_before": reuse,
        },
        "environments": {d: dict(HARNESS) for d in DOMAINS},
        "checkpoint_every": 1,
    }


@pytest.fixture(scope="module", params=[0.0, 0.6], ids=["greedy", "sampled"])
def run(request, tmp_path_factory, renderer, stage_runner) -> dict:
    """An SFT model, a teacher per effort, and rl-general-low trained from the SFT model (its
    eval.json holds its before-evaluation: the SFT model's episodes on 4 held-out prompts, greedy
    or sampled at 0.6)."""
    root = tmp_path_factory.mktemp("mopd-reuse")
    found = {"sft": save_tiny_k3(root / "sft", renderer.tokenizer, seed=0, sharpen=4.0)}
    for seed, effort in enumerate(EFFORTS, start=1):
        found[effort] = save_tiny_k3(root / effort, renderer.tokenizer, seed=seed, sharpen=4.0)
    body = copy.deepcopy(TINY_RL_BODY) | {"eval": {"prompts": 4, "temperature": request.param}}
    body["environments"] = {d: dict(HARNESS) for d in DOMAINS}
    rl = stage_runner.context(
        "rl",
        root / "run",
        body,
        stage_id="rl-general-low",
        inputs={"sft": found["sft"]},
        matrix={"domain": "general", "effort": "low"},
    )
    stage_runner.run(rl)
    found["rl"] = rl.stage_dir
    return {**found, "temperature": request.param}


def inputs(run: dict[str, Path]) -> dict[str, Path]:
    teachers = {f"rl-{d}-{e}": run[e] for d in DOMAINS for e in EFFORTS}
    return {"sft": run["sft"], **teachers, "rl-general-low": run["rl"] / ".model-tmp"}


def test_the_rl_stage_records_what_its_before_episodes_were_played_with(run):
    report = json.loads((run["rl"] / "eval.json").read_text())
    protocol, rows = report["before_protocol"], report["episodes"]["before"]
    assert len(protocol["prompts"]) == len(rows["uid"]) == 4
    assert protocol["domain"] == "general" and protocol["engine"] == "embedded"
    assert protocol["environment"]["max_tokens_per_turn"] == 12 and protocol["qat"]["scheme"] == "k3"
    sampled = run["temperature"] > 0
    assert protocol["sampling"] == {"temperature": run["temperature"], "seed": 0 if sampled else None}
    [(source, recorded, found)] = played_before([run["rl"], run["sft"]])  # the sft dir has no eval.json
    assert source == "rl-general-low" and recorded == protocol and found == rows


def test_taken_episodes_equal_replayed_ones(run, tmp_path, stage_runner, caplog):
    reports = {}
    for reuse in (True, False):
        body = mopd_body(reuse, run["temperature"])
        ctx = stage_runner.context("mopd", tmp_path / str(reuse), body, inputs=inputs(run))
        with caplog.at_level(logging.INFO, logger=ctx.log.name):
            caplog.clear()
            stage_runner.run(ctx)
        taken = [r.getMessage() for r in caplog.records if "not replayed" in r.getMessage()]
        # only general-low's student is the RL stage's init model at its effort
        assert taken == (["evaluation before training: the accuracy episodes of 1 of 9 pairs taken from "
                          "rl-general-low (the same student, engine, harness and prompts), not replayed"]
                         if reuse else [])  # fmt: skip
        reports[reuse] = (ctx.stage_dir / "eval.json").read_text()
    assert reports[True] == reports[False]


def test_the_rows_taken_are_the_rl_stages_first_ones(run, tmp_path, stage_runner):
    # The tiny models' greedy episodes all run to the token cap, so equal reports alone would not
    # show which rows were taken: mark the RL stage's rows and find them in MOPD's report.
    copied = tmp_path / "rl-general-low"
    shutil.copytree(run["rl"], copied)
    report = json.loads((copied / "eval.json").read_text())
    report["episodes"]["before"].update(reward=[1.0, 0.0, 1.0, 1.0], tokens=[1.0, 2.0, 6.0, 9.0])
    (copied / "eval.json").write_text(json.dumps(report))
    ctx = stage_runner.context(
        "mopd",
        tmp_path / "run",
        mopd_body(True, run["temperature"]),
        inputs={**inputs(run), "rl-general-low": copied / ".model-tmp"},
    )
    stage_runner.run(ctx)
    values = json.loads((ctx.stage_dir / "eval.json").read_text())
    assert values["general-low"]["accuracy_before"] == 2 / 3 and values["general-low"]["tokens_before"] == 3.0
    assert values["general-high"]["tokens_before"] == 12.0  # played


def test_episodes_are_taken_only_when_everything_that_fixes_them_matches(run):
    [(_, played, rows)] = played_before([run["rl"]])
    prefix = {**played, "prompts": played["prompts"][:2]}
    assert same_episodes(prefix, played) and same_episodes(played, played)
    source, taken = taken_rows(prefix, [("rl", played, rows)])
    assert source == "rl" and taken == {
        "uid": rows["uid"][:2],
        "reward": rows["reward"][:2],
        "tokens": rows["tokens"][:2],
    }
    more = {**played, "prompts": [*played["prompts"], "0" * 16]}
    other_prompts = {**played, "prompts": played["prompts"][1:3]}
    other_weights = {**played, "policy": "0" * 16}
    other_harness = {**played, "environment": {**played["environment"], "max_tokens_per_turn": 11}}
    other_engine = {**played, "engine": "vllm"}
    other_sampling = {**played, "sampling": {"temperature": 1.0, "seed": 0}}
    for protocol in (more, other_prompts, other_weights, other_harness, other_engine, other_sampling):
        assert not same_episodes(protocol, played)
        assert taken_rows(protocol, [("rl", played, rows)]) is None
