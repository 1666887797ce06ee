"""Tool-task success: play held-out agent tasks with the policy and verify the outcome.

SFT's eval loss says how well the model imitates demonstrations; this says whether it can do the
tasks. Each held-out record's prompt (messages before the first assistant turn, with the hidden
task data) is played as an episode of its domain's RL environment, through the one episode loop
(posttrain.envs.environments.play_episodes): the policy generates a turn greedily, the turn's tool
calls run for real (in a sandbox where they need one), their results are appended, and so on until
the model answers or runs out of turns; the environment's verifier scores it. Generation runs
batched over all episodes still going, with the same model object the trainer optimises (QAT
hooks included).
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.data.chat import ChatRenderer
from posttrain.data.loading import prompt_sample
from posttrain.engines import EmbeddedEngine
from posttrain.envs.environments import EnvironmentConfig, make_environment, play_episodes
from posttrain.envs.tasks import TASK_FAMILIES


@dataclass
class ToolEvalResult:
    """success: share of episodes verified fully correct (reward 1); reward: mean reward;
    tool_calls: mean tool calls per episode; episodes: how many were played."""

    success: float
    reward: float
    tool_calls: float
    episodes: int

    def metrics(self, suffix: str) -> dict[str, float]:
        return {
            f"tool_success_{suffix}": self.success,
            f"tool_reward_{suffix}": self.reward,
            f"tool_calls_{suffix}": self.tool_calls,
        }


def tool_task_prompts(records: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """Up to `limit` records whose task names a registered task family (others cannot be
    verified), taken round-robin over the families in order of appearance, so a small eval still
    covers every kind of task."""
    by_family: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        family = str(record.get("task", {}).get("family", ""))
        if family in TASK_FAMILIES:
            by_family.setdefault(family, []).append(record)
    chosen: list[dict[str, Any]] = []
    queues = list(by_family.values())
    while len(chosen) < limit and any(queues):
        for queue in queues:
            if queue and len(chosen) < limit:
                chosen.append(queue.pop(0))
    return chosen


def tool_task_success(
    model: nn.Module,
    renderer: ChatRenderer,
    records: list[dict[str, Any]],
    *,
    max_new_tokens: int,
    max_turns: int,
    autocast_dtype: torch.dtype | None = None,
) -> ToolEvalResult:
    """Play one greedy episode per record through its domain's environment (the RL episode loop,
    posttrain.envs.environments.play_episodes) and verify each."""
    if not records:
        raise ValueError("tool-task eval: no held-out record names a registered task family")
    engine = EmbeddedEngine(model, pad_token_id=renderer.pad_id, autocast_dtype=autocast_dtype)
    prompts = [prompt_sample(record) for record in records]
    # each domain's environment offers exactly the records' families (opt-in ones included)
    families = {
        p.domain: sorted({q.task["family"] for q in prompts if q.domain == p.domain}) for p in prompts
    }
    with tempfile.TemporaryDirectory(prefix="tool-eval-") as root, contextlib.ExitStack() as stack:
        envs = {
            domain: stack.enter_context(
                make_environment(
                    domain,
                    renderer,
                    EnvironmentConfig(
                        max_turns=max_turns, max_tokens_per_turn=max_new_tokens, families=names
                    ),
                    sandbox_dir=Path(root) / domain,
                )
            )
            for domain, names in families.items()
        }
        samples = [envs[p.domain].start(p, uid=p.uid, group=p.uid, effort=p.effort) for p in prompts]
        sampling = {domain: env.turn_sampling(0.0, seed=0) for domain, env in envs.items()}
        play_episodes(envs, engine, samples, sampling)
    rewards = [s.reward or 0.0 for s in samples]
    calls = [
        sum(len(m.get("tool_calls") or []) for m in s.messages if m["role"] == "assistant") for s in samples
    ]
    return ToolEvalResult(
        success=sum(r >= 1.0 for r in rewards) / len(rewards),
        reward=sum(rewards) / len(rewards),
        tool_calls=sum(calls) / len(samples),
        episodes=len(samples),
    )
