"""User-facing configuration errors.

A stage file mistake must read like a compiler error (``file:line: key: what is wrong; the fix``)
so the user fixes it without reading Python. Every check in the config layer collects `Issue`s and
raises one `ConfigError` holding all of them, so one run shows every mistake at once.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Issue:
    """One mistake: where it is (file, 1-based line, dotted key path) and what to do about it."""

    file: str
    message: str
    key: str = ""
    line: int | None = None
    hint: str = ""

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        key = f" {self.key}:" if self.key else ""
        hint = f" ({self.hint})" if self.hint else ""
        return f"{where}:{key} {self.message}{hint}"


class ConfigError(Exception):
    """One or more `Issue`s in stage files or command-line overrides (exit code 2, no traceback)."""

    def __init__(self, issues: Iterable[Issue]) -> None:
        self.issues = sorted(set(issues), key=lambda i: (i.file, i.line or 0, i.key, i.message))
        super().__init__("\n".join(str(i) for i in self.issues))


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """The hint naming the nearest valid spelling, or "" when nothing is close. A candidate that
    shares a prefix with `word` up to a '/' or '.' must also be close after it: the shared
    'general/' alone made 'general/zzz' look like 'general/visual'."""
    names = sorted(set(candidates))
    for close in difflib.get_close_matches(word, names, n=max(len(names), 1), cutoff=0.6):
        if _close_after_shared_prefix(word, close):
            return f"did you mean {close!r}?"
    return ""


def _close_after_shared_prefix(word: str, candidate: str) -> bool:
    cut = 0
    for i, (a, b) in enumerate(zip(word, candidate, strict=False)):
        if a != b:
            break
        if a in "/.":
            cut = i + 1
    if not cut:
        return True
    return difflib.SequenceMatcher(None, word[cut:], candidate[cut:]).ratio() >= 0.5


def key_path(parts: Iterable[object]) -> str:
    """('train', 'steps') -> 'train.steps'; list indices render as [i]."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
