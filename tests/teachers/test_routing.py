"""Strict teacher routing: every trained (domain, effort) has a teacher, or the stage file fails
validation (or the stage fails at setup) naming the pair and the fix; each sample is scored by its
own pair's teacher; teachers sharing a checkpoint share one engine."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from posttrain.data.chat import TokenIds
from posttrain.data.sample import EFFORTS, Sample
from posttrain.engines.build import build_engine
from posttrain.envs.environments import Environment
from posttrain.testing import mopd_context, run_mopd_stage
from posttrain.trainers.mopd import MOPDConfig
from posttrain.trainers.mopd_teachers import (
    TeacherPool,
    TeacherRoutingError,
    check_teacher_tokenizers,
    route_teachers,
    teacher_domain,
)


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


def retokenized(model_dir: Path, into: Path, edit: Callable[[dict], None]) -> Path:
    """A copy of the checkpoint `model_dir` whose tokenizer.json is rewritten after `edit` of its
    parsed JSON (and with other indentation, as a hand-edited or differently saved file has)."""
    copy = Path(shutil.copytree(model_dir, into))
    data = json.loads((copy / "tokenizer.json").read_text())
    edit(data)
    (copy / "tokenizer.json").write_text(json.dumps(data, indent=4))
    return copy


def swap_two_ids(data: dict) -> None:
    vocab = data["model"]["vocab"]
    (first, i), (second, j) = sorted(vocab.items(), key=lambda item: item[1])[300:302]
    vocab[first], vocab[second] = j, i


def add_a_token(data: dict) -> None:
    last = data["added_tokens"][-1]
    data["added_tokens"].append({**last, "id": last["id"] + 1, "content": "<|extra|>"})


def mopd_file(tmp_path: Path, student: Path, teacher: Path) -> Path:
    stage = tmp_path / "mopd.yaml"
    stage.write_text(
        "kind: mopd\ndomains: [general]\nefforts: [low]\n"
        f"student: {student}\nteachers:\n  general-low: {{model: {teacher}}}\ntrain: {{steps: 1}}\n"
    )
    return stage


@pytest.mark.parametrize(
    ("edit", "difference"),
    [(swap_two_ids, "id 300 is 'me' against 'Ġi'"), (add_a_token, "2048 tokens against 2049")],
)
def test_a_teacher_dir_with_another_tokenizer_fails_plan_naming_the_pair_both_dirs_and_the_fix(
    tiny_dirs, tmp_path: Path, posttrain, edit, difference
):
    """MOPD's reward is log p_teacher - log p_student over the student's ids: a teacher that numbers
    tokens otherwise scores other text, and the stage used to train on that noise without a word."""
    teacher = retokenized(tiny_dirs["low"], tmp_path / "teacher", edit)
    code, out, err = posttrain("plan", mopd_file(tmp_path, tiny_dirs["student"], teacher))
    assert code == 2
    message = out + err
    assert "mopd.yaml:4: student: teachers with another tokenizer than the student's" in message
    assert f"({tiny_dirs['student']}): general-low: {teacher} (tokenizer {teacher}: {difference})" in message
    assert "give each such pair a teacher trained with the student's tokenizer" in message


def test_a_teacher_whose_tokenizer_file_differs_only_in_formatting_passes_plan(
    tiny_dirs, tmp_path, posttrain
):
    teacher = retokenized(tiny_dirs["low"], tmp_path / "teacher", lambda data: None)
    assert (teacher / "tokenizer.json").read_bytes() != (tiny_dirs["student"] / "tokenizer.json").read_bytes()
    code, out, err = posttrain("plan", mopd_file(tmp_path, tiny_dirs["student"], teacher))
    assert code == 0, out + err


def test_the_tokenizer_check_reads_the_student_and_each_teacher_tokenizer_once(
    tiny_dirs, renderer, monkeypatch
):
    """Reading a tokenizer's ids (vocabulary, merges) takes over a second at K3's 163k tokens; it
    was done for the student again for every pair, and for a teacher dir again for every pair using it."""
    read, of = [], TokenIds.of

    def counted(tokenizer):
        read.append(tokenizer)
        return of(tokenizer)

    monkeypatch.setattr(TokenIds, "of", staticmethod(counted))
    teachers = {(d, e): tiny_dirs[e] for d in ("general", "agent", "coding") for e in EFFORTS}
    check_teacher_tokenizers(renderer.tokenizer, None, teachers)
    assert read[0] is renderer.tokenizer and len(read) == 1 + len(EFFORTS)


def test_teachers_saved_with_the_students_very_tokenizer_files_are_not_loaded(tiny_dirs, monkeypatch):
    """Every stage of one run saves the same tokenizer files: comparing their digests is enough,
    where loading and reading each of nine K3-sized tokenizers takes seconds (the default run's
    MOPD start)."""
    import posttrain.trainers.mopd_teachers as mopd_teachers
    from posttrain.data.chat import load_tokenizer

    student = load_tokenizer(tiny_dirs["student"])
    read, of = [], TokenIds.of
    monkeypatch.setattr(mopd_teachers, "load_tokenizer", lambda path: read.append(path))
    monkeypatch.setattr(
        TokenIds, "of", staticmethod(lambda tokenizer: read.append(tokenizer) or of(tokenizer))
    )
    teachers = {(d, e): tiny_dirs["student"] for d in ("general", "agent", "coding") for e in EFFORTS}
    check_teacher_tokenizers(student, tiny_dirs["student"], teachers)
    assert read == []


def without_tokenizer(model_dir: Path, into: Path, config: Callable[[dict], dict]) -> Path:
    """A copy of the checkpoint `model_dir` saved without tokenizer files (the shipped tokenizer is
    assumed for it), its config.json rewritten by `config`."""
    copy = Path(
        shutil.copytree(model_dir, into, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*"))
    )
    (copy / "config.json").write_text(json.dumps(config(json.loads((copy / "config.json").read_text()))))
    return copy


def smaller_vocab(data: dict) -> dict:
    return {**data, "vocab_size": 1024}


def smaller_vocab_released(data: dict) -> dict:
    """The released wrapper layout stage outputs are saved in: the text keys under `text_config`."""
    return {"model_type": "kimi_k3", "text_config": smaller_vocab(data)}


@pytest.mark.parametrize("config", [smaller_vocab, smaller_vocab_released])
def test_a_teacher_dir_without_tokenizer_files_and_a_smaller_vocab_fails_plan_naming_both_sizes(
    tiny_dirs, tmp_path: Path, posttrain, config
):
    """Such a teacher passes the tokenizer comparison (the shipped tokenizer is assumed), and its
    first scoring call, after SFT and nine RL stages, indexed past its 1024 embedding rows."""
    teacher = without_tokenizer(tiny_dirs["low"], tmp_path / "teacher", config)
    code, out, err = posttrain("plan", mopd_file(tmp_path, tiny_dirs["student"], teacher))
    assert code == 2
    message = out + err
    assert (
        "mopd.yaml:4: student: teachers whose embeddings are smaller than the student's 2048 tokens "
        f"({tiny_dirs['student']}): general-low: {teacher} (vocab_size 1024)"
    ) in message
    assert "give each such pair a teacher trained with the student's tokenizer" in message


@pytest.mark.parametrize(
    ("damaged", "kept", "message"),
    [
        ("tokenizer.json", 500, "general-low: the tokenizer of the teacher {teacher} cannot be loaded"),
        ("config.json", 100, "general-low: {teacher}/config.json cannot be read"),
    ],
)
def test_a_teacher_dir_with_a_damaged_file_fails_plan_naming_it(
    tiny_dirs, tmp_path, posttrain, damaged: str, kept: int, message: str
):
    teacher = Path(shutil.copytree(tiny_dirs["low"], tmp_path / "teacher"))
    (teacher / damaged).write_text((teacher / damaged).read_text()[:kept])  # cut short
    code, out, err = posttrain("plan", mopd_file(tmp_path, tiny_dirs["student"], teacher))
    assert code == 2
    assert message.format(teacher=teacher) in out + err


@pytest.mark.parametrize(
    ("teacher_of", "message"),
    [
        (
            lambda low, into: retokenized(low, into, swap_two_ids),
            r"general-low: .*teacher \(tokenizer .*id 300 is 'me'",
        ),
        (
            lambda low, into: without_tokenizer(low, into, smaller_vocab_released),
            r"general-low: .*teacher \(vocab_size 1024\)",
        ),
    ],
    ids=["another_tokenizer", "a_smaller_vocab"],
)
def test_a_need_teacher_that_cannot_score_the_students_ids_stops_the_stage_before_it_trains(
    tiny_dirs, tmp_path: Path, teacher_of, message: str
):
    # A need's model exists only when the stage starts: the same checks run there.
    teacher = teacher_of(tiny_dirs["low"], tmp_path / "teacher")
    body_keys = body(domains=["general"], efforts=["low"], student="sft")
    inputs = {"sft": tiny_dirs["student"], "rl-general-low": teacher}
    ctx = mopd_context(tmp_path / "run" / "mopd", body_keys, inputs)
    with pytest.raises(TeacherRoutingError, match=message):
        run_mopd_stage(ctx)
    assert ctx.checkpoints.steps() == [] and not (ctx.output_dir / "model.safetensors").exists()
