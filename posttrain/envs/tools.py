"""Agent tools that act through a `Sandbox`, and the step that turns a tool call into a tool message.

An agent episode alternates assistant turns that call tools and tool messages that answer them;
both are trajectory messages in `Sample.messages`. `call_tool` executes one OpenAI-style call
against a sandbox and returns the answering message. A tool never raises on bad input or a
sandbox refusal: the model sees an "error: ..." result and can recover, as it would in production.
A tool that raises anything else has a bug; `call_tool` still answers with the error (its type and
message) and logs a warning naming the tool once, so one buggy plug-in tool does not end a run.

The shipped task families (data_recipes/agent_tasks) generate their SFT demonstrations with these
same tools, so the policy meets in RL the very interface (names, schemas, result wording) it
learned in SFT. Plug-ins add tools by registering a `Tool` subclass in `TOOLS` (the calculator
lives there); a tool that is one command in the sandbox subclasses `SandboxTool` (or its
`ProgramTool` / `FileTool`) and only says what to run and how the result reads.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from posttrain.envs.sandbox import RunResult, Sandbox, SandboxError
from posttrain.registry import Registry

LOG = logging.getLogger(__name__)
# Tools whose unexpected exception was logged in this process (`_answer`).
_FAILED_TOOLS: set[str] = set()
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_CHARS = 8000
JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "object": dict,
    "array": list,
}


class Tool:
    """A function an agent can call: a name, a description, a JSON schema of its arguments, and
    `call(sandbox, arguments) -> str`. Subclasses implement `execute` with validated arguments."""

    name: ClassVar[str]
    description: ClassVar[str]
    parameters: ClassVar[dict[str, Any]]
    # Tools that run commands or touch files need a sandbox; host-side ones (search) accept None.
    needs_sandbox: ClassVar[bool] = False

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self.timeout = timeout
        self.max_chars = max_chars

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function-calling declaration offered to the model (`Sample.tools`)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def call(self, sandbox: Sandbox | None, arguments: Mapping[str, Any]) -> str:
        problem = _argument_problem(arguments, self.parameters)
        if problem:
            return f"error: {problem}"
        if sandbox is None and self.needs_sandbox:
            return f"error: {self.name} runs in a sandbox and this episode has none"
        try:
            result = self.execute(sandbox, **arguments)
        except (SandboxError, ValueError, OSError) as exc:
            return f"error: {exc}"
        return _clip(result, self.max_chars)

    def execute(self, sandbox: Sandbox | None, **arguments: Any) -> str:
        raise NotImplementedError


TOOLS: Registry[type[Tool]] = Registry("tool", named=True)


def _string_parameters(**properties: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {key: {"type": "string", "description": text} for key, text in properties.items()},
        "required": list(properties),
    }


class SandboxTool(Tool):
    """A tool that is one command run in the sandbox as its user, under the tool's timeout.

    Subclasses give the command (`command`: an argv list or a /bin/sh line, and what goes to its
    stdin) and word its result for the model (`answer`).
    """

    needs_sandbox = True

    def execute(self, sandbox: Sandbox, **arguments: str) -> str:
        command, stdin = self.command(**arguments)
        return self.answer(sandbox.run(command, timeout=self.timeout, stdin=stdin), sandbox, **arguments)

    def command(self, **arguments: str) -> tuple[str | list[str], str | None]:
        raise NotImplementedError

    def answer(self, result: RunResult, sandbox: Sandbox, **arguments: str) -> str:
        raise NotImplementedError


class ProgramTool(SandboxTool):
    """Runs a program the agent wrote. Such a program can exhaust the sandbox's limits, and the model
    should learn that it did: a kill (timeout, memory, CPU time) is the whole answer. Otherwise the
    answer is `output(result)`, or "(no output)"."""

    def answer(self, result: RunResult, sandbox: Sandbox, **arguments: str) -> str:
        if problem := _killed(result, self.timeout, sandbox):
            return problem
        return self.output(result) or "(no output)"

    def output(self, result: RunResult) -> str:
        raise NotImplementedError


class FileTool(SandboxTool):
    """Reads or writes the file at `path` as the sandbox user (so only where the agent may). A failure
    answers with the command's last stderr line, or "cannot <verb> <path>" when it printed none;
    success with `done(result, path, ...)`."""

    verb: ClassVar[str]

    def answer(self, result: RunResult, sandbox: Sandbox, path: str, **arguments: str) -> str:
        if result.exit_code != 0:
            return f"error: {_last_line(result.stderr) or f'cannot {self.verb} {path}'}"
        return self.done(result, path, **arguments)

    def done(self, result: RunResult, path: str, **arguments: str) -> str:
        raise NotImplementedError


@TOOLS.register("run_python")
class RunPython(ProgramTool):
    """Python 3 in the sandbox, program on stdin, working directory /workspace. A failing program
    answers with its output and its error's last line (the exception), or its exit code."""

    name = "run_python"
    description = "Run a Python program and return its output."
    parameters = _string_parameters(code="program")

    def command(self, code: str) -> tuple[list[str], str]:
        return ["python3", "-"], code

    def output(self, result: RunResult) -> str:
        printed = result.stdout.strip()
        if result.exit_code == 0:
            return printed
        return "\n".join(
            filter(None, [printed, _last_line(result.stderr) or f"exit code {result.exit_code}"])
        )


@TOOLS.register("shell")
class Shell(ProgramTool):
    """A /bin/sh command line in the sandbox; background jobs it starts keep running. Answers with
    stdout, stderr and, when it failed, the exit code."""

    name = "shell"
    description = "Run a shell command in the workspace and return its output and exit code."
    parameters = _string_parameters(command="a /bin/sh command line")

    def command(self, command: str) -> tuple[str, None]:
        return command, None

    def output(self, result: RunResult) -> str:
        parts = [result.stdout.rstrip("\n"), result.stderr.rstrip("\n")]
        if result.exit_code != 0:
            parts.append(f"(exit code {result.exit_code})")
        return "\n".join(filter(None, parts))


@TOOLS.register("read_file")
class ReadFile(FileTool):
    """A text file's content."""

    name = "read_file"
    description = "Read a text file."
    parameters = _string_parameters(path="file name")
    verb = "read"

    def command(self, path: str) -> tuple[list[str], None]:
        return ["cat", "--", path], None

    def done(self, result: RunResult, path: str) -> str:
        return result.stdout


@TOOLS.register("write_file")
class WriteFile(FileTool):
    """Writes `content`, creating parent directories; paths are relative to /workspace."""

    name = "write_file"
    description = "Write a text file."
    parameters = _string_parameters(path="file name", content="text")
    verb = "write"

    def command(self, path: str, content: str) -> tuple[list[str], str]:
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'  # the path is $1, never spliced in
        return ["/bin/sh", "-c", script, "write_file", path], content

    def done(self, result: RunResult, path: str, content: str) -> str:
        return f"wrote {len(content)} characters to {path}"


@TOOLS.register("search")
class Search(Tool):
    """Keyword search over a directory of shipped documents (*.txt and *.md).

    The lines sharing the most words with the query, at most `max_results`, in document order. It
    runs on the host, not in the sandbox: no agent code executes, the query is only compared as
    data, and indexing once beats re-reading the documents in every call.
    """

    name = "search"
    description = "Search the company documents."
    parameters = _string_parameters(query="keywords")

    def __init__(self, docs_dir: str | Path, max_results: int = 2, **options: Any) -> None:
        super().__init__(**options)
        directory = Path(docs_dir)
        if not directory.is_dir():
            raise ValueError(
                f"search tool: docs_dir {str(directory)!r} is not a directory; "
                f"pass the folder of shipped documents, e.g. data_recipes/docs"
            )
        paths = sorted(p for pattern in ("*.txt", "*.md") for p in directory.glob(pattern))
        self.lines = [
            (p.name, line.strip()) for p in paths for line in p.read_text().splitlines() if line.strip()
        ]
        self.max_results = max_results

    def execute(self, sandbox: Sandbox | None, query: str) -> str:
        wanted = _words(query)
        if not wanted:
            raise ValueError("the query has no words")
        scored = [(len(wanted & _words(line)), name, line) for name, line in self.lines]
        best = max((score for score, _, _ in scored), default=0)
        if best == 0:
            return "no results"
        return "\n".join(
            [f"{name}: {line}" for score, name, line in scored if score == best][: self.max_results]
        )


def make_tools(names: Sequence[str], **options: Any) -> dict[str, Tool]:
    """Instantiate registered tools by name; `options` go to each tool that accepts them
    (e.g. docs_dir for search, timeout for all)."""
    tools = {}
    for name in names:
        cls = TOOLS.get(name)
        accepted = _init_parameters(cls)
        tools[name] = cls(**{key: value for key, value in options.items() if key in accepted})
    return tools


def call_tool(
    tools: Mapping[str, Tool], sandbox: Sandbox | None, tool_call: Mapping[str, Any]
) -> dict[str, Any]:
    """Execute one assistant tool call {"id", "type": "function", "function": {"name", "arguments"}}
    and return the tool message answering it: {"role": "tool", "tool_call_id", "content"}."""
    function = tool_call.get("function") or {}
    name = function.get("name")
    raw = function.get("arguments", "{}")
    if name not in tools:
        content = f"error: unknown tool {name!r}; available: {', '.join(sorted(tools)) or 'none'}"
    else:
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError as exc:
            arguments, content = (
                None,
                f"error: arguments are not valid JSON ({exc.msg} at character {exc.pos})",
            )
        if arguments is not None:
            if isinstance(arguments, dict):
                content = _answer(tools[name], name, sandbox, arguments)
            else:
                content = f"error: arguments must be a JSON object, got {type(arguments).__name__}"
    return {"role": "tool", "tool_call_id": tool_call.get("id", ""), "content": content}


def _answer(tool: Tool, name: str, sandbox: Sandbox | None, arguments: dict[str, Any]) -> str:
    """`tool.call`, with any exception it lets out as the model's error result: a plug-in tool's bug
    (a KeyError on an argument it did not expect) must not abort the whole batch of episodes it is
    played in. KeyboardInterrupt and SystemExit are no Exception and still stop the run."""
    try:
        return tool.call(sandbox, arguments)
    except Exception as exc:
        if name not in _FAILED_TOOLS:  # once per tool: a bug repeats on every call that meets it
            _FAILED_TOOLS.add(name)
            LOG.warning(
                "tool %r (%s) raised %s; the model gets it as an error result. A tool should answer bad "
                "input with an 'error: ...' result or raise ValueError; later failures of this tool "
                "are not logged",
                name,
                type(tool).__qualname__,
                type(exc).__name__,
                exc_info=True,
            )
        return f"error: {type(exc).__name__}: {exc}"


def _argument_problem(arguments: Mapping[str, Any], schema: dict[str, Any]) -> str | None:
    if not isinstance(arguments, Mapping):
        return f"arguments must be an object, got {type(arguments).__name__}"
    properties = schema.get("properties", {})
    missing = [key for key in schema.get("required", []) if key not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(map(repr, missing))}; expected {sorted(properties)}"
    unknown = [key for key in arguments if key not in properties]
    if unknown:
        return f"unknown argument(s) {', '.join(map(repr, unknown))}; expected {sorted(properties)}"
    for key, value in arguments.items():
        expected = JSON_TYPES.get(properties[key].get("type", ""), object)
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            return f"argument {key!r} must be a {properties[key]['type']}, got {type(value).__name__}"
    return None


def _killed(result: RunResult, timeout: float, sandbox: Sandbox) -> str | None:
    if result.timed_out:
        return f"error: timed out after {timeout:g} s"
    if result.killed_reason == "memory":
        return f"error: killed: out of memory (limit {sandbox.config['memory_mb']} MiB)"
    if result.killed_reason == "cpu":
        return f"error: killed: CPU time limit ({sandbox.config['cpu_seconds']} s)"
    return None


def _clip(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters omitted ...]\n{text[-half:]}"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def _init_parameters(cls: type[Tool]) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            names |= {p for p in inspect.signature(init).parameters if p not in ("self", "options")}
    return names
