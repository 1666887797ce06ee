"""How often does a model take the calculator route of the route-choice families, sampled?

The general max specialist's gain is mostly the calculator route of general/unit_cost,
general/unit_convert and general/arithmetic that RL selects (bench/RESULTS.md), so it depends on
how often the SFT model already takes that route. The shipped data demonstrate it on half the
rows (`takes_tool_route`); this measures what a trained model does with that half: for each MODEL,
the RL stages' held-out prompts of each `--family` (the eval draw, `eval.seed` 0, the harness of
`stages/rl.yaml`) are played `--samples` times at `--temperature` (0.6: the RL evaluation's) and it
prints, per family, the share of episodes that call the calculator and the share solved, each with
its standard error over prompts (the episodes of one prompt are not independent).

A MODEL may be `MODEL_DIR:WEIGHTS` where WEIGHTS is a training checkpoint's model.safetensors
(`<stage>/checkpoints/step-N/`): the checkpoint's weights in MODEL_DIR's model, to follow the route
share through an SFT run (run it with `sft.checkpoint_every=100 sft.keep_checkpoints=20` and copy the
step directories before the stage publishes its model and removes them).

    PYTHONPATH=. python bench/route_share.py runs/mopd/sft/model runs/mopd/rl-general-max/model
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from stage_policy import environment, load_policy, rl_harness

from posttrain.envs.env_eval import eval_episodes, eval_family
from posttrain.stats import mean_standard_error

# A rendered call opens with the K3 tool-call id `functions.<name>:<index>` after <|tool_call_begin|>
# (the tool's result repeats the id after <|im_tool|>; bench/family_episodes.py reads calls the same way).
ROUTE_CALL = "<|tool_call_begin|>functions.calculator:"


def prompt_mean(values: dict[str, list[float]]) -> tuple[float, float]:
    """Mean over prompts of each prompt's mean, and its standard error over prompts."""
    means = [sum(v) / len(v) for v in values.values()]
    return sum(means) / len(means), mean_standard_error(means)


def route_share(spec: str, domain: str, families: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Per family: prompts, episodes, route share and solved share, each with its error."""
    model_dir, _, weights = spec.partition(":")
    policy = load_policy(Path(model_dir), Path(weights) if weights else None)
    tokenizer = policy.tokenizer
    with environment(domain, policy.renderer, rl_harness(domain)) as env:
        prompts = [p for p in env.prompts("eval", args.prompts, seed=0) if eval_family(p.uid) in families]
        episodes = eval_episodes(env, prompts, args.effort, args.samples)
        env.play(policy.engine, episodes, env.turn_sampling(args.temperature, args.seed))
    routed: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    solved: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for sample in episodes:
        prompt = sample.uid.rsplit("/", 1)[0]
        family = eval_family(sample.uid)
        text = tokenizer.decode(sample.tokens[sample.prompt_length :])
        routed[family][prompt].append(float(ROUTE_CALL in text))
        solved[family][prompt].append(float(sample.reward == 1.0))
    table = {}
    for family in sorted(routed):
        route, route_se = prompt_mean(routed[family])
        win, win_se = prompt_mean(solved[family])
        table[family] = {
            "prompts": len(routed[family]),
            "route": route,
            "route_se": route_se,
            "solved": win,
            "solved_se": win_se,
        }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="+", help="MODEL_DIR or MODEL_DIR:CHECKPOINT_WEIGHTS")
    parser.add_argument("--domain", default="general", choices=("general", "agent"))
    parser.add_argument("--family", action="append", default=None, help="repeatable")
    parser.add_argument("--effort", default="max", choices=("low", "high", "max"))
    parser.add_argument("--prompts", type=int, default=96, help="held-out prompts drawn (all families)")
    parser.add_argument("--samples", type=int, default=8, help="sampled episodes per prompt")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=1, help="sampling seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="write the tables here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    defaults = {
        "general": ["general/arithmetic", "general/unit_convert", "general/unit_cost"],
        "agent": ["agent/order_cost"],
    }
    families = args.family or defaults[args.domain]
    results = {}
    print("| model | family | prompts | calculator route | solved |\n| --- | --- | ---: | ---: | ---: |")
    for spec in args.model:
        results[spec] = route_share(spec, args.domain, families, args)
        for family, row in results[spec].items():
            print(
                f"| {spec} | {family} | {row['prompts']} | {row['route']:.3f} ± {row['route_se']:.3f} "
                f"| {row['solved']:.3f} ± {row['solved_se']:.3f} |",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
