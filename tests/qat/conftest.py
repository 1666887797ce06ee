"""Fixtures for the QAT tests that need a model: the shipped tiny K3 config and a seeded tiny model
(eval mode, so the router's balancing statistics do not move between forwards being compared)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def tiny_config():
    from posttrain.engines.testing import TINY_K3_PRESET
    from posttrain.model import load_model_config

    return load_model_config(TINY_K3_PRESET)


@pytest.fixture
def tiny_model():
    from posttrain.engines.testing import tiny_k3

    return tiny_k3(0).eval()


@pytest.fixture
def token_ids():
    return torch.randint(3, 2048, (2, 12), generator=torch.Generator().manual_seed(1))
