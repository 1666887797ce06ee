"""Partial rollouts against fully synchronous generation: wall time per RL iteration, same run.

Both modes play the same trajectories (same uids, so the same per-(seed, uid, position) random
draws and the same lengths) through the real rollout path: the general environment's episode loop,
the embedded engine on the tiny K3 with QAT, the RolloutQueue. Each iteration starts `--groups`
prompt groups of `--group-size` trajectories and the policy version advances after it, as in
training (the weights stay fixed: this measures generation, not learning).

Lengths are long-tailed by construction: the model's output layer is zeroed, so every token is a
uniform draw over the vocabulary, and a turn ends when it draws one of a set of stop tokens sized
for a mean of `--mean-length` tokens (a geometric distribution, capped at `--max-tokens`). In a
synchronous iteration the batch shrinks while the last few trajectories decode; with lambda < 1
generation pauses once that share has ended and the stragglers continue in the next iteration's
full batch. AReaL and verl report 2.3-2.8x at scale, where a decoding step's cost grows far more
slowly with the batch than on this CPU.

    PYTHONPATH=. python bench/partial_rollouts.py --iterations 5 --groups 8 --group-size 4 --fraction 0.7
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from posttrain.data.chat import ChatRenderer, load_tokenizer
from posttrain.engines import EmbeddedEngine, SamplingConfig
from posttrain.envs.environments import EnvironmentConfig, make_environment
from posttrain.model import KimiK3ForCausalLM, load_model_config
from posttrain.qat import QATConfig, apply_qat
from posttrain.trainers.rollout import PartialRolloutConfig, RolloutQueue

TINY = Path(__file__).resolve().parents[1] / "stages" / "models" / "tiny.yaml"


def uniform_model() -> KimiK3ForCausalLM:
    """The tiny K3 (QAT on) whose every next-token distribution is uniform: the whole network
    still runs each step, only the output layer is zero."""
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(load_model_config(TINY))
    apply_qat(model, QATConfig(scheme="k3"))
    with torch.no_grad():
        model.lm_head.weight.zero_()
    return model


class Mode:
    """One way of generating (its own queue and policy version), stepped one iteration at a time."""

    def __init__(self, name: str, fraction: float, args: argparse.Namespace, env, engine, sampling) -> None:
        self.name, self.env, self.engine = name, env, engine
        config = PartialRolloutConfig(fraction=fraction, max_staleness=args.max_staleness)
        self.queue = RolloutQueue(env, engine, sampling, config)
        self.version = 0
        self.records: list[dict] = []

    def iteration(self, new: list) -> None:
        self.engine.policy_version = self.version
        started = time.perf_counter()
        rollout = self.queue.step(new)
        wall = time.perf_counter() - started
        finished = rollout.samples
        self.records.append(
            {
                "wall_s": wall,
                "finished": len(finished),
                "tokens": sum(s.num_generated for s in finished),
                "lengths": [s.num_generated for s in finished],
            }
        )
        self.version += 1
        print(
            f"{self.name:>11} iteration {len(self.records) - 1}: {wall:6.2f} s, "
            f"{len(finished):3d} trajectories finished, {rollout.metrics['rollout/paused']:3.0f} paused, "
            f"max span {rollout.metrics['rollout/max_span']:.0f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--fraction", type=float, default=0.7, help="lambda of the partial mode")
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--mean-length", type=int, default=40, help="mean tokens per trajectory")
    parser.add_argument("--max-tokens", type=int, default=240)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    renderer = ChatRenderer(load_tokenizer())
    engine = EmbeddedEngine(uniform_model(), pad_token_id=renderer.pad_id)
    vocab = engine.model.config.vocab_size
    stops = max(1, round(vocab / args.mean_length))
    extra = tuple(t for t in range(vocab - stops, vocab) if t != renderer.tool_calls_end_id)
    sampling = SamplingConfig(
        max_tokens=args.max_tokens,
        stop_token_ids=(renderer.end_of_turn_id, *extra),
        tool_call_token_ids=(renderer.tool_calls_end_id,),
        seed=0,
    )
    with make_environment("general", renderer, EnvironmentConfig(max_tokens_per_turn=args.max_tokens)) as env:
        prompts = env.prompts("train", args.groups, seed=0)
        # Warm-up (first forwards allocate and pick kernels), timed by neither mode.
        env.play(
            engine,
            [env.start(p, uid=f"warm-up/{p.uid}", group="w", effort="high") for p in prompts],
            sampling,
        )
        modes = [
            Mode("synchronous", 1.0, args, env, engine, sampling),
            Mode(f"lambda={args.fraction:g}", args.fraction, args, env, engine, sampling),
        ]
        # The modes alternate iteration by iteration, so a change in the machine's load hits both.
        for iteration in range(args.iterations):
            for mode in modes:
                mode.iteration(
                    [
                        env.start(p, uid=f"{iteration}/{g}/{k}", group=f"{iteration}/{g}", effort="high")
                        for g, p in enumerate(prompts)
                        for k in range(args.group_size)
                    ]
                )
        for mode in modes:
            mode.queue.clear()
        synchronous, partial = (mode.records for mode in modes)

    lengths = sorted(n for r in synchronous for n in r["lengths"])
    print(
        f"\n{args.iterations} iterations x {args.groups} groups x {args.group_size} trajectories, "
        f"{args.threads} thread(s); stop probability {len(extra) + 1}/{vocab} per token, "
        f"cap {args.max_tokens}"
    )
    print(
        f"trajectory tokens (synchronous run): mean {statistics.mean(lengths):.0f}, "
        f"p50 {lengths[len(lengths) // 2]}, p90 {lengths[int(len(lengths) * 0.9)]}, max {lengths[-1]}"
    )
    for name, records in (("synchronous", synchronous), (f"lambda={args.fraction:g}", partial)):
        wall = sum(r["wall_s"] for r in records)
        done = sum(r["finished"] for r in records)
        tokens = sum(r["tokens"] for r in records)
        print(
            f"{name:>11}: {wall / len(records):6.2f} s per iteration, {done / wall:6.2f} trajectories/s, "
            f"{tokens / wall:7.1f} finished tokens/s"
        )
    per_iteration = statistics.mean(r["wall_s"] for r in synchronous) / statistics.mean(
        r["wall_s"] for r in partial
    )
    throughput = (sum(r["finished"] for r in partial) / sum(r["wall_s"] for r in partial)) / (
        sum(r["finished"] for r in synchronous) / sum(r["wall_s"] for r in synchronous)
    )
    print(f"ratio synchronous / partial wall time per iteration: {per_iteration:.2f}x")
    print(f"ratio partial / synchronous finished trajectories per second: {throughput:.2f}x")


if __name__ == "__main__":
    main()
