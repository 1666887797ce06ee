"""Task families: one object per kind of task, shared by SFT data generation, SFT evaluation and RL.

A family makes prompts (`make_prompt`, with the hidden verification data in ``Sample.task``),
executes the tools it offers for real (`call_tool`), scores an episode's final state (`verify`), and
demonstrates a solution (`demonstration`, a scripted policy whose tool calls run through the same
`Episode` an RL environment uses). Demonstrations are therefore real trajectories: every tool
result in the SFT data is what the tool returned, and every demonstration is verified.

Families register by decorator in `TASK_FAMILIES` (the shipped ones live in
``data_recipes/agent_tasks``):

    @TASK_FAMILIES.register("general/arithmetic")
    class Arithmetic(TaskFamily): ...

    family = TASK_FAMILIES.get(sample.task["family"])()
    episode = Episode(family, sample, workspace)
    tool_messages = episode.step(parsed_assistant_message)   # [] once the turn has no tool calls
    reward = episode.reward()
"""

from __future__ import annotations

import json
import random
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from posttrain.data.chat import tool_call_id
from posttrain.data.sample import Sample
from posttrain.registry import Registry

MAX_TOOL_RESULT_CHARS = 400


@dataclass
class FinalState:
    """What a verifier sees at the end of an episode.

    answer: content of the last assistant turn ("" if it never answered).
    files: the workspace's files (relative path -> text) after the episode.
    tool_calls: number of tool calls made.
    """

    answer: str = ""
    files: dict[str, str] = field(default_factory=dict)
    tool_calls: int = 0


class TaskFamily(ABC):
    """One kind of task. Subclasses set `name`, `domain` and `tools` (JSON schemas)."""

    name: ClassVar[str]
    domain: ClassVar[str]
    tools: ClassVar[list[dict[str, Any]]] = []

    @abstractmethod
    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        """A fresh prompt: messages up to the first assistant turn, tools, domain, effort, and in
        ``task`` the family name plus everything `verify` needs (never rendered)."""

    @abstractmethod
    def verify(self, sample: Sample, state: FinalState) -> float:
        """Reward in [0, 1] for the episode that ended in `state`."""

    @abstractmethod
    def demonstration(self, sample: Sample, episode: Episode) -> Iterator[dict[str, Any]]:
        """Yield the assistant turns of a correct solution; after each yield the episode has run the
        turn's tool calls, so the next turn can read their results from ``episode.messages``."""

    def call_tool(self, name: str, arguments: dict[str, Any], workspace: Path) -> str:
        """Execute one tool call for real in `workspace` and return its text result."""
        raise ValueError(f"unknown tool {name!r}")

    def demonstrate(self, sample: Sample, workspace: Path) -> list[dict[str, Any]]:
        """A verified demonstration: the full message list of a solved episode."""
        episode = Episode(self, sample, workspace)
        for message in self.demonstration(sample, episode):
            episode.step(message)
        reward = episode.reward()
        if reward != 1.0:
            raise RuntimeError(f"{self.name}: the demonstration of {sample.uid} scored {reward}, not 1.0")
        return episode.messages

    def sample(self, uid: str, effort: str, messages: list[dict[str, Any]], task: dict[str, Any]) -> Sample:
        """Build this family's prompt Sample (make_prompt's usual last line)."""
        return Sample(
            uid=uid,
            domain=self.domain,
            effort=effort,
            group=uid,
            messages=messages,
            tools=[json.loads(json.dumps(tool)) for tool in self.tools],
            task={"family": self.name, **task},
        )


TASK_FAMILIES: Registry[type[TaskFamily]] = Registry("task family")


class Episode:
    """A conversation being played out against a family's real tools in one workspace directory."""

    def __init__(self, family: TaskFamily, sample: Sample, workspace: Path) -> None:
        self.family = family
        self.sample = sample
        self.workspace = Path(workspace)
        self.workspace.mkdir(parents=True, exist_ok=True)
        self.messages: list[dict[str, Any]] = [dict(message) for message in sample.messages]
        self.tool_calls = 0
        self.done = False

    def assistant(self, reasoning: str, content: str = "", calls: list[tuple[str, dict[str, Any]]] = ()) -> dict:
        """An assistant message whose tool calls get the K3 ids the model writes (a conversation-wide
        count), so demonstrations teach exactly what generation must reproduce."""
        message: dict[str, Any] = {"role": "assistant", "reasoning_content": reasoning, "content": content}
        if calls:
            message["tool_calls"] = [
                {
                    "id": tool_call_id(name, self.tool_calls + offset),
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
                }
                for offset, (name, arguments) in enumerate(calls)
            ]
        return message

    def step(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """Append an assistant turn and run its tool calls; returns the tool messages (also appended).
        A turn without tool calls ends the episode."""
        if self.done:
            raise RuntimeError(f"episode {self.sample.uid} already ended with a final answer")
        self.messages.append(message)
        calls = message.get("tool_calls") or []
        if not calls:
            self.done = True
            return []
        results = []
        for call in calls:
            self.tool_calls += 1
            results.append({"role": "tool", "tool_call_id": call["id"], "content": self._run(call)})
        self.messages += results
        return results

    def results(self) -> list[str]:
        """Contents of the tool messages that answered the last assistant turn."""
        out: list[str] = []
        for message in reversed(self.messages):
            if message["role"] != "tool":
                break
            out.insert(0, message["content"])
        return out

    def _run(self, call: dict[str, Any]) -> str:
        name = call.get("function", {}).get("name", "")
        if name not in {tool["function"]["name"] for tool in self.family.tools}:
            return f"error: unknown tool {name!r}"
        try:
            arguments = json.loads(call["function"].get("arguments") or "{}")
        except json.JSONDecodeError as error:
            return f"error: arguments are not JSON ({error.msg})"
        if not isinstance(arguments, dict):
            return "error: arguments must be a JSON object"
        try:
            result = self.family.call_tool(name, arguments, self.workspace)
        except (ValueError, KeyError, TypeError, OSError) as error:
            result = f"error: {error}"
        return result[:MAX_TOOL_RESULT_CHARS]

    def final_state(self) -> FinalState:
        answer = next((m.get("content") or "" for m in reversed(self.messages) if m["role"] == "assistant"), "")
        files = {
            str(path.relative_to(self.workspace)): path.read_text(errors="replace")
            for path in sorted(self.workspace.rglob("*"))
            if path.is_file()
        }
        return FinalState(answer=answer, files=files, tool_calls=self.tool_calls)

    def reward(self) -> float:
        return self.family.verify(self.sample, self.final_state())
