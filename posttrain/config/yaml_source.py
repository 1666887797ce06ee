"""YAML loading that remembers where every key was written.

PyYAML's `safe_load` returns plain dicts and forgets positions, so a schema error could only say
*what* is wrong. Composing the node graph first keeps each node's start mark; we record the line
of every key path so schema errors point at the line to edit. Duplicate keys, which PyYAML
silently resolves to the last one, are reported as errors. Keys are read as the text written:
YAML 1.1 would make `on:` the boolean True, `~:` None and `3:` the integer 3, keys no schema names
(and that JSON cannot sort beside names when a stage's config is hashed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from posttrain.config.errors import ConfigError, Issue, key_path

KeyPath = tuple[str | int, ...]


def load_yaml(path: Path, display: str | None = None) -> tuple[Any, dict[KeyPath, int], list[Issue]]:
    """Parse `path`, every mapping key a string as written; return (data, {key path: 1-based line},
    issues). The empty path () maps to line 1. `issues` lists duplicate keys (the data is still
    usable, so the caller can go on and report every other mistake too).

    Raises ConfigError naming the file and line for syntax errors and a missing file.
    """
    name = display or str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([Issue(name, "file does not exist")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([Issue(name, f"cannot read file: {exc}")]) from None
    loader = yaml.SafeLoader(text)
    lines: dict[KeyPath, int] = {(): 1}
    issues: list[Issue] = []
    try:
        node = loader.get_single_node()
        if node is not None:
            _record_lines(node, (), lines, issues, name)
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        problem = " ".join(p for p in (exc.context, exc.problem) if p)
        raise ConfigError([Issue(name, f"YAML syntax error: {problem}", line=line)]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([Issue(name, f"YAML error: {exc}")]) from None
    finally:
        loader.dispose()
    return data, lines, issues


def _record_lines(
    node: yaml.Node, path: KeyPath, lines: dict[KeyPath, int], issues: list[Issue], name: str
) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key = key_node.value
                key_node.tag = "tag:yaml.org,2002:str"  # constructed as written
            else:
                key = str(key_node.value)
            line = key_node.start_mark.line + 1
            if key in seen:
                issues.append(
                    Issue(
                        name,
                        f"duplicate key (first written on line {seen[key]})",
                        key=key_path((*path, key)),
                        line=line,
                        hint="keep one of them",
                    )
                )
            seen[key] = line
            lines[(*path, key)] = line
            _record_lines(value_node, (*path, key), lines, issues, name)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[(*path, index)] = item.start_mark.line + 1
            _record_lines(item, (*path, index), lines, issues, name)


def line_of(lines: dict[KeyPath, int], path: KeyPath) -> int | None:
    """Line of `path`, or of its nearest written ancestor (a missing key is reported where its
    parent mapping is)."""
    for end in range(len(path), -1, -1):
        if path[:end] in lines:
            return lines[path[:end]]
    return None
