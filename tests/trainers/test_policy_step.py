"""The one policy-gradient step (posttrain.trainers.policy_step): a left-padded micro-batch gives
each trajectory the loss and gradient it has alone (the naive twin: one unpadded forward per
trajectory), and no other module of the pipeline computes the policy loss."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from posttrain.algos.policy_loss import PolicyLossConfig
from posttrain.data.batch import TokenBatch
from posttrain.data.sample import Sample
from posttrain.engines.testing import tiny_k3
from posttrain.trainers.policy_step import micro_batch_loss

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


def test_only_the_one_step_computes_the_policy_loss():
    callers = []
    for path in sorted((ROOT / "posttrain").rglob("*.py")):
        if path.name == "policy_loss.py":
            continue
        if re.search(r"(?<![\w.])policy_loss\(", path.read_text()):
            callers.append(str(path.relative_to(ROOT)))
    assert callers == ["posttrain/trainers/policy_step.py"]
