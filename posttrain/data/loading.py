"""Load trajectory files (local JSONL/JSON/parquet or a `datasets` dataset) into validated records.

JSONL files are read line by line here, so a broken line is one bad row (skipped and counted as
`broken_line`, or fatal under strict loading) named by its 1-based line number, as an editor shows
it; `datasets` would fail the whole file on it. JSON arrays, parquet shards, directories and
`datasets` ids (a hub id, or a local dataset folder) go through `datasets.load_dataset`; their rows
are named `row N`, 1-based. What comes out is a `datasets.Dataset` whose `record` column holds each
cleaned trajectory as a JSON string, next to `uid`/`domain`/`effort` columns for filtering: a JSON
string survives Arrow exactly (key order, no null padding), so what the renderer sees is what the
file said.

Bad rows are skipped and counted per reason by default; ``strict=True`` raises with the file, the
line or row and the reason; a source where nothing survives is always an error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.data.chat_media import MEDIA_PART_TYPES
from posttrain.data.sample import Sample
from posttrain.data.trajectory import (
    BadTrajectoryError,
    ValidationReport,
    Verdict,
    clean_record,
    validate_trajectory,
)

if TYPE_CHECKING:
    import datasets

    from posttrain.data.chat import ChatRenderer

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def read_rows(source: str | Path, split: str = "train") -> datasets.Dataset:
    """Raw rows of a local file, a directory of files, or a hub dataset id (needs a network)."""
    # Imported here, where rows are read: the stage kinds' modules import this one, and the CLI
    # validating a stage file (or a GPU test of a trainer) needs no data library until data loads.
    import datasets

    path = Path(source)
    if path.is_dir() and split != "train":  # a dataset folder whose files name their splits
        return datasets.load_dataset(str(path), split=split)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in _BUILDERS)
        if not files:
            raise FileNotFoundError(f"{path} holds no {', '.join(_BUILDERS)} files")
        suffixes = {p.suffix for p in files}
        if len({_BUILDERS[s] for s in suffixes}) > 1:
            raise ValueError(f"{path} mixes JSON and parquet files; point at one kind")
        builder, data_files = _BUILDERS[files[0].suffix], [str(p) for p in files]
    elif path.suffix in _BUILDERS:
        if not path.exists():
            raise FileNotFoundError(f"trajectory file {path} does not exist")
        builder, data_files = _BUILDERS[path.suffix], [str(path)]
    else:
        return datasets.load_dataset(str(source), split=split)
    try:
        return datasets.load_dataset(builder, data_files=data_files, split="train")
    except datasets.exceptions.DatasetGenerationError as error:
        raise ValueError(
            f"{source}: the file is not readable as rows ({error.__cause__ or error}); "
            "each line of a .jsonl file must be one JSON object"
        ) from error


def load_trajectories(
    source: str | Path,
    *,
    split: str = "train",
    renderer: ChatRenderer | None = None,
    max_length: int | None = None,
    strict: bool = False,
) -> tuple[datasets.Dataset, ValidationReport]:
    """Read, clean and validate trajectories.

    Returns a Dataset with columns uid, domain, effort and record (the cleaned trajectory as JSON;
    `decode_record` turns it back into a dict), and the per-reason report. Rows over `max_length`
    rendered tokens count as ``too_long`` (needs `renderer`).
    """
    report = ValidationReport()
    kept: list[dict[str, Any]] = []
    for index, (where, row) in enumerate(_placed_rows(source, split)):
        # our own JSONL reader never pads rows; everything else went through Arrow
        arrow_padded = not _jsonl_files(source)
        record = clean_record(row, arrow_padded=arrow_padded) if isinstance(row, dict) else {}
        verdict = (
            validate_trajectory(record, renderer, max_length)
            if isinstance(row, dict)
            else Verdict(False, "broken_line", f"not one JSON object ({row})")
        )
        if not verdict.ok and strict:
            raise BadTrajectoryError(f"{where}: {verdict.reason}: {verdict.detail}")
        report.add(verdict, where)
        if verdict.ok:
            uid = str(record.get("uid", f"{Path(str(source)).stem}-{index}"))
            kept.append(
                {
                    "uid": uid,
                    "domain": str(record.get("domain", "general")),
                    "effort": record.get("effort") or "",
                    "record": json.dumps({**record, "uid": uid}, ensure_ascii=False),
                }
            )
    if not kept:
        examples = "; ".join(report.first_example.values())
        raise BadTrajectoryError(
            f"{source}: no trajectory survived validation ({report.summary()}): {examples}"
        )
    import datasets  # where rows are read (read_rows says why)

    return datasets.Dataset.from_list(kept), report


def _jsonl_files(source: str | Path) -> list[Path]:
    path = Path(source)
    if path.suffix == ".jsonl" and path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in _BUILDERS)
        if files and all(p.suffix == ".jsonl" for p in files):
            return files
    return []


def _placed_rows(source: str | Path, split: str) -> Iterator[tuple[str, dict[str, Any] | str]]:
    """(where, row) for every row: `FILE line N` and the parsed object (or, for a line that is
    not one JSON object, the parse error as a string) for JSONL; `SOURCE row N` otherwise."""
    files = _jsonl_files(source)
    if not files:
        for index, row in enumerate(read_rows(source, split)):
            yield f"{source} row {index + 1}", row
        return
    for path in files:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    row = str(error)
                yield (
                    f"{path if len(files) > 1 else source} line {number}",
                    (row if isinstance(row, dict | str) else f"a JSON {type(row).__name__}, not an object"),
                )


def decode_record(row: dict[str, Any]) -> dict[str, Any]:
    """A row of a `load_trajectories` Dataset -> the trajectory dict."""
    return json.loads(row["record"])


def prompt_sample(record: dict[str, Any]) -> Sample:
    """The prompt-only form (messages before the first assistant turn) with the hidden task kept:
    what an environment or an eval of tool-task success starts from."""
    messages = record["messages"]
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    media_parts = sum(
        part.get("type") in MEDIA_PART_TYPES
        for m in messages[:first]
        if isinstance(m.get("content"), list)
        for part in m["content"]
    )
    return Sample(
        uid=record["uid"],
        domain=record.get("domain", "general"),
        effort=record.get("effort") or "high",
        group=record["uid"],
        messages=messages[:first],
        tools=record.get("tools", []),
        task=record.get("task", {}),
        images=record.get("images", [])[:media_parts],
    )
