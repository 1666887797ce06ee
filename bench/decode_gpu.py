"""Greedy decoding on a GPU: the K3 of bench/train_step_gpu.py through transformers' generate with
KimiK3Cache, against the equal-active LlamaForCausalLM.generate (the baseline), both bf16, the same
prompts (batch x 128 random tokens), every row forced to the same number of new tokens. Prints
new tokens/s for both and the ratio; asserts nothing. K3 runs three ways: generate (no pre-allocated
cache, no graph), `CudaGraphK3Decoder` (pre-allocated caches, a captured decode step; built once
before timing, as a serving engine would) and the EmbeddedEngine's rollout path over that decoder
(Samples in, sampled at temperature 1, log-probs recorded). Times include the prefill. Then
scoring, as MOPD's teachers do it: `EmbeddedEngine.score` of those rollouts against a Llama
forward + log-softmax of the same tokens.

Usage: python bench/decode_gpu.py [--batch 32] [--prompt 128] [--new 32]
"""

from __future__ import annotations

import argparse
import time

import torch
from train_step_gpu import VOCAB, k3_config, llama_config
from transformers import LlamaForCausalLM

from posttrain.engines import EmbeddedEngine, SamplingConfig
from posttrain.engines.cuda_graph_decode import CudaGraphK3Decoder
from posttrain.engines.testing import prompt_sample
from posttrain.model import KimiK3ForCausalLM


def new_tokens_per_s(model: torch.nn.Module, ids: torch.Tensor, new: int) -> float:
    kwargs = dict(do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2, **kwargs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, **kwargs
        )
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + new
    return ids.shape[0] * new / seconds


def graph_tokens_per_s(model: KimiK3ForCausalLM, ids: torch.Tensor, new: int) -> float:
    start = time.perf_counter()
    greedy = SamplingConfig(max_tokens=new, temperature=0)
    decoder = CudaGraphK3Decoder(model, batch=ids.shape[0], max_len=ids.shape[1] + new + 1, sampling=greedy)
    decoder.greedy(ids, None, new)  # first prefill compiles its regions
    torch.cuda.synchronize()
    print(f"  K3 graph decoder built and warmed in {time.perf_counter() - start:.1f} s", flush=True)
    start = time.perf_counter()
    out = decoder.greedy(ids, None, new)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert out.shape == (ids.shape[0], new)
    return ids.shape[0] * new / seconds


def engine_tokens_per_s(model: KimiK3ForCausalLM, ids: torch.Tensor, new: int) -> tuple:
    """The embedded engine's rollout path: Samples in, sampled at temperature 1 on the device (its
    graph decode, rows read back every sync_every tokens, log-probs recorded), no stop ids so every
    row makes `new` tokens. Timed on a second call (the first builds and captures the decoder)."""
    engine = EmbeddedEngine(model, max_batch_size=ids.shape[0])
    sampling = SamplingConfig(max_tokens=new, seed=0)

    def prompts(tag: str) -> list:
        return [prompt_sample(f"{tag}{i}", row.tolist()) for i, row in enumerate(ids.cpu())]

    engine.generate(prompts("warm"), sampling)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.generate(prompts("timed"), sampling)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert all(sample.response_length == new for sample in out)
    return ids.shape[0] * new / seconds, engine, out


def score_tokens_per_s(score, tokens: int) -> float:
    """Tokens/s of one scoring call (after a warm-up call), as MOPD's teachers prefill."""
    score()
    torch.cuda.synchronize()
    start = time.perf_counter()
    score()
    torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (args.batch, args.prompt), generator=gen).cuda()
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}: batch {args.batch}, "
        f"prompt {args.prompt}, {args.new} new tokens, greedy, bf16"
    )
    torch.manual_seed(0)
    k3 = KimiK3ForCausalLM(k3_config()).to(torch.bfloat16).cuda().eval()
    k3_rate = new_tokens_per_s(k3, ids, args.new)
    print(f"  K3 generate: {k3_rate:.0f} new tokens/s", flush=True)
    graph_rate = graph_tokens_per_s(k3, ids, args.new)
    print(f"  K3 CudaGraphK3Decoder: {graph_rate:.0f} new tokens/s", flush=True)
    engine_rate, engine, rollouts = engine_tokens_per_s(k3, ids, args.new)
    print(f"  K3 EmbeddedEngine (graph decode, sampled T=1): {engine_rate:.0f} new tokens/s", flush=True)
    scored = sum(len(sample.tokens) for sample in rollouts)
    k3_score = score_tokens_per_s(lambda: engine.score(rollouts), scored)
    print(f"  K3 EmbeddedEngine.score (teacher prefill): {k3_score:.0f} tokens/s", flush=True)
    full = torch.tensor([sample.tokens for sample in rollouts]).cuda()
    del k3
    torch.cuda.empty_cache()
    llama = LlamaForCausalLM(llama_config()).to(torch.bfloat16).cuda().eval()
    llama_rate = new_tokens_per_s(llama, ids, args.new)
    print(f"  Llama generate (baseline): {llama_rate:.0f} new tokens/s")

    def llama_score() -> None:
        with torch.no_grad():
            logits = llama(input_ids=full).logits
            torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, full[:, 1:, None]).cpu()

    llama_score_rate = score_tokens_per_s(llama_score, full.numel())
    print(f"  Llama forward + log-softmax (scoring baseline): {llama_score_rate:.0f} tokens/s")
    print(f"  K3 EmbeddedEngine.score / Llama: {k3_score / llama_score_rate:.3f}x")
    print(f"  K3 generate / Llama: {k3_rate / llama_rate:.3f}x")
    print(f"  K3 graph decoder / Llama: {graph_rate / llama_rate:.3f}x (goal >= 1.0x)")
    print(f"  K3 EmbeddedEngine / Llama: {engine_rate / llama_rate:.3f}x")


if __name__ == "__main__":
    main()
