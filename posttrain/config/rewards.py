"""The stage-file schemas of the plug-in rewards the `rl` stage uses: the budget reward (`budget:`)
and the generative reward model (`genrm:`).

They live in the engine, not in the rewards/ plug-in package, because a stage file is validated
(and its `key=value` overrides resolved) against static pydantic types before any plug-in runs, and
posttrain never imports the plug-ins by name. The rewards package implements what these configure
and registers it in posttrain.rewards_registry.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from posttrain.data.sample import EFFORTS

UsageKind = Literal["thinking", "output"]

DEFAULT_USAGE: dict[str, UsageKind] = {"general": "thinking", "agent": "output", "coding": "output"}


class TauSchedule(BaseModel):
    """tau for one effort, annealed from tau_start (step 0) to tau_end (last step)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tau_start: float = Field(gt=0)
    tau_end: float = Field(gt=0)


def _default_tau() -> dict[str, TauSchedule]:
    return {
        "low": TauSchedule(tau_start=1.0, tau_end=0.5),
        "high": TauSchedule(tau_start=1.5, tau_end=1.0),
        "max": TauSchedule(tau_start=2.0, tau_end=2.0),
    }


class BudgetRewardConfig(BaseModel):
    """The budget reward's knobs (defaults are ours: K3 does not publish its values).

    quantile: which quantile of the cold-start usages is b0 (0.5 = median).
    min_budget_tokens: floor on b0, so a prompt the cold-start policy solved without thinking does
        not make every thinking token over budget.
    tau: per effort; must order max > high > low at both ends of the run (then it does at every
        step, since all efforts share the schedule's shape).
    tau_by_domain: domain -> {effort: schedule} replacing `tau` for that domain's runs. b0 is a
        relative scale, and where usage has a floor no effort can go below (agent: the tool calls
        a task needs), a tau that binds usefully in one domain is infeasible in another.
    schedule: "linear" or "cosine" interpolation from tau_start to tau_end.
    usage: domain -> how usage is counted ("thinking" or "output"); add custom domains here.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    quantile: float = Field(0.5, gt=0.0, le=1.0)
    min_budget_tokens: float = Field(1.0, ge=0.0)
    tau: dict[str, TauSchedule] = Field(default_factory=_default_tau)
    tau_by_domain: dict[str, dict[str, TauSchedule]] = Field(default_factory=dict)
    schedule: Literal["linear", "cosine"] = "linear"
    usage: dict[str, UsageKind] = Field(default_factory=lambda: dict(DEFAULT_USAGE))

    @model_validator(mode="after")
    def _efforts_ordered(self) -> BudgetRewardConfig:
        if set(self.tau) != set(EFFORTS):
            raise ValueError(f"tau must have exactly the efforts {list(EFFORTS)}; got {sorted(self.tau)}")
        tables = {"tau": self.tau}
        for domain, table in self.tau_by_domain.items():
            unknown = sorted(set(table) - set(EFFORTS))
            if unknown:
                raise ValueError(
                    f"tau_by_domain.{domain}: unknown efforts {unknown}; efforts are {list(EFFORTS)}"
                )
            tables[f"tau_by_domain.{domain} (over tau)"] = {**self.tau, **table}
        for name, tau in tables.items():
            for end in ("tau_start", "tau_end"):
                low, high, top = (getattr(tau[e], end) for e in ("low", "high", "max"))
                if not top > high > low:
                    raise ValueError(
                        f"{name}: *.{end} must order max > high > low; got max={top}, high={high}, low={low}"
                    )
        return self

    def for_domain(self, domain: str) -> BudgetRewardConfig:
        """This config as `domain`'s runs use it: its tau_by_domain entries over `tau`."""
        if domain not in self.tau_by_domain:
            return self
        tau = {**self.tau, **self.tau_by_domain[domain]}
        return self.model_copy(update={"tau": tau, "tau_by_domain": {}})

    def usage_kind(self, domain: str) -> UsageKind:
        if domain not in self.usage:
            raise ValueError(
                f"domain {domain!r} has no budget usage counting; add `budget: {{usage: {{{domain}: "
                f"thinking}}}}` (or `output`) to the rl stage file: budget.usage.{domain} (known: "
                f"{sorted(self.usage)})"
            )
        return self.usage[domain]


class GenRMConfig(BaseModel):
    """rubric: what a good answer is, in the judge's words. score_max: N in "Score: N/score_max".
    over_cap_penalty: subtracted from the [0, 1] score of a candidate longer than
    max_candidate_tokens (>= 1 makes any over-cap candidate score <= 0)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rubric: str = Field(min_length=1)
    max_candidate_tokens: int = Field(1024, gt=0)
    max_judge_tokens: int = Field(512, gt=0)
    score_max: int = Field(10, gt=0)
    over_cap_penalty: float = Field(1.0, ge=0.0)
