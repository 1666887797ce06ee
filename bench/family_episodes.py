"""Where does a model fail one task family? Greedy held-out episodes, each failure printed.

Plays the first `--prompts` held-out prompts of FAMILY (the RL stages' eval draw, `eval.seed` 0,
with that family alone offered) as greedy episodes of its domain under the harness
`stages/rl.yaml` gives that domain, with the embedded engine over MODEL_DIR and the QAT its
training recorded. Prints the share solved with its binomial standard error, then the last
`--tail` characters of every failed episode, so a failure's kind (a wrong file, a wrong number
copied, a truncated turn) can be read off. This is how `agent/order_total`'s wrong quantities and
wrong files were found (bench/RESULTS.md). Before the failures it prints each sequence of tool calls
the episodes made, with how many took it and how many of those were solved: the route a family like
`agent/order_cost` offers (calculator or not) and which one RL moved the model to; `--by KEY` adds
the share solved per value of a task key (coding's `function`). For a family that asks for an
answer written to a named file (the agent families: task `path` and `answer`), the failures are
also counted by how the episode's last `write_file` missed: the right answer to another file (the
question's file name copied wrong, which one SFT seed did in 18 of 92 episodes), a wrong answer,
both, or no write, with the files written.

    PYTHONPATH=. python bench/family_episodes.py runs/mopd/sft/model agent/order_total --effort high
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import Counter
from pathlib import Path

import torch
from stage_policy import environment, load_policy, rl_harness

# The arguments of each rendered write_file call (K3's call id `functions.write_file:<index>`).
WRITE = re.compile(
    r"<\|tool_call_begin\|>functions\.write_file:\d+<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
    re.S,
)


def last_write_miss(task: dict, text: str) -> tuple[str, str | None] | None:
    """How a failed episode of a file-answer family missed, by its last write_file call: (kind, the
    file it wrote), kind one of "wrong file" (the right answer elsewhere), "wrong answer", "wrong
    file and answer", "no write", "unreadable write" or "right write" (the tool then failed); None
    for a family whose task names no file."""
    if not {"path", "answer"} <= task.keys():
        return None
    writes = WRITE.findall(text)
    if not writes:
        return "no write", None
    try:
        arguments = json.loads(writes[-1])
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):  # cut JSON, or not an object
        return "unreadable write", None
    path = str(arguments.get("path"))
    right_file, right_answer = (
        path == task["path"],
        str(arguments.get("content", "")).strip() == task["answer"],
    )
    kind = {
        (True, True): "right write",
        (False, True): "wrong file",
        (True, False): "wrong answer",
        (False, False): "wrong file and answer",
    }[right_file, right_answer]
    return kind, path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("family", help="a registered task family, e.g. agent/order_total")
    parser.add_argument("--effort", default="high", choices=("low", "high", "max"))
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--tail", type=int, default=700, help="characters of each failure shown (0: none)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; the RL rollouts sample at 0.6"
    )
    parser.add_argument("--samples", type=int, default=1, help="episodes per prompt (when sampling)")
    parser.add_argument(
        "--by", metavar="KEY", help="also print solved per value of this task key (e.g. function)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    domain = args.family.split("/")[0]
    policy = load_policy(args.model_dir)
    tokenizer = policy.tokenizer
    with environment(domain, policy.renderer, rl_harness(domain, [args.family])) as env:
        prompts = env.prompts("eval", args.prompts, seed=0)
        samples = [
            env.start(p, uid=f"{p.uid}/{k}", group=p.uid, effort=args.effort)
            for p in prompts
            for k in range(args.samples)
        ]
        sampling = env.turn_sampling(args.temperature, seed=0)
        env.play(policy.engine, samples, sampling)
    solved = [s.reward == 1.0 for s in samples]
    p = sum(solved) / len(solved)
    print(
        f"{args.family} at {args.effort}, temperature {args.temperature}: "
        f"solved {sum(solved)}/{len(solved)} = {p:.3f} ± "
        f"{math.sqrt(p * (1 - p) / len(solved)):.3f}"
    )
    texts = [tokenizer.decode(s.tokens[s.prompt_length :]) for s in samples]
    # A rendered call opens with the K3 tool-call id `functions.<name>:<index>` (the tool's result
    # repeats the id after <|im_tool|>, so only the ids after <|tool_call_begin|> count).
    call = re.compile(r"<\|tool_call_begin\|>functions\.(\w+):\d+")
    routes = [" > ".join(call.findall(text)) or "(no tool)" for text in texts]
    taken, route_solved = Counter(routes), Counter(r for r, ok in zip(routes, solved, strict=True) if ok)
    for route, count in taken.most_common():
        print(f"  calls {route}: {count} episodes, {route_solved[route]} solved")
    if args.by:
        values = [str(s.task.get(args.by)) for s in samples]
        count, value_solved = Counter(values), Counter(v for v, ok in zip(values, solved, strict=True) if ok)
        for value, n in sorted(count.items()):
            print(f"  {args.by} {value}: {value_solved[value]}/{n} solved")
    misses = [
        miss
        for sample, ok, text in zip(samples, solved, texts, strict=True)
        if not ok and (miss := last_write_miss(sample.task, text))
    ]
    for kind, count in Counter(kind for kind, _ in misses).most_common():
        written = Counter(path for k, path in misses if k == kind and path)
        files = f" (files written: {', '.join(f'{p} {n}' for p, n in written.most_common())})" * bool(written)
        print(f"  failures by the last write: {kind} {count}{files}")
    for sample, ok, text in zip(samples, solved, texts, strict=True):
        if not ok and args.tail > 0:
            hidden = {k: v for k, v in sample.task.items() if k != "family"}
            print(f"\n--- {sample.uid} reward {sample.reward} task {hidden}")
            print(text[-args.tail :])


if __name__ == "__main__":
    main()
