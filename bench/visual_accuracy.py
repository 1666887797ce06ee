"""How often does a multimodal stage output answer the drawn visual questions?

Plays `--prompts` prompts of the visual families (`--family`, repeatable: general/visual and
general/visual_cost by default; the general environment's "eval" draw at seed 0 with those
families alone offered, each image drawn from its own 32-bit seed, so none is an SFT row's) as
episodes through the RL stages' evaluation (posttrain.envs.env_eval.eval_episodes: `--samples` a
prompt, uids eval/<prompt>/<effort>/<k>) with the embedded engine over MODEL_DIR, in the vision
RL stages' harness (3 turns of 128 tokens, the calculator offered where the family has it).
Greedy by default; `--temperature 0.6` samples as the stages' evaluation does, each episode's noise
fixed by its uid. Prints the share answered exactly with its standard error over prompts, overall
and per kind of question (count, digit, bar, digit_cost), beside the rate of always giving each
kind's most common answer among those prompts.

With several MODEL_DIRs (an SFT model first, then stages trained from it) every model plays the same
episodes, and each later one's difference from the first is printed with its paired standard error
(the per-prompt differences' standard deviation over sqrt(n)): the prompts' own difficulty cancels,
so a change is told from about half the unpaired error.

Usage: PYTHONPATH=. python bench/visual_accuracy.py MODEL_DIR [MODEL_DIR ...] [--prompts 60]
       [--effort high] [--family general/visual_cost] [--temperature 0.6 --samples 4] [--threads 1]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import torch
from stage_policy import environment, load_policy

from posttrain.envs.env_eval import eval_episodes
from posttrain.envs.environments import EnvironmentConfig
from posttrain.model.vision_model import KimiK3ForConditionalGeneration
from posttrain.stats import mean_standard_error, paired_standard_error


def per_prompt(samples: list, samples_per_prompt: int) -> list[float]:
    """Each prompt's share of exact answers over its `samples_per_prompt` episodes (consecutive)."""
    hits = [float(s.reward == 1.0) for s in samples]
    k = samples_per_prompt
    return [sum(hits[i : i + k]) / k for i in range(0, len(hits), k)]


def share(scores: list[float]) -> str:
    """Mean over prompts with its standard error over prompts."""
    return f"{sum(scores) / len(scores):.3f} ± {mean_standard_error(scores):.3f} (n={len(scores)})"


def paired(first: list[float], later: list[float]) -> str:
    """later - first on the same prompts, with the paired standard error."""
    change = (sum(later) - sum(first)) / len(first)
    return f"{change:+.3f} ± {paired_standard_error(first, later):.3f} (paired, n={len(first)})"


def play(
    model_dir: Path, families: list[str], prompts_n: int, effort: str, temperature: float, samples_n: int
) -> tuple[list, list]:
    """(prompts, episodes) of `prompts_n` drawn visual prompts, `samples_n` episodes each, in draw order."""
    policy = load_policy(model_dir)
    if not isinstance(policy.model, KimiK3ForConditionalGeneration):
        raise SystemExit(f"{model_dir} is not a multimodal model (no vision weights its tokenizer feeds)")
    config = EnvironmentConfig(max_turns=3, max_tokens_per_turn=128, families=families)
    with environment("general", policy.renderer, config) as env:
        prompts = env.prompts("eval", prompts_n, seed=0)
        samples = eval_episodes(env, prompts, effort, samples_n)
        env.play(policy.engine, samples, env.turn_sampling(temperature, seed=0))
    return prompts, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dirs", type=Path, nargs="+", metavar="MODEL_DIR")
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--effort", default="high")
    parser.add_argument("--family", action="append", help="a visual family (repeatable); default both")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--samples", type=int, default=1, help="episodes a prompt")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    families = args.family or ["general/visual", "general/visual_cost"]

    first: list[float] | None = None
    for model_dir in args.model_dirs:
        prompts, samples = play(
            model_dir, families, args.prompts, args.effort, args.temperature, args.samples
        )
        scores = per_prompt(samples, args.samples)
        print(f"{model_dir}: exact answers {share(scores)}")
        kinds = list(dict.fromkeys(p.task["kind"] for p in prompts))
        for kind in kinds:
            chosen = [i for i, p in enumerate(prompts) if p.task["kind"] == kind]
            common = Counter(prompts[i].task["answer"] for i in chosen).most_common(1)[0][1] / len(chosen)
            line = f"  {kind:10s} {share([scores[i] for i in chosen])}  most-common-answer rate {common:.3f}"
            if first is not None:
                line += f"  change {paired([first[i] for i in chosen], [scores[i] for i in chosen])}"
            print(line)
        if first is None:
            first = scores
        else:
            print(f"  change from {args.model_dirs[0]}: {paired(first, scores)}")


if __name__ == "__main__":
    main()
