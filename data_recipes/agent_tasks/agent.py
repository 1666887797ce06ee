"""Agent-domain task families: search the shipped documents, compute, write a file, report.

Multi-turn tool use scored on the final workspace state (the file's content), which the policy
never sees: task["path"] and task["answer"] are the hidden verifier data.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from typing import Any

from data_recipes.agent_tasks.common import ToolFamily, system_message, takes_tool_route, thinking
from data_recipes.agent_tasks.tools import DOCS_DIR
from posttrain.data.sample import Sample
from posttrain.envs.tasks import TASK_FAMILIES, Episode, FinalState

FILE_NAMES = ("answer.txt", "result.txt", "report.txt", "out.txt")
# Questions and thinking name the file in quotes: `to "out.txt".` holds the bare token `out` that
# write_file's JSON argument uses, while `to out.txt.` is one superword token (` out.txt.`) the tiny
# model never learned to map to it; unquoted, the SFT model wrote the right number to answer.txt
# (`{"path": "answer.txt", "content": "` is one token) instead of the asked file (docs/data.md).
# Likewise order_total's thinking restates the quantity after the question's own words (`A customer
# orders ` is one token, the digit after it is what a copy reads): stated only in the question, 150
# tokens before the calculator call, the SFT model put a guess there (0 of 12 held-out prompts).


def _facts(document: str, pattern: str) -> list[re.Match[str]]:
    """Regex matches over one shipped document's lines (what the tasks are built from)."""
    lines = (DOCS_DIR / document).read_text().splitlines()
    return [match for line in lines if (match := re.fullmatch(pattern, line.strip()))]


def _read(results: list[str], pattern: str) -> re.Match[str]:
    """Find a fact in tool results; a demonstration reads values from what the tools returned."""
    for result in results:
        for line in result.splitlines():
            if match := re.search(pattern, line):
                return match
    raise RuntimeError(f"no tool result matched {pattern!r}: {results}")


# (plan, working, checks) of one turn's thinking, as common.thinking takes them.
Thought = tuple[str, Sequence[str], Sequence[str]]


def goes_to(path: str) -> str:
    """The file named again at the end of every turn's plan before the write, so each mention of it
    copies the one a turn back: named only in the question, two turns and three tool results before
    the write's thinking, some SFT seeds wrote a name they had learnt instead (answer.txt for any
    asked file), and which seeds did was a lottery (bench/RESULTS.md, issue #21)."""
    return f'It goes to "{path}".'


def write_then_report(
    episode: Episode, effort: str, path: str, value: str, write: Thought, written: Thought, report: str
) -> Iterator[dict[str, Any]]:
    """The last two turns of every file task: write `value` to `path`, then, once the tool has
    confirmed the write, say `report`."""
    yield episode.assistant(
        thinking(effort, *write), calls=[("write_file", {"path": path, "content": value})]
    )
    yield episode.assistant(thinking(effort, *written), content=report)


class FileAnswerFamily(ToolFamily):
    """Solved when the workspace file task["path"] holds exactly task["answer"]."""

    domain = "agent"
    tool_names = ("search", "calculator", "write_file")

    def file_task(
        self,
        rng: random.Random,
        effort: str,
        question: str | tuple[str, ...],
        answer: str,
        path: str,
        values: dict[str, str],
    ) -> Sample:
        """The prompt: a system prompt drawn from `rng`, then `question` (or one of its phrasings,
        drawn after the system prompt: that order keeps the shipped rows regenerating). The hidden
        task: `answer` written to `path`; `values` are what the demonstration looks up."""
        system = system_message(self.domain, rng)
        if not isinstance(question, str):
            question = rng.choice(question)
        messages = [system, {"role": "user", "content": question}]
        task = {"answer": answer, "path": path, "values": values}
        return self.sample(f"{self.name}-{rng.getrandbits(40):010x}", effort, messages, task)

    def verify(self, sample: Sample, state: FinalState) -> float:
        written = state.files.get(sample.task["path"])
        return float(written is not None and written.strip() == sample.task["answer"])


def product_query(product: str) -> str:
    """The catalog search for `product`, a verbatim piece of the thinking ("I need the X price").

    A query that opens with the product name tokenises its first word without the leading space it
    has in the prompt and the thinking ('Canyon' against ' Canyon'), so the call cannot copy the
    name token for token; one SFT seed learnt that mapping badly and searched another product in
    three of four order_cost and order_total episodes (bench/RESULTS.md). After "the" the name's
    tokens are the prompt's own.
    """
    return f"the {product} price"


PRODUCT = r"(?P<product>[A-Z]\w+ [A-Z]\w+): price (?P<price>\d+) dollars, weight (?P<weight>\d+) grams\."
REGION = r"(?P<region>\w+) region: shipping fee (?P<fee>\d+) dollars per order\."
STAFF = r"(?P<person>\w+ \w+) works in the (?P<team>\w+) team at the (?P<city>\w+) office\."
OFFICE = r"(?P<city>\w+) office: opened in (?P<year>\d+), (?P<floors>\d+) floors, (?P<desks>\d+) desks\."


@TASK_FAMILIES.register("agent/order_total")
class OrderTotal(FileAnswerFamily):
    """Price x quantity + shipping fee, looked up in two documents, written to a file."""

    name = "agent/order_total"

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        product = rng.choice(_facts("catalog.txt", PRODUCT))
        region = rng.choice(_facts("shipping.txt", REGION))
        quantity, path = rng.randint(2, 9), rng.choice(FILE_NAMES)
        question = (
            f"A customer orders {quantity} {product['product']} units to the {region['region']} region. "
            f'Find the total cost in dollars and write only the number to "{path}".'
        )
        total = quantity * int(product["price"]) + int(region["fee"])
        values = {"product": product["product"], "region": region["region"], "quantity": str(quantity)}
        return self.file_task(rng, effort, question, str(total), path, values)

    def demonstration(self, sample: Sample, episode: Episode) -> Iterator[dict[str, Any]]:
        values, path, effort = sample.task["values"], sample.task["path"], sample.effort
        product, region, quantity = values["product"], values["region"], values["quantity"]
        yield episode.assistant(
            thinking(
                effort,
                f"A customer orders {quantity} units. I need the {product} price and the {region} "
                f"shipping fee. {goes_to(path)}",
                ["The catalog has prices and the shipping document has fees.", "I search both at once."],
                ["The fee is charged once per order, not per unit."],
            ),
            calls=[
                ("search", {"query": product_query(product)}),
                ("search", {"query": f"{region} region shipping fee"}),
            ],
        )
        price = _read(episode.results(), rf"{product}: price (\d+)").group(1)
        fee = _read(episode.results(), rf"{region} region: shipping fee (\d+)").group(1)
        expression = f"{quantity}*{price}+{fee}"
        yield episode.assistant(
            thinking(
                effort,
                f"A customer orders {quantity} units, price {price}, fee {fee}: the total is {expression}. "
                + goes_to(path),
                [f"{quantity} units at {price} dollars each, plus one fee of {fee}."],
                [f"Check: {expression} adds the fee once."],
            ),
            calls=[("calculator", {"expression": expression})],
        )
        total = episode.results()[0]
        yield from write_then_report(
            episode,
            effort,
            path,
            total,
            (f'The total is {total}. I write it to "{path}".', [], ["Only the number goes in the file."]),
            ("The file is written.", [], [f'The tool confirmed the write to "{path}".']),
            f'The total is {total} dollars. I wrote it to "{path}".',
        )


@TASK_FAMILIES.register("agent/staff_office")
class StaffOffice(FileAnswerFamily):
    """Find the city a person works in and save it."""

    name = "agent/staff_office"

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        person, path = rng.choice(_facts("staff.txt", STAFF)), rng.choice(FILE_NAMES)
        asks = (
            f'In which city does {person["person"]} work? Save the city name to "{path}".',
            f'Look up the office city of {person["person"]} and write it to "{path}".',
        )
        return self.file_task(rng, effort, asks, person["city"], path, {"person": person["person"]})

    def demonstration(self, sample: Sample, episode: Episode) -> Iterator[dict[str, Any]]:
        person, path, effort = sample.task["values"]["person"], sample.task["path"], sample.effort
        yield episode.assistant(
            thinking(
                effort,
                f"Search the staff directory for {person}. {goes_to(path)}",
                ["The directory lists each person's team and office city."],
                ["If two people share a name I would need to ask, so I check the hit."],
            ),
            calls=[("search", {"query": person})],
        )
        city = _read(episode.results(), rf"{person} works in the \w+ team at the (\w+) office").group(1)
        yield from write_then_report(
            episode,
            effort,
            path,
            city,
            (f"{person} works at the {city} office.", [f'I save {city} to "{path}".'], []),
            ("Saved.", [], [f'The write to "{path}" succeeded.']),
            f'{person} works in {city}. I saved it to "{path}".',
        )


@TASK_FAMILIES.register("agent/desks_per_floor")
class DesksPerFloor(FileAnswerFamily):
    """Average desks per floor of an office: search, divide, write."""

    name = "agent/desks_per_floor"

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        office, path = rng.choice(_facts("offices.txt", OFFICE)), rng.choice(FILE_NAMES)
        question = (
            f"How many desks per floor does the {office['city']} office have on average? "
            f'Write the number to "{path}".'
        )
        answer = str(int(office["desks"]) // int(office["floors"]))
        return self.file_task(rng, effort, question, answer, path, {"city": office["city"]})

    def demonstration(self, sample: Sample, episode: Episode) -> Iterator[dict[str, Any]]:
        city, path, effort = sample.task["values"]["city"], sample.task["path"], sample.effort
        yield episode.assistant(
            thinking(
                effort,
                f"Find the {city} office's floors and desks. {goes_to(path)}",
                ["The offices document lists floors and desks per office."],
                ["I search with the words floors and desks so the office line ranks first."],
            ),
            calls=[("search", {"query": f"{city} office floors desks"})],
        )
        found = _read(episode.results(), rf"{city} office: opened in \d+, (\d+) floors, (\d+) desks")
        floors, desks = found.group(1), found.group(2)
        expression = f"{desks}/{floors}"
        yield episode.assistant(
            thinking(
                effort,
                f"{desks} desks over {floors} floors: {expression}. {goes_to(path)}",
                ["Divide desks by floors."],
                [],
            ),
            calls=[("calculator", {"expression": expression})],
        )
        average = episode.results()[0]
        yield from write_then_report(
            episode,
            effort,
            path,
            average,
            (
                f"The average is {average}.",
                [f'I write {average} to "{path}".'],
                [f"{average}*{floors} = {desks}."],
            ),
            ("Written.", [], [f'The file "{path}" now holds {average}.']),
            f'The {city} office has {average} desks per floor on average. I wrote it to "{path}".',
        )


@TASK_FAMILIES.register("agent/order_cost")
class OrderCost(FileAnswerFamily):
    """Quantity x price, written to a file, by one of two routes: a choice RL can select.

    The other agent families are one fixed sequence of tool calls each, so group advantages have no
    behaviour to select there (bench/RESULTS.md, issue #21). Here the demonstrations part at one
    token: route A computes `q*price` with the calculator, route B states the product in the
    thinking and writes it (`takes_tool_route`). Both are correct in the data; the tiny model cannot
    multiply two-digit numbers, so in its own episodes only route A succeeds, and RL's max
    specialist learns to take it (bench/RESULTS.md).
    """

    name = "agent/order_cost"

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        product = rng.choice(_facts("catalog.txt", PRODUCT))
        quantity, path = rng.randint(12, 39), rng.choice(FILE_NAMES)
        question = (
            f"A customer orders {quantity} {product['product']} units. "
            f'Find the cost in dollars, without shipping, and write only the number to "{path}".'
        )
        cost = quantity * int(product["price"])
        values = {"product": product["product"], "quantity": str(quantity)}
        return self.file_task(rng, effort, question, str(cost), path, values)

    def demonstration(self, sample: Sample, episode: Episode) -> Iterator[dict[str, Any]]:
        values, path, effort = sample.task["values"], sample.task["path"], sample.effort
        product, quantity = values["product"], values["quantity"]
        yield episode.assistant(
            thinking(
                effort,
                f"A customer orders {quantity} units. I need the {product} price. {goes_to(path)}",
                ["The catalog has the prices.", "Shipping is not asked for."],
                ["The price is per unit, so the cost is the quantity times the price."],
            ),
            calls=[("search", {"query": product_query(product)})],
        )
        price = _read(episode.results(), rf"{product}: price (\d+)").group(1)
        expression = f"{quantity}*{price}"
        plan = f"A customer orders {quantity} units at {price} dollars. I compute {expression}"
        if takes_tool_route(sample.uid):
            yield episode.assistant(
                thinking(
                    effort,
                    f"{plan} with the calculator. {goes_to(path)}",
                    [f"{quantity} units at {price} dollars each."],
                    [f"Check: {expression} multiplies the units by the price."],
                ),
                calls=[("calculator", {"expression": expression})],
            )
            cost = episode.results()[0]
        else:
            cost = str(int(quantity) * int(price))
            yield episode.assistant(
                thinking(
                    effort,
                    f"{plan} = {cost}. {goes_to(path)}",
                    [f'I write {cost} to "{path}".'],
                    ["Only the number goes in the file."],
                ),
                calls=[("write_file", {"path": path, "content": cost})],
            )
            yield episode.assistant(
                thinking(effort, "The file is written.", [], [f'The tool confirmed the write to "{path}".']),
                content=f'The cost is {cost} dollars. I wrote it to "{path}".',
            )
            return
        yield from write_then_report(
            episode,
            effort,
            path,
            cost,
            (f'The cost is {cost}. I write it to "{path}".', [], ["Only the number goes in the file."]),
            ("The file is written.", [], [f'The tool confirmed the write to "{path}".']),
            f'The cost is {cost} dollars. I wrote it to "{path}".',
        )
