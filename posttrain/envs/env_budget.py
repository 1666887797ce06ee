"""The budget reward's base budget b0(x): estimated once per training prompt by the cold-start
policy (the SFT model) and cached on disk for all nine RL runs (rewards.budget).

The cold-start policy plays each training prompt `cold_start.samples` times through the domain's
environment (the same episode loop, tools and token counting as RL), at one effort marker for every
run, so the entries of a prompt do not depend on the specialist that asks first. b0 is a quantile of
the successful samples' usage (of all samples' when none succeeded). The cache key holds everything
b0 depends on (policy weights, sampling, counting, episode limits), so a new SFT model or a changed
setting re-estimates instead of reusing a stale budget.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from posttrain.checkpoint import sha256_file
from posttrain.data.sample import Sample
from posttrain.engines.base import Engine, SamplingConfig
from posttrain.envs.environments import Environment
from rewards.budget import BudgetCache, BudgetRewardConfig, estimate_base_budget, prompt_hash

Effort = Literal["low", "high", "max"]


class ColdStartConfig(BaseModel):
    """How b0(x) is estimated: the SFT policy samples each training prompt `samples` times."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    samples: int = Field(4, gt=0)
    effort: Effort = Field(
        "high", description="effort marker the cold-start policy samples with (shared by all runs)"
    )
    temperature: float = Field(1.0, gt=0)


class BudgetConfig(BudgetRewardConfig):
    """rewards.budget.BudgetRewardConfig plus the cold start and where b0 is cached."""

    cold_start: ColdStartConfig = Field(default_factory=ColdStartConfig)
    cache_dir: str | None = Field(
        None, description="b0 cache shared by the nine runs; null: DIR/budget_cache"
    )


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
    missing = [p for p in prompts if cache.get(p.uid, digests[p.uid], key) is None]
    started = time.perf_counter()
    if missing:
        samples = [
            env.start(p, uid=f"cold-start/{p.uid}/{k}", group=p.uid, effort=cold.effort)
            for p in missing
            for k in range(cold.samples)
        ]
        sampling = SamplingConfig(
            max_tokens=env.config.max_tokens_per_turn,
            temperature=cold.temperature,
            seed=seed,
            stop_token_ids=(env.renderer.end_of_turn_id,),
            tool_call_token_ids=(env.renderer.tool_calls_end_id,),
        )
        env.play(engine, samples, sampling)
        markers = (env.renderer.token_ids["think_begin"], env.renderer.token_ids["think_end"])
        for prompt in missing:
            group = [s for s in samples if s.group == prompt.uid]
            successes = [s.reward is not None and s.reward >= 1.0 for s in group]
            cache.put(
                prompt.uid, digests[prompt.uid], key, estimate_base_budget(group, successes, cfg, markers)
            )
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
