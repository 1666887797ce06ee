"""Fixtures for the data tests: the shipped tokenizer (the renderer is tests/conftest.py's), the
shipped trajectories, and a hand-written tool-calling conversation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SHIPPED_SFT = REPO / "data_recipes" / "data" / "agent_sft.jsonl"


@pytest.fixture(scope="session")
def tokenizer(renderer):
    """The shipped tokenizer, the very object `renderer` (tests/conftest.py) renders with."""
    return renderer.tokenizer


@pytest.fixture(scope="session")
def shipped() -> list[dict[str, Any]]:
    return [json.loads(line) for line in SHIPPED_SFT.read_text().splitlines()]


@pytest.fixture
def calculator_schema() -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }


@pytest.fixture
def conversation() -> list[dict[str, Any]]:
    """system, user, an assistant turn calling a tool, the result, a final answer."""
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+3?"},
        {
            "role": "assistant",
            "reasoning_content": "Add them.",
            "content": "",
            "tool_calls": [
                {
                    "id": "functions.calculator:0",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "functions.calculator:0", "content": "5"},
        {"role": "assistant", "reasoning_content": "It is 5.", "content": "5"},
    ]
