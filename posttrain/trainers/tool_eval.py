"""Tool-task success: play held-out agent tasks with the policy and verify the outcome.

SFT's eval loss says how well the model imitates demonstrations; this says whether it can do the
tasks. Each held-out record's prompt (messages before the first assistant turn, with the hidden
task data) is played as an episode: the policy generates a turn greedily through an `Engine`, the
turn's tool calls run for real through the task family's tools (in a sandbox where they run code),
their results are appended with the chat renderer, and so on until the model answers or runs out
of turns. The family's `verify` scores the final state. Generation runs batched over all episodes
still going, with the same model object the trainer optimises (QAT hooks included).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from torch import nn

from posttrain.data.chat import ChatRenderer
from posttrain.data.loading import prompt_sample
from posttrain.data.tasks import TASK_FAMILIES, Episode
from posttrain.engines import EmbeddedEngine, SamplingConfig


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
) -> ToolEvalResult:
    """Play one greedy episode per record (see the module docstring) and verify each."""
    if not records:
        raise ValueError("tool-task eval: no held-out record names a registered task family")
    engine = EmbeddedEngine(model, pad_token_id=renderer.pad_id)
    sampling = SamplingConfig(
        max_tokens=max_new_tokens,
        temperature=0.0,
        stop_token_ids=(renderer.end_of_turn_id,),
        tool_call_token_ids=(renderer.tool_calls_end_id,),
    )
    with contextlib.ExitStack() as sandboxes:
        episodes = []
        for record in records:
            family = TASK_FAMILIES.get(record["task"]["family"])()
            sample = prompt_sample(record)
            sample.tokens = renderer.render_prompt(sample.messages, sample.tools, record.get("effort"))
            sample.prompt_length = len(sample.tokens)
            sample.loss_mask = [0] * len(sample.tokens)
            sample.rollout_logprobs = [0.0] * len(sample.tokens)
            sample.policy_version = [-1] * len(sample.tokens)
            episodes.append(Episode(family, sample, sandboxes.enter_context(family.open_sandbox())))
        active = list(episodes)
        for turn in range(max_turns):
            if not active:
                break
            starts = [len(episode.sample.tokens) for episode in active]
            engine.generate([episode.sample for episode in active], sampling)
            going = []
            for episode, start in zip(active, starts, strict=True):
                sample = episode.sample
                results = episode.step(renderer.parse_assistant(sample.tokens[start:]))
                if results and sample.finish_reason == "tool_call" and turn + 1 < max_turns:
                    sample.append(renderer.render_tool_results(results), generated=False)
                    going.append(episode)
            active = going
        rewards = [episode.reward() for episode in episodes]
    return ToolEvalResult(
        success=sum(r >= 1.0 for r in rewards) / len(rewards),
        reward=sum(rewards) / len(rewards),
        tool_calls=sum(e.tool_calls for e in episodes) / len(episodes),
        episodes=len(episodes),
    )
