"""Fixtures for the QAT tests that need a model: the shipped tiny K3 config and a seeded tiny model
(eval mode, so the router's balancing statistics do not move between forwards being compared)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TINY_YAML = REPO / "stages" / "models" / "tiny.yaml"


@pytest.fixture
def tiny_config():
    from posttrain.model import load_model_config

    return load_model_config(TINY_YAML)


@pytest.fixture
def tiny_model(tiny_config):
    from posttrain.model import KimiK3ForCausalLM

    torch.manual_seed(0)
    return KimiK3ForCausalLM(tiny_config).eval()


@pytest.fixture
def token_ids():
    return torch.randint(3, 2048, (2, 12), generator=torch.Generator().manual_seed(1))
