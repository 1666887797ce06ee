"""Coding-domain task families: write a small Python function, fix a buggy one, or compute a
product of the question's numbers by one of two routes (crate_cost, unit_convert, arithmetic).

Scored by hidden unit tests (task["tests"], asserts the policy never sees) executed in a fresh
sandbox against the code in the final answer's python block. Demonstrations test their
code with the run_python tool (more at higher effort) and read the real output.
"""

from __future__ import annotations

import random
import re
from abc import abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

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


ROUTE_COUNTS = (0, 1, 3, 10)  # the hidden tests' arguments of the route families taking n


class Examples(NamedTuple):
    """A route family's example runs: the calls (high effort runs the first, max all of them) and
    what a correct function prints for each; the working sentence and max effort's check."""

    calls: list[str]
    printed: list[str]
    working: str
    check: str


class CodeRouteFamily(HiddenTestFamily):
    """A coding route choice (issue #21): the demonstrations part at one token of the plan, where
    the code computes a product of the question's numbers (Python is the calculator) or the
    thinking states the product and the code uses that number (`takes_tool_route` picks by uid).
    Both are correct in the data; the tiny model cannot multiply two-digit numbers, so in its own
    episodes only the first route succeeds, and RL has one behaviour, the same on every prompt, to
    select. The other coding families decide per prompt (which function, which bug) and the SFT
    model already passes nearly all of them: with crate_cost coding's only route family, a seed's
    coding max gain was what its SFT model's route choice there left (bench/RESULTS.md)."""

    result = "cost"  # "It printed the cost, as expected."

    @abstractmethod
    def routes(self, sample: Sample) -> tuple[str, str, str, str]:
        """(the code route's plan, its code, the stated route's plan, its code)."""

    @abstractmethod
    def examples(self, sample: Sample) -> Examples:
        """The runs the demonstration tests its code with."""

    def demonstration(self, sample: Sample, episode: Episode) -> Iterator[dict[str, Any]]:
        effort = sample.effort
        tool_plan, tool_code, stated_plan, stated_code = self.routes(sample)
        plan, code = (tool_plan, tool_code) if takes_tool_route(sample.uid) else (stated_plan, stated_code)
        if effort == "low":
            yield episode.assistant(plan, content=_code_block(code))
            return
        examples = self.examples(sample)
        runs = 1 if effort == "high" else len(examples.calls)
        prints = "\n".join(f"print({call})" for call in examples.calls[:runs])
        yield episode.assistant(
            thinking(effort, plan, [examples.working], [examples.check]),
            calls=[("run_python", {"code": f"{code}\n{prints}"})],
        )
        _check_printed(sample, episode.results()[0], examples.printed[:runs])
        yield episode.assistant(
            thinking(effort, f"It printed the {self.result}, as expected.", [], ["The code is done."]),
            content=_code_block(code),
        )


def _times_n_tests(function: str, unit: int) -> list[str]:
    return [f"assert {function}({n}) == {n * unit}" for n in ROUTE_COUNTS]


@TASK_FAMILIES.register("coding/crate_cost")
class CrateCost(CodeRouteFamily):
    """Write crate_cost(n) for crates of q items at p dollars: the code multiplies (`n * q * p`),
    or the thinking states the crate's price and the code returns n times that number."""

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
            "tests": _times_n_tests("crate_cost", q * p),
            "values": {"q": str(q), "p": str(p), "item": item},
        }
        return self.sample(f"{self.name}-{rng.getrandbits(40):010x}", effort, messages, task)

    def routes(self, sample: Sample) -> tuple[str, str, str, str]:
        q, p = int(sample.task["values"]["q"]), int(sample.task["values"]["p"])
        return (
            f"A crate costs {q}*{p} dollars; the code multiplies.",
            f"def crate_cost(n):\n    return n * {q} * {p}",
            f"A crate costs {q}*{p} = {q * p} dollars.",
            f"def crate_cost(n):\n    return n * {q * p}",
        )

    def examples(self, sample: Sample) -> Examples:
        q, p = int(sample.task["values"]["q"]), int(sample.task["values"]["p"])
        return Examples(
            ["crate_cost(1)", "crate_cost(3)"],
            [str(q * p), str(3 * q * p)],
            "I run it on one crate first.",
            "And on three crates, to be sure.",
        )


# (the unit asked for, the unit a trip's length is given in, how many of the first make one of
# the second): general/unit_convert's kind of fact, in units of time so that a trip has them
TIME_UNITS = (
    ("minutes", "hours", 60),
    ("hours", "days", 24),
    ("days", "weeks", 7),
    ("seconds", "minutes", 60),
)


@TASK_FAMILIES.register("coding/unit_convert")
class UnitConvert(CodeRouteFamily):
    """Write trip_minutes(n) for trips of q hours: the code multiplies (`n * q * 60`), or the
    thinking states a trip's minutes and the code returns n times that number. Coding's second
    route family, coding/arithmetic its third, so that a seed's coding gain no longer rests on one
    SFT route choice, as general's did until it had three (docs/data.md)."""

    name = "coding/unit_convert"
    domain = "coding"
    result = "count"

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        small, big, factor = rng.choice(TIME_UNITS)
        q, function = rng.randint(12, 39), f"trip_{small}"
        ask = (
            f"A trip takes {q} {big}. Write a Python function {function} that should return how "
            f"many {small} n trips take."
        )
        messages = [system_message(self.domain, rng), {"role": "user", "content": ask}]
        task = {
            "function": function,
            "tests": _times_n_tests(function, q * factor),
            "values": {"q": str(q), "small": small, "big": big, "factor": str(factor)},
        }
        return self.sample(f"{self.name}-{rng.getrandbits(40):010x}", effort, messages, task)

    def routes(self, sample: Sample) -> tuple[str, str, str, str]:
        values, function = sample.task["values"], sample.task["function"]
        q, small, factor = int(values["q"]), values["small"], int(values["factor"])
        return (
            f"A trip is {q}*{factor} {small}; the code multiplies.",
            f"def {function}(n):\n    return n * {q} * {factor}",
            f"A trip is {q}*{factor} = {q * factor} {small}.",
            f"def {function}(n):\n    return n * {q * factor}",
        )

    def examples(self, sample: Sample) -> Examples:
        values, function = sample.task["values"], sample.task["function"]
        unit = int(values["q"]) * int(values["factor"])
        return Examples(
            [f"{function}(1)", f"{function}(3)"],
            [str(unit), str(3 * unit)],
            "I run it on one trip first.",
            "And on three trips, to be sure.",
        )


@TASK_FAMILIES.register("coding/arithmetic")
class Arithmetic(CodeRouteFamily):
    """Write a function returning how many items a shop has in a boxes of b and c loose ones: the
    code computes `a * b + c`, or the thinking states the total and the code returns that number.
    Coding's third route family (see coding/unit_convert); no argument, and a sum beside the
    product, so its code is not crate_cost's with other names."""

    name = "coding/arithmetic"
    domain = "coding"
    result = "total"

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        a, b, c, item = rng.randint(12, 39), rng.randint(12, 39), rng.randint(2, 11), rng.choice(ITEMS)
        function = f"total_{item}"
        ask = (
            f"A shop has {a} boxes of {b} {item} and {c} loose {item}. Write a Python function "
            f"{function} that should return how many {item} the shop has."
        )
        messages = [system_message(self.domain, rng), {"role": "user", "content": ask}]
        task = {
            "function": function,
            "tests": [f"assert {function}() == {a * b + c}"],
            "values": {"a": str(a), "b": str(b), "c": str(c), "item": item},
        }
        return self.sample(f"{self.name}-{rng.getrandbits(40):010x}", effort, messages, task)

    def routes(self, sample: Sample) -> tuple[str, str, str, str]:
        values, function = sample.task["values"], sample.task["function"]
        a, b, c, item = int(values["a"]), int(values["b"]), int(values["c"]), values["item"]
        count = f"The shop has {a}*{b}+{c}"
        return (
            f"{count} {item}; the code computes it.",
            f"def {function}():\n    return {a} * {b} + {c}",
            f"{count} = {a * b + c} {item}.",
            f"def {function}():\n    return {a * b + c}",
        )

    def examples(self, sample: Sample) -> Examples:
        values, function = sample.task["values"], sample.task["function"]
        total = int(values["a"]) * int(values["b"]) + int(values["c"])
        return Examples(
            [f"{function}()"], [str(total)], "I run it once.", "Once is enough: it takes no input."
        )
