"""The budget reward that teaches reasoning effort (K3 spec section 2.2), whole: its stage-file
schema, its formulas, the cold start that estimates b0 and the on-disk b0 cache.

A cold-start policy (the SFT model) samples every training prompt n times; the base budget b0(x)
is a quantile of the token usage of its successful samples (of all samples' when none succeeded).
During RL a trajectory y with usage T(y) > tau * b0(x) gets reward -1 whatever its task reward, so
the specialist for an effort learns to finish within its multiple tau of what the prompt needed.
tau is largest for max effort and is annealed down over the run for high and low.

Usage T(y) is counted from the trajectory's tokens (exactly what the policy sampled, no
re-tokenisation): `thinking` counts generated tokens inside thinking spans (general domain);
`output` counts every generated token after the prompt: reasoning, tool-call names and arguments,
answers and turn markers (agent and coding; cumulative over all assistant turns; tool results are
not generated and never count).

The cold-start policy plays each training prompt `cold_start.samples` times through the domain's
environment (the same episode loop, tools and token counting as RL), at one effort marker for every
run, so the entries of a prompt do not depend on the specialist that asks first. The cache key
holds everything b0 depends on (policy weights, sampling, counting, episode limits), so a new SFT
model or a changed setting re-estimates instead of reusing a stale budget. The `rl` stage calls
`base_budgets` once and `trajectory_rewards` every iteration.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from posttrain.config.errors import did_you_mean
from posttrain.data.chat import ChatRenderer
from posttrain.data.sample import EFFORTS, Sample
from posttrain.engines.base import Engine
from posttrain.envs.environments import Environment
from posttrain.files import atomic_write_text, exclusive_lock, sha256_file

UsageKind = Literal["thinking", "output"]

DEFAULT_USAGE: dict[str, UsageKind] = {"general": "thinking", "agent": "output", "coding": "output"}


class TauSchedule(BaseModel):
    """tau for one effort, annealed from tau_start (step 0) to tau_end (last step)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tau_start: float = Field(gt=0, description="tau on the first iteration")
    tau_end: float = Field(gt=0, description="tau on the last iteration")


def _default_tau() -> dict[str, TauSchedule]:
    return {
        "low": TauSchedule(tau_start=1.0, tau_end=0.5),
        "high": TauSchedule(tau_start=1.5, tau_end=1.0),
        "max": TauSchedule(tau_start=2.0, tau_end=2.0),
    }


Effort = Literal["low", "high", "max"]


class ColdStartConfig(BaseModel):
    """How b0(x) is estimated: the SFT policy samples each training prompt `samples` times."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    samples: int = Field(4, gt=0, description="cold-start episodes per training prompt")
    effort: Effort = Field(
        "high", description="effort marker the cold-start policy samples with (shared by all runs)"
    )
    temperature: float = Field(1.0, gt=0, description="the cold start's sampling temperature")


class BudgetConfig(BaseModel):
    """The `budget:` block of an `rl` stage file (defaults are ours: K3 does not publish its values).

    tau must order max > high > low at both ends of the run (then it does at every step, since all
    efforts share the schedule's shape). tau_by_domain exists because b0 is a relative scale: where
    usage has a floor no effort can go below (agent: the tool calls a task needs), a tau that binds
    usefully in one domain is infeasible in another.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    quantile: float = Field(
        0.5, gt=0.0, le=1.0, description="which quantile of the cold-start usages is b0 (0.5: the median)"
    )
    min_budget_tokens: float = Field(
        1.0,
        ge=0.0,
        description="floor on b0, so a prompt solved without thinking does not put every thinking "
        "token over budget",
    )
    tau: dict[str, TauSchedule] = Field(
        default_factory=_default_tau,
        description="effort -> budget multiple, annealed; must order max > high > low at both ends",
    )
    tau_by_domain: dict[str, dict[str, TauSchedule]] = Field(
        default_factory=dict,
        description="domain -> {effort: schedule} over `tau` for that domain's runs",
    )
    schedule: Literal["linear", "cosine"] = Field(
        "linear", description="interpolation from tau_start to tau_end: linear or cosine"
    )
    usage: dict[str, UsageKind] = Field(
        default_factory=lambda: dict(DEFAULT_USAGE),
        description="domain -> how usage T(y) is counted: thinking or output; add custom domains here",
    )
    cold_start: ColdStartConfig = Field(default_factory=ColdStartConfig)
    cache_dir: str | None = Field(
        None, description="b0 cache shared by the nine runs; null: DIR/budget_cache"
    )

    @field_validator("usage")
    @classmethod
    def _over_the_shipped_domains(cls, usage: dict[str, UsageKind]) -> dict[str, UsageKind]:
        # A custom domain's rule is added to the shipped domains' counting, not put in its place:
        # an rl.yaml whose matrix adds `math` beside general, agent and coding writes only
        # `usage: {math: thinking}`, and its agent and coding stages must still count output.
        return {**DEFAULT_USAGE, **usage}

    @model_validator(mode="after")
    def _efforts_ordered(self) -> BudgetConfig:
        if set(self.tau) != set(EFFORTS):
            raise ValueError(f"tau must have exactly the efforts {list(EFFORTS)}; got {sorted(self.tau)}")
        tables = {"tau": self.tau}
        for domain, table in self.tau_by_domain.items():
            if domain not in self.usage:  # a misspelled domain would leave its runs on `tau`, silently
                raise ValueError(
                    f"tau_by_domain.{domain}: {domain!r} is not a domain with budget usage counting "
                    f"({', '.join(sorted(self.usage))}); "
                    + (did_you_mean(domain, self.usage) or f"add budget.usage.{domain} for a custom domain")
                )
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

    def for_domain(self, domain: str) -> BudgetConfig:
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


# The formulas --------------------------------------------------------------------------------------


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


def tau_at(config: BudgetConfig, effort: str, step: int, total_steps: int) -> float:
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


def base_budget(usages: Sequence[float], successes: Sequence[bool], config: BudgetConfig) -> BaseBudget:
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
    config: BudgetConfig,
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
    config: BudgetConfig,
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


# The cold start and the b0 cache -------------------------------------------------------------------


def thinking_markers_of(renderer: ChatRenderer) -> tuple[int, int]:
    """(think_start_id, think_end_id): the renderer's thinking-span tokens, for usage kind "thinking"."""
    return renderer.token_ids["think_begin"], renderer.token_ids["think_end"]


def model_digest(model_dir: Path) -> str:
    """Identity of a model dir's weights (part of the b0 cache key: a new SFT model re-estimates)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights")
    return ":".join(sha256_file(path)[:16] for path in files)


def base_budgets(
    env: Environment,
    engine: Engine,
    prompts: list[Sample],
    cfg: BudgetConfig,
    *,
    seed: int,
    policy_id: str,
    cache_dir: Path,
) -> tuple[dict[str, float], dict[str, float]]:
    """b0(x) of every training prompt: read from the cache, or estimated by the cold-start policy
    (`engine`, playing each prompt `cold_start.samples` times) and cached. Returns prompt uid -> b0
    and metrics. The cache key holds everything b0 depends on and nothing of the run's effort, so
    the three efforts of a domain (and any rerun) share the entries."""
    cold = cfg.cold_start
    key = {
        "policy": policy_id,
        "samples": cold.samples,
        "effort": cold.effort,
        "temperature": cold.temperature,
        "seed": seed,
        "quantile": cfg.quantile,
        "min_budget_tokens": cfg.min_budget_tokens,
        "usage": cfg.usage_kind(env.domain),
        "max_turns": env.config.max_turns,
        "max_tokens_per_turn": env.config.max_tokens_per_turn,
        "max_submissions": env.config.max_submissions,
    }
    cache = BudgetCache(cache_dir)
    digests = {p.uid: prompt_hash(p.messages, p.tools) for p in prompts}
    started = time.perf_counter()
    # The three efforts of a domain start together and need the same b0: one cold start per
    # domain at a time, so a stage that finds another estimating waits and reads its entries.
    with cache.cold_start_lock(env.domain):
        missing = [p for p in prompts if cache.get(p.uid, digests[p.uid], key) is None]
        if missing:
            estimate(env, engine, missing, cfg, seed, cache, digests, key)
    found = {p.uid: cache.get(p.uid, digests[p.uid], key) for p in prompts}
    budgets = {uid: budget.tokens for uid, budget in found.items() if budget is not None}
    if len(budgets) < len(prompts):
        raise RuntimeError(f"the budget cache in {cache_dir} lost entries while this stage was writing them")
    metrics = {
        "budget/b0_mean": sum(budgets.values()) / len(budgets),
        "budget/cold_start_prompts": float(len(missing)),
        "budget/cold_start_s": time.perf_counter() - started,
        "budget/from_successes": sum(b.source == "successes" for b in found.values() if b) / len(budgets),
    }
    return budgets, metrics


def estimate(
    env: Environment,
    engine: Engine,
    missing: list[Sample],
    cfg: BudgetConfig,
    seed: int,
    cache: BudgetCache,
    digests: Mapping[str, str],
    key: Mapping[str, Any],
) -> None:
    """Play each prompt of `missing` cold_start.samples times with the cold-start policy and cache
    its b0."""
    cold = cfg.cold_start
    samples = [
        env.start(p, uid=f"cold-start/{p.uid}/{k}", group=p.uid, effort=cold.effort)
        for p in missing
        for k in range(cold.samples)
    ]
    env.play(engine, samples, env.turn_sampling(cold.temperature, seed))
    markers = thinking_markers_of(env.renderer)
    for prompt in missing:
        group = [s for s in samples if s.group == prompt.uid]
        successes = [s.reward is not None and s.reward >= 1.0 for s in group]
        cache.put(prompt.uid, digests[prompt.uid], key, estimate_base_budget(group, successes, cfg, markers))


def trajectory_rewards(
    samples: list[Sample],
    budgets: Mapping[str, float],
    cfg: BudgetConfig,
    step: int,
    total_steps: int,
    renderer: ChatRenderer,
) -> tuple[list[Sample], torch.Tensor, dict[str, float]]:
    """The scored samples of an RL iteration (a judge's unparsable verdicts are left out), their
    budget rewards at iteration `step` of `total_steps` (-1 over tau(effort) * b0(prompt), else
    the task reward; `budgets`: prompt uid -> b0) and metrics. `cfg`: the run's domain's config
    (BudgetConfig.for_domain)."""
    markers = thinking_markers_of(renderer)
    # tau_start on the first iteration, tau_end on the last.
    progress, span = step - 1, max(total_steps - 1, 1)
    scored = [s for s in samples if s.reward is not None]
    rewards, usages, over = [], [], 0
    for sample in scored:
        outcome = sample_budget_reward(
            sample, float(sample.reward), budgets[sample.task["prompt_uid"]], cfg, progress, span, markers
        )
        rewards.append(outcome.reward)
        usages.append(outcome.usage)
        over += outcome.over_budget
    n = max(len(scored), 1)
    effort = scored[0].effort if scored else "high"
    metrics = {
        "reward_mean": sum(rewards) / n,
        "task_reward_mean": sum(float(s.reward) for s in scored) / n,
        "over_budget_fraction": over / n,
        "usage_mean": sum(usages) / n,
        "tau": tau_at(cfg, effort, progress, span),
        "response_tokens_mean": sum(s.num_generated for s in scored) / n,
        "unscored": float(len(samples) - len(scored)),
    }
    return scored, torch.tensor(rewards, dtype=torch.float32), metrics


def prompt_hash(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()) -> str:
    """sha256 of the prompt's canonical JSON: an edited prompt under the same id misses the cache."""
    payload = json.dumps(
        {"messages": list(messages), "tools": list(tools)}, sort_keys=True, ensure_ascii=False
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def config_key(cold_start: Mapping[str, Any]) -> str:
    """sha256 of the cold-start configuration (policy, n, sampling, quantile, counting...)."""
    return hashlib.sha256(json.dumps(cold_start, sort_keys=True).encode()).hexdigest()[:16]


class BudgetCache:
    """b0 per prompt on disk, shared by concurrent RL runs.

    One file per prompt id: {"prompt_id": ..., "entries": {"<prompt_hash>/<config_key>":
    {"config": {...}, "budget": {...}}}}. Writes go to a temporary file in the same directory,
    are fsynced and renamed over the old one, so a reader never sees half a file; a per-file lock
    serialises read-modify-write so two runs adding entries do not lose one.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def path_for(self, prompt_id: str) -> Path:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", prompt_id)[:80]
        digest = hashlib.sha256(prompt_id.encode()).hexdigest()[:12]
        return self.directory / f"{safe}-{digest}.json"

    def get(self, prompt_id: str, prompt_digest: str, cold_start: Mapping[str, Any]) -> BaseBudget | None:
        entry = self._read(prompt_id)["entries"].get(f"{prompt_digest}/{config_key(cold_start)}")
        return None if entry is None else BaseBudget(**entry["budget"])

    def put(
        self, prompt_id: str, prompt_digest: str, cold_start: Mapping[str, Any], budget: BaseBudget
    ) -> None:
        with self._locked(prompt_id):
            data = self._read(prompt_id)
            data["entries"][f"{prompt_digest}/{config_key(cold_start)}"] = {
                "config": dict(cold_start),
                "budget": asdict(budget),
            }
            atomic_write_text(self.path_for(prompt_id), json.dumps(data, indent=1, sort_keys=True))

    def _read(self, prompt_id: str) -> dict[str, Any]:
        path = self.path_for(prompt_id)
        if not path.exists():
            return {"prompt_id": prompt_id, "entries": {}}
        try:
            data = json.loads(path.read_text())
        except ValueError as err:  # JSONDecodeError, or bytes that are not UTF-8 (a damaged disk)
            raise ValueError(
                f"budget cache file {path} is not valid JSON ({err}); delete it to recompute"
            ) from err
        if not isinstance(data, dict):
            raise ValueError(
                f"budget cache file {path} holds a {type(data).__name__}, not a mapping; "
                "delete it to recompute"
            )
        if data.get("prompt_id") != prompt_id or not isinstance(data.get("entries"), dict):
            raise ValueError(
                f"budget cache file {path} holds prompt_id {data.get('prompt_id')!r}, expected "
                f"{prompt_id!r}, or has no 'entries' mapping; delete it to recompute"
            )
        return data

    def cold_start_lock(self, domain: str) -> contextlib.AbstractContextManager[None]:
        """Held while a stage estimates b0 for `domain`, by every process sharing the directory."""
        return self._locked(f"cold-start:{domain}")

    def _locked(self, prompt_id: str) -> contextlib.AbstractContextManager[None]:
        return exclusive_lock(self.path_for(prompt_id).with_suffix(".lock"))
