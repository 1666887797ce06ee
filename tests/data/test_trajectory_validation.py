"""Bad trajectory rows: each reason on hand-written rows, skipped and counted by default, fatal with
file, row and reason under strict loading, and an error when nothing survives."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import datasets
import pytest

from posttrain.data.loading import decode_record, load_trajectories, prompt_sample
from posttrain.data.trajectory import REASONS, BadTrajectoryError, clean_record, validate_trajectory


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _calling(*calls: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn that only calls tools."""
    return {"role": "assistant", "content": "", "tool_calls": list(calls)}


CALCULATOR = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}


def _row(uid: str, messages: list[dict[str, Any]], effort: str | None = "high") -> dict[str, Any]:
    return {"uid": uid, "domain": "general", "effort": effort, "messages": messages, "tools": [CALCULATOR]}


USER = {"role": "user", "content": "What is 2+3?"}
GOOD = _row("good", [USER, {"role": "assistant", "reasoning_content": "Add.", "content": "5"}])
BAD_ROWS = {
    "malformed_tool_call_json": _row(
        "json",
        [
            USER,
            _calling(_call("c1", "calculator", '{"expression": "2+')),
        ],
    ),
    "unknown_role": _row("role", [USER, {"role": "narrator", "content": "Meanwhile..."}]),
    "unmatched_tool_result": _row(
        "unmatched",
        [
            USER,
            _calling(_call("c1", "calculator", '{"expression": "2+3"}')),
            {"role": "tool", "tool_call_id": "c9", "content": "5"},
        ],
    ),
    "empty_assistant_turn": _row(
        "empty", [USER, {"role": "assistant", "reasoning_content": " ", "content": ""}]
    ),
    "no_assistant_turn": _row("none", [USER]),
    "undeclared_tool": _row(
        "undeclared",
        [
            USER,
            _calling(_call("c1", "web_search", '{"query": "2+3"}')),
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
            {"role": "assistant", "content": "5"},
        ],
    ),
}


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_each_reason_is_detected_on_its_row():
    for reason, row in BAD_ROWS.items():
        verdict = validate_trajectory(clean_record(row))
        assert (verdict.ok, verdict.reason) == (False, reason), verdict.detail
    assert validate_trajectory(clean_record(GOOD)) == (True, "", "")


def test_malformed_records_are_their_own_reason():
    not_a_list = {"uid": "x", "messages": "hello"}
    content_not_text = _row("x", [USER, {"role": "assistant", "content": 5}])
    bad_effort = {**GOOD, "effort": "medium"}
    arguments_not_object = _row(
        "x", [USER, {"role": "assistant", "tool_calls": [_call("c", "calculator", "[1, 2]")]}]
    )
    for row, reason in (
        (not_a_list, "malformed_record"),
        (content_not_text, "malformed_record"),
        (bad_effort, "malformed_record"),
        (arguments_not_object, "malformed_tool_call_json"),
    ):
        assert validate_trajectory(clean_record(row)).reason == reason


def test_bad_rows_are_skipped_and_counted(tmp_path):
    rows = [GOOD, *BAD_ROWS.values(), {**GOOD, "uid": "good-2"}]
    dataset, report = load_trajectories(_write_jsonl(tmp_path / "mixed.jsonl", rows))
    assert dataset["uid"] == ["good", "good-2"]
    assert report.kept == 2
    assert dict(report.skipped) == dict.fromkeys(BAD_ROWS, 1)
    metrics = report.metrics()
    assert metrics["data/kept"] == 2.0
    assert {key for key in metrics if key.startswith("data/skipped/")} == {
        f"data/skipped/{r}" for r in REASONS
    }
    assert metrics["data/skipped/unknown_role"] == 1.0 and metrics["data/skipped/too_long"] == 0.0
    assert "mixed.jsonl line 3" in report.first_example["unknown_role"]  # 1-based, as an editor shows it


def test_strict_loading_names_file_row_and_reason(tmp_path):
    path = _write_jsonl(tmp_path / "strict.jsonl", [GOOD, GOOD, BAD_ROWS["unmatched_tool_result"]])
    with pytest.raises(
        BadTrajectoryError, match=r"strict\.jsonl line 3: unmatched_tool_result: message 2 answers 'c9'"
    ):
        load_trajectories(path, strict=True)


def test_nothing_surviving_is_an_error(tmp_path):
    path = _write_jsonl(tmp_path / "all_bad.jsonl", list(BAD_ROWS.values()))
    with pytest.raises(BadTrajectoryError, match="all_bad.jsonl: no trajectory survived validation"):
        load_trajectories(path)


def test_too_long_counts_rendered_tokens(tmp_path, renderer):
    long_answer = _row("long", [USER, {"role": "assistant", "content": "five " * 200}])
    path = _write_jsonl(tmp_path / "lengths.jsonl", [GOOD, long_answer])
    limit = len(renderer.render(GOOD["messages"], GOOD["tools"], "high")[0])
    dataset, report = load_trajectories(path, renderer=renderer, max_length=limit)
    assert dataset["uid"] == ["good"] and report.skipped["too_long"] == 1
    assert f"> max_length {limit}" in report.first_example["too_long"]


def test_tool_call_ids_become_k3_ids_and_results_follow():
    row = _row(
        "ids",
        [
            USER,
            _calling(_call("call_a", "search", '{"query": "x"}'), _call("call_b", "calculator", "{}")),
            {"role": "tool", "tool_call_id": "call_b", "content": "1"},
            {"role": "tool", "tool_call_id": "call_a", "content": "2"},
            _calling(_call("call_c", "search", '{"query": "y"}')),
        ],
    )
    row["tools"].append({"name": "search", "parameters": {"type": "object"}})  # a bare schema counts too
    messages = clean_record(row)["messages"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["functions.search:0", "functions.calculator:1"]
    assert [m["tool_call_id"] for m in messages[2:4]] == ["functions.calculator:1", "functions.search:0"]
    assert messages[4]["tool_calls"][0]["id"] == "functions.search:2"
    assert validate_trajectory({**row, "messages": messages}).ok


def test_parquet_and_arrow_null_padding(tmp_path, renderer):
    """Arrow pads every row with the keys other rows have; the loaded record is the written one."""
    rows = [
        GOOD,
        _row(
            "tools",
            [
                USER,
                _calling(_call("c", "calculator", '{"expression": "2+3"}')),
                {"role": "tool", "tool_call_id": "c", "content": "5"},
                {"role": "assistant", "content": "5"},
            ],
            effort=None,
        ),
    ]
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    dataset, report = load_trajectories(path)
    assert report.kept == 2
    loaded = decode_record(dataset[1])
    assert "reasoning_content" not in loaded["messages"][1] and "tool_call_id" not in loaded["messages"][0]
    assert loaded["messages"][2] == {"role": "tool", "tool_call_id": "functions.calculator:0", "content": "5"}
    assert dataset[1]["effort"] == ""

    prompt = prompt_sample(loaded)
    assert [m["role"] for m in prompt.messages] == ["user"] and prompt.tokens == []


def test_rows_of_other_types_are_counted_and_broken_lines_are_skipped(tmp_path):
    mixed = _write_jsonl(tmp_path / "types.jsonl", [GOOD, {**GOOD, "uid": "odd", "messages": 7}])
    dataset, report = load_trajectories(mixed)
    assert dataset["uid"] == ["good"] and report.skipped["malformed_record"] == 1
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(GOOD) + "\n\n{not json\n" + json.dumps({**GOOD, "uid": "after"}) + "\n")
    dataset, report = load_trajectories(broken)  # strict: false skips and counts it
    assert dataset["uid"] == ["good", "after"] and report.skipped["broken_line"] == 1
    assert "broken.jsonl line 3: not one JSON object" in report.first_example["broken_line"]
    with pytest.raises(BadTrajectoryError, match=r"broken\.jsonl line 3: broken_line: not one JSON object"):
        load_trajectories(broken, strict=True)


def test_tool_calls_must_name_a_declared_tool(tmp_path):
    verdict = validate_trajectory(clean_record(BAD_ROWS["undeclared_tool"]))
    assert "calls 'web_search', which the record's 'tools' does not declare (declared: calculator)" in (
        verdict.detail
    )
    path = _write_jsonl(tmp_path / "tools.jsonl", [GOOD, BAD_ROWS["undeclared_tool"]])
    with pytest.raises(BadTrajectoryError, match=r"tools\.jsonl line 2: undeclared_tool"):
        load_trajectories(path, strict=True)


def _strict_error(tmp_path: Path, row: dict[str, Any]) -> str:
    """The strict loading error of a file whose line 2 is `row`."""
    with pytest.raises(BadTrajectoryError) as error:
        load_trajectories(_write_jsonl(tmp_path / "strict.jsonl", [GOOD, row]), strict=True)
    return str(error.value)


def test_wrong_types_are_counted_malformed_records_not_crashes(tmp_path):
    """Cleaning runs before validation and checks no types: a call whose function is a string, a
    tool_call_id that is a list or a task that is not an object must still reach validation and be
    a malformed_record named by file and line, never a bare AttributeError / TypeError."""
    function_text = _row(
        "function-text",
        [
            USER,
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": "calculator"}]},
        ],
    )
    list_id = _row(
        "list-id",
        [
            USER,
            _calling(_call("c1", "calculator", '{"expression": "2+3"}')),
            {"role": "tool", "tool_call_id": ["c1"], "content": "5"},
            {"role": "assistant", "content": "5"},
        ],
    )
    task_text = {**GOOD, "uid": "task-text", "task": "arithmetic"}
    rows = [GOOD, function_text, list_id, task_text, {**GOOD, "uid": "task-json", "task": '{"family": "x"}'}]
    dataset, report = load_trajectories(_write_jsonl(tmp_path / "types.jsonl", rows))
    assert dataset["uid"] == ["good", "task-json"] and dict(report.skipped) == {"malformed_record": 3}
    assert "types.jsonl line 2: message 1 tool call 0 needs id" in report.first_example["malformed_record"]
    for row, detail in (
        (function_text, "message 1 tool call 0 needs id, type 'function' and function.name"),
        (list_id, "message 2 'tool_call_id' must be the string id of a tool call"),
        (task_text, "'task' must be a JSON object of verifier data .* got str 'arithmetic'"),
    ):
        assert re.search(rf"strict\.jsonl line 2: malformed_record: {detail}", _strict_error(tmp_path, row))


def test_thinking_anywhere_but_an_assistants_reasoning_content_is_malformed(tmp_path):
    """docs/data.md: thinking is an assistant message's `reasoning_content`, which the renderer wraps
    in <think>...</think>. Tags in the text would be rendered as the special tokens (an R1-style
    inline block gives `<think></think><think>...</think>5`), other keys would be dropped: both are
    rejected (they were accepted silently, strict or not), with where the thinking belongs."""
    assistant = {"role": "assistant", "content": "5"}
    cases = {
        "inline": (
            [USER, {"role": "assistant", "content": "<think>2+3 is 5.</think>5"}],
            "'content' contains <think>",
        ),
        "closing tag": (
            [USER, {**assistant, "content": "2+3 is 5.</think>5"}],
            "'content' contains </think>",
        ),
        "tags in reasoning": (
            [USER, {**assistant, "reasoning_content": "<think>2+3 is 5.</think>"}],
            "'reasoning_content' contains <think>",
        ),
        "thinking key": ([USER, {**assistant, "thinking": "2+3 is 5."}], "has thinking under 'thinking'"),
        "reasoning key": ([USER, {**assistant, "reasoning": "2+3 is 5."}], "has thinking under 'reasoning'"),
        "user reasoning": (
            [{**USER, "reasoning_content": "2+3 is 5."}, assistant],
            "message 0 \\(user\\) has thinking under 'reasoning_content'",
        ),
    }
    for name, (messages, detail) in cases.items():
        verdict = validate_trajectory(clean_record(_row(name, messages)))
        assert verdict.reason == "malformed_record" and re.search(detail, verdict.detail), (name, verdict)
        assert "thinking belongs in" in verdict.detail and "'reasoning_content'" in verdict.detail
        assert "strict.jsonl line 2: malformed_record: message" in _strict_error(
            tmp_path, _row(name, messages)
        )
    # empty values hold no thinking to lose
    empty = _row("empty", [{**USER, "reasoning_content": ""}, {**assistant, "thinking": ""}])
    assert validate_trajectory(clean_record(empty)).ok


def test_jsonl_nulls_inside_arguments_tools_and_task_are_kept(tmp_path, renderer):
    """What the model trains on is what the file says: a null argument and a schema's
    `"default": null` stay (only a record's or message's null key means absent and is dropped;
    Arrow's padding, test_parquet_and_arrow_null_padding, is the other case)."""
    schema = {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"site": {"type": ["string", "null"], "default": None}},
            },
        },
    }
    arguments = {"query": "price", "site": None}
    row = {
        "uid": "nulls",
        "effort": None,
        "messages": [
            USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "search", "arguments": arguments}}
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "12"},
            {"role": "assistant", "reasoning_content": None, "content": "12"},
        ],
        "tools": [schema],
        "task": {"family": "x", "site": None},
    }
    dataset, report = load_trajectories(_write_jsonl(tmp_path / "nulls.jsonl", [row]))
    loaded = decode_record(dataset[0])
    assert loaded["messages"][1]["tool_calls"][0]["function"]["arguments"] == arguments
    assert loaded["tools"] == [schema] and loaded["task"] == {"family": "x", "site": None}
    assert "effort" not in loaded and "content" not in loaded["messages"][1]
    assert "reasoning_content" not in loaded["messages"][3]
    text = renderer.decode(renderer.render(loaded["messages"], loaded["tools"])[0])
    assert '{"query": "price", "site": null}' in text and '"default":null' in text


def test_a_call_without_id_gets_its_k3_id(tmp_path):
    """docs/data.md: ids are rewritten from the name and the call's position, so a call without one
    is given one like any other (its result must then name that id) and the row is kept."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}
    row = _row(
        "no-id",
        [
            USER,
            _calling(call),
            {"role": "tool", "tool_call_id": "functions.calculator:0", "content": "5"},
            {"role": "assistant", "content": "5"},
        ],
    )
    cleaned = clean_record(row)
    assert cleaned["messages"][1]["tool_calls"][0]["id"] == "functions.calculator:0"
    assert validate_trajectory(cleaned).ok
