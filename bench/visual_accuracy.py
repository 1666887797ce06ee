"""How often does a multimodal stage output answer the drawn visual questions (general/visual)?

Plays `--prompts` general/visual prompts (the general environment's "eval" draw at seed 0 with
this family alone offered; each image is drawn from its own 32-bit seed, so none is an SFT row's)
as greedy episodes through the one episode loop (posttrain.envs.environments.play_episodes) with
the embedded engine over MODEL_DIR. Prints the share answered exactly with its standard error
(binomial: sqrt(p (1 - p) / n)), overall and per kind of question, beside the rate of always
giving each kind's most common answer among those prompts.

Usage: PYTHONPATH=. python bench/visual_accuracy.py MODEL_DIR [--prompts 60] [--effort high] [--threads 1]
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections import Counter
from pathlib import Path

import torch

import data_recipes  # noqa: F401  (registers the task families)
from posttrain.data.chat import load_tokenizer
from posttrain.engines import EmbeddedEngine
from posttrain.envs.environments import EnvironmentConfig, make_environment
from posttrain.model.vision_model import KimiK3ForConditionalGeneration, load_pretrained
from posttrain.qat import restore_qat
from posttrain.trainers.common import renderer_for


def share(hits: list[bool]) -> str:
    p = sum(hits) / len(hits)
    return f"{p:.3f} ± {math.sqrt(p * (1 - p) / len(hits)):.3f} (n={len(hits)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--effort", default="high")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = load_pretrained(args.model_dir)
    if not isinstance(model, KimiK3ForConditionalGeneration):
        raise SystemExit(
            f"{args.model_dir} is not a multimodal model (no vision weights its tokenizer feeds)"
        )
    restore_qat(model)
    renderer = renderer_for(load_tokenizer(args.model_dir), model.eval())
    config = EnvironmentConfig(max_turns=1, max_tokens_per_turn=96, families=["general/visual"])
    with (
        tempfile.TemporaryDirectory() as root,
        make_environment("general", renderer, config, sandbox_dir=Path(root)) as env,
    ):
        prompts = env.prompts("eval", args.prompts, seed=0)
        samples = [env.start(p, uid=p.uid, group=p.uid, effort=args.effort) for p in prompts]
        env.play(EmbeddedEngine(model, pad_token_id=renderer.pad_id), samples, env.turn_sampling(0.0, seed=0))
    hits = [s.reward == 1.0 for s in samples]
    print(f"{args.model_dir}: exact answers {share(hits)}")
    for kind in ("count", "digit", "bar"):
        chosen = [s for s in samples if s.task["kind"] == kind]
        if chosen:
            common = Counter(s.task["answer"] for s in chosen).most_common(1)[0][1] / len(chosen)
            rate = share([s.reward == 1.0 for s in chosen])
            print(f"  {kind:5s} {rate}  most-common-answer rate {common:.3f}")


if __name__ == "__main__":
    main()
