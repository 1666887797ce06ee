"""The budget reward that teaches reasoning effort (K3 spec section 2.2).

A cold-start policy (the SFT model) samples every training prompt n times; the base budget b0(x)
is a quantile of the token usage of its successful samples. During RL a trajectory y with usage
T(y) > tau * b0(x) gets reward -1 whatever its task reward, so the specialist for an effort learns
to finish within its multiple tau of what the prompt needed. tau is largest for max effort and is
annealed down over the run for high and low.

The `rl` stage reaches this module only through the reward registry: `AnnealedBudgetReward` is
registered as "budget" (posttrain.rewards_registry.budget_reward looks it up), its config schema is
posttrain.config.rewards.BudgetRewardConfig, and the stage plays the cold start and caches b0 for
all nine runs itself (posttrain.envs.env_budget).

Usage T(y) is counted from the trajectory's tokens (exactly what the policy sampled, no
re-tokenisation): `thinking` counts generated tokens inside thinking spans (general domain);
`output` counts every generated token after the prompt: reasoning, tool-call names and arguments,
answers and turn markers (agent and coding; cumulative over all assistant turns; tool results are
not generated and never count).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from posttrain.config.rewards import BudgetRewardConfig, UsageKind
from posttrain.data.sample import EFFORTS, Sample
from posttrain.rewards_registry import REWARDS, BaseBudget, BudgetOutcome


def anneal(
    step: int, total_steps: int, start: float, end: float, shape: Literal["linear", "cosine"] = "linear"
) -> float:
    """Value at `step` of a schedule from `start` (step 0) to `end` (step >= total_steps).
    linear: start + (end - start) p; cosine: end + (start - end) (1 + cos(pi p)) / 2, with
    p = clamp(step / total_steps, 0, 1)."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be > 0, got {total_steps}")
    p = min(max(step / total_steps, 0.0), 1.0)
    if shape == "linear":
        return start + (end - start) * p
    if shape == "cosine":
        return end + (start - end) * (1 + math.cos(math.pi * p)) / 2
    raise ValueError(f"schedule shape must be 'linear' or 'cosine', got {shape!r}")


def tau_at(config: BudgetRewardConfig, effort: str, step: int, total_steps: int) -> float:
    """tau for `effort` at optimiser `step` of `total_steps`."""
    if effort not in config.tau:
        raise ValueError(f"unknown effort {effort!r}; efforts are {list(EFFORTS)}")
    t = config.tau[effort]
    return anneal(step, total_steps, t.tau_start, t.tau_end, config.schedule)


def budget_reward(task_reward: float, usage: float, b0: float, tau: float) -> float:
    """-1 if usage > tau * b0, else task_reward. Using exactly tau * b0 tokens is within budget."""
    return -1.0 if usage > tau * b0 else task_reward


def usage_tokens(sample: Sample, kind: UsageKind, thinking_markers: tuple[int, int] | None = None) -> int:
    """T(y): tokens the policy generated in `sample`, counted the way `kind` says.

    thinking_markers: (think_start_id, think_end_id), the renderer's thinking-span tokens
    (`ChatRenderer.token_ids["think_begin"]`, `["think_end"]`); needed for kind "thinking".
    The scan starts at the first token so a prompt that opens the thinking span (an assistant
    header ending in think_start) is handled; the markers themselves do not count.
    """
    sample.check()
    generated = sample.generated_mask
    if kind == "output":
        return sum(generated)
    if kind != "thinking":
        raise ValueError(f"usage kind must be 'thinking' or 'output', got {kind!r}")
    if thinking_markers is None:
        raise ValueError("counting thinking tokens needs thinking_markers=(think_start_id, think_end_id)")
    start, end = thinking_markers
    inside, count = False, 0
    for token, gen in zip(sample.tokens, generated, strict=True):
        if token == start:
            inside = True
        elif token == end:
            inside = False
        elif inside and gen:
            count += 1
    return count


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default): position q * (n - 1) in sorted values."""
    if not values:
        raise ValueError("quantile of no values")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def base_budget(usages: Sequence[float], successes: Sequence[bool], config: BudgetRewardConfig) -> BaseBudget:
    """b0 = max(quantile of the successful samples' usages, min_budget_tokens); all samples'
    usages when none succeeded."""
    if len(usages) != len(successes):
        raise ValueError(f"{len(usages)} usages but {len(successes)} success flags")
    if not usages:
        raise ValueError("base_budget needs at least one cold-start sample")
    won = [u for u, ok in zip(usages, successes, strict=True) if ok]
    pool, source = (won, "successes") if won else (list(usages), "all")
    tokens = max(quantile(pool, config.quantile), config.min_budget_tokens)
    return BaseBudget(tokens, config.quantile, len(usages), len(won), source)


def estimate_base_budget(
    samples: Sequence[Sample],
    successes: Sequence[bool],
    config: BudgetRewardConfig,
    thinking_markers: tuple[int, int] | None = None,
) -> BaseBudget:
    """b0 of one prompt from its cold-start samples (all of the same prompt group)."""
    groups = {s.group for s in samples}
    if len(groups) > 1:
        raise ValueError(f"cold-start samples of one prompt must share a group; got {sorted(groups)}")
    usages = [usage_tokens(s, config.usage_kind(s.domain), thinking_markers) for s in samples]
    return base_budget(usages, successes, config)


def sample_budget_reward(
    sample: Sample,
    task_reward: float,
    b0: float,
    config: BudgetRewardConfig,
    step: int,
    total_steps: int,
    thinking_markers: tuple[int, int] | None = None,
) -> BudgetOutcome:
    """The budget reward of one RL trajectory at training `step`: its usage under its domain's
    counting, limit tau(effort, step) * b0, and the reward."""
    usage = usage_tokens(sample, config.usage_kind(sample.domain), thinking_markers)
    tau = tau_at(config, sample.effort, step, total_steps)
    reward = budget_reward(task_reward, usage, b0, tau)
    return BudgetOutcome(reward, usage, tau * b0, usage > tau * b0)


@REWARDS.register("budget")
class AnnealedBudgetReward:
    """The budget reward with tau annealed per effort: posttrain.rewards_registry.BudgetReward over
    this module's formulas, bound to one stage's `config` and the renderer's thinking markers
    (think_start_id, think_end_id; needed for domains counted by thinking tokens)."""

    def __init__(self, config: BudgetRewardConfig, thinking_markers: tuple[int, int] | None = None) -> None:
        self.config = config
        self.thinking_markers = thinking_markers

    def base_budget(self, samples: Sequence[Sample], successes: Sequence[bool]) -> BaseBudget:
        return estimate_base_budget(samples, successes, self.config, self.thinking_markers)

    def outcome(
        self, sample: Sample, task_reward: float, b0: float, step: int, total_steps: int
    ) -> BudgetOutcome:
        return sample_budget_reward(
            sample, task_reward, b0, self.config, step, total_steps, self.thinking_markers
        )

    def tau(self, effort: str, step: int, total_steps: int) -> float:
        return tau_at(self.config, effort, step, total_steps)
