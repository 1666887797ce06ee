"""The worked custom domain, examples/math_domain.py, plugs into MOPD from its file alone: its
prompt recipe and verifier work, a stage file listing it under `plugins:` validates, and a mopd
stage distils it (eval.json holds exactly its three pairs)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from posttrain.data.sample import EFFORTS
from posttrain.envs.environments import EnvironmentConfig
from posttrain.envs.tasks import TASK_FAMILIES, FinalState
from posttrain.registry import import_plugin
from posttrain.testing import mopd_context, run_mopd_stage
from posttrain.trainers.mopd_teachers import TEACHER_DOMAINS

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "math_domain.py"


@pytest.fixture(scope="module", autouse=True)
def math_plugin() -> None:
    # By file path, as a stage file's `plugins:` entry loads it (posttrain_user_plugin_math_domain_<hash>).
    import_plugin(str(EXAMPLE))


def test_the_domain_brings_its_prompts_verifier_and_teachers(renderer, tmp_path):
    domain = TEACHER_DOMAINS.get("math")
    assert dict(domain.teachers) == {e: f"rl-math-{e}" for e in EFFORTS}
    with domain.environment(renderer, EnvironmentConfig(), sandbox_dir=tmp_path) as env:
        prompts = env.prompts("train", 4, seed=0)
    assert {p.domain for p in prompts} == {"math"} and {p.task["family"] for p in prompts} == {"math/sum"}
    family = TASK_FAMILIES.get("math/sum")()
    for prompt in prompts:
        assert int(prompt.task["answer"]) == prompt.task["a"] + prompt.task["b"]
        assert prompt.task["answer"] not in json.dumps(prompt.messages)  # the answer is hidden
        family.demonstrate(prompt)  # raises unless the verifier accepts the demonstration
        assert family.verify(prompt, FinalState(answer=str(int(prompt.task["answer"]) + 1))) == 0.0
    assert family.make_prompt(random.Random(1), "low").effort == "low"


def test_a_stage_file_lists_the_example_under_plugins(tmp_path, posttrain, tiny_dirs):
    stage = tmp_path / "mopd.yaml"
    head = f"kind: mopd\nplugins: ['{EXAMPLE}']\nstudent: {tiny_dirs['student']}\ntrain: {{steps: 1}}\n"
    teachers = {f"math-{e}": {"model": str(tiny_dirs[e])} for e in EFFORTS}
    stage.write_text(head + f"domains: [math]\nteachers: {json.dumps(teachers)}\n")
    code, out, err = posttrain("plan", stage)
    assert code == 0, out + err
    # The example's own teachers are the rl-math-<effort> stages, which this file does not need.
    stage.write_text(head + "domains: [math]\n")
    code, out, err = posttrain("plan", stage)
    assert code == 2
    assert (
        "teacher of (domain 'math', effort 'low') 'rl-math-low' is neither one of this stage's needs" in err
    )
    stage.write_text(head + "domains: [math, algebra]\n")
    code, out, err = posttrain("plan", stage)
    assert code == 2 and "'algebra' is not a registered teacher domain" in out + err


def test_a_mopd_stage_distils_the_custom_domain(tiny_dirs, tmp_path):
    body = {
        "domains": ["math"],
        "teachers": {f"math-{e}": {"model": str(tiny_dirs[e])} for e in EFFORTS},
        "student": str(tiny_dirs["student"]),
        "train": {"steps": 2, "lr": 1e-4},
        "rollout": {"prompts_per_domain": 2},
        "eval": {"prompts_per_domain": 2, "samples_per_prompt": 1},
        "environments": {"math": {"max_tokens_per_turn": 12}},
    }
    ctx = mopd_context(tmp_path / "mopd", body, inputs={})
    final = run_mopd_stage(ctx)
    report = json.loads((ctx.stage_dir / "eval.json").read_text())
    assert sorted(report) == ["math-high", "math-low", "math-max"]
    for values in report.values():
        assert 0 < values["tokens_before"] <= 12 and 0 < values["tokens_after"] <= 12
        assert 0.0 <= values["accuracy_before"] <= 1.0 and 0.0 <= values["accuracy_after"] <= 1.0
    assert final["steps"] == 2.0 and final["teacher_retries"] == 0.0
    assert (ctx.output_dir / "config.json").is_file()
