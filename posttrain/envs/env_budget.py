"""The budget reward's base budget b0(x): estimated once per training prompt by the cold-start
policy (the SFT model) and cached on disk for all nine RL runs.

The cold-start policy plays each training prompt `cold_start.samples` times through the domain's
environment (the same episode loop, tools and token counting as RL), at one effort marker for every
run, so the entries of a prompt do not depend on the specialist that asks first. b0 is a quantile of
the successful samples' usage (of all samples' when none succeeded). The cache key holds everything
b0 depends on (policy weights, sampling, counting, episode limits), so a new SFT model or a changed
setting re-estimates instead of reusing a stale budget.

The formulas (usage counting, the quantile, tau) are the registered "budget" reward's
(posttrain.rewards_registry); playing the cold start and keeping its results, and scoring each
iteration's trajectories with it (`trajectory_rewards`), is this stage's job.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from posttrain.config.rewards import BudgetRewardConfig
from posttrain.data.chat import ChatRenderer
from posttrain.data.sample import Sample
from posttrain.engines.base import Engine
from posttrain.envs.environments import Environment
from posttrain.files import sha256_file
from posttrain.rewards_registry import BaseBudget, budget_reward

Effort = Literal["low", "high", "max"]


class ColdStartConfig(BaseModel):
    """How b0(x) is estimated: the SFT policy samples each training prompt `samples` times."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    samples: int = Field(4, gt=0, description="cold-start episodes per training prompt")
    effort: Effort = Field(
        "high", description="effort marker the cold-start policy samples with (shared by all runs)"
    )
    temperature: float = Field(1.0, gt=0, description="the cold start's sampling temperature")


class BudgetConfig(BudgetRewardConfig):
    """posttrain.config.rewards.BudgetRewardConfig plus the cold start and where b0 is cached."""

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
    reward = budget_reward(cfg, (env.renderer.token_ids["think_begin"], env.renderer.token_ids["think_end"]))
    for prompt in missing:
        group = [s for s in samples if s.group == prompt.uid]
        successes = [s.reward is not None and s.reward >= 1.0 for s in group]
        cache.put(prompt.uid, digests[prompt.uid], key, reward.base_budget(group, successes))


def trajectory_rewards(
    samples: list[Sample],
    budgets: Mapping[str, float],
    cfg: BudgetRewardConfig,
    step: int,
    total_steps: int,
    renderer: ChatRenderer,
) -> tuple[list[Sample], torch.Tensor, dict[str, float]]:
    """The scored samples of an RL iteration (a judge's unparsable verdicts are left out), their
    budget rewards at iteration `step` of `total_steps` (-1 over tau(effort) * b0(prompt), else
    the task reward; `budgets`: prompt uid -> b0) and metrics. `cfg`: the run's domain's config
    (BudgetRewardConfig.for_domain)."""
    markers = (renderer.token_ids["think_begin"], renderer.token_ids["think_end"])
    budget = budget_reward(cfg, markers)
    # tau_start on the first iteration, tau_end on the last.
    progress, span = step - 1, max(total_steps - 1, 1)
    scored = [s for s in samples if s.reward is not None]
    rewards, usages, over = [], [], 0
    for sample in scored:
        outcome = budget.outcome(
            sample, float(sample.reward), budgets[sample.task["prompt_uid"]], progress, span
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
        "tau": budget.tau(effort, progress, span),
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
            self._write_atomic(self.path_for(prompt_id), data)

    def _read(self, prompt_id: str) -> dict[str, Any]:
        path = self.path_for(prompt_id)
        if not path.exists():
            return {"prompt_id": prompt_id, "entries": {}}
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(
                f"budget cache file {path} is not valid JSON ({err}); delete it to recompute"
            ) from err
        if data.get("prompt_id") != prompt_id or not isinstance(data.get("entries"), dict):
            raise ValueError(
                f"budget cache file {path} holds prompt_id {data.get('prompt_id')!r}, expected "
                f"{prompt_id!r}, or has no 'entries' mapping; delete it to recompute"
            )
        return data

    def cold_start_lock(self, domain: str) -> contextlib.AbstractContextManager[None]:
        """Held while a stage estimates b0 for `domain`, by every process sharing the directory."""
        return self._locked(f"cold-start:{domain}")

    @contextlib.contextmanager
    def _locked(self, prompt_id: str) -> Iterator[None]:
        lock_path = self.path_for(prompt_id).with_suffix(".lock")
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write_atomic(self, path: Path, data: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(data, handle, indent=1, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
