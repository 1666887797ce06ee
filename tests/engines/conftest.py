"""Shared fixtures for the engine tests: the tiny Llama vLLM can serve (sharing the shipped
tokenizer) and chat prompts rendered the way RL renders them. The renderer is tests/conftest.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from posttrain.data.sample import Sample
from posttrain.engines.testing import build_tiny_llama, chat_prompts

QUESTIONS = ["What is 2+2?", "Name a prime above ten.", "Say hello.", "Which is larger, 9 or 12? Explain."]


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
        return chat_prompts(renderer, QUESTIONS, prefix)

    return make
