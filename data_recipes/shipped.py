"""The shipped artifacts' guard: the data_recipes scripts default `--out` to the file or directory
they made (the SFT rows, the pretrained bases), which the default recipe and the results recorded
with it depend on. Those scripts write it only with the arguments that made it; a trial with other
ones needs `--out`, rather than replacing the shipped copy unseen. A pretrained base is replaced
whole (`replaced_dir`): a killed save leaves the old one, its hand-written README.md kept."""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from posttrain.files import new_dir


def check_shipped_out(
    parser: argparse.ArgumentParser, out: Path, shipped: Path, asked: dict[str, Any], made_by: dict[str, Any]
) -> None:
    """An argparse error (exit 2), before any work, where `out` is `shipped` and the arguments
    `asked` (argparse dests) are not `made_by`, the ones that made it; it names both and the fix."""
    if out.resolve() != shipped.resolve() or asked == made_by:
        return
    differ = " ".join(
        f"--{key.replace('_', '-')} {value}" for key, value in asked.items() if made_by.get(key) != value
    )
    made = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in made_by.items())
    parser.error(
        f"{differ} would overwrite the shipped {shipped}, made by {made}: pass --out PATH for another"
    )


def logged_arguments(log: Path) -> dict[str, Any]:
    """The arguments a shipped base's pretrain_log.json recorded ({} where it has none)."""
    return json.loads(log.read_text(encoding="utf-8")).get("args", {}) if log.is_file() else {}


@contextmanager
def replaced_dir(out: Path) -> Iterator[Path]:
    """A directory to write `out` anew into (posttrain.files.new_dir, replacing): a run killed while
    saving leaves the old `out` whole. The old README.md (a shipped base's description, written by
    hand, not by the script) is carried over."""
    with new_dir(out, replace=True) as tmp:
        yield tmp
        readme = out / "README.md"
        if readme.is_file() and not (tmp / readme.name).exists():
            shutil.copy(readme, tmp / readme.name)
