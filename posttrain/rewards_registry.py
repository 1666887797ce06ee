"""The reward registry, and the contracts of the plug-in rewards the `rl` stage calls by name.

Rewards (the budget reward, the length-capped GenRM) are plug-ins: the rewards/
package registers them here under the names stage files use, and the engine looks them up by name
without importing that package (posttrain.registry.load_plugins imports it through the
`posttrain.plugins` entry points before the first lookup returns). What crosses the boundary is
typed here: the budget reward's records and protocol, and one typed lookup per reward a trainer
calls. Their stage-file schemas are in posttrain.config.rewards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

from posttrain.config.rewards import BudgetRewardConfig, GenRMConfig
from posttrain.data.sample import Sample
from posttrain.registry import Registry

if TYPE_CHECKING:
    from posttrain.envs.environments import Judge

REWARDS: Registry[Callable[..., Any]] = Registry("reward")


@dataclass(frozen=True)
class BaseBudget:
    """b0(x) and where it came from. source is "successes" normally, "all" when no cold-start
    sample succeeded (then the quantile of all samples' usage stands in: the prompt is hard, and
    its budget should be what the policy spends trying, not zero)."""

    tokens: float
    quantile: float
    num_samples: int
    num_successes: int
    source: Literal["successes", "all"]


class BudgetOutcome(NamedTuple):
    """One trajectory's budget reward: reward (-1 when over budget, else the task reward), usage
    T(y) in tokens, limit tau * b0 in tokens, and whether usage exceeded it."""

    reward: float
    usage: int
    limit: float
    over_budget: bool


class BudgetReward(Protocol):
    """The budget reward (K3 spec section 2.2) bound to one stage's BudgetRewardConfig."""

    def base_budget(self, samples: Sequence[Sample], successes: Sequence[bool]) -> BaseBudget:
        """b0 of one prompt from its cold-start samples (one group) and which of them succeeded."""
        ...

    def outcome(
        self, sample: Sample, task_reward: float, b0: float, step: int, total_steps: int
    ) -> BudgetOutcome:
        """The reward of one RL trajectory at training `step` of `total_steps`."""
        ...

    def tau(self, effort: str, step: int, total_steps: int) -> float:
        """The budget multiple tau of `effort` at training `step` of `total_steps`."""
        ...


def budget_reward(
    config: BudgetRewardConfig, thinking_markers: tuple[int, int] | None = None
) -> BudgetReward:
    """The registered "budget" reward for `config`. thinking_markers: the renderer's
    (think_start_id, think_end_id), needed for domains whose usage counts thinking tokens."""
    return REWARDS.get("budget")(config, thinking_markers)


def generative_reward_model(
    engine: Any,
    tokenizer: Any,
    config: GenRMConfig,
    *,
    render_prompt: Callable[[list[dict[str, str]]], list[int]],
    sampling: Any,
    decode_output: Callable[[list[int]], str] | None = None,
) -> Judge:
    """The registered "genrm" judge over `engine` (any posttrain.engines Engine serving the judge
    model) with `tokenizer` (the judge's); the keyword arguments are those of rewards.genrm.GenRM."""
    return REWARDS.get("genrm")(
        engine,
        tokenizer,
        config,
        render_prompt=render_prompt,
        sampling=sampling,
        decode_output=decode_output,
    )
