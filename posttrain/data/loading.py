"""Load trajectory files (local JSONL/JSON/parquet or a `datasets` dataset) into validated records.

JSONL files are read line by line here, so a broken line (not one JSON object, or not UTF-8) is one
bad row (skipped and counted as `broken_line`, or fatal under strict loading) named by its file and
1-based line number, as an editor shows it; `datasets` would fail the whole file on it. File
suffixes are matched in any case. JSON arrays, parquet shards, directories and
`datasets` ids (a hub id, or a local dataset folder) go through `datasets.load_dataset`; their rows
are named `row N`, 1-based. What comes out is a `datasets.Dataset` whose `record` column holds each
cleaned trajectory as a JSON string, next to `uid`/`domain`/`effort` columns for filtering: a JSON
string survives Arrow exactly (key order, no null padding), so what the renderer sees is what the
file said.

Bad rows are skipped and counted per reason by default; ``strict=True`` raises with the file, the
line or row and the reason; a source where nothing survives is always an error.
"""

from __future__ import annotations

import hashlib
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

# File suffixes read as rows (in any case: `traces.JSONL` is a JSONL file) and their builders.
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SUPPORTED_FILES = ".jsonl, .json or .parquet"


def data_builder(path: Path) -> str | None:
    """The `datasets` builder that reads a trajectory file of this suffix; None: not one we read."""
    return _BUILDERS.get(path.suffix.lower())


def is_local_path(name: str) -> bool:
    """Whether `name` is written as a local path (./x, ../x, /x, ~/x) rather than a hub id, so a
    missing one is "no such file or directory", not a hub lookup."""
    return name.startswith(("./", "../", "/", "~"))


def read_rows(source: str | Path, split: str = "train") -> datasets.Dataset:
    """Raw rows of a local file, a directory of files, or a hub dataset id (needs a network)."""
    # Imported here, where rows are read: the stage kinds' modules import this one, and the CLI
    # validating a stage file (or a GPU test of a trainer) needs no data library until data loads.
    import datasets

    path = Path(source).expanduser()
    if path.is_dir() and split != "train":  # a dataset folder whose files name their splits
        return datasets.load_dataset(str(path), split=split)
    if path.is_dir():
        files = _data_files(path)
        if len({data_builder(p) for p in files}) > 1:
            raise ValueError(f"{path} mixes JSON and parquet files; point at one kind")
        builder, data_files = data_builder(files[0]), [str(p) for p in files]
    elif path.is_file():
        builder, data_files = _supported_file(path), [str(path)]
    elif data_builder(path) is not None or is_local_path(str(source)):
        raise FileNotFoundError(f"trajectory source {source}: no such file or directory")
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
    files = _jsonl_files(source, split)
    rows = _jsonl_rows(files) if files else _dataset_rows(source, split)
    for where, row in rows:
        record = clean_record(row, arrow_padded=not files) if isinstance(row, dict) else {}
        verdict = (
            validate_trajectory(record, renderer, max_length)
            if isinstance(row, dict)
            else Verdict(False, "broken_line", row)
        )
        if not verdict.ok and strict:
            raise BadTrajectoryError(f"{where}: {verdict.reason}: {verdict.detail}")
        report.add(verdict, where)
        if verdict.ok:
            uid = str(record["uid"]) if "uid" in record else content_uid(record)
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


def content_uid(record: dict[str, Any]) -> str:
    """A row without a uid is named by a hash of its own cleaned content: the split and SFT's eval
    de-duplication go by uid, so it must differ between different rows (two train.jsonl files in two
    directories gave `train-0` twice when it was the file's stem and the row's index) and stay the
    same wherever the file is moved, however it is named and whatever rows are added around it (a
    path or an index would move rows between train and eval). Equal rows get one uid, so one side
    of the split: a duplicate is never both trained on and evaluated."""
    digest = hashlib.sha256(json.dumps(record, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return f"row-{digest[:16]}"


def _supported_file(path: Path) -> str:
    """The builder of a trajectory file, or an error naming the formats read."""
    builder = data_builder(path)
    if builder is None:
        kind = f"a {path.suffix} file" if path.suffix else "a file without a suffix"
        raise ValueError(
            f"{path}: {kind} is not read as trajectories; use {SUPPORTED_FILES} (in any case; "
            "decompress a compressed file first)"
        )
    return builder


def _data_files(directory: Path) -> list[Path]:
    """The trajectory files of a directory, sorted (files of other types beside them are not data)."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and data_builder(p) is not None)
    if not files:
        raise FileNotFoundError(f"{directory} holds no {SUPPORTED_FILES} files")
    return files


def _jsonl_files(source: str | Path, split: str) -> list[Path]:
    """The .jsonl files `source` names (itself, or a directory holding only .jsonl files), which are
    read line by line here; [] for anything `datasets` reads (a directory with a split other than
    train is a dataset folder whose files name their splits)."""
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".jsonl":
        return [path]
    if path.is_dir() and split == "train":
        files = _data_files(path)
        if all(p.suffix.lower() == ".jsonl" for p in files):
            return files
    return []


def _dataset_rows(source: str | Path, split: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for index, row in enumerate(read_rows(source, split)):
        yield f"{source} row {index + 1}", row


def _jsonl_rows(files: list[Path]) -> Iterator[tuple[str, dict[str, Any] | str]]:
    """(`FILE line N`, the parsed object) for every non-blank line; for a line that is not one JSON
    object in UTF-8, the reason as a string. Lines are decoded one by one, so a stray byte of
    another encoding is one broken line, named, not a failed file."""
    for path in files:
        with open(path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                where = f"{path} line {number}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    yield where, f"not UTF-8 text ({error}); save the file as UTF-8"
                    continue
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    yield where, f"not one JSON object ({error})"
                    continue
                yield (
                    where,
                    row if isinstance(row, dict) else f"not one JSON object (a JSON {type(row).__name__})",
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
