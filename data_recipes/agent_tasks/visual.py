"""The general domain's visual questions: an image drawn with Pillow from the prompt's seed and a
question with one exact answer (how many shapes, which digit, which bar is tallest).

Nothing is downloaded: `draw` is a pure function of (kind, seed), so a prompt's image is redrawn
bit for bit from ``task["seed"]`` and the PNG data URI in ``Sample.images`` is reproducible. Digits
are seven-segment glyphs (no font file), shapes never overlap, bars differ in height by at least a
tenth of the chart. The image is 112 x 112 px: 8 x 8 patches of 14 px, 16 visual tokens after
MoonViT's 2 x 2 merge, and exactly the tiny vision preset's position table (no resize).

general/visual_cost reads a drawn digit as a count and prices it: the visual twin of
general/unit_cost's route choice (the calculator, or the product stated in the thinking).

Both families are opt-in (`TaskFamily.opt_in`): an environment offers one only when its config
lists it (`environments.general.families`), so the text-only default run never meets an image.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from PIL import Image, ImageDraw

from data_recipes.agent_tasks.common import system_message, thinking
from data_recipes.agent_tasks.general import ITEMS, NAMES, ExactAnswerFamily, product_routes
from posttrain.data.images import image_to_data_uri
from posttrain.data.sample import Sample
from posttrain.envs.tasks import TASK_FAMILIES, Episode

SIZE = 112
KINDS = ("count", "digit", "bar")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
SHAPES = ("circle", "square")
BACKGROUND = (255, 255, 255)
# Seven-segment glyphs: which of segments a (top) b c (right) d (bottom) e f (left) g (middle) light.
SEGMENTS = {
    "0": "abcdef",
    "1": "bc",
    "2": "abged",
    "3": "abgcd",
    "4": "fgbc",
    "5": "afgcd",
    "6": "afgedc",
    "7": "abc",
    "8": "abcdefg",
    "9": "abfgcd",
}
QUESTIONS = {
    "count": "How many {shape}s are in the image? Answer with a number.",
    "digit": "Which digit is shown in the image? Answer with the digit.",
    "bar": "In the bar chart, which bar is the tallest, counting from the left? Answer with a number.",
}


def draw(kind: str, seed: int) -> tuple[Image.Image, dict[str, Any]]:
    """(the 112 x 112 RGB image, what it shows) for a kind of question and a seed.

    count: 1-6 shapes of one kind (circles or squares) plus 0-3 distractors of the other kind;
    facts {"shape", "count"}. digit: one seven-segment digit in a random colour and place; {"digit"}.
    bar: 3-5 bars of distinct heights; {"bars", "tallest"} (1-based from the left).
    """
    image, facts, _ = draw_scene(kind, seed)
    return image, facts


def draw_scene(kind: str, seed: int) -> tuple[Image.Image, dict[str, Any], dict[str, Any]]:
    """`draw`'s image and facts plus the whole scene, question-independent: {"circle": n,
    "square": m} for count (distractors included), {"digit": d} for digit, {"heights": [tenths, ...]}
    for bar. The vision pre-alignment (data_recipes/pretrain_vision.py) learns to read scenes."""
    rng = random.Random(f"visual:{kind}:{seed}")
    image = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    pen = ImageDraw.Draw(image)
    if kind == "count":
        shape = rng.choice(SHAPES)
        other = SHAPES[1 - SHAPES.index(shape)]
        count = rng.randint(1, 6)
        cells = rng.sample(range(16), count + rng.randint(0, 3))  # a 4 x 4 grid of 28 px cells
        for index, cell in enumerate(cells):
            _shape(pen, shape if index < count else other, cell, rng)
        return image, {"shape": shape, "count": count}, {shape: count, other: len(cells) - count}
    if kind == "digit":
        digit = str(rng.randint(0, 9))
        _seven_segment(
            pen, digit, rng.randint(20, 56), rng.randint(10, 30), rng.choice(list(COLOURS.values()))
        )
        return image, {"digit": digit}, {"digit": digit}
    if kind == "bar":
        bars = rng.randint(3, 5)
        heights = rng.sample(range(2, 11), bars)  # tenths of the chart, all distinct
        width = (SIZE - 16) // bars
        colour = rng.choice(list(COLOURS.values()))
        pen.line([(6, SIZE - 8), (SIZE - 6, SIZE - 8)], fill=(0, 0, 0), width=2)
        for index, height in enumerate(heights):
            left = 8 + index * width
            top = SIZE - 8 - height * (SIZE - 20) // 10
            pen.rectangle([left + 3, top, left + width - 3, SIZE - 9], fill=colour)
        facts = {"bars": bars, "tallest": heights.index(max(heights)) + 1}
        return image, facts, {"heights": heights}
    raise ValueError(f"visual question kind {kind!r}: expected one of {', '.join(KINDS)}")


def _shape(pen: ImageDraw.ImageDraw, shape: str, cell: int, rng: random.Random) -> None:
    """A shape of radius 7-10 px inside grid cell `cell` (28 px cells), in a random colour."""
    radius = rng.randint(7, 10)
    cx = (cell % 4) * 28 + 14 + rng.randint(-3, 3)
    cy = (cell // 4) * 28 + 14 + rng.randint(-3, 3)
    box = [cx - radius, cy - radius, cx + radius, cy + radius]
    colour = rng.choice(list(COLOURS.values()))
    if shape == "circle":
        pen.ellipse(box, fill=colour)
    else:
        pen.rectangle(box, fill=colour)


def _seven_segment(pen: ImageDraw.ImageDraw, digit: str, left: int, top: int, colour: tuple) -> None:
    """A 36 x 72 px seven-segment digit with its top-left corner at (left, top)."""
    w, h, t = 36, 72, 7
    half = top + h // 2
    boxes = {
        "a": (left, top, left + w, top + t),
        "b": (left + w - t, top, left + w, half),
        "c": (left + w - t, half, left + w, top + h),
        "d": (left, top + h - t, left + w, top + h),
        "e": (left, half, left + t, top + h),
        "f": (left, top, left + t, half),
        "g": (left, half - t // 2, left + w, half + t // 2),
    }
    for segment in SEGMENTS[digit]:
        pen.rectangle(boxes[segment], fill=colour)


@TASK_FAMILIES.register("general/visual")
class VisualQuestions(ExactAnswerFamily):
    """One drawn image, one question with an exact answer; no tools."""

    name = "general/visual"
    domain = "general"
    opt_in = True

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        kind = rng.choice(KINDS)
        seed = rng.getrandbits(32)
        image, facts = draw(kind, seed)
        question = QUESTIONS[kind].format(**facts)
        answer = str(
            facts["count"] if kind == "count" else facts["digit"] if kind == "digit" else facts["tallest"]
        )
        user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
        task = {"answer": answer, "kind": kind, "seed": seed, "facts": facts}
        sample = self.sample(
            f"{self.name}-{kind}-{seed:08x}", effort, [system_message(self.domain, rng), user], task
        )
        sample.images = [image_to_data_uri(image)]
        return sample

    def demonstration(self, sample: Sample, episode: Episode) -> Iterator[dict[str, Any]]:
        kind, facts, answer = sample.task["kind"], sample.task["facts"], sample.task["answer"]
        if kind == "count":
            plan = f"I count the {facts['shape']}s in the image."
            working = [f"There are {answer} {facts['shape']}s; other shapes do not count."]
        elif kind == "digit":
            plan = "I read the lit segments of the digit."
            working = [f"The segments {SEGMENTS[answer]} are lit, which is {answer}."]
        else:
            plan = f"I compare the heights of the {facts['bars']} bars."
            working = [f"Bar {answer} from the left is the tallest."]
        checks = [f"Check: the answer is a single number, {answer}."]
        yield episode.assistant(thinking(sample.effort, plan, working, checks), content=answer)


@TASK_FAMILIES.register("general/visual_cost")
class VisualCost(ExactAnswerFamily):
    """A drawn digit (2-9) is how many items someone buys at a stated price: read the digit, then
    multiply, by one of two routes (issue #22).

    general/visual's specialists did not rise above the SFT model: with the tower fixed, RL moved
    the answers' prior, not the reading (bench/RESULTS.md). Here, as in general/unit_cost, half the
    demonstrations call the calculator on digit*price and half state the product in the thinking
    (`takes_tool_route`); the tiny model cannot multiply a two-digit price in its head, so only the
    calculator route succeeds, and group advantages have one behaviour, the same on every image, to
    select. Both routes need the digit read right, so the gain stays a visual question's.
    """

    name = "general/visual_cost"
    domain = "general"
    opt_in = True
    tool_names = ("calculator",)

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        seed = rng.getrandbits(32)
        image, facts = draw("digit", seed)
        while facts["digit"] in "01":  # 0 and 1 need no multiplying
            seed = rng.getrandbits(32)
            image, facts = draw("digit", seed)
        values = {"n": rng.choice(NAMES), "price": str(rng.randint(12, 60)), "item": rng.choice(ITEMS)}
        question = (
            "{n} buys as many {item} as the digit in the image shows, at {price} dollars each. "
            "How many dollars does {n} pay?"
        ).format(**values)
        user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
        answer = str(int(facts["digit"]) * int(values["price"]))
        task = {"answer": answer, "kind": "digit_cost", "seed": seed, "facts": facts, "values": values}
        sample = self.sample(
            f"{self.name}-{seed:08x}", effort, [system_message(self.domain, rng), user], task
        )
        sample.images = [image_to_data_uri(image)]
        return sample

    def demonstration(self, sample: Sample, episode: Episode) -> Iterator[dict[str, Any]]:
        digit, values = sample.task["facts"]["digit"], sample.task["values"]
        expression = f"{digit}*{values['price']}"
        # The segments before the digit, at every effort (general/visual's digit demonstrations read
        # them first too): named first, the digit was a guess the next words only rationalised, and
        # two of three SFT seeds' calculator routes solved 11% (bench/RESULTS.md).
        plan = (
            f"The segments {SEGMENTS[digit]} are lit, which is {digit}, so {values['n']} buys {digit} "
            f"{values['item']}. I compute {expression}"
        )
        working = [f"{digit} {values['item']} at {values['price']} dollars each."]
        yield from product_routes(sample, episode, plan, working, expression)
