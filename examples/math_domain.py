"""A worked custom teacher domain, "math", plugged into MOPD without touching posttrain/.

Three registrations make a domain MOPD can distil:
1. a task family (posttrain.envs.tasks.TASK_FAMILIES): the prompt recipe and the hidden verifier;
2. an environment (posttrain.envs.environments.ENVIRONMENTS): how the domain's episodes are
   played; the base class plays every registered family of its domain, tools included, so a domain
   without special scoring needs only a subclass naming it (and RL can train on it too);
3. `@teacher_domain(teachers=...)`: the teacher of each effort, a need's stage id or a model dir
   (default rl-math-<effort>, the stage ids an `rl` matrix over domain [math] would produce).

Use it from a mopd stage file:

    plugins: [path/to/examples/math_domain.py]        # or a module of an installed package
    domains: [math]
    teachers: {math-low: {model: /ckpt/low}, math-high: {model: /ckpt/high}, math-max: {model: /ckpt/max}}
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from posttrain.data.sample import Sample
from posttrain.envs.environments import ENVIRONMENTS, Environment
from posttrain.envs.tasks import TASK_FAMILIES, Episode, FinalState, TaskFamily
from posttrain.envs.tools import Tool
from posttrain.trainers.mopd_teachers import teacher_domain

DOMAIN = "math"


@TASK_FAMILIES.register("math/sum")
class SumOfTwo(TaskFamily):
    """'What is a + b?' with two-digit numbers; the answer must be the exact sum. No tools."""

    name = "math/sum"
    domain = DOMAIN

    def make_toolset(self) -> dict[str, Tool]:
        return {}

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        messages = [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}]
        return self.sample(f"{self.name}-{a}-{b}", effort, messages, {"a": a, "b": b, "answer": str(a + b)})

    def verify(self, sample: Sample, state: FinalState) -> float:
        return float(state.answer.strip().rstrip(".") == sample.task["answer"])

    def demonstration(self, sample: Sample, episode: Episode) -> Iterator[dict[str, Any]]:
        a, b, answer = sample.task["a"], sample.task["b"], sample.task["answer"]
        yield episode.assistant(f"{a} + {b} = {answer}.", content=answer)


@teacher_domain()
@ENVIRONMENTS.register(DOMAIN)
class MathEnvironment(Environment):
    """Arithmetic questions scored by exact match of the final answer."""

    domain = DOMAIN
