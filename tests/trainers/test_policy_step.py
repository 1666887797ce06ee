"""The one policy-gradient step (posttrain.trainers.policy_step): a left-padded micro-batch gives
each trajectory the loss and gradient it has alone (the naive twin: one unpadded forward per
trajectory), and no other module of the pipeline computes the policy loss."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import data_recipes  # noqa: F401  (registers the task families)
from posttrain.algos.policy_loss import PolicyLossConfig
from posttrain.data.batch import TokenBatch
from posttrain.data.chat import load_tokenizer
from posttrain.data.sample import Sample
from posttrain.engines.testing import tiny_k3, tiny_vl_k3
from posttrain.envs.environments import EnvironmentConfig, make_environment
from posttrain.trainers.common import AccelerateConfig, OptimConfig, TrainState, renderer_for
from posttrain.trainers.policy_step import micro_batch_loss, policy_step, reference_kl, target_logprobs

ROOT = Path(__file__).resolve().parents[2]


def trajectory(uid: str, prompt: list[int], turns: list[tuple[list[int], bool]]) -> Sample:
    sample = Sample(uid=uid)
    sample.append(prompt, generated=False)
    sample.prompt_length = len(prompt)
    for ids, generated in turns:
        logprobs = [-2.0 - 0.1 * i for i in range(len(ids))] if generated else None
        sample.append(ids, generated=generated, logprobs=logprobs, version=0)
    return sample


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


def test_a_padded_micro_batch_gives_each_trajectory_its_own_loss_and_gradient():
    model = tiny_k3(0).train()
    samples = [
        trajectory("a", [11, 12, 13], [([21, 22, 23, 24], True), ([31, 32], False), ([25, 26, 27], True)]),
        trajectory("b", [14, 15], [([41, 42], True)]),
        trajectory("c", [16], [([51, 52, 53, 54, 55], True)]),
    ]
    advantages = [0.7, -1.3, 0.4]
    config = PolicyLossConfig(reduction="sum")
    batch = TokenBatch.of(samples, pad_id=0)
    full = torch.tensor(advantages)[:, None].expand_as(batch.input_ids)
    out, _ = micro_batch_loss(model, batch, full, config=config, temperature=0.7)
    out.loss.backward()
    batched = grads(model)

    total = torch.zeros(())
    for sample, advantage in zip(samples, advantages, strict=True):
        alone = TokenBatch.of([sample], pad_id=0)
        one, _ = micro_batch_loss(
            model, alone, torch.full(alone.input_ids.shape, advantage), config=config, temperature=0.7
        )
        one.loss.backward()
        total = total + one.loss.detach()
    single = grads(model)
    torch.testing.assert_close(out.loss.detach(), total, rtol=1e-5, atol=1e-6)
    assert out.num_tokens == sum(s.num_generated for s in samples) == 14
    for name, grad in single.items():
        torch.testing.assert_close(batched[name], grad, rtol=1e-4, atol=1e-6)


def test_target_logprobs_project_only_the_columns_with_generated_targets():
    """The trainer's log-probs equal a forward over every position's logits, bit for bit, from the
    first column where any row has a generated target (rows whose answers start at different
    columns, a tool result between two turns), are 0 before it, give the same gradients up to
    float32 rounding, and the model was asked for the logits of those trailing columns only."""
    model = tiny_k3(0).train()
    samples = [
        trajectory("a", list(range(3, 30)), [([40, 41, 42], True), ([50, 51], False), ([43, 44], True)]),
        trajectory("b", list(range(5, 13)), [([60, 61, 62, 63, 64, 65], True)]),
        trajectory("c", list(range(7, 40)), [([70], True)]),
    ]
    batch = TokenBatch.of(samples, pad_id=0)
    mask = TokenBatch.targets(batch.generated).bool()
    kept = []
    forward = model.forward

    def spy(*args, **kwargs):
        kept.append(kwargs.get("logits_to_keep", 0))
        return forward(*args, **kwargs)

    model.forward = spy
    weights = torch.linspace(-1.0, 1.0, mask.shape[1])
    logp = target_logprobs(model, batch, 0.7)
    (logp * mask * weights).sum().backward()
    trained = grads(model)
    model.forward = forward
    ids = batch.input_ids
    logits = model(input_ids=ids, attention_mask=batch.attention_mask).logits.float()
    full = torch.log_softmax(logits[:, :-1] / 0.7, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (full * mask * weights).sum().backward()
    reference = grads(model)
    first = int(mask.any(0).nonzero()[0])
    assert kept == [ids.shape[1] - first] and 0 < first
    assert torch.equal(logp[:, first:], full[:, first:]) and bool((logp[:, :first] == 0).all())
    assert trained.keys() == reference.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(trained[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_visual_rows_of_different_lengths_keep_their_own_images_in_a_micro_batch(tmp_path):
    """Issue #22 suspected the images of a batch's rows being attached to other rows' media runs
    (the forward fills `<|media_pad|>` positions in row-major order). Drawn visual prompts with
    replies of different lengths, a text prompt between them: the micro-batch's loss and gradient
    are the sums of each trajectory's alone, and moving the images one visual row on changes them."""
    model = tiny_vl_k3(0, init_scale=4.0).train()
    renderer = renderer_for(load_tokenizer(media=True), model)
    config = EnvironmentConfig(families=["general/visual", "general/lookup"])
    with make_environment("general", renderer, config, sandbox_dir=tmp_path) as env:
        prompts = env.prompts("train", 4, seed=0)
        samples = [env.start(p, uid=f"s{i}", group=p.uid, effort="high") for i, p in enumerate(prompts)]
    assert [len(s.images) for s in samples] == [1, 0, 1, 0]
    visual = [samples[0], samples[2], samples[1]]  # a text row between the visual ones
    for n, sample in enumerate(visual):
        reply = list(range(40, 43 + 3 * n))
        sample.append(reply, generated=True, logprobs=[-1.0] * len(reply), version=0)
    advantages = [0.9, -0.6, 0.3]
    config = PolicyLossConfig(reduction="sum")

    def batched(images: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        batch = TokenBatch.of(visual, pad_id=renderer.pad_id)
        batch = TokenBatch(*batch.tensors(), lengths=batch.lengths, images=images)
        full = torch.tensor(advantages)[:, None].expand_as(batch.input_ids)
        out, _ = micro_batch_loss(model, batch, full, config=config, temperature=0.6)
        out.loss.backward()
        return out.loss.detach(), grads(model)

    loss, gradient = batched(tuple(s.images for s in visual))
    total = torch.zeros(())
    for sample, advantage in zip(visual, advantages, strict=True):
        alone = TokenBatch.of([sample], pad_id=renderer.pad_id)
        one, _ = micro_batch_loss(
            model, alone, torch.full(alone.input_ids.shape, advantage), config=config, temperature=0.6
        )
        one.loss.backward()
        total = total + one.loss.detach()
    single = grads(model)
    torch.testing.assert_close(loss, total, rtol=1e-5, atol=1e-6)
    for name, grad in single.items():
        # the patch convolution sums both images' terms in one backward: float order, not leakage
        scale = float(grad.abs().max())
        torch.testing.assert_close(gradient[name], grad, rtol=1e-4, atol=1e-4 * scale)
    swapped, _ = batched((visual[1].images, visual[0].images, []))
    assert (swapped - loss).abs() > 1e-3


def test_only_the_one_step_computes_the_policy_loss():
    callers = []
    for path in sorted((ROOT / "posttrain").rglob("*.py")):
        if path.name == "policy_loss.py":
            continue
        if re.search(r"(?<![\w.])policy_loss\(", path.read_text()):
            callers.append(str(path.relative_to(ROOT)))
    assert callers == ["posttrain/trainers/policy_step.py"]


class _State:
    """What policy_step needs of a TrainState: a model, backward and a plain AdamW step."""

    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def check_finite(self, *args, **kwargs) -> None:
        pass

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self, step: int) -> dict[str, float]:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {}


def test_the_reference_kl_pulls_zero_advantage_trajectories_back_to_the_init_policy():
    """Issue #21: trajectories of groups without reward variance have advantage 0, so without a
    reference term nothing holds them where the init model had them and the policy drifts there
    (bench/RESULTS.md). A drifted copy of the init model, trained on such trajectories with
    kl_to_init's term only, moves back toward the init model; without the term it stays put."""
    reference = tiny_k3(0).eval()
    samples = [
        trajectory("a", [11, 12, 13], [([21, 22, 23, 24], True), ([31, 32], False), ([25, 26, 27], True)]),
        trajectory("b", [14, 15], [([41, 42, 43, 44, 45], True)]),
    ]
    batch = TokenBatch.of(samples, pad_id=0)
    mask = TokenBatch.targets(batch.generated).bool()

    def drifted() -> torch.nn.Module:
        model = tiny_k3(0).train()
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=generator))
        return model

    def kl(model: torch.nn.Module) -> float:
        with torch.no_grad():
            logp = target_logprobs(model, batch, 1.0)
            ref = target_logprobs(reference, batch, 1.0)
        return float(reference_kl(logp, ref, mask).sum() / mask.sum())

    zero = torch.zeros(batch.input_ids.shape)
    runs = {}
    for coef in (0.0, 1.0):
        model = drifted()
        start = kl(model)
        state = _State(model, lr=1e-3)
        stats = {}
        for step in range(5):
            stats = policy_step(
                state,
                samples,
                zero,
                step=step,
                loss=PolicyLossConfig(penalty="none", penalty_coef=0.0),
                micro_batch_size=1,
                pad_id=0,
                reference=reference,
                reference_coef=coef,
            )
        runs[coef] = (start, kl(model), stats)
    (start0, end0, _), (start1, end1, stats1) = runs[0.0], runs[1.0]
    assert start0 == start1 > 0.01
    assert end0 == start0  # no advantage, no penalty: no gradient, no step
    assert end1 < 0.5 * start1 and stats1["kl_ref"] > 0
    # Throughput counts the real tokens the forward read (prompts and tool results too), not padding.
    assert stats1["train_tokens"] == sum(len(s.tokens) for s in samples) < batch.input_ids.numel()
    assert 0 < stats1["train_tokens_per_s"] < math.inf
    assert stats1["train_tokens_per_s"] * stats1["train_s"] == pytest.approx(stats1["train_tokens"])


@pytest.mark.parametrize("micro_batch_size", [2, 4, 9])
def test_any_micro_batch_size_gives_the_gradient_of_one_micro_batch(micro_batch_size: int):
    """rl and mopd accept any train.micro_batch_size > 0 against their batch (groups_per_step x
    group_size; mopd's episodes a step): one that does not divide it (2 or 4 of 5) or exceeds it
    (9) must still weight every token as one micro-batch of the whole batch does, since each
    micro-batch's token sum is divided by the whole batch's token count, not its own."""
    samples = [
        trajectory("a", [11, 12, 13], [([21, 22, 23, 24], True), ([31, 32], False), ([25, 26, 27], True)]),
        trajectory("b", [14, 15], [([41, 42], True)]),
        trajectory("c", [16], [([51, 52, 53, 54, 55], True)]),
        trajectory("d", [17, 18, 19, 20], [([61], True)]),
        trajectory("e", [21], [([71, 72, 73], True), ([81], False), ([74, 75], True)]),
    ]
    batch = TokenBatch.of(samples, pad_id=0)
    advantages = torch.tensor([0.7, -1.3, 0.4, 2.0, -0.5])[:, None].expand_as(batch.input_ids)
    weights = torch.tensor([1.0, 2.0, 0.5, 1.5, 1.0])  # MOPD's pair balance weights, say

    def step(micro: int) -> tuple[dict[str, torch.Tensor], float]:
        model = tiny_k3(0).train()
        ctx = SimpleNamespace(stage_id="micro-test", log=logging.getLogger("micro-test"))
        state = TrainState.create(ctx, model, OptimConfig(lr=1e-3, grad_clip=None), AccelerateConfig(), 1)
        seen: dict[str, torch.Tensor] = {}
        state.optimizer.optimizer.register_step_pre_hook(
            lambda *_: seen.update(
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            )
        )
        metrics = policy_step(
            state,
            samples,
            advantages,
            step=1,
            loss=PolicyLossConfig(),
            micro_batch_size=micro,
            pad_id=0,
            sample_weights=weights,
        )
        return seen, metrics["loss"]

    whole, whole_loss = step(len(samples))
    split, split_loss = step(micro_batch_size)
    assert split.keys() == whole.keys() and len(whole) > 10
    for name, grad in whole.items():
        torch.testing.assert_close(split[name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert split_loss == pytest.approx(whole_loss, rel=1e-5)
