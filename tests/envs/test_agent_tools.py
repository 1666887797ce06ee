"""Agent tools through a sandbox: every registered tool's schema, results of real calls, and errors
that come back as result text rather than exceptions."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from posttrain.envs.sandbox import Sandbox
from posttrain.envs.tools import TOOLS, Tool, call_tool, make_tools

DOCS = {
    "catalog.txt": "Trail Lamp: price 24 dollars.\nRiver Tent: price 180 dollars.\n",
    "offices.md": "The Oslo office opens at 9.\n\nThe Lima office opens at 8.\n",
}


@pytest.fixture
def docs_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "docs"
    directory.mkdir()
    for name, text in DOCS.items():
        (directory / name).write_text(text)
    return directory


@pytest.fixture
def tools(docs_dir: Path) -> dict:
    return make_tools(list(TOOLS), docs_dir=docs_dir, timeout=5)


def _call(
    tools: dict, sandbox: Sandbox, name: str, arguments: dict | str, call_id: str = "functions.x:0"
) -> dict:
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return call_tool(
        tools, sandbox, {"id": call_id, "type": "function", "function": {"name": name, "arguments": raw}}
    )


def test_every_registered_tool_has_a_well_formed_schema_and_reports_missing_arguments(tools, sandbox):
    assert set(TOOLS) >= {"run_python", "shell", "read_file", "write_file", "search"}
    for name, tool in tools.items():
        schema = tool.schema
        assert schema["type"] == "function" and schema["function"]["name"] == name == tool.name
        parameters = schema["function"]["parameters"]
        assert parameters["type"] == "object"
        assert set(parameters["required"]) <= set(parameters["properties"])
        result = tool.call(sandbox, {})
        assert result.startswith("error: missing required argument"), (name, result)


def test_run_python_and_shell_return_output_and_failures(tools, sandbox):
    assert _call(tools, sandbox, "run_python", {"code": "print(6 * 7)"})["content"] == "42"
    failed = _call(tools, sandbox, "run_python", {"code": "print('before')\n1 / 0"})["content"]
    assert failed == "before\nZeroDivisionError: division by zero"
    assert _call(tools, sandbox, "run_python", {"code": "x = 1"})["content"] == "(no output)"
    impatient = make_tools(["run_python"], timeout=0.5)
    timed = _call(impatient, sandbox, "run_python", {"code": "while True: pass"})["content"]
    assert timed == "error: timed out after 0.5 s"
    shell = _call(tools, sandbox, "shell", {"command": "echo out; echo err >&2; exit 3"})["content"]
    assert shell == "out\nerr\n(exit code 3)"


def test_files_written_by_one_tool_are_read_by_another_and_by_programs(tools, sandbox):
    written = _call(tools, sandbox, "write_file", {"path": "notes/plan.txt", "content": "étape 1\n"})
    assert written["content"] == "wrote 8 characters to notes/plan.txt"
    assert (sandbox.workspace / "notes" / "plan.txt").read_text() == "étape 1\n"
    assert _call(tools, sandbox, "read_file", {"path": "notes/plan.txt"})["content"] == "étape 1\n"
    code = "print(open('notes/plan.txt').read().upper(), end='')"
    assert _call(tools, sandbox, "run_python", {"code": code})["content"] == "ÉTAPE 1"


def test_file_tools_cannot_leave_the_sandbox(tools, sandbox, tmp_path):
    (tmp_path / "host.txt").write_text("host secret")
    denied = _call(tools, sandbox, "write_file", {"path": "/etc/evil", "content": "x"})["content"]
    assert denied.startswith("error: ") and "Read-only file system" in denied
    missing = _call(tools, sandbox, "read_file", {"path": str(tmp_path / "host.txt")})["content"]
    assert missing.startswith("error: ") and "No such file" in missing


def test_search_ranks_lines_of_the_shipped_documents(tools, sandbox):
    assert _call(tools, sandbox, "search", {"query": "river tent price"})["content"] == (
        "catalog.txt: River Tent: price 180 dollars."
    )
    both = _call(tools, sandbox, "search", {"query": "office opens"})["content"]
    assert both == "offices.md: The Oslo office opens at 9.\noffices.md: The Lima office opens at 8."
    assert _call(tools, sandbox, "search", {"query": "zebra"})["content"] == "no results"
    assert _call(tools, sandbox, "search", {"query": "?!"})["content"] == "error: the query has no words"


def test_a_call_is_answered_by_a_tool_message_and_bad_calls_by_error_text(tools, sandbox):
    message = _call(tools, sandbox, "shell", {"command": "echo hi"}, call_id="functions.shell:3")
    assert message == {"role": "tool", "tool_call_id": "functions.shell:3", "content": "hi"}
    json_error = "Expecting property name enclosed in double quotes at character 1"
    cases = [
        ("nope", "{}", f"error: unknown tool 'nope'; available: {', '.join(sorted(tools))}"),
        ("shell", "{not json", f"error: arguments are not valid JSON ({json_error})"),
        ("shell", "[1]", "error: arguments must be a JSON object, got list"),
        ("shell", '{"command": 5}', "error: argument 'command' must be a string, got int"),
        (
            "shell",
            '{"command": "ls", "sudo": true}',
            "error: unknown argument(s) 'sudo'; expected ['command']",
        ),
    ]
    for name, raw, expected in cases:
        assert _call(tools, sandbox, name, raw)["content"] == expected


class CapitalOf(Tool):
    """A plug-in tool with a bug: it indexes its table with whatever country the model names."""

    name = "capital_of"
    description = "The capital city of a country."
    parameters = {"type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]}

    def execute(self, sandbox: Sandbox | None, **arguments: Any) -> str:
        if arguments["country"] == "Stop":
            raise KeyboardInterrupt
        return {"France": "Paris"}[arguments["country"]]


def test_a_tool_that_raises_is_answered_with_the_error_and_logged_once(caplog):
    tools = {"capital_of": CapitalOf()}
    with caplog.at_level(logging.WARNING, logger="posttrain.envs.tools"):
        answers = [_call(tools, None, "capital_of", {"country": c})["content"] for c in ("Atlantis", "Mu")]
    assert answers == ["error: KeyError: 'Atlantis'", "error: KeyError: 'Mu'"]
    assert len(caplog.records) == 1 and "tool 'capital_of' (CapitalOf) raised KeyError" in caplog.text
    assert _call(tools, None, "capital_of", {"country": "France"})["content"] == "Paris"
    with pytest.raises(KeyboardInterrupt):  # not an Exception: an interrupt still stops the run
        _call(tools, None, "capital_of", {"country": "Stop"})


def test_sandbox_refusals_become_error_text(tools, tmp_path):
    sandbox = Sandbox(snapshot_root=tmp_path)
    sandbox.pause()
    paused = _call(tools, sandbox, "shell", {"command": "true"})["content"]
    assert paused.startswith("error: sandbox") and "paused" in paused
    sandbox.close()
    closed = _call(tools, sandbox, "run_python", {"code": "1"})["content"]
    assert closed.startswith("error: sandbox") and closed.endswith("is closed")


def test_without_a_sandbox_host_tools_work_and_sandboxed_ones_say_they_need_one(tools):
    assert _call(tools, None, "search", {"query": "tent"})["content"].startswith("catalog.txt: River Tent")
    for name, arguments in (("run_python", {"code": "1"}), ("write_file", {"path": "a", "content": ""})):
        content = _call(tools, None, name, arguments)["content"]
        assert content == f"error: {name} runs in a sandbox and this episode has none"


def test_search_needs_an_existing_docs_dir(tmp_path):
    with pytest.raises(ValueError, match="docs_dir .* is not a directory"):
        make_tools(["search"], docs_dir=tmp_path / "missing")
