"""Does a multimodal stage output read the image? Two measurements that need no generation.

1. Teacher-forced answer: for `--n` drawn low-effort visual trajectories (whose thinking is the plan
   only, so the answer token is the first place the image matters), the share where the model's
   most likely token at the answer is the answer, with the trajectory's own image and with another
   trajectory's. Equal shares: the answer does not depend on the image.
2. What the visual tokens hold: per kind of question, nearest-class-mean accuracy of the answer
   from the mean projected visual token (means fitted on `--n` drawn images, scored on `--n`
   others), beside the most common answer's rate.

Images are drawn from seeds no SFT row or eval prompt uses (indices from 50,000 up).

Usage: PYTHONPATH=. python bench/visual_reading.py MODEL_DIR [--n 150] [--threads 1]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import torch

import data_recipes  # noqa: F401  (registers the task families)
from data_recipes.agent_tasks.generate import generate_trajectory
from data_recipes.agent_tasks.visual import KINDS, draw
from posttrain.data.chat import load_tokenizer
from posttrain.model.vision_model import (
    KimiK3ForConditionalGeneration,
    image_processor,
    load_pretrained,
    media_inputs,
)
from posttrain.trainers.common import renderer_for

FIRST_INDEX = 50_000


def answer_of(kind: str, facts: dict) -> str:
    return str(facts["count"] if kind == "count" else facts["digit"] if kind == "digit" else facts["tallest"])


@torch.no_grad()
def teacher_forced(model: KimiK3ForConditionalGeneration, renderer, n: int) -> dict[str, float]:
    """Answer-token accuracy with each trajectory's own image and with the next one's."""
    # generate_trajectory cycles efforts low, high, max by index: multiples of 3 are low effort
    records = [generate_trajectory("general/visual", 3 * i) for i in range(FIRST_INDEX, FIRST_INDEX + n)]
    hits = {"own image": 0, "another image": 0}
    for index, record in enumerate(records):
        ids, _ = renderer.render(record["messages"], None, "low", renderer.media_blocks(record["images"]))
        position = len(ids) - 2  # the answer, before <|im_end|>
        other = records[(index + 1) % n]["images"]
        for name, images in (("own image", record["images"]), ("another image", other)):
            logits = model(
                input_ids=torch.tensor([ids]), use_cache=False, **media_inputs(model, [images])
            ).logits
            hits[name] += int(logits[0, position - 1].argmax()) == ids[position]
    return {name: count / n for name, count in hits.items()}


def pooled_tokens(model, processor, kind: str, seeds: range) -> tuple[torch.Tensor, list[str]]:
    """The mean projected visual token of each drawn image of `kind`, and its answer."""
    drawn = [draw(kind, seed) for seed in seeds]
    batch = processor([image for image, _ in drawn])
    tokens = model.media_embeddings(batch.pixel_values, batch.grid_thws)
    return tokens.view(len(drawn), -1, tokens.shape[-1]).mean(1), [answer_of(kind, f) for _, f in drawn]


@torch.no_grad()
def centroid_probe(model: KimiK3ForConditionalGeneration, n: int) -> dict[str, tuple[float, float]]:
    """kind -> (nearest-class-mean accuracy from the mean visual token, most common answer's rate)."""
    processor = image_processor(model.config)
    out = {}
    for kind in KINDS:
        fit_x, fit_y = pooled_tokens(model, processor, kind, range(FIRST_INDEX, FIRST_INDEX + n))
        test_x, test_y = pooled_tokens(model, processor, kind, range(FIRST_INDEX + n, FIRST_INDEX + 2 * n))
        labels = sorted(set(fit_y))
        means = torch.stack([fit_x[[y == label for y in fit_y]].mean(0) for label in labels])
        guesses = [labels[i] for i in torch.cdist(test_x, means).argmin(1).tolist()]
        accuracy = sum(g == y for g, y in zip(guesses, test_y, strict=True)) / n
        out[kind] = (accuracy, Counter(test_y).most_common(1)[0][1] / n)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--n", type=int, default=150)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_pretrained(args.model_dir)
    if not isinstance(model, KimiK3ForConditionalGeneration):
        raise SystemExit(f"{args.model_dir} is not a multimodal model")
    model.eval()
    renderer = renderer_for(load_tokenizer(args.model_dir), model)
    shares = teacher_forced(model, renderer, args.n)
    print(f"{args.model_dir}: teacher-forced answer token, {args.n} low-effort trajectories")
    for name, share in shares.items():
        print(f"  with {name}: {share:.3f}")
    print("nearest-class-mean answer from the mean visual token (most common answer's rate):")
    for kind, (accuracy, common) in centroid_probe(model, args.n).items():
        print(f"  {kind:5s} {accuracy:.3f} ({common:.3f})")


if __name__ == "__main__":
    main()
