"""The budget reward that teaches reasoning effort (K3 spec section 2.2).

A cold-start policy (the SFT model) samples every training prompt n times; the base budget b0(x)
is a quantile of the token usage of its successful samples. During RL a trajectory y with usage
T(y) > tau * b0(x) gets reward -1 whatever its task reward, so the specialist for an effort learns
to finish within its multiple tau of what the prompt needed. tau is largest for max effort and is
annealed down over the run for high and low.

b0 is cached on disk per prompt and shared by all nine RL runs: one JSON file per prompt id,
entries keyed by the prompt's hash and the cold-start configuration, written atomically.

Usage T(y) is counted from the trajectory's tokens (exactly what the policy sampled, no
re-tokenisation): `thinking` counts generated tokens inside thinking spans (general domain);
`output` counts every generated token after the prompt: reasoning, tool-call names and arguments,
answers and turn markers (agent and coding; cumulative over all assistant turns; tool results are
not generated and never count).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

from posttrain.data.sample import EFFORTS, Sample
from rewards.registry import REWARDS

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
    schedule: "linear" or "cosine" interpolation from tau_start to tau_end.
    usage: domain -> how usage is counted ("thinking" or "output"); add custom domains here.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    quantile: float = Field(0.5, gt=0.0, le=1.0)
    min_budget_tokens: float = Field(1.0, ge=0.0)
    tau: dict[str, TauSchedule] = Field(default_factory=_default_tau)
    schedule: Literal["linear", "cosine"] = "linear"
    usage: dict[str, UsageKind] = Field(default_factory=lambda: dict(DEFAULT_USAGE))

    @model_validator(mode="after")
    def _efforts_ordered(self) -> BudgetRewardConfig:
        if set(self.tau) != set(EFFORTS):
            raise ValueError(f"tau must have exactly the efforts {list(EFFORTS)}; got {sorted(self.tau)}")
        for end in ("tau_start", "tau_end"):
            low, high, top = (getattr(self.tau[e], end) for e in ("low", "high", "max"))
            if not top > high > low:
                raise ValueError(
                    f"tau.*.{end} must order max > high > low; got max={top}, high={high}, low={low}"
                )
        return self

    def usage_kind(self, domain: str) -> UsageKind:
        if domain not in self.usage:
            raise ValueError(
                f"domain {domain!r} has no budget usage counting; add `usage: {{{domain}: thinking}}` "
                f"or `output` to the budget config (known: {sorted(self.usage)})"
            )
        return self.usage[domain]


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


@REWARDS.register("budget")
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
    generated = [i >= sample.prompt_length and m == 1 for i, m in enumerate(sample.loss_mask)]
    if len(generated) != len(sample.tokens):
        raise ValueError(
            f"sample {sample.uid}: loss_mask has {len(generated)} entries, tokens {len(sample.tokens)}"
        )
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


class BudgetOutcome(NamedTuple):
    reward: float
    usage: int
    limit: float
    over_budget: bool


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
