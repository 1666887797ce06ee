"""What the shipped task families share: tool dispatch, effort-scaled thinking, system prompts.

Effort is learned from data, so the demonstrations make it visible: low effort thinks one plan
sentence, high adds the working, max adds checks (and in coding also tests more), giving thinking
lengths of roughly 1 : 3 : 6 that RL can later shape with the budget reward.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from data_recipes.agent_tasks.tools import DOCS_DIR
from posttrain.envs.tasks import TaskFamily
from posttrain.envs.tools import Tool, make_tools

SYSTEM_PROMPTS: dict[str, tuple[str, ...]] = {
    "general": (
        "You are a careful assistant. Reply with the final answer only.",
        "Answer the question. Give only the answer, no explanation.",
        "You are Kimi, a helpful assistant. Answer briefly and exactly.",
    ),
    "agent": (
        "You are an agent for Northwind. Use the tools to finish the task, then report.",
        "You can search company documents, compute and write files. Complete the task.",
        "You are Kimi, an assistant with tools. Do the task step by step with the tools.",
    ),
    "coding": (
        "You write correct Python. Reply with the final code in a python block.",
        "You are a Python programmer. Test your code with the tool when useful, then reply with the code.",
        "You are Kimi, a coding assistant. Answer with the complete function in a python block.",
    ),
}


def thinking(effort: str, plan: str, working: Sequence[str] = (), checks: Sequence[str] = ()) -> str:
    """low: the plan; high: plan + working; max: plan + working + checks."""
    parts = [plan]
    if effort in ("high", "max"):
        parts += working
    if effort == "max":
        parts += checks
    return " ".join(parts)


def system_message(domain: str, rng: random.Random) -> dict[str, str]:
    """One of the domain's system prompts: the harness varies so no protocol is memorised."""
    return {"role": "system", "content": rng.choice(SYSTEM_PROMPTS[domain])}


def normalise_answer(text: str) -> str:
    """Exact-match normal form: case, surrounding space and a final full stop do not count."""
    return re.sub(r"\s+", " ", text.strip().rstrip(".").strip()).lower()


class ToolFamily(TaskFamily):
    """A family offering registered tools by name (search reads the shipped documents)."""

    tool_names: tuple[str, ...] = ()

    def make_toolset(self) -> dict[str, Tool]:
        if not hasattr(self, "_toolset"):
            self._toolset = make_tools(self.tool_names, docs_dir=DOCS_DIR)
        return self._toolset


# Route-choice families (agent/order_cost, general/unit_cost, general/arithmetic, general/unit_convert,
# coding/crate_cost, coding/unit_convert, coding/arithmetic; issue #21): the share of
# demonstrations that compute with the calculator (or, in coding, the code); the rest state the
# result in the thinking, which the tiny model cannot do, so RL's group advantages have one
# behaviour, the same on every prompt, to select. A group carries signal only when its samples take
# both routes, most often at a half: at 0.35 the SFT model sampled the calculator in 6-15% of its
# episodes at T=0.6 and its greedy choice fell to either route by the SFT run; at 0.5 in 35-52%,
# and in 14-89% of unit_cost's max-effort episodes over twelve SFT seeds: the end of SFT's random
# walk on that choice (bench/RESULTS.md, bench/route_share.py).
CALCULATOR_ROUTE_SHARE = 0.5


def takes_tool_route(uid: str) -> bool:
    """Whether a route-choice family's demonstration of `uid` calls the calculator: a pure function
    of the uid, the same mixture at every effort, so effort does not decide the route."""
    return random.Random(f"route:{uid}").random() < CALCULATOR_ROUTE_SHARE
