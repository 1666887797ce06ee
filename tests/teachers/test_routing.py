"""Strict teacher routing: every trained (domain, effort) has a teacher, or the stage file fails
validation (or the stage fails at setup) naming the pair and the fix; each sample is scored by its
own pair's teacher; teachers sharing a checkpoint share one engine."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from posttrain.data.sample import EFFORTS, Sample
from posttrain.engines.build import build_engine
from posttrain.envs.environments import Environment
from posttrain.trainers.mopd import MOPDConfig
from posttrain.trainers.mopd_teachers import TeacherPool, TeacherRoutingError, route_teachers, teacher_domain


@teacher_domain(
    "routing-partial", teachers={"low": "rl-routing-partial-low", "high": "rl-routing-partial-high"}
)
class PartialEnvironment(Environment):
    """A domain whose plug-in registers teachers for two efforts only."""

    domain = "routing-partial"


def body(**keys) -> dict:
    return {"train": {"steps": 1}, **keys}


def test_a_pair_without_a_teacher_is_a_validation_error_naming_pair_and_fix():
    with pytest.raises(ValidationError) as error:
        MOPDConfig.model_validate(body(domains=["routing-partial"]))
    message = str(error.value)
    assert "no teacher for (domain 'routing-partial', effort 'max')" in message
    assert "the domain registers teachers for ['high', 'low']" in message
    assert "teachers: {routing-partial-max: {model:" in message and "remove 'max' from `efforts`" in message
    # Either fix named in the message makes the file valid.
    MOPDConfig.model_validate(
        body(domains=["routing-partial"], teachers={"routing-partial-max": {"model": "/ckpt"}})
    )
    MOPDConfig.model_validate(body(domains=["routing-partial"], efforts=["low", "high"]))


@pytest.mark.parametrize(
    ("keys", "key", "expected"),
    [
        ({"domains": ["maths"]}, "domains", "'maths' is not a registered teacher domain"),
        ({"teachers": {"general-medium": {"model": "x"}}}, "teachers", "general-medium: not a trained pair"),
        (
            {"efforts": ["low"], "teachers": {"general-max": {"model": "x"}}},
            "teachers",
            "general-max: not a trained",
        ),
        ({"teachers": {"general-low": {"engine": "vllm-gpu"}}}, "teachers.general-low.engine", "'vllm-gpu'"),
        ({"teacher_engine": "vllm-gpu"}, "teacher_engine", "unknown teacher engine 'vllm-gpu'"),
        ({"efforts": ["medium"]}, "efforts", "['medium'] are not efforts; use ['low', 'high', 'max']"),
        ({"environments": {"math": {}}}, "environments", "['math'] are not in `domains`"),
        ({"environments": {"coding": {"reward": "genrm"}}}, "environments", "set reward: verifier"),
        # a trl_vllm teacher needs its server's url (refused by plan, not when the stage starts)
        (
            {"teachers": {"general-high": {"engine": "trl_vllm"}}},
            "teachers",
            "teachers general-high use engine trl_vllm without the url of their `trl vllm-serve` server; "
            "add `teachers: {general-high: {url: http://host:port}}`",
        ),
        (
            {"teacher_engine": "trl_vllm", "domains": ["agent"], "efforts": ["low", "max"]},
            "teachers",
            "teachers agent-low, agent-max use engine trl_vllm without the url",
        ),
        # and only it: another engine would ignore the url and score with a different model
        (
            {"teachers": {"coding-max": {"url": "http://host:8000"}}},
            "teachers",
            "teachers coding-max (engine embedded) have a url, which only engine trl_vllm reads",
        ),
        # what a domain's environment refused only when the stage built it (after every need ran)
        (
            {"environments": {"general": {"max_submissions": 2}}},
            "environments",
            "general: max_submissions is 2, but only the coding environment runs submissions",
        ),
        (
            {"environments": {"agent": {"families": ["agent/order_totl"]}}},
            "environments",
            "agent: families: unknown task family 'agent/order_totl'; did you mean 'agent/order_total'?",
        ),
        # nothing to distil, or a pair's episodes played twice under the same uids
        ({"domains": [], "environments": {}}, "domains", "no domain listed; list at least one of"),
        ({"efforts": []}, "efforts", "no effort listed; list at least one of ['low', 'high', 'max']"),
        ({"domains": ["coding", "coding"]}, "domains", "['coding'] listed more than once"),
        (
            {"efforts": ["low", "max", "low"]},
            "efforts",
            "['low'] listed more than once; list each effort once",
        ),
    ],
)
def test_other_routing_mistakes_are_validation_errors_at_their_key(keys, key, expected):
    with pytest.raises(ValidationError) as error:
        MOPDConfig.model_validate(body(**keys))
    assert error.value.error_count() == 1
    (detail,) = error.value.errors()
    assert ".".join(str(part) for part in detail["loc"]) == key and expected in detail["msg"]


def test_stage_file_with_a_bad_route_fails_plan_with_the_file_and_the_pair(tmp_path: Path, posttrain):
    stage = tmp_path / "mopd.yaml"
    lines = ["kind: mopd", "domains: [general]", "efforts: [low]", "teachers:", "  agent-low: {model: /ckpt}"]
    stage.write_text("\n".join([*lines, "train: {steps: 1}", ""]))
    code, out, err = posttrain("plan", stage)
    assert code == 2
    assert "mopd.yaml:4: teachers:" in out + err and "agent-low: not a trained pair" in out + err


def test_with_the_stage_needs_a_student_or_teacher_that_is_no_need_fails_validation(tiny_dirs):
    needs = {"needs": ["sft", "rl-general-low"]}  # what orchestration passes when it loads the file
    MOPDConfig.model_validate(body(domains=["general"], efforts=["low"]), context=needs)
    with pytest.raises(ValidationError) as error:
        MOPDConfig.model_validate(
            body(domains=["general"], efforts=["low", "max"], student="stf"), context=needs
        )
    messages = {".".join(map(str, e["loc"])): e["msg"] for e in error.value.errors()}
    assert sorted(messages) == ["student", "teachers"]
    assert (
        "student 'stf' is neither one of this stage's needs (sft, rl-general-low) nor a model directory "
        "with config.json; did you mean 'sft'?" in messages["student"]
    )
    assert "teacher of (domain 'general', effort 'max') 'rl-general-max' is neither" in messages["teachers"]
    # a model directory stands in for a need
    MOPDConfig.model_validate(
        body(domains=["general"], efforts=["low"], student=str(tiny_dirs["student"])),
        context={"needs": ["rl-general-low"]},
    )


def test_a_student_directory_with_a_damaged_shard_fails_validation(tiny_dirs, tmp_path: Path):
    # Before: only config.json was looked for; the stage failed when it loaded the student.
    student = Path(shutil.copytree(tiny_dirs["student"], tmp_path / "student"))
    (student / "model.safetensors").write_bytes(b"\x00" * 7)  # cut short
    with pytest.raises(ValidationError) as error:
        MOPDConfig.model_validate(
            body(domains=["general"], efforts=["low"], student=str(student)),
            context={"needs": ["rl-general-low"]},
        )
    (detail,) = error.value.errors()
    assert detail["loc"] == ("student",)
    assert f"{student / 'model.safetensors'} is not a readable safetensors file" in detail["msg"]


def test_routes_resolve_needs_and_directories_and_name_a_missing_one(tiny_dirs):
    cfg = MOPDConfig.model_validate(
        body(
            domains=["general"],
            efforts=["low", "max"],
            teachers={"general-max": {"model": str(tiny_dirs["max"])}},
        )
    )
    routes = route_teachers(cfg, {"rl-general-low": tiny_dirs["low"]})
    assert routes[("general", "low")].model_dir == tiny_dirs["low"]
    assert routes[("general", "max")].model_dir == tiny_dirs["max"].resolve()
    assert {t.engine for t in routes.values()} == {"embedded"}
    with pytest.raises(TeacherRoutingError) as error:
        route_teachers(cfg, {"sft": tiny_dirs["student"]})
    assert (
        "teacher of (domain 'general', effort 'low'): 'rl-general-low' is neither a need of this stage"
        in str(error.value)
    )
    assert "(needs: sft)" in str(error.value) and "add the stage that trains it to `needs`" in str(
        error.value
    )


def _sample(renderer, uid: str, domain: str, effort: str) -> Sample:
    ids, mask = renderer.render(
        [{"role": "user", "content": f"Question {uid}?"}, {"role": "assistant", "content": "An answer."}],
        None,
        effort,
    )
    prompt = mask.index(1)
    return Sample(
        uid=uid,
        domain=domain,
        effort=effort,
        tokens=ids,
        prompt_length=prompt,
        loss_mask=mask,
        rollout_logprobs=[0.0] * len(ids),
        policy_version=[-1] * len(ids),
    )


def test_each_sample_is_scored_by_its_pairs_teacher_and_shared_checkpoints_share_an_engine(
    tiny_dirs, renderer, tmp_path
):
    shared = str(tiny_dirs["max"])
    cfg = MOPDConfig.model_validate(
        body(domains=["general", "agent"], teachers={f"agent-{e}": {"model": shared} for e in EFFORTS})
    )
    routes = route_teachers(cfg, {f"rl-general-{e}": tiny_dirs[e] for e in EFFORTS})
    pool = TeacherPool(routes, tmp_path, max_retries=0, log=logging.getLogger("test-routing"))
    try:
        pool.start()
        # general-low, general-high, general-max; the three agent teachers share general-max's checkpoint.
        assert len(pool.engines) == 3
        samples = [_sample(renderer, f"{d}-{e}", d, e) for d in ("general", "agent") for e in EFFORTS]
        pool.score(samples)
    finally:
        pool.close()
    references = {e: build_engine("embedded", tiny_dirs[e], work_dir=tmp_path, log_name=e) for e in EFFORTS}
    for sample in samples:
        own = "max" if sample.domain == "agent" else sample.effort
        expected = references[own].score([sample])[0]
        torch.testing.assert_close(
            torch.tensor(sample.teacher_logprobs), torch.tensor(expected), atol=1e-5, rtol=0
        )
        other = references["low" if own != "low" else "high"].score([sample])[0]
        assert max(abs(a - b) for a, b in zip(sample.teacher_logprobs[1:], other[1:], strict=True)) > 0.1

    unrouted = _sample(renderer, "coding-1", "coding", "low")
    with pytest.raises(TeacherRoutingError, match=r"\(domain 'coding', effort 'low'\) has no teacher"):
        pool.teacher_for(unrouted)
