"""`key=value` overrides from the command line.

Rules (docs/orchestration.md repeats them for users):
- `STAGE.path=value` sets `path` in the stages whose id matches STAGE (an id or a glob such as
  `rl-*`): `sft.train.steps=3`, `rl-coding-*.seed=7`.
- `path=value` without a stage prefix sets `path` in every stage of the DAG that has it (written
  in its file or accepted by its schema): `train.steps=3` shortens every stage with a `train.steps` key.
- The value is parsed as YAML: `3` is an int, `true` a bool, `[a, b]` a list, `x` a string.
- Keys that shape the DAG (stage, kind, needs, plugins, matrix) cannot be overridden.
Overridden values are validated like file values; errors name the override.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from posttrain.config.errors import Issue, did_you_mean
from posttrain.config.stage_file import ENTRY, STRUCTURAL_KEYS

SOURCE = "command line"


@dataclass(frozen=True)
class Override:
    text: str
    key: tuple[str, ...]
    value: Any


def parse_overrides(texts: Iterable[str]) -> tuple[list[Override], list[Issue]]:
    overrides, issues = [], []
    for text in texts:
        key, sep, raw = text.partition("=")
        parts = tuple(key.strip().split("."))
        if not sep or not all(parts):
            issues.append(
                Issue(
                    SOURCE, f"cannot read override {text!r}", hint="write KEY=VALUE, e.g. sft.train.steps=3"
                )
            )
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        overrides.append(Override(text, parts, value))
    return overrides, issues


def apply_overrides(
    overrides: Iterable[Override],
    stages: Mapping[str, dict[str, Any]],
    known: Mapping[str, set[tuple[str, ...]]],
) -> tuple[dict[str, dict[tuple[str, ...], str]], list[Issue]]:
    """Set each override in the stage mappings (in place).

    stages: stage id -> its raw mapping (generic keys and body).
    known: stage id -> key paths its schemas accept (generic + registered kind's body).
    Returns (stage id -> {overridden path: override text}, issues).
    """
    applied: dict[str, dict[tuple[str, ...], str]] = {sid: {} for sid in stages}
    issues = []
    for override in overrides:
        head, rest = override.key[0], override.key[1:]
        prefixed = [sid for sid in stages if fnmatch.fnmatchcase(sid, head)] if rest else []
        if prefixed:
            targets, path = prefixed, rest
        else:
            path = override.key
            targets = [
                sid
                for sid in stages
                if _accepts(known.get(sid, set()), stages[sid], path) or _has(stages[sid], path)
            ]
        if path[0] in STRUCTURAL_KEYS:
            issues.append(
                Issue(
                    SOURCE,
                    f"{path[0]!r} shapes the stage DAG and cannot be overridden",
                    key=override.text,
                    hint="edit the stage file instead",
                )
            )
            continue
        if not targets:
            issues.append(
                Issue(SOURCE, "no stage has this key", key=override.text, hint=_hint(override, stages, known))
            )
            continue
        for sid in targets:
            problem = _set(stages[sid], path, override.value)
            if problem:
                issues.append(Issue(SOURCE, f"stage {sid}: {problem}", key=override.text))
            else:
                applied[sid][path] = override.text
    return applied, issues


def _hint(
    override: Override, stages: dict[str, dict[str, Any]], known: dict[str, set[tuple[str, ...]]]
) -> str:
    """A new entry inside a mapping the stages have (`environments.math.max_turns` when no stage
    has `environments.math` yet) can only be set per stage: say so with a stage prefix. Anything
    else is most likely a typo: the nearest key."""
    path = override.key
    # The schema takes the path, but a mapping entry on the way is in no stage's file yet.
    owners = [sid for sid in stages if any(_matches(a, path) for a in known.get(sid, set()))]
    if owners:
        entries = [
            i
            for i, part in enumerate(next(a for a in known[owners[0]] if _matches(a, path)))
            if part == ENTRY
        ]
        depth = next((i for i in entries if not _has(stages[owners[0]], path[: i + 1])), entries[-1])
        return _per_stage(override, owners, path[: depth + 1])
    for depth in range(len(path) - 2, 0, -1):
        owners = [sid for sid in stages if _has(stages[sid], path[:depth])]
        if owners:
            return _per_stage(override, owners, path[: depth + 1])
    candidates = {
        ".".join(p).replace(ENTRY, "<name>")
        for sid in stages
        for p in known.get(sid, set()) | _paths(stages[sid])
    }
    return did_you_mean(".".join(path), candidates) or (
        f"prefix a stage id to target one stage, e.g. {next(iter(stages), 'sft')}.{override.text}"
    )


def _per_stage(override: Override, owners: list[str], entry: tuple[str, ...]) -> str:
    """The per-stage advice, its example a matrix stage (`rl-math-low`) with its glob where several
    stages could take the entry."""
    matrix = [sid for sid in owners if "-" in sid] if len(owners) > 1 else []
    example = (matrix or owners)[0]
    glob = f" (a glob such as '{example.split('-')[0]}-*' targets several)" if matrix else ""
    return f"no stage has {'.'.join(entry)} yet; add it per stage: {example}.{override.text}{glob}"


def _matches(accepted: tuple[str, ...], path: tuple[str, ...]) -> bool:
    """Whether `path` is the schema path `accepted`, any name standing for an ENTRY."""
    return len(accepted) == len(path) and all(a in (ENTRY, b) for a, b in zip(accepted, path, strict=True))


def _accepts(known: set[tuple[str, ...]], data: dict[str, Any], path: tuple[str, ...]) -> bool:
    """Whether a stage's schema takes `path` and every mapping entry it names is in the stage's
    file already (`environments.general.max_turns` where the file has `environments.general`): a
    new entry is set per stage, with a stage prefix."""
    return any(
        _matches(accepted, path)
        and all(_has(data, path[: i + 1]) for i, part in enumerate(accepted) if part == ENTRY)
        for accepted in known
    )


def _has(data: Any, path: tuple[str, ...]) -> bool:
    for part in path:
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def _paths(data: Any, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    if not isinstance(data, dict):
        return set()
    out = set()
    for key, value in data.items():
        out.add((*prefix, str(key)))
        out |= _paths(value, (*prefix, str(key)))
    return out


def _set(data: dict[str, Any], path: tuple[str, ...], value: Any) -> str:
    for i, part in enumerate(path[:-1]):
        child = data.setdefault(part, {})
        if child is None:
            child = data[part] = {}
        if not isinstance(child, dict):
            return f"{'.'.join(path[: i + 1])} is {type(child).__name__}, not a mapping"
        data = child
    data[path[-1]] = value
    return ""
