"""How often does a multimodal stage output answer the drawn visual questions (general/visual)?

Plays `--prompts` general/visual prompts (the general environment's "eval" draw at seed 0 with
this family alone offered; each image is drawn from its own 32-bit seed, so none is an SFT row's)
as greedy episodes through the one episode loop (posttrain.envs.environments.play_episodes) with
the embedded engine over MODEL_DIR. Prints the share answered exactly with its standard error
(binomial: sqrt(p (1 - p) / n)), overall and per kind of question, beside the rate of always
giving each kind's most common answer among those prompts.

With several MODEL_DIRs (an SFT model first, then stages trained from it) every model plays the same
prompts, and each later one's difference from the first is printed with its paired standard error
(the per-prompt differences' standard deviation over sqrt(n)): the prompts' own difficulty cancels,
so a change is told from about half the unpaired error.

Usage: PYTHONPATH=. python bench/visual_accuracy.py MODEL_DIR [MODEL_DIR ...] [--prompts 60]
       [--effort high] [--threads 1]
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
from posttrain.envs.env_eval import paired_standard_error
from posttrain.envs.environments import EnvironmentConfig, make_environment
from posttrain.model.vision_model import KimiK3ForConditionalGeneration, load_pretrained
from posttrain.qat import restore_qat
from posttrain.trainers.common import renderer_for


def share(hits: list[bool]) -> str:
    p = sum(hits) / len(hits)
    return f"{p:.3f} ± {math.sqrt(p * (1 - p) / len(hits)):.3f} (n={len(hits)})"


def paired(first: list[bool], later: list[bool]) -> str:
    """later - first on the same prompts, with the paired standard error."""
    before, after = [float(h) for h in first], [float(h) for h in later]
    change = (sum(after) - sum(before)) / len(before)
    return f"{change:+.3f} ± {paired_standard_error(before, after):.3f} (paired, n={len(before)})"


def play(model_dir: Path, prompts_n: int, effort: str) -> list:
    """The greedy episodes of `prompts_n` drawn visual prompts, in draw order."""
    model = load_pretrained(model_dir)
    if not isinstance(model, KimiK3ForConditionalGeneration):
        raise SystemExit(f"{model_dir} is not a multimodal model (no vision weights its tokenizer feeds)")
    restore_qat(model)
    renderer = renderer_for(load_tokenizer(model_dir), model.eval())
    config = EnvironmentConfig(max_turns=1, max_tokens_per_turn=96, families=["general/visual"])
    with (
        tempfile.TemporaryDirectory() as root,
        make_environment("general", renderer, config, sandbox_dir=Path(root)) as env,
    ):
        prompts = env.prompts("eval", prompts_n, seed=0)
        samples = [env.start(p, uid=p.uid, group=p.uid, effort=effort) for p in prompts]
        env.play(EmbeddedEngine(model, pad_token_id=renderer.pad_id), samples, env.turn_sampling(0.0, seed=0))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dirs", type=Path, nargs="+", metavar="MODEL_DIR")
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--effort", default="high")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    first: list | None = None
    for model_dir in args.model_dirs:
        samples = play(model_dir, args.prompts, args.effort)
        hits = [s.reward == 1.0 for s in samples]
        print(f"{model_dir}: exact answers {share(hits)}")
        for kind in ("count", "digit", "bar"):
            chosen = [i for i, s in enumerate(samples) if s.task["kind"] == kind]
            if not chosen:
                continue
            common = Counter(samples[i].task["answer"] for i in chosen).most_common(1)[0][1] / len(chosen)
            line = f"  {kind:5s} {share([hits[i] for i in chosen])}  most-common-answer rate {common:.3f}"
            if first is not None:
                line += f"  change {paired([first[i] for i in chosen], [hits[i] for i in chosen])}"
            print(line)
        if first is None:
            first = hits
        else:
            print(f"  change from {args.model_dirs[0]}: {paired(first, hits)}")


if __name__ == "__main__":
    main()
