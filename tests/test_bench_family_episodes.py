"""bench/family_episodes.py's count of a file-answer family's failures by their last write_file, read
from episodes as the K3 renderer writes them (the count that found one SFT seed writing the right
answer to the wrong file)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))  # family_episodes imports its sibling stage_policy
_spec = importlib.util.spec_from_file_location("family_episodes", REPO / "bench" / "family_episodes.py")
family_episodes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(family_episodes)

TASK = {"family": "agent/order_total", "path": "result.txt", "answer": "130", "values": {}}


def _episode(renderer, *writes: dict) -> str:
    """Decoded generated turns: a search call, then one turn per write_file call in `writes`."""
    turns = [{"name": "search", "arguments": {"query": "the Canyon Lamp price"}}] + [
        {"name": "write_file", "arguments": arguments} for arguments in writes
    ]
    ids: list[int] = []
    for index, call in enumerate(turns):
        message = {
            "role": "assistant",
            "reasoning_content": "I write the number.",
            "tool_calls": [
                {
                    "id": f"functions.{call['name']}:{index}",
                    "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
                }
            ],
        }
        ids += renderer.render_assistant(message)
    return renderer.decode(ids)


@pytest.mark.parametrize(
    ("writes", "miss"),
    [
        ([{"path": "answer.txt", "content": "130"}], ("wrong file", "answer.txt")),
        ([{"path": "result.txt", "content": "131"}], ("wrong answer", "result.txt")),
        ([{"path": "out.txt", "content": "7"}], ("wrong file and answer", "out.txt")),
        # the last write counts: a correct first write overwritten, and a wrong one corrected
        (
            [{"path": "result.txt", "content": "130"}, {"path": "report.txt", "content": "130"}],
            ("wrong file", "report.txt"),
        ),
        (
            [{"path": "report.txt", "content": "130"}, {"path": "result.txt", "content": "130 "}],
            ("right write", "result.txt"),
        ),
        ([], ("no write", None)),
    ],
)
def test_a_failure_is_classed_by_its_last_write(renderer, writes: list[dict], miss: tuple) -> None:
    assert family_episodes.last_write_miss(TASK, _episode(renderer, *writes)) == miss


def test_unreadable_writes_and_families_without_a_file(renderer) -> None:
    text = _episode(renderer, {"path": "result.txt", "content": "130"})
    broken = text.replace('"content": "130"}', '"content": 130')  # cut JSON
    assert family_episodes.last_write_miss(TASK, broken) == ("unreadable write", None)
    assert family_episodes.last_write_miss({"family": "general/arithmetic", "answer": "4"}, text) is None
