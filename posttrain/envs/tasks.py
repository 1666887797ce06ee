"""Task families: one object per kind of task, shared by SFT data generation, SFT evaluation and RL.

A family makes prompts (`make_prompt`, with the hidden verification data in ``Sample.task``),
offers tools (posttrain.envs.tools, executed for real, sandboxed where they run code or touch
files), scores an episode's final state (`verify`), and demonstrates a solution (`demonstration`, a
scripted policy whose tool calls run through the same `Episode` an RL environment uses).
Demonstrations are therefore real trajectories: every tool result in the SFT data is what the tool
returned, and every demonstration is verified.

Families register by decorator in `TASK_FAMILIES` (the shipped ones live in
``data_recipes/agent_tasks``):

    @TASK_FAMILIES.register("general/arithmetic")
    class Arithmetic(TaskFamily): ...

    family = TASK_FAMILIES.get(sample.task["family"])()
    with family.open_sandbox() as sandbox:                 # None for families without sandboxed tools
        episode = Episode(family, sample, sandbox)
        tool_messages = episode.step(parsed_assistant_message)   # [] once the turn has no tool calls
        reward = episode.reward()
"""

from __future__ import annotations

import contextlib
import json
import numbers
import random
import reprlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from posttrain.config.errors import did_you_mean
from posttrain.data.chat import tool_call_id
from posttrain.data.sample import Sample
from posttrain.envs.sandbox import Sandbox
from posttrain.envs.tools import Tool, call_tool
from posttrain.registry import Registry

MAX_TOOL_RESULT_CHARS = 400


@dataclass
class FinalState:
    """What a verifier sees at the end of an episode.

    answer: content of the last assistant turn ("" if it never answered).
    files: the sandbox workspace's files (relative path -> text) after the episode ({} without one).
    tool_calls: number of tool calls made.
    """

    answer: str = ""
    files: dict[str, str] = field(default_factory=dict)
    tool_calls: int = 0


class TaskFamily(ABC):
    """One kind of task. Subclasses set `name`, `domain` and implement `make_toolset`.

    opt_in: an environment offers the family only when its config lists it (`families`), never
    by default; e.g. the visual questions, which need a model with a vision tower.
    """

    name: ClassVar[str]
    domain: ClassVar[str]
    opt_in: ClassVar[bool] = False

    @abstractmethod
    def make_toolset(self) -> dict[str, Tool]:
        """The tools an episode offers, by name (instances of posttrain.envs.tools.Tool)."""

    def toolset(self) -> dict[str, Tool]:
        """`make_toolset`, checked: each key must be its tool's `name`. The prompt declares a tool
        by its name and the episode runs a call by the key, so a key of its own would let the
        demonstrations call a tool no prompt declares and leave the model's calls unknown."""
        tools = self.make_toolset()
        for key, tool in tools.items():
            if not isinstance(tool, Tool):
                raise TypeError(
                    f"task family {self.name}: make_toolset()[{key!r}] is {tool!r}, not a Tool instance"
                )
            if key != tool.name:
                raise ValueError(
                    f"task family {self.name}: make_toolset offers tool {tool.name!r} "
                    f"({type(tool).__qualname__}) under the key {key!r}; key it by its name, "
                    f"{{{tool.name!r}: {type(tool).__qualname__}()}}, and call it by that name"
                )
        return tools

    @property
    def tools(self) -> list[dict[str, Any]]:
        """JSON schemas of the offered tools, as rendered into the prompt."""
        return [tool.schema for tool in self.toolset().values()]

    def open_sandbox(self) -> contextlib.AbstractContextManager[Sandbox | None]:
        """A fresh sandbox for one episode, or a null context when no offered tool needs one."""
        if not any(tool.needs_sandbox for tool in self.toolset().values()):
            return contextlib.nullcontext()
        return Sandbox(memory_mb=512, cpu_seconds=30, max_processes=64, network=False)

    @abstractmethod
    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        """A fresh prompt: messages up to the first assistant turn, tools, domain, effort, and in
        ``task`` the family name plus everything `verify` needs (never rendered)."""

    def prompt(self, rng: random.Random, effort: str) -> Sample:
        """`make_prompt`, checked: what callers use, so a family that returns anything but a Sample
        is named here, not met as an AttributeError deep in an episode loop."""
        prompt = self.make_prompt(rng, effort)
        if not isinstance(prompt, Sample):
            raise TypeError(
                f"task family {self.name}: make_prompt returned {type(prompt).__name__}, not Sample; "
                "build it with self.sample(uid, effort, messages, task)"
            )
        return prompt

    @abstractmethod
    def verify(self, sample: Sample, state: FinalState) -> float:
        """Reward in [0, 1] for the episode that ended in `state`."""

    @abstractmethod
    def demonstration(self, sample: Sample, episode: Episode) -> Iterator[dict[str, Any]]:
        """Yield the assistant turns of a correct solution; after each yield the episode has run the
        turn's tool calls, so the next turn can read their results from ``episode.messages``."""

    def demonstrate(self, sample: Sample) -> list[dict[str, Any]]:
        """A verified demonstration: the full message list of a solved episode."""
        with self.open_sandbox() as sandbox:
            episode = Episode(self, sample, sandbox)
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


TASK_FAMILIES: Registry[type[TaskFamily]] = Registry("task family", named=True)


def registered_family(name: str, domain: str | None = None) -> type[TaskFamily]:
    """The family registered as `name`; a ValueError for an unknown name that suggests the nearest
    of `domain`'s families (every domain's when None) and lists that domain's, where the registry's
    own message lists every family of every domain (14 shipped, plug-ins' besides)."""
    if name in TASK_FAMILIES:
        return TASK_FAMILIES.get(name)
    candidates = [n for n, family in TASK_FAMILIES.items() if domain is None or family.domain == domain]
    hint = did_you_mean(name, candidates)
    listed = (
        f"the {domain} domain's: {', '.join(candidates)}"
        if domain
        else "docs/data.md describes the shipped ones"
    )
    raise ValueError(f"unknown task family {name!r}{'; ' + hint if hint else ''} ({listed})")


def check_listed_once(families: Sequence[str]) -> None:
    """Raise ValueError naming a family listed more than once: prompts are drawn from the listed
    families in turn, so a repeat silently gave that family one more share of the prompts."""
    repeated = sorted({name for name in families if families.count(name) > 1})
    if repeated:
        raise ValueError(
            f"{', '.join(repeated)} listed more than once; prompts come from the families in turn, so a "
            "repeat would give it another share of them: list each family once"
        )


class Episode:
    """A conversation played out against a family's real tools (in `sandbox` where they need one)."""

    def __init__(self, family: TaskFamily, sample: Sample, sandbox: Sandbox | None) -> None:
        self.family = family
        self.sample = sample
        self.sandbox = sandbox
        self.toolset = family.toolset()
        self.messages: list[dict[str, Any]] = [dict(message) for message in sample.messages]
        # A resumed episode (a paused partial rollout) keeps counting from the calls it already made.
        self.tool_calls = sum(
            len(m.get("tool_calls") or []) for m in self.messages if m["role"] == "assistant"
        )
        self.done = False

    def assistant(
        self, reasoning: str, content: str = "", calls: Sequence[tuple[str, dict[str, Any]]] = ()
    ) -> dict[str, Any]:
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
            result = call_tool(self.toolset, self.sandbox, call)
            results.append({**result, "content": result["content"][:MAX_TOOL_RESULT_CHARS]})
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

    def final_state(self) -> FinalState:
        answer = next(
            (m.get("content") or "" for m in reversed(self.messages) if m["role"] == "assistant"), ""
        )
        files = {}
        if self.sandbox is not None:
            # Never read the workspace with ordinary path calls: they follow symlinks an agent
            # may plant to host files, and this process is root.
            files = {
                path: content.decode(errors="replace")
                for path, content in sorted(self.sandbox.workspace_files().items())
            }
        return FinalState(answer=answer, files=files, tool_calls=self.tool_calls)

    def reward(self) -> float:
        """The family's `verify` of the final state, checked: a reward that is not a number in
        [0, 1] (a forgotten return, NaN, a score out of 100) is a bug in the family, and training
        on it would be silently wrong, so it is an error rather than clamped."""
        reward = self.family.verify(self.sample, self.final_state())
        if not isinstance(reward, numbers.Real) or not 0.0 <= reward <= 1.0:  # NaN fails the range
            raise ValueError(
                f"task family {self.family.name}: verify returned {reprlib.repr(reward)} for "
                f"{self.sample.uid}; it must return a float in [0, 1]"
            )
        return float(reward)
