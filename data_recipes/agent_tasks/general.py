"""General-domain task families: word arithmetic and unit conversions with a calculator, order
puzzles, reading.

Every answer is exact (a number or a name) and checked by normalised string match.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any, NamedTuple

from data_recipes.agent_tasks.common import (
    ToolFamily,
    normalise_answer,
    system_message,
    takes_tool_route,
    thinking,
)
from data_recipes.agent_tasks.tools import calculate
from posttrain.data.sample import Sample
from posttrain.envs.tasks import TASK_FAMILIES, Episode, FinalState

NAMES = ("Ana", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea")


class ExactAnswerFamily(ToolFamily):
    """The final answer must equal task["answer"] after `normalise_answer`."""

    @staticmethod
    def answer_content(answer: str) -> str:
        """The final content a demonstration gives: a word answer after a space, so it is written
        in the tokens of its mentions ("than Jun." ends in " Jun"). The shipped BPE has another token
        for the bare word that opens a content ("Jun"), and the tiny model never learned to map one
        to the other: taught the bare word, its answer after "The shortest is Jun.</think>" was a
        name at chance (docs/rl.md). Digits are one token each either way; verifiers strip spaces."""
        return f" {answer}" if answer[:1].isalpha() else answer

    def verify(self, sample: Sample, state: FinalState) -> float:
        return float(normalise_answer(state.answer) == normalise_answer(sample.task["answer"]))


# (question, expression, working) with a, b, c the numbers and n a person's name.
ARITHMETIC_TEMPLATES = (
    (
        "A shop has {a} boxes of {b} pens and {c} loose pens. How many pens are there in total?",
        "{a}*{b}+{c}",
        ["There are {a} boxes of {b} pens, so {a}*{b} pens in boxes.", "Then add the {c} loose pens."],
    ),
    (
        "A farm has {a} rows of {b} trees. {c} trees are cut down. How many trees remain?",
        "{a}*{b}-{c}",
        ["{a} rows of {b} trees is {a}*{b} trees.", "Removing {c} trees leaves {a}*{b}-{c}."],
    ),
    (
        "{n} has {a} coins, spends {c} and then earns {b}. How many coins does {n} have now?",
        "{a}-{c}+{b}",
        ["{n} starts with {a} coins.", "Spending {c} and earning {b} gives {a}-{c}+{b}."],
    ),
    (
        "A bus carries {b} people on each of {a} trips, plus {c} people on a last trip. "
        "How many people ride?",
        "{a}*{b}+{c}",
        ["{a} full trips of {b} people is {a}*{b}.", "The last trip adds {c}."],
    ),
    (
        "What is {a} times {b} plus {c}?",
        "{a}*{b}+{c}",
        ["Multiply {a} by {b} first.", "Then add {c}."],
    ),
)


@TASK_FAMILIES.register("general/arithmetic")
class Arithmetic(ExactAnswerFamily):
    """Word problems, answered by one of two routes like unit_cost: one calculator call, or the
    result stated in the thinking (`takes_tool_route`), which the tiny model cannot compute."""

    name = "general/arithmetic"
    domain = "general"
    tool_names = ("calculator",)

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        template = rng.randrange(len(ARITHMETIC_TEMPLATES))
        question, expression, _ = ARITHMETIC_TEMPLATES[template]
        values = {
            "a": rng.randint(3, 40),
            "b": rng.randint(3, 40),
            "c": rng.randint(2, 30),
            "n": rng.choice(NAMES),
        }
        if template == 2:
            values["c"] = rng.randint(1, values["a"])
        messages = [system_message(self.domain, rng), {"role": "user", "content": question.format(**values)}]
        expression = expression.format(**values)
        task = {
            "answer": calculate(expression),
            "expression": expression,
            "template": str(template),
            "values": {key: str(value) for key, value in values.items()},
        }
        return self.sample(f"{self.name}-{rng.getrandbits(40):010x}", effort, messages, task)

    def demonstration(self, sample: Sample, episode: Episode) -> Iterator[dict[str, Any]]:
        expression, answer, effort = sample.task["expression"], sample.task["answer"], sample.effort
        template = ARITHMETIC_TEMPLATES[int(sample.task["template"])]
        values = sample.task["values"]
        working = [line.format(**values) for line in template[2]]
        if not takes_tool_route(sample.uid):
            check = f"Check: {expression} uses every number in the question."
            yield episode.assistant(
                thinking(effort, f"The answer is {expression} = {answer}.", working, [check]), content=answer
            )
            return
        check = f"Check: the calculator computes {values['a']}*{values['b']} exactly."
        plan = f"The answer is {expression}; I will use the calculator."
        yield episode.assistant(
            thinking(effort, plan, working, [check]), calls=[("calculator", {"expression": expression})]
        )
        result = episode.results()[0]
        checks = [f"Check: {result} is a whole number, as a count must be, so it stands."]
        # As unit_cost's: at low effort the answer follows the result unrestated (the low budget).
        reading = thinking(effort, f"The calculator gives {result}.", ["That is the final count."], checks)
        yield episode.assistant("" if effort == "low" else reading, content=result)


RELATIONS = (
    ("taller", "shortest", "tallest"),
    ("older", "youngest", "oldest"),
    ("faster", "slowest", "fastest"),
)


@TASK_FAMILIES.register("general/ordering")
class Ordering(ExactAnswerFamily):
    """Order puzzles: from 'X is taller than Y' facts, name the extreme person. No tools."""

    name = "general/ordering"
    domain = "general"
    tool_names = ()

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        relation, low, high = rng.choice(RELATIONS)
        people = rng.sample(NAMES, rng.choice((3, 4)))
        facts = [f"{people[i]} is {relation} than {people[i + 1]}." for i in range(len(people) - 1)]
        rng.shuffle(facts)
        ask_low = rng.random() < 0.5
        question = f"{' '.join(facts)} Who is the {low if ask_low else high}?"
        messages = [system_message(self.domain, rng), {"role": "user", "content": question}]
        answer = people[-1] if ask_low else people[0]
        task = {"answer": answer, "order": people, "relation": relation, "asked": low if ask_low else high}
        return self.sample(f"{self.name}-{rng.getrandbits(40):010x}", effort, messages, task)

    def demonstration(self, sample: Sample, episode: Episode) -> Iterator[dict[str, Any]]:
        people, relation = sample.task["order"], sample.task["relation"]
        chain = " > ".join(people)
        plan = f"Ordering by {relation}: {chain}. The {sample.task['asked']} is {sample.task['answer']}."
        working = [f"{people[i]} is {relation} than {people[i + 1]}." for i in range(len(people) - 1)]
        working.append("Chaining these facts gives one order.")
        checks = [
            f"Check: nobody is {relation} than {people[0]}, and {people[-1]} is {relation} than nobody."
        ]
        yield episode.assistant(
            thinking(sample.effort, plan, working, checks), content=self.answer_content(sample.task["answer"])
        )


# (fact template, question template, what the answer is) over one attribute of several people.
LOOKUP_ATTRIBUTES = (
    ("{n} is {v} years old.", "How old is {n}?", "age", tuple(str(v) for v in range(6, 61))),
    ("{n} lives in {v}.", "Where does {n} live?", "city", ("Oslo", "Lima", "Rome", "Kyiv", "Hanoi", "Quito")),
    (
        "{n} has {v} books.",
        "How many books does {n} have?",
        "number of books",
        tuple(str(v) for v in range(2, 41)),
    ),
    ("{n}'s desk is in room {v}.", "Which room is {n}'s desk in?", "room", tuple(map(str, range(101, 131)))),
)


@TASK_FAMILIES.register("general/lookup")
class Lookup(ExactAnswerFamily):
    """Reading: the answer is one fact among several stated in the question. No tools.

    The working restates the facts and picks the asked one, so a longer thinking puts the answer
    next to where it is written, which is what makes higher effort more accurate here.
    """

    name = "general/lookup"
    domain = "general"
    tool_names = ()

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        attribute = rng.randrange(len(LOOKUP_ATTRIBUTES))
        fact, question, _, values = LOOKUP_ATTRIBUTES[attribute]
        people = rng.sample(NAMES, rng.choice((3, 4)))
        chosen = rng.sample(values, len(people))
        asked = rng.randrange(len(people))
        facts = " ".join(fact.format(n=name, v=value) for name, value in zip(people, chosen, strict=True))
        content = f"{facts} {question.format(n=people[asked])}"
        messages = [system_message(self.domain, rng), {"role": "user", "content": content}]
        task = {
            "answer": chosen[asked],
            "attribute": str(attribute),
            "people": people,
            "values": chosen,
            "asked": people[asked],
        }
        return self.sample(f"{self.name}-{rng.getrandbits(40):010x}", effort, messages, task)

    def demonstration(self, sample: Sample, episode: Episode) -> Iterator[dict[str, Any]]:
        fact, _, what, _ = LOOKUP_ATTRIBUTES[int(sample.task["attribute"])]
        asked, answer = sample.task["asked"], sample.task["answer"]
        plan = f"The question asks for the {what} of {asked}."
        stated = zip(sample.task["people"], sample.task["values"], strict=True)
        working = [fact.format(n=name, v=value) for name, value in stated]
        working.append(f"So {fact.format(n=asked, v=answer)}")
        others = [name for name in sample.task["people"] if name != asked]
        checks = [f"Check: the fact about {asked} is the only one naming {asked}, not {' or '.join(others)}."]
        yield episode.assistant(
            thinking(sample.effort, plan, working, checks), content=self.answer_content(answer)
        )


ITEMS = ("pens", "cups", "lamps", "books", "chairs", "tickets", "plates", "boxes")


@TASK_FAMILIES.register("general/unit_cost")
class UnitCost(ExactAnswerFamily):
    """Count x unit price, answered by one of two routes: a choice RL can select (issue #21).

    The other general families decide per prompt (which name, which fact), so group advantages
    have no behaviour shared across prompts to select (bench/RESULTS.md). Here the demonstrations
    part at one token: with the calculator (then the answer in a second turn), or the product
    stated in the thinking and answered at once (`takes_tool_route`). The tiny model cannot multiply
    two-digit numbers, so in its own episodes only the calculator route succeeds.
    """

    name = "general/unit_cost"
    domain = "general"
    tool_names = ("calculator",)

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        values = {"n": rng.choice(NAMES), "q": rng.randint(12, 39), "p": rng.randint(12, 60)}
        values["item"] = rng.choice(ITEMS)
        question = "{n} buys {q} {item} at {p} dollars each. How many dollars does {n} pay?".format(**values)
        messages = [system_message(self.domain, rng), {"role": "user", "content": question}]
        task = {
            "answer": str(values["q"] * values["p"]),
            "values": {key: str(value) for key, value in values.items()},
        }
        return self.sample(f"{self.name}-{rng.getrandbits(40):010x}", effort, messages, task)

    def demonstration(self, sample: Sample, episode: Episode) -> Iterator[dict[str, Any]]:
        values = sample.task["values"]
        q, p, item = values["q"], values["p"], values["item"]
        expression = f"{q}*{p}"
        plan = f"{values['n']} buys {q} {item} at {p} dollars. I compute {expression}"
        yield from product_routes(sample, episode, plan, [f"{q} {item} at {p} dollars each."], expression)


class RouteChecks(NamedTuple):
    """What a product family's two routes check at max effort: the mental route's fact, what the
    calculator's expression multiplies ("Check: 12*34 multiplies the count by the price."), and
    the check after the result."""

    mental: str
    multiplies: str
    reading: str


PRICE_CHECKS = RouteChecks("The price is per item.", "the count by the price", "That is the total price.")


def product_routes(
    sample: Sample,
    episode: Episode,
    plan: str,
    working: list[str],
    expression: str,
    checks: RouteChecks = PRICE_CHECKS,
) -> Iterator[dict[str, Any]]:
    """unit_cost's two routes after a plan ending at the product's expression (general/unit_convert
    and general/visual_cost share them): the product stated in the thinking and answered at once,
    or the calculator called on `expression` and its result answered (`takes_tool_route` picks by
    uid)."""
    effort = sample.effort
    if not takes_tool_route(sample.uid):
        answer = sample.task["answer"]
        yield episode.assistant(
            thinking(effort, f"{plan} = {answer}.", working, [checks.mental]), content=answer
        )
        return
    yield episode.assistant(
        thinking(
            effort,
            f"{plan} with the calculator.",
            working,
            [f"Check: {expression} multiplies {checks.multiplies}."],
        ),
        calls=[("calculator", {"expression": expression})],
    )
    result = episode.results()[0]
    # At low effort the answer follows the call without restating it: the calculator route then
    # thinks no longer than the mental one, whose thinking is shorter by the call's turn, and the
    # low budget no longer scores the working route's successes below the failing route's
    # failures (bench/RESULTS.md, "Why seed 2's general-low specialist kept the failing route").
    reading = (
        "" if effort == "low" else thinking(effort, f"The calculator gives {result}.", [], [checks.reading])
    )
    yield episode.assistant(reading, content=result)


# (the unit asked for, the unit given, how many of the first make one of the second)
CONVERSIONS = (("minutes", "hours", 60), ("hours", "days", 24), ("days", "weeks", 7), ("inches", "feet", 12))


@TASK_FAMILIES.register("general/unit_convert")
class UnitConvert(ExactAnswerFamily):
    """A count in one unit converted to a smaller one (17 hours in minutes), answered by one of
    unit_cost's two routes: the calculator, or the product stated in the thinking, which the tiny
    model cannot compute. The factor is the one fact to recall, from four the data repeat ~50
    times each.

    It replaced general/elements (deleted), element facts the tiny model almost never recalled
    and RL never moved, neither recalled nor looked up with a periodic-table tool (the model
    miscopied the rare name tokens): general's max gain then rested on two route families, and a
    seed whose SFT model already took both routes had nothing left to gain (bench/RESULTS.md,
    issue #21)."""

    name = "general/unit_convert"
    domain = "general"
    tool_names = ("calculator",)

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        small, big, factor = rng.choice(CONVERSIONS)
        q = rng.randint(12, 39)
        question = f"How many {small} are there in {q} {big}?"
        messages = [system_message(self.domain, rng), {"role": "user", "content": question}]
        task = {
            "answer": str(q * factor),
            "values": {"q": str(q), "small": small, "big": big, "factor": str(factor)},
        }
        return self.sample(f"{self.name}-{rng.getrandbits(40):010x}", effort, messages, task)

    def demonstration(self, sample: Sample, episode: Episode) -> Iterator[dict[str, Any]]:
        values = sample.task["values"]
        q, small, big, factor = values["q"], values["small"], values["big"], values["factor"]
        expression = f"{q}*{factor}"
        plan = f"One of the {big} is {factor} {small}. I compute {expression}"
        checks = RouteChecks(
            f"The count is in {small}.",
            f"the {big} by {factor}",
            f"That is the number of {small}.",
        )
        yield from product_routes(
            sample, episode, plan, [f"{q} {big} of {factor} {small} each."], expression, checks
        )
