"""Shared fixtures for the engine tests: the tiny Llama vLLM can serve (sharing the shipped
tokenizer), chat prompts rendered the way RL renders them, and one torch thread per test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from posttrain.data.chat import ChatRenderer, load_tokenizer
from posttrain.data.sample import Sample
from posttrain.engines.testing import build_tiny_llama

QUESTIONS = ["What is 2+2?", "Name a prime above ten.", "Say hello.", "Which is larger, 9 or 12? Explain."]


@pytest.fixture(scope="session")
def renderer() -> ChatRenderer:
    return ChatRenderer(load_tokenizer())


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, renderer) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), renderer.tokenizer, seed=0)


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def make_prompts(renderer):
    """make_prompts(prefix) -> one fresh Sample per question, rendered up to the assistant header."""

    def make(prefix: str = "p") -> list[Sample]:
        samples = []
        for i, question in enumerate(QUESTIONS):
            ids = renderer.render_prompt([{"role": "user", "content": question}], None, "high")
            n = len(ids)
            samples.append(
                Sample(
                    uid=f"{prefix}{i}",
                    tokens=ids,
                    prompt_length=n,
                    loss_mask=[0] * n,
                    rollout_logprobs=[0.0] * n,
                    policy_version=[-1] * n,
                )
            )
        return samples

    return make
