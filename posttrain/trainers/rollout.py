"""Partial rollouts: the queue of unfinished trajectories that carries them from one RL iteration to
the next (K3 spec section 2, "partial rollouts"; AReaL and verl call it asynchronous or partial
rollout).

Trajectory lengths are long-tailed: waiting for the longest one leaves the batch nearly empty while a
few stragglers decode. So an iteration starts its new prompt groups beside the trajectories queued
by the previous one, and once a fraction `lambda` of all of them has finished, generation pauses.
Groups whose trajectories have all finished go to the optimiser; every other trajectory waits in the
queue: a paused one with its tokens, behaviour log-probs, policy version per token and a snapshot of
its sandbox, a finished one until the rest of its group is done. The next iteration resumes the
paused ones under the new policy: the agent continues where it stopped (same tokens, same files),
it does not restart. The trainer's per-token regularisation (posttrain.algos.policy_loss) keeps
the update local for tokens sampled by older policies; a trajectory whose oldest token is
`max_staleness` versions old is played to its end, unpaused, so staleness stays bounded.

The queue is part of the checkpoint: its samples as JSON and the snapshot directories of paused
sandboxes, so a killed run resumes exactly.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from posttrain.checkpoint import Checkpoint
from posttrain.data.sample import Sample
from posttrain.engines.base import Engine, SamplingConfig
from posttrain.envs.environments import Environment, PauseRule
from posttrain.files import remove_tree

QUEUE = "rollout_queue"
SNAPSHOTS = "sandbox-snapshots"


class PartialRolloutConfig(BaseModel):
    """lambda and the staleness bound."""

    model_config = ConfigDict(extra="forbid")
    fraction: float = Field(
        1.0,
        gt=0,
        le=1,
        description="lambda: pause once this share of the iteration's trajectories ended; 1: synchronous",
    )
    max_staleness: int = Field(
        2,
        ge=1,
        description="a paused trajectory this many policy versions old is played to its end, unpaused",
    )


@dataclass
class Rollout:
    """What one iteration hands the optimiser: complete groups (every trajectory ended) and metrics."""

    groups: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def samples(self) -> list[Sample]:
        return [sample for group in self.groups for sample in group]


def _oldest(sample: Sample, default: int) -> int:
    """Policy version of the sample's oldest generated token (`default` before any was generated)."""
    return min(_versions(sample), default=default)


def version_span(sample: Sample) -> int:
    """How many policy updates happened while the trajectory was being generated."""
    versions = _versions(sample)
    return max(versions) - min(versions) if versions else 0


def _versions(sample: Sample) -> list[int]:
    """The policy version of each generated token."""
    return [v for v, m in zip(sample.policy_version, sample.generated_mask, strict=True) if m and v >= 0]


class RolloutQueue:
    """Runs the rollout of each iteration through `env` and keeps what is unfinished.

    step(new_samples) plays the queued paused trajectories and the new ones (fresh prompt groups
    from Environment.start) with the engine's current policy version, pausing per lambda, and
    returns the groups that are complete. `samples` / `write_files` / `restore` move the queue
    through a CheckpointManager.
    """

    def __init__(
        self, env: Environment, engine: Engine, sampling: SamplingConfig, config: PartialRolloutConfig
    ):
        self.env = env
        self.engine = engine
        self.sampling = sampling
        self.config = config
        self.waiting: list[Sample] = []

    def step(self, new_samples: list[Sample]) -> Rollout:
        version = self.engine.policy_version
        resumed = [s for s in self.waiting if s.finish_reason == "paused"]
        # Taken before playing: a resumed trajectory that ends now must count once (in inflight).
        finished_waiting = [s for s in self.waiting if s.finish_reason != "paused"]
        inflight = resumed + list(new_samples)
        overdue = [s for s in resumed if version - _oldest(s, version) >= self.config.max_staleness]
        rest = [s for s in inflight if not any(s is o for o in overdue)]
        # What a resumed trajectory sampled before this call is not this call's throughput.
        generated_before = sum(s.num_generated for s in inflight)
        started = time.perf_counter()
        if overdue:
            self.env.play(self.engine, overdue, self.sampling)
        should_pause = None
        if self.config.fraction < 1.0:
            target = math.ceil(self.config.fraction * len(inflight))
            should_pause = _threshold(target - len(overdue))
        self.env.play(self.engine, rest, self.sampling, should_pause)
        elapsed = time.perf_counter() - started
        generated = sum(s.num_generated for s in inflight) - generated_before

        everything = finished_waiting + inflight
        groups: dict[str, list[Sample]] = {}
        for sample in everything:
            groups.setdefault(sample.group, []).append(sample)
        complete = [g for g in groups.values() if all(s.finish_reason != "paused" for s in g)]
        self.waiting = [s for g in groups.values() if any(s.finish_reason == "paused" for s in g) for s in g]
        paused = sum(s.finish_reason == "paused" for s in inflight)
        trained = [s for g in complete for s in g]
        metrics = {
            "rollout/trajectories": float(len(inflight)),
            "rollout/resumed": float(len(resumed)),
            "rollout/overdue": float(len(overdue)),
            "rollout/paused": float(paused),
            "rollout/paused_fraction": paused / max(len(inflight), 1),
            "rollout/groups_done": float(len(complete)),
            "rollout/partial_fraction": sum(version_span(s) > 0 for s in trained) / max(len(trained), 1),
            "rollout/max_span": float(max((version_span(s) for s in trained), default=0)),
            "rollout/generate_s": elapsed,
            "rollout/generated_tokens": float(generated),
            "rollout/tokens_per_s": generated / elapsed,  # tool calls, sandboxes and verifiers included
            # failed sandbox starts that a retry made good, so far this stage (env_sandboxes.START_ATTEMPTS)
            "rollout/sandbox_start_retries": float(self.env.sandboxes.start_retries),
        }
        return Rollout(complete, metrics)

    # Checkpoints -------------------------------------------------------------------------------

    def samples(self) -> dict[str, list[Sample]]:
        """The queue for CheckpointManager.save(samples=...)."""
        return {QUEUE: list(self.waiting)}

    def write_files(self, directory: Path) -> None:
        """CheckpointManager.save(write_files=...): copy every paused sandbox's snapshot in."""
        for sample in self.waiting:
            if sample.sandbox_snapshot:
                source = Path(sample.sandbox_snapshot)
                shutil.copytree(source, directory / SNAPSHOTS / source.name, symlinks=True)

    def restore(self, checkpoint: Checkpoint) -> None:
        """Take the queue back from a loaded checkpoint; snapshots are copied next to the
        environment's live ones (the checkpoint's stay intact for a later resume)."""
        self.waiting = list(checkpoint.samples.get(QUEUE, []))
        for sample in self.waiting:
            if sample.sandbox_snapshot:
                name = Path(sample.sandbox_snapshot).name
                live = self.env.sandboxes.snapshot_root / name
                remove_tree(live)
                shutil.copytree(checkpoint.path / SNAPSHOTS / name, live, symlinks=True)
                sample.sandbox_snapshot = str(live)

    def clear(self) -> int:
        """Drop the queue (end of training); returns how many trajectories were discarded."""
        dropped = len(self.waiting)
        for sample in self.waiting:
            if sample.sandbox_snapshot:
                remove_tree(Path(sample.sandbox_snapshot))
        self.waiting = []
        return dropped


def _threshold(target: int) -> PauseRule:
    return lambda ended: ended >= target
