"""Coding-domain task families: write a small Python function, fix a buggy one, or price crates.

Scored by hidden unit tests (task["tests"], asserts the policy never sees) executed in a fresh
sandbox against the code in the final answer's python block. Demonstrations test their
code with the run_python tool (more at higher effort) and read the real output.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from data_recipes.agent_tasks.common import ToolFamily, system_message, takes_tool_route, thinking
from data_recipes.agent_tasks.general import ITEMS
from posttrain.data.sample import Sample
from posttrain.envs.sandbox import Sandbox
from posttrain.envs.tasks import TASK_FAMILIES, Episode, FinalState

PASS_MARK = "ALL TESTS PASSED"
VERIFY_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class FunctionSpec:
    """A function to write, parameterised by small constants drawn per prompt.

    code / bug: the solution and a buggy variant (format strings over the constants);
    inputs: argument tuples for tests; make: the constants -> a Python reference of the function.
    """

    name: str
    description: str
    code: str
    bug: str
    bug_note: str
    constants: Callable[[random.Random], dict[str, Any]]
    make: Callable[[dict[str, Any]], Callable[..., Any]]
    inputs: tuple[tuple[Any, ...], ...]


SPECS = (
    FunctionSpec(
        "scale",
        "return {k} times x plus {c}",
        "def scale(x):\n    return {k} * x + {c}",
        "def scale(x):\n    return {k} * x - {c}",
        "it subtracts {c} instead of adding it",
        lambda rng: {"k": rng.randint(2, 9), "c": rng.randint(1, 9)},
        lambda p: lambda x: p["k"] * x + p["c"],
        ((0,), (3,), (-2,), (10,)),
    ),
    FunctionSpec(
        "count_char",
        "count how many times the letter '{ch}' appears in the string s",
        "def count_char(s):\n    return s.count('{ch}')",
        "def count_char(s):\n    return s.count('{ch}') + 1",
        "it adds 1 to the count",
        lambda rng: {"ch": rng.choice("aeiost")},
        lambda p: lambda s: s.count(p["ch"]),
        (("banana",), ("test case",), ("",), ("assessment",)),
    ),
    FunctionSpec(
        "sum_above",
        "return the sum of the numbers in the list xs that are greater than {t}",
        "def sum_above(xs):\n    return sum(x for x in xs if x > {t})",
        "def sum_above(xs):\n    return sum(x for x in xs if x >= {t})",
        "it keeps numbers equal to {t}",
        lambda rng: {"t": rng.randint(1, 5)},
        lambda p: lambda xs: sum(x for x in xs if x > p["t"]),
        (([1, 2, 3, 4, 5, 6],), ([],), ([5, 5, 9],), ([0, 7],)),
    ),
    FunctionSpec(
        "clamp",
        "return x limited to the range {lo} to {hi}",
        "def clamp(x):\n    return max({lo}, min({hi}, x))",
        "def clamp(x):\n    return max({lo}, min({lo}, x))",
        "it uses {lo} as the upper limit instead of {hi}",
        lambda rng: {"lo": rng.randint(0, 5), "hi": rng.randint(10, 20)},
        lambda p: lambda x: max(p["lo"], min(p["hi"], x)),
        ((-3,), (7,), (25,), (10,)),
    ),
    FunctionSpec(
        "repeat_word",
        "return the string w repeated {n} times, joined by '-'",
        "def repeat_word(w):\n    return '-'.join([w] * {n})",
        "def repeat_word(w):\n    return '-'.join([w] * ({n} - 1))",
        "it repeats the word one time too few",
        lambda rng: {"n": rng.randint(2, 5)},
        lambda p: lambda w: "-".join([w] * p["n"]),
        (("ab",), ("x",), ("hey",)),
    ),
    FunctionSpec(
        "is_multiple",
        "return True when n is a multiple of {k}, else False",
        "def is_multiple(n):\n    return n % {k} == 0",
        "def is_multiple(n):\n    return n % {k} == 1",
        "it compares the remainder with 1 instead of 0",
        lambda rng: {"k": rng.randint(2, 9)},
        lambda p: lambda n: n % p["k"] == 0,
        ((0,), (12,), (35,), (63,), (7,)),
    ),
    FunctionSpec(
        "last_items",
        "return the last {n} items of the list xs",
        "def last_items(xs):\n    return xs[-{n}:]",
        "def last_items(xs):\n    return xs[{n}:]",
        "it drops the first {n} items instead of keeping the last {n}",
        lambda rng: {"n": rng.randint(1, 3)},
        lambda p: lambda xs: xs[-p["n"] :],
        (([1, 2, 3, 4, 5],), ([9],), (["a", "b", "c", "d"],)),
    ),
    FunctionSpec(
        "spread",
        "return the largest number in the list xs minus the smallest",
        "def spread(xs):\n    return max(xs) - min(xs)",
        "def spread(xs):\n    return max(xs) - xs[0]",
        "it subtracts the first item instead of the smallest",
        lambda rng: {},
        lambda p: lambda xs: max(xs) - min(xs),
        (([3, 9, 1],), ([5],), ([-2, 4, 0],), ([8, 2, 6],)),
    ),
)
SPEC_BY_NAME = {spec.name: spec for spec in SPECS}


def _call(spec: FunctionSpec, args: tuple[Any, ...]) -> str:
    return f"{spec.name}({', '.join(repr(a) for a in args)})"


def final_code(answer: str) -> str:
    """The code of the last python block in an answer (the whole answer when it has none)."""
    blocks = re.findall(r"```(?:python)?\n(.*?)```", answer, flags=re.DOTALL)
    return blocks[-1] if blocks else answer


class HiddenTestFamily(ToolFamily):
    """Solved when the final answer's code passes every hidden test."""

    tool_names = ("run_python",)

    def verify(self, sample: Sample, state: FinalState) -> float:
        program = "\n".join([final_code(state.answer), *sample.task["tests"], f"print({PASS_MARK!r})"])
        with Sandbox(memory_mb=512, cpu_seconds=10, max_processes=16, network=False) as sandbox:
            result = sandbox.run(["python3", "-"], timeout=VERIFY_TIMEOUT_S, stdin=program)
        return float(result.ok and result.stdout.splitlines()[-1:] == [PASS_MARK])

    def function_prompt(self, rng: random.Random) -> tuple[FunctionSpec, dict[str, Any], dict[str, Any]]:
        """A spec, its constants and the hidden task data shared by write and fix prompts."""
        spec = rng.choice(SPECS)
        constants = spec.constants(rng)
        reference = spec.make(constants)
        tests = [f"assert {_call(spec, args)} == {reference(*args)!r}" for args in spec.inputs]
        task = {
            "function": spec.name,
            "tests": tests,
            "values": {key: str(value) for key, value in constants.items()},
        }
        return spec, constants, task


def _spec_and_constants(sample: Sample) -> tuple[FunctionSpec, dict[str, Any]]:
    spec = SPEC_BY_NAME[sample.task["function"]]
    values = sample.task["values"].items()
    return spec, {key: int(text) if text.lstrip("-").isdigit() else text for key, text in values}


def _examples(
    spec: FunctionSpec, constants: dict[str, Any], inputs: list[tuple[Any, ...]]
) -> tuple[str, list[str]]:
    """A program tail printing the function on `inputs`, and what a correct function prints."""
    reference = spec.make(constants)
    return "\n".join(f"print({_call(spec, args)})" for args in inputs), [str(reference(*a)) for a in inputs]


def _define(code: str, name: str) -> Callable[..., Any]:
    """The function a snippet of the shipped spec code defines (trusted code, written above)."""
    namespace: dict[str, Any] = {}
    exec(code, namespace)
    return namespace[name]


def _code_block(code: str) -> str:
    return f"```python\n{code}\n```"


def _check_printed(sample: Sample, printed: str, expected: list[str]) -> None:
    """A reference demonstration must print what its examples expect, or the row is not written."""
    lines = printed.splitlines()
    if lines != expected:
        raise RuntimeError(f"{sample.uid}: the reference printed {lines}, expected {expected}")


@TASK_FAMILIES.register("coding/write_function")
class WriteFunction(HiddenTestFamily):
    """Write a one-line function from a description."""

    name = "coding/write_function"
    domain = "coding"

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        spec, constants, task = self.function_prompt(rng)
        ask = f"Write a Python function {spec.name} that should {spec.description.format(**constants)}."
        messages = [system_message(self.domain, rng), {"role": "user", "content": ask}]
        return self.sample(f"{self.name}-{rng.getrandbits(40):010x}", effort, messages, task)

    def demonstration(self, sample: Sample, episode: Episode) -> Iterator[dict[str, Any]]:
        spec, constants = _spec_and_constants(sample)
        code = spec.code.format(**constants)
        plan = f"{spec.name} should {spec.description.format(**constants)}: one return line."
        if sample.effort == "low":
            yield episode.assistant(plan, content=_code_block(code))
            return
        prints, expected = _examples(
            spec, constants, list(spec.inputs[1 : 2 if sample.effort == "high" else 3])
        )
        yield episode.assistant(
            thinking(sample.effort, plan, ["I run it on an example first."], ["Two examples, to be sure."]),
            calls=[("run_python", {"code": f"{code}\n{prints}"})],
        )
        _check_printed(sample, episode.results()[0], expected)
        seen = "It printed what the description asks, as expected."
        yield episode.assistant(
            thinking(sample.effort, seen, [], ["The code is done."]), content=_code_block(code)
        )


@TASK_FAMILIES.register("coding/fix_function")
class FixFunction(HiddenTestFamily):
    """Find and fix the bug in a given function."""

    name = "coding/fix_function"
    domain = "coding"

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        spec, constants, task = self.function_prompt(rng)
        ask = (
            f"This function should {spec.description.format(**constants)}, "
            f"but it is wrong. Fix it.\n{_code_block(spec.bug.format(**constants))}"
        )
        messages = [system_message(self.domain, rng), {"role": "user", "content": ask}]
        return self.sample(f"{self.name}-{rng.getrandbits(40):010x}", effort, messages, task)

    def demonstration(self, sample: Sample, episode: Episode) -> Iterator[dict[str, Any]]:
        spec, constants = _spec_and_constants(sample)
        code, buggy = spec.code.format(**constants), spec.bug.format(**constants)
        diagnosis = f"The bug: {spec.bug_note.format(**constants)}."
        if sample.effort == "low":
            yield episode.assistant(diagnosis, content=_code_block(code))
            return
        wrong, reference = _define(buggy, spec.name), spec.make(constants)
        revealing = next(args for args in spec.inputs if wrong(*args) != reference(*args))
        prints, expected = _examples(spec, constants, [revealing])
        yield episode.assistant(
            thinking(
                sample.effort, "I run the given code on an example.", [], ["That shows what goes wrong."]
            ),
            calls=[("run_python", {"code": f"{buggy}\n{prints}"})],
        )
        seen = f"That is not what {_call(spec, revealing)} should give. {diagnosis}"
        if sample.effort == "high":
            yield episode.assistant(seen, content=_code_block(code))
            return
        yield episode.assistant(
            thinking(sample.effort, seen, [], ["I test the fix."]),
            calls=[("run_python", {"code": f"{code}\n{prints}"})],
        )
        fixed = episode.results()[0]
        if fixed.splitlines() != expected:
            raise RuntimeError(f"{sample.uid}: the fix printed {fixed}, expected {expected}")
        yield episode.assistant("Now it prints what it should.", content=_code_block(code))


CRATE_COUNTS = (0, 1, 3, 10)  # the hidden tests' arguments


@TASK_FAMILIES.register("coding/crate_cost")
class CrateCost(HiddenTestFamily):
    """Write crate_cost(n) for crates of q items at p dollars, by one of two routes: a choice RL can
    select (issue #21).

    The other coding families decide per prompt (which function, which bug), so group advantages
    have no behaviour shared across prompts to select (bench/RESULTS.md). Here the demonstrations
    part at one token: the code multiplies (`n * q * p`), or the thinking states the crate's price
    and the code returns n times that number (`takes_tool_route`: Python is the calculator). Both
    are correct in the data; the tiny model cannot multiply two-digit numbers, so in its own
    episodes only the first route succeeds.
    """

    name = "coding/crate_cost"
    domain = "coding"

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        q, p, item = rng.randint(12, 39), rng.randint(12, 60), rng.choice(ITEMS)
        ask = (
            f"A crate holds {q} {item} at {p} dollars each. Write a Python function crate_cost that "
            "should return the cost in dollars of n crates."
        )
        messages = [system_message(self.domain, rng), {"role": "user", "content": ask}]
        task = {
            "function": "crate_cost",
            "tests": [f"assert crate_cost({n}) == {n * q * p}" for n in CRATE_COUNTS],
            "values": {"q": str(q), "p": str(p), "item": item},
        }
        return self.sample(f"{self.name}-{rng.getrandbits(40):010x}", effort, messages, task)

    def demonstration(self, sample: Sample, episode: Episode) -> Iterator[dict[str, Any]]:
        q, p, effort = int(sample.task["values"]["q"]), int(sample.task["values"]["p"]), sample.effort
        if takes_tool_route(sample.uid):
            plan, cost = f"A crate costs {q}*{p} dollars; the code multiplies.", f"n * {q} * {p}"
        else:
            plan, cost = f"A crate costs {q}*{p} = {q * p} dollars.", f"n * {q * p}"
        code = f"def crate_cost(n):\n    return {cost}"
        if effort == "low":
            yield episode.assistant(plan, content=_code_block(code))
            return
        counts = [1] if effort == "high" else [1, 3]
        prints = "\n".join(f"print(crate_cost({n}))" for n in counts)
        yield episode.assistant(
            thinking(effort, plan, ["I run it on one crate first."], ["And on three crates, to be sure."]),
            calls=[("run_python", {"code": f"{code}\n{prints}"})],
        )
        _check_printed(sample, episode.results()[0], [str(n * q * p) for n in counts])
        yield episode.assistant(
            thinking(effort, "It printed the cost, as expected.", [], ["The code is done."]),
            content=_code_block(code),
        )
