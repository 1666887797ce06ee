"""What can RL's group advantages select in a domain? Greedy accuracy against sampled pass@k.

RL with group-relative advantages can only move the greedy policy toward behaviour its own
rollouts show: a prompt the greedy episode fails gives signal only if some sampled episodes of
its group succeed. So the headroom RL has is the gap between pass@k of the sampled episodes (k the
group size) and greedy accuracy, per task family (issue #21: coding's max specialist gains, general's
and agent's do not). For each MODEL this plays the RL stages' held-out prompts of DOMAIN (the same
draw as `eval.json`: `eval.seed` 0, every family of the domain, the harness of `stages/rl.yaml`)
once greedy and `--samples` times at each `--temperature` (0.6 is the shipped rollout temperature),
and prints per family: greedy accuracy, mean sampled accuracy, unbiased pass@k for k = 1, 4, 8
(out of `--samples`), "rescued" (prompts greedy fails with at least one sampled success) and
"mixed" (prompts whose samples neither all fail nor all succeed: the groups that carry signal).

    PYTHONPATH=. python bench/rl_headroom.py general --effort max \
        --model sft=runs/mopd/sft/model --model rl=runs/mopd/rl-general-max/model

It also prints where the sampled successes of greedy failures first leave the greedy episode: the
share of those first differing tokens found in the question or a tool result before them (a copy:
which name, word or number) and the commonest (sampled, greedy) pairs. Headroom alone did not
predict the gain (bench/RESULTS.md): coding/fix_function's rescues leave out a sentence, one
choice on every prompt that the advantages select; general's pick another copy on each prompt.
`--show FAMILY` prints, for a few rescued prompts, the greedy failure and one sampled success (the
last `--tail` characters of each).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter, defaultdict
from pathlib import Path

import torch
from stage_policy import environment, load_policy, rl_harness

from posttrain.data.sample import Sample
from posttrain.envs.env_eval import eval_episodes, eval_family

KS = (1, 4, 8)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c successes (Chen et al. 2021); nan when k > n."""
    if k > n:
        return math.nan
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def family_table(greedy: dict[str, float], sampled: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per family (and "all"): prompts, greedy, mean sampled accuracy, pass@k, rescued, mixed."""
    by_family: dict[str, list[str]] = defaultdict(list)
    for uid in greedy:
        by_family[eval_family(uid)].append(uid)
    by_family["all"] = list(greedy)
    table = {}
    for family, uids in sorted(by_family.items()):
        n = len(sampled[uids[0]])
        wins = {uid: sum(r == 1.0 for r in sampled[uid]) for uid in uids}
        table[family] = {
            "prompts": len(uids),
            "greedy": sum(greedy[u] for u in uids) / len(uids),
            "mean": sum(sum(sampled[u]) / n for u in uids) / len(uids),
            **{f"pass@{k}": sum(pass_at_k(n, wins[u], k) for u in uids) / len(uids) for k in KS},
            "rescued": sum(greedy[u] < 1.0 and wins[u] > 0 for u in uids) / len(uids),
            "mixed": sum(0 < wins[u] < n for u in uids) / len(uids),
        }
    return table


def play(model_dir: Path, domain: str, effort: str, args: argparse.Namespace) -> dict:
    """One model's greedy and sampled episodes of the held-out prompts, keyed by prompt: the
    question's tokens, the greedy episode and, per temperature, the sampled ones (each as
    (reward, the tokens after the prompt, which of them the policy generated))."""
    policy = load_policy(model_dir)
    renderer, engine = policy.renderer, policy.engine

    def episode(sample: Sample) -> tuple[float, list[int], list[int]]:
        start = sample.prompt_length
        return float(sample.reward or 0.0), sample.tokens[start:], sample.generated_mask[start:]

    with environment(domain, renderer, rl_harness(domain)) as env:
        prompts = env.prompts("eval", args.prompts, seed=0)
        # keyed as the episodes below are: their uid (eval/<prompt uid>/<effort>/<k>) less the copy
        out: dict = {
            "question": {
                f"eval/{p.uid}/{effort}": renderer.encode(p.messages[-1]["content"]) for p in prompts
            }
        }
        greedy = eval_episodes(env, prompts, effort, 1)
        env.play(engine, greedy, env.turn_sampling(0.0, 0))
        out["greedy"] = {s.uid.rsplit("/", 1)[0]: episode(s) for s in greedy}
        for temperature in args.temperature:
            samples = eval_episodes(env, prompts, effort, args.samples)
            env.play(engine, samples, env.turn_sampling(temperature, args.seed))
            sampled: dict[str, list[tuple[float, list[int], list[int]]]] = defaultdict(list)
            for s in samples:
                sampled[s.uid.rsplit("/", 1)[0]].append(episode(s))
            out[temperature] = dict(sampled)
    out["decode"] = policy.tokenizer.decode
    return out


def divergences(played: dict, temperature: float) -> dict[str, dict]:
    """Where the sampled successes of prompts greedy fails first leave the greedy episode, per
    family: how many, the share whose first differing token occurs in the question or in a tool
    result before it (a content choice: which name or number is copied) rather than not (a choice
    of what to do: a check left out, an answer given a turn earlier), and the commonest (sampled,
    greedy) token pairs."""
    decode = played["decode"]
    found: dict[str, list[tuple[bool, tuple[str, str]]]] = defaultdict(list)
    for uid, (reward, greedy, _) in played["greedy"].items():
        if reward == 1.0:
            continue
        for won, tokens, generated in played[temperature][uid]:
            if won != 1.0:
                continue
            i = next(
                (i for i, (a, b) in enumerate(zip(tokens, greedy, strict=False)) if a != b),
                min(len(tokens), len(greedy)),
            )
            mine = tokens[i] if i < len(tokens) else None
            theirs = greedy[i] if i < len(greedy) else None
            pair = tuple("<end>" if t is None else decode([t]) for t in (mine, theirs))
            seen = {
                *played["question"][uid],
                *(t for t, g in zip(tokens[:i], generated, strict=False) if not g),
            }
            found[eval_family(uid)].append((mine in seen, pair))
    return {
        family: {
            "successes": len(rows),
            "in_context": sum(copied for copied, _ in rows) / len(rows),
            "common": Counter(pair for _, pair in rows).most_common(3),
        }
        for family, rows in sorted(found.items())
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("domain", choices=("general", "agent", "coding"))
    parser.add_argument("--model", action="append", required=True, help="NAME=MODEL_DIR (repeatable)")
    parser.add_argument("--effort", default="max", choices=("low", "high", "max"))
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--samples", type=int, default=8, help="sampled episodes per prompt")
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.6, 1.0])
    parser.add_argument("--seed", type=int, default=1, help="sampling seed (greedy draws none)")
    parser.add_argument("--show", default=None, help="a family whose rescued prompts are printed")
    parser.add_argument("--tail", type=int, default=500)
    parser.add_argument("--json", type=Path, default=None, help="write the tables and rewards here")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    for spec in args.model:
        name, _, model_dir = spec.partition("=")
        played = play(Path(model_dir), args.domain, args.effort, args)
        greedy = {uid: row[0] for uid, row in played["greedy"].items()}
        results[name] = {"greedy": greedy}
        head = f"{name} ({model_dir}), {args.domain} at {args.effort}"
        for temperature in args.temperature:
            sampled = {uid: [row[0] for row in rows] for uid, rows in played[temperature].items()}
            table = family_table(greedy, sampled)
            results[name][temperature] = {"table": table, "sampled": sampled}
            print(f"\n{head}, T={temperature}, {args.samples} samples")
            columns = ["greedy", "mean", *(f"pass@{k}" for k in KS if k <= args.samples), "rescued", "mixed"]
            print(f"| family | n | {' | '.join(columns)} |")
            print(f"| --- | ---: |{' ---: |' * len(columns)}")
            for family, row in table.items():
                print(f"| {family} | {row['prompts']} | {' | '.join(f'{row[c]:.3f}' for c in columns)} |")
            print("first token where a sampled success of a prompt greedy fails leaves the greedy episode:")
            for family, row in divergences(played, temperature).items():
                pairs = ", ".join(f"{mine!r} for {theirs!r} x{n}" for (mine, theirs), n in row["common"])
                share = f"{row['in_context']:.2f} at a token of the question or a tool result"
                print(f"  {family}: {row['successes']} successes, {share}; {pairs}")
        if args.show:
            shown, decode, temperature = 0, played["decode"], args.temperature[0]
            for uid, (reward, tokens, _) in played["greedy"].items():
                wins = [won for r, won, _ in played[temperature][uid] if r == 1.0]
                if args.show not in uid or reward == 1.0 or not wins or shown == 3:
                    continue
                shown += 1
                print(f"\n--- {uid}: greedy failed\n{decode(tokens)[-args.tail :]}")
                print(f"--- a T={temperature} success\n{decode(wins[0])[-args.tail :]}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
