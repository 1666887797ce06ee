"""Multi-turn episodes with the embedded engine's cache reuse against full re-prefill, same run.

An agent episode calls `generate` once per assistant turn; between turns the environment appends
tool results. Without reuse every call prefills the whole trajectory again (prompt, every earlier
turn and tool result); with reuse (`EmbeddedEngine(max_cached_samples>0)`, the default) it
prefills only the last sampled token and the appended tool results. This plays the engine side of
such episodes: the agent environment's own prompts (rendered with its tools), `--turns` turns of
at most `--max-tokens` tokens, and between turns the real `search` tool's answer over the shipped
documents, rendered with `render_tool_results`. Every episode plays all its turns (a turn that
happened to end on end-of-turn still gets tool results), so both modes do the same decoding work.
`--prompt-docs R` pastes the shipped documents R times into each system prompt (about 370 tokens
each): an agent handed a long brief, where re-prefilling the prompt every turn costs most.

The tiny K3 (stages/models/tiny.yaml) with QAT k3 as in RL, the shipped tokenizer, 1 torch thread.
The two modes alternate repeat by repeat (a change in machine load hits both) and sample the same
uids, so they draw the same tokens; the script checks that and prints the largest log-prob gap.

    PYTHONPATH=. python bench/multiturn_cache.py --episodes 16 --turns 4 --max-tokens 96 --repeats 3
    PYTHONPATH=. python bench/multiturn_cache.py --episodes 16 --turns 6 --max-tokens 32 --prompt-docs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from posttrain.data.chat import ChatRenderer, load_tokenizer, tool_call_id
from posttrain.data.sample import Sample
from posttrain.engines import EmbeddedEngine, SamplingConfig
from posttrain.engines.testing import tiny_k3
from posttrain.envs.environments import EnvironmentConfig, make_environment
from posttrain.envs.tools import make_tools
from posttrain.qat import QATConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "data_recipes" / "docs"
QUERIES = ["Oslo office", "Trail Lamp price", "North region shipping", "Dana Ruiz team", "Lyon desks"]


def with_brief(start: Sample, renderer: ChatRenderer, copies: int) -> Sample:
    """`start` re-rendered with the shipped documents pasted `copies` times into its system prompt."""
    if copies == 0:
        return start
    brief = "\n".join(path.read_text() for path in sorted(DOCS.glob("*.txt")))
    messages = [dict(message) for message in start.messages]
    messages[0]["content"] = f"{messages[0]['content']}\n\n" + "\n".join([brief] * copies)
    sample = Sample(
        uid=start.uid, domain=start.domain, effort=start.effort, messages=messages, tools=start.tools
    )
    ids = renderer.render_prompt(messages, start.tools, start.effort)
    sample.append(ids, generated=False)
    sample.prompt_length = len(ids)
    return sample


def play(
    engine: EmbeddedEngine,
    starts: list[Sample],
    renderer: ChatRenderer,
    sampling: SamplingConfig,
    turns: int,
    prefix: str,
) -> tuple[list[Sample], float, float]:
    """Play fresh copies of `starts` (uids prefixed) for `turns` turns; (samples, wall s, CPU s)."""
    search = make_tools(["search"], docs_dir=DOCS)["search"]
    samples = [Sample.from_dict({**start.to_dict(), "uid": f"{prefix}/{start.uid}"}) for start in starts]
    wall, cpu = time.perf_counter(), time.process_time()
    for turn in range(turns):
        engine.generate(samples, sampling)
        if turn == turns - 1:
            break
        for index, sample in enumerate(samples):
            query = QUERIES[(index + turn) % len(QUERIES)]
            result = {
                "role": "tool",
                "tool_call_id": tool_call_id("search", turn),
                "content": search.execute(None, query),
            }
            sample.append(renderer.render_tool_results([result]), generated=False)
    return samples, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16, help="episodes played as one batch")
    parser.add_argument("--turns", type=int, default=4, help="assistant turns per episode")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per assistant turn at most")
    parser.add_argument("--prompt-docs", type=int, default=0, help="copies of the documents in each prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    renderer = ChatRenderer(load_tokenizer())
    model = tiny_k3(0, qat=QATConfig(scheme="k3")).eval()
    sampling = SamplingConfig(
        max_tokens=args.max_tokens,
        temperature=1.0,
        stop_token_ids=(renderer.end_of_turn_id,),
        tool_call_token_ids=(renderer.tool_calls_end_id,),
        seed=0,
    )
    with make_environment("agent", renderer, EnvironmentConfig()) as env:
        prompts = env.prompts("train", args.episodes, seed=0)
        starts = [
            with_brief(env.start(p, uid=f"e{i}", group=f"e{i}", effort="high"), renderer, args.prompt_docs)
            for i, p in enumerate(prompts)
        ]
    engines = {
        "full prefill": EmbeddedEngine(model, pad_token_id=renderer.pad_id, max_cached_samples=0),
        "cache reuse": EmbeddedEngine(model, pad_token_id=renderer.pad_id),
    }
    # Warm-up (first forwards allocate and pick kernels), timed by neither mode.
    play(engines["cache reuse"], starts, renderer, sampling, 2, "warm-up")
    warm = {name: engine.cache_stats.prefill_tokens for name, engine in engines.items()}

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    results: dict[str, list[Sample]] = {}
    for repeat in range(args.repeats):
        for name, engine in engines.items():
            samples, wall, cpu = play(engine, starts, renderer, sampling, args.turns, f"r{repeat}")
            times[name].append((wall, cpu))
            results[name] = samples
            print(f"{name:>12} repeat {repeat}: {wall:6.2f} s wall, {cpu:6.2f} s CPU", flush=True)

    full, reuse = results["full prefill"], results["cache reuse"]
    same_tokens = all(a.tokens == b.tokens for a, b in zip(full, reuse, strict=True))
    gap = max(
        abs(x - y)
        for a, b in zip(full, reuse, strict=True)
        for x, y in zip(a.rollout_logprobs, b.rollout_logprobs, strict=True)
    )
    lengths = [len(s.tokens) for s in reuse]
    prompts = [s.prompt_length for s in starts]
    print(
        f"\n{args.episodes} episodes x {args.turns} turns x <= {args.max_tokens} tokens, "
        f"{args.threads} thread(s), load average {os.getloadavg()[0]:.1f}; final lengths mean "
        f"{statistics.mean(lengths):.0f}, max {max(lengths)} tokens (prompts {min(prompts)}-{max(prompts)})"
    )
    print(f"same tokens in both modes: {same_tokens}; largest |log-prob difference|: {gap:.2e}")
    for name, engine in engines.items():
        tokens = (engine.cache_stats.prefill_tokens - warm[name]) / args.repeats
        wall = statistics.median(t[0] for t in times[name])
        cpu = statistics.median(t[1] for t in times[name])
        print(
            f"{name:>12}: median {wall:6.2f} s wall, {cpu:6.2f} s CPU, "
            f"{tokens:7.0f} prefill tokens per repeat"
        )
    base, new = times["full prefill"], times["cache reuse"]
    for index, kind in ((0, "wall"), (1, "CPU")):
        ratio = statistics.median(t[index] for t in base) / statistics.median(t[index] for t in new)
        print(f"ratio full prefill / cache reuse, median {kind} time: {ratio:.2f}x")


if __name__ == "__main__":
    main()
