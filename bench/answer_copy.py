"""Does a model give the answer its own correct reasoning states? A diagnostic for SFT models.

For the general domain's held-out prompts (the RL stages' eval prompts, `eval.seed` 0) it renders
each family's verified demonstration (gold thinking and answer) and asks the model, teacher-forced,
for the first answer token after the last `</think>`. A model that reasons right but answers at
chance there loses every such episode, and RL's group advantages then punish correct thinking as
often as they reward it (docs/rl.md). Prints, per family, the share of prompts whose first answer
token is the model's top-1 and its mean probability.

    python bench/answer_copy.py runs/mopd/sft/model --effort max
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from posttrain.data.chat import load_tokenizer  # noqa: E402
from posttrain.envs.environments import EnvironmentConfig, make_environment  # noqa: E402
from posttrain.envs.tasks import TASK_FAMILIES  # noqa: E402
from posttrain.model.vision_model import load_pretrained  # noqa: E402
from posttrain.qat import apply_qat  # noqa: E402
from posttrain.trainers.common import renderer_for  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a stage's model/ directory")
    parser.add_argument("--effort", default="max", choices=("low", "high", "max"))
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--qat", default="k3", help="QAT scheme the stages ran with (none: off)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = load_tokenizer(args.model)
    model = load_pretrained(args.model)
    apply_qat(model, {"scheme": args.qat})
    model.eval()
    renderer = renderer_for(tokenizer, model)
    env = make_environment("general", renderer, EnvironmentConfig())
    end_think = tokenizer.convert_tokens_to_ids("</think>")
    top1: dict[str, int] = defaultdict(int)
    prob: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for drawn in env.prompts("eval", args.prompts, 0):
        prompt = dataclasses.replace(drawn, effort=args.effort)  # the demonstration thinks at this effort
        family = prompt.task["family"]
        messages = TASK_FAMILIES.get(family)().demonstrate(prompt)
        ids, _ = renderer.render(messages, prompt.tools, effort=args.effort)
        last = max(i for i, token in enumerate(ids) if token == end_think)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids[: last + 1]])).logits[0, -1].float()
        target = ids[last + 1]
        top1[family] += int(logits.argmax().item() == target)
        prob[family] += torch.softmax(logits, -1)[target].item()
        count[family] += 1
    print(f"{args.model} (effort {args.effort}): first answer token after the gold thinking")
    print("| family | top-1 | mean p |\n| --- | ---: | ---: |")
    for family in sorted(count):
        n = count[family]
        print(f"| {family} | {top1[family]}/{n} | {prob[family] / n:.2f} |")


if __name__ == "__main__":
    main()
