"""Trajectory records: what one line of an SFT file is, how it is cleaned, and why a row is rejected.

A record is an OpenAI-style conversation plus what K3 conditions on:

    {"uid": str, "domain": str, "effort": "low"|"high"|"max"|None,
     "messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str|None,
                   "reasoning_content": str|None,                    # assistant: preserved thinking
                   "tool_calls": [{"id", "type": "function",
                                   "function": {"name", "arguments": JSON-object string}}],
                   "tool_call_id": str}],                            # tool: the call it answers
     "tools": [JSON schemas], "task": {...hidden verification data, never rendered...},
     "images": [str | [str]]}     # optional: one entry per image / video part, in order

A system, user or tool message's content may instead be a list of parts: {"type": "text", "text":
str}, {"type": "image"} or {"type": "video"}; each media part takes the next entry of "images" (a
file path or data URI; a video, a list of its frames).

Bad rows are data, not bugs: `validate_trajectory` names a reason from `REASONS` so a loader can
skip and count them, or fail with the file, the line (row) and the reason. A tool call must name a
tool the record declares in `tools`: the model is trained to call only what it was offered.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from posttrain.data.chat import ROLES, SPECIAL_TOKENS, tool_call_id
from posttrain.data.chat_media import MEDIA_PART_TYPES
from posttrain.data.sample import EFFORTS

if TYPE_CHECKING:
    from posttrain.data.chat import ChatRenderer

REASONS: tuple[str, ...] = (
    "malformed_record",  # wrong types or missing keys (messages not a list, content not a string, ...)
    "unknown_role",
    "malformed_tool_call_json",  # arguments that do not parse to a JSON object
    "undeclared_tool",  # a tool call naming a tool the record's `tools` does not declare
    "unmatched_tool_result",  # a tool message answering no call of the assistant turn before it
    "empty_assistant_turn",  # no thinking, content or tool call: only an end-of-turn token to train
    "no_assistant_turn",  # nothing at all to train
    "too_long",  # more rendered tokens than max_length
    "broken_line",  # a line of a .jsonl file that is not one JSON object
)
# The renderer wraps an assistant's reasoning_content in these and reads thinking from nowhere else,
# so thinking given another way would be trained as content (tags in text: the tokenizer makes them
# the special tokens) or silently dropped (other keys); such rows are malformed, not converted.
THINK_TAGS = (SPECIAL_TOKENS["think_begin"], SPECIAL_TOKENS["think_end"])
OTHER_THINKING_KEYS = ("thinking", "reasoning")


class Verdict(NamedTuple):
    """(ok, reason) plus a human detail; reason is one of `REASONS`, "" when ok."""

    ok: bool
    reason: str = ""
    detail: str = ""


class BadTrajectoryError(ValueError):
    """A row failed validation under strict loading, or nothing survived."""


@dataclass
class ValidationReport:
    """How many rows were kept and, per reason, how many were skipped (with the first example)."""

    kept: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    first_example: dict[str, str] = field(default_factory=dict)

    def add(self, verdict: Verdict, where: str) -> None:
        if verdict.ok:
            self.kept += 1
            return
        self.skipped[verdict.reason] += 1
        self.first_example.setdefault(verdict.reason, f"{where}: {verdict.detail}")

    def merge(self, other: ValidationReport) -> None:
        self.kept += other.kept
        self.skipped.update(other.skipped)
        for reason, example in other.first_example.items():
            self.first_example.setdefault(reason, example)

    def metrics(self) -> dict[str, float]:
        """Flat numbers for a stage log: data/kept and data/skipped/<reason> for every reason."""
        out = {"data/kept": float(self.kept)}
        out.update({f"data/skipped/{reason}": float(self.skipped[reason]) for reason in REASONS})
        return out

    def summary(self) -> str:
        skipped = ", ".join(f"{reason} {count}" for reason, count in sorted(self.skipped.items()))
        return f"kept {self.kept}, skipped {sum(self.skipped.values())}" + (
            f" ({skipped})" if skipped else ""
        )


def clean_record(row: dict[str, Any], *, arrow_padded: bool = False) -> dict[str, Any]:
    """Undo what storage does to a record and make tool-call ids K3-style.

    A null under a record's or a message's key means the key is absent (OpenAI writes `"content":
    null` beside tool calls) and is dropped. Deeper values are what the model trains on and are kept
    exactly, nulls included: an argument `"site": null`, a schema's `"default": null`. Rows read back
    through Arrow (`arrow_padded`: parquet, JSON arrays, `datasets`) are the exception: Arrow unifies
    struct fields across rows at every depth, so such a row carries None for every key another row
    had, inside tool schemas, tasks and dict arguments too, where it cannot be told from a null of the
    file's own; all of them are dropped (a `tools`, `task` or `arguments` stored as a JSON string
    keeps its nulls). `tools` and `task` may be JSON strings (common on the hub). Tool-call ids are
    rewritten to ``functions.<name>:<k>`` (k counts calls in the conversation), the ids the model
    writes itself, and tool results follow their call's new id. Types are not checked here: that is
    `validate_trajectory`'s job, so malformed rows survive cleaning (without raising) to be counted.
    """
    record = _drop_none(row) if arrow_padded else _without_none(row)
    for key in ("tools", "task"):
        if isinstance(record.get(key), str):
            try:
                record[key] = json.loads(record[key])
            except json.JSONDecodeError:
                pass
    messages = record.get("messages")
    if isinstance(messages, list):
        record["messages"] = _canonical_call_ids(
            [_without_none(m) if isinstance(m, dict) else m for m in messages]
        )
    return record


def _without_none(mapping: dict[str, Any]) -> dict[str, Any]:
    return {key: item for key, item in mapping.items() if item is not None}


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _drop_none(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_drop_none(item) for item in value]
    return value


def _canonical_call_ids(messages: list[Any]) -> list[Any]:
    renamed: dict[str, str] = {}
    count = 0
    out = []
    for message in messages:
        if not isinstance(message, dict):
            out.append(message)
            continue
        message = dict(message)
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            new_calls = []
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                name = function.get("name") if isinstance(function, dict) else None
                if isinstance(name, str):
                    new_id = tool_call_id(name, count)
                    if isinstance(call.get("id"), str):
                        renamed[call["id"]] = new_id
                    call = {**call, "id": new_id}
                    count += 1
                new_calls.append(call)
            message["tool_calls"] = new_calls
        elif message.get("role") == "tool" and isinstance(message.get("tool_call_id"), str):
            message["tool_call_id"] = renamed.get(message["tool_call_id"], message["tool_call_id"])
        out.append(message)
    return out


def validate_trajectory(
    record: dict[str, Any], renderer: ChatRenderer | None = None, max_length: int | None = None
) -> Verdict:
    """Check one cleaned record. `too_long` needs a renderer (the length is counted in tokens)."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        return Verdict(False, "malformed_record", "'messages' must be a non-empty list")
    tools = record.get("tools", [])
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        return Verdict(False, "malformed_record", "'tools' must be a list of JSON schemas")
    effort = record.get("effort")
    if effort is not None and effort not in EFFORTS:
        return Verdict(False, "malformed_record", f"effort {effort!r} is not one of {', '.join(EFFORTS)}")
    task = record.get("task", {})
    if not isinstance(task, dict):  # verifiers and environments read it as a dict (task["family"])
        return Verdict(
            False,
            "malformed_record",
            f"'task' must be a JSON object of verifier data such as {{\"family\": ...}} (or a JSON "
            f"string of one), got {type(task).__name__} {task!r:.60}",
        )
    images = record.get("images", [])
    verdict = _check_media(messages, images)
    if not verdict.ok:
        return verdict
    declared = {_tool_name(tool) for tool in tools} - {None}
    pending: set[str] = set()
    trained = False
    for index, message in enumerate(messages):
        verdict = _check_message(message, index, pending, declared)
        if not verdict.ok:
            return verdict
        trained = trained or message["role"] == "assistant"
    if not trained:
        return Verdict(False, "no_assistant_turn", "the conversation has no assistant message to train on")
    if renderer is not None and max_length is not None:
        length = len(renderer.render(messages, tools, effort, renderer.media_blocks(images))[0])
        if length > max_length:
            return Verdict(False, "too_long", f"{length} tokens after rendering > max_length {max_length}")
    return Verdict(True)


def _check_media(messages: list[Any], images: Any) -> Verdict:
    """The media parts of `messages` (list contents) and the record's `images` agree in number;
    every part is text, image or video."""
    if not isinstance(images, list) or not all(
        isinstance(entry, str)
        or (isinstance(entry, list) and entry and all(isinstance(f, str) for f in entry))
        for entry in images
    ):
        return Verdict(
            False, "malformed_record", "'images' must be a list of paths / data URIs or frame lists"
        )
    parts = 0
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", *MEDIA_PART_TYPES) or (
                kind == "text" and not isinstance(part.get("text"), str)
            ):
                return Verdict(
                    False,
                    "malformed_record",
                    f"message {index}: content part {part!r} is not text, image or video",
                )
            parts += kind in MEDIA_PART_TYPES
    if parts != len(images):
        return Verdict(
            False,
            "malformed_record",
            f"the messages have {parts} image/video parts but 'images' has {len(images)}",
        )
    return Verdict(True)


def _tool_name(tool: dict[str, Any]) -> str | None:
    """The name a tool schema declares: OpenAI's {"type": "function", "function": {"name"}} or a
    bare {"name"}."""
    function = tool.get("function", tool)
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


def _check_message(message: Any, index: int, pending: set[str], declared: set[str]) -> Verdict:
    """Validate message `index`; `pending` holds the ids of calls not yet answered (mutated);
    `declared` the tool names the record's `tools` declares."""
    where = f"message {index}"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return Verdict(False, "malformed_record", f"{where} is not an object with a string 'role'")
    role = message["role"]
    if role not in ROLES:
        return Verdict(
            False, "unknown_role", f"{where} has role {role!r}; expected one of {', '.join(ROLES)}"
        )
    misplaced = OTHER_THINKING_KEYS + (("reasoning_content",) if role != "assistant" else ())
    for key in misplaced:
        if message.get(key) not in (None, ""):
            return Verdict(
                False,
                "malformed_record",
                f"{where} ({role}) has thinking under '{key}', which is never rendered: thinking belongs "
                "in an assistant message's 'reasoning_content'",
            )
    for key in ("content", "reasoning_content"):
        value = message.get(key, "")
        # a list of parts (text and media, checked by _check_media) is content outside assistant turns
        if not isinstance(value, str) and not (
            key == "content" and role != "assistant" and isinstance(value, list)
        ):
            return Verdict(False, "malformed_record", f"{where} '{key}' must be a string")
        tag = next((tag for tag in THINK_TAGS if role == "assistant" and tag in value), None)
        if tag is not None:
            return Verdict(
                False,
                "malformed_record",
                f"{where} '{key}' contains {tag}: thinking belongs in 'reasoning_content' without tags "
                "(the renderer wraps it in <think>...</think>)",
            )
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str | None):
            return Verdict(
                False, "malformed_record", f"{where} 'tool_call_id' must be the string id of a tool call"
            )
        if call_id not in pending:
            return Verdict(
                False, "unmatched_tool_result", f"{where} answers {call_id!r}, no open tool call has that id"
            )
        pending.discard(call_id)
        return Verdict(True)
    if role != "assistant":
        pending.clear()
        return Verdict(True)
    calls = message.get("tool_calls", [])
    if not isinstance(calls, list):
        return Verdict(False, "malformed_record", f"{where} 'tool_calls' must be a list")
    pending.clear()
    for number, call in enumerate(calls):
        verdict = _check_call(call, f"{where} tool call {number}")
        if not verdict.ok:
            return verdict
        name = call["function"]["name"]
        if name not in declared:
            return Verdict(
                False,
                "undeclared_tool",
                f"{where} tool call {number} calls {name!r}, which the record's 'tools' does not declare "
                f"(declared: {', '.join(sorted(declared)) or 'none'})",
            )
        pending.add(call["id"])
    if (
        not calls
        and not message.get("content", "").strip()
        and not message.get("reasoning_content", "").strip()
    ):
        return Verdict(False, "empty_assistant_turn", f"{where} has no thinking, content or tool call")
    return Verdict(True)


def _check_call(call: Any, where: str) -> Verdict:
    function = call.get("function") if isinstance(call, dict) else None
    if (
        not isinstance(function, dict)
        or not isinstance(call.get("id"), str)
        or call.get("type", "function") != "function"
        or not isinstance(function.get("name"), str)
    ):
        return Verdict(False, "malformed_record", f"{where} needs id, type 'function' and function.name")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            return Verdict(False, "malformed_tool_call_json", f"{where} arguments are not JSON ({error})")
    if not isinstance(arguments, dict):
        return Verdict(False, "malformed_tool_call_json", f"{where} arguments must be a JSON object")
    return Verdict(True)
