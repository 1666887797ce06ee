"""SFT data: registered recipes -> rendered documents -> a seeded stream of packed rows with a cursor.

The stream is a pure function of (documents, row length, seed) and a cursor (epoch, row): epoch e
shuffles the documents with a generator seeded by (seed, e) and packs them first-fit, so a resumed
run rebuilds the very rows it would have seen and continues at the saved cursor. No data-loader
worker, prefetch queue or sampler state has to be checkpointed.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from posttrain.config.stage_file import NEEDS_CONTEXT
from posttrain.data.chat import ChatRenderer
from posttrain.data.images import MediaItem
from posttrain.data.loading import decode_record
from posttrain.data.mixture import DATA_RECIPES, build_mixture, recipe_for, weighted_indices
from posttrain.data.packing import PackedRow, pack_documents
from posttrain.data.trajectory import ValidationReport
from posttrain.registry import RegistryError


class DataConfig(BaseModel):
    """Which trajectories SFT trains on and how they are cut."""

    model_config = ConfigDict(extra="forbid")
    recipes: dict[str, float] = Field(
        default_factory=lambda: {"agent_sft": 1.0},
        description="registered data recipe, .jsonl/.json/.parquet file or dir, or datasets id[:split] "
        "-> weight, positive and finite (0.5: a seeded half of its train rows, 2: twice); a local file "
        "or dir that does not exist fails plan",
    )
    eval_fraction: float | None = Field(
        None, ge=0, lt=1, description="held-out share of every recipe; null: each recipe's own"
    )
    max_length: int | None = Field(
        None, gt=0, description="longer trajectories are skipped as too_long; null: train.micro_batch_tokens"
    )
    strict: bool = Field(
        False, description="a bad row fails the stage (file, row, reason) instead of being skipped"
    )

    @field_validator("recipes")
    @classmethod
    def _weighted_and_present(cls, recipes: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        """At least one recipe, each with a positive finite weight (0 or less keeps none of its rows,
        and NaN or inf is no row count). When the orchestrator validates the stage file (the needs
        context given) a local data file that does not exist is an error too, so `plan` reports it;
        a stage process re-validating skips that, and `recipe_for` applies the same rule when the
        stage loads it."""
        if not recipes:
            raise ValueError("no recipe: name at least one, e.g. {agent_sft: 1.0}")
        for name, weight in recipes.items():
            if not (weight > 0 and math.isfinite(weight)):
                raise ValueError(f"{name}: weight must be a positive finite number, got {weight}")
        if (info.context or {}).get(NEEDS_CONTEXT) is not None:
            problems = _resolve([name for name in recipes if name not in DATA_RECIPES])[1]
            if problems:
                raise ValueError("; ".join(problems))
        return recipes


def _resolve(names: list[str]) -> tuple[list[Path], list[str]]:
    """What recipe keys that are not registered recipes name, by `recipe_for`'s own rules: the local
    files and directories they resolve to, and why those that name nothing fail (a local path that
    does not exist, an unknown recipe name). Registered recipes are not passed here: a recipe
    function may do work (visual_sft writes its file). A hub id has no local content and is only
    known when it loads."""
    paths: list[Path] = []
    missing: list[str] = []
    problems: list[str] = []
    for name in names:
        try:
            sources = recipe_for(name).sources
        except FileNotFoundError:
            missing.append(name)
            continue
        except RegistryError as error:
            problems.append(str(error).removeprefix("data.recipes: "))
            continue
        paths += [Path(s.path) for s in sources if Path(s.path).exists()]
    if missing:
        problems.insert(
            0,
            f"{', '.join(missing)}: no such file or directory (relative paths are read from the "
            f"directory `posttrain run` is started in, here {Path.cwd()})",
        )
    return paths, problems


def local_data_paths(cfg: DataConfig) -> list[Path]:
    """The local files and directories `recipes` names: what the run hashes, so that editing a
    user's data makes a finished SFT stage stale. A registered recipe is named by its name, as code
    is; a name that resolves to nothing is left to the stage's own clear error."""
    return _resolve([name for name in cfg.recipes if name not in DATA_RECIPES])[0]


@dataclass
class Document:
    """One rendered trajectory: ids, the loss mask (1 on assistant tokens) and its media entries
    (the record's `images`, whose visual tokens are the `<|media_pad|>` runs of ids, in order)."""

    uid: str
    ids: list[int]
    loss_mask: list[int]
    images: list[MediaItem] = field(default_factory=list)


@dataclass
class SFTData:
    """Rendered train and eval documents, the eval records (for tool-task prompts) and the report
    of skipped rows per reason."""

    train: list[Document]
    eval: list[Document]
    eval_records: list[dict[str, Any]]
    report: ValidationReport = field(default_factory=ValidationReport)


def load_sft_data(
    cfg: DataConfig, renderer: ChatRenderer, seed: int, max_length: int, log: logging.Logger
) -> SFTData:
    """Build every recipe's mixture (validated, split by (seed, uid)), weight the recipes' train rows
    and render everything once. Eval rows shared by two recipes count once. A uid given to two
    different rows is warned about: both are held out or trained together, and only the first of
    two held-out ones is evaluated."""
    report = ValidationReport()
    train: list[Document] = []
    eval_docs: list[Document] = []
    eval_records: list[dict[str, Any]] = []
    seen_eval: set[str] = set()
    first_rows: dict[str, tuple[str, str]] = {}  # uid -> (source, record) of its first row
    shared: dict[str, tuple[str, str]] = {}  # uid -> the two sources of two different rows
    for name, weight in cfg.recipes.items():
        recipe = recipe_for(name)
        if cfg.eval_fraction is not None:
            recipe = replace(recipe, eval_fraction=cfg.eval_fraction)
        mixture = build_mixture(
            recipe, seed=seed, renderer=renderer, max_length=max_length, strict=cfg.strict
        )
        report.merge(mixture.report)
        for part in (mixture.train, mixture.eval):
            for uid, source, record in zip(part["uid"], part["source"], part["record"], strict=True):
                first_source, first_record = first_rows.setdefault(uid, (source, record))
                if record != first_record:  # a weight's repeats and a file shared by recipes are equal
                    shared.setdefault(uid, (first_source, source))
        rows = mixture.train.select(
            weighted_indices(len(mixture.train), weight, random.Random(f"{seed}:{name}"))
        )
        train += [_render(decode_record(row), renderer) for row in rows]
        for row in mixture.eval:
            record = decode_record(row)
            if record["uid"] not in seen_eval:
                seen_eval.add(record["uid"])
                eval_records.append(record)
                eval_docs.append(_render(record, renderer))
    log.info("SFT data: %s; %d train and %d eval trajectories", report.summary(), len(train), len(eval_docs))
    if shared:
        uid, (first_source, source) = next(iter(shared.items()))
        log.warning(
            "%d uids are given to more than one different row, e.g. %r in %s and in %s: rows are held "
            "out by uid and evaluated once per uid, so give every row its own uid",
            len(shared),
            uid,
            first_source,
            source,
        )
    for reason, example in sorted(report.first_example.items()):
        log.warning("skipped %d rows as %s, e.g. %s", report.skipped[reason], reason, example)
    return SFTData(train=train, eval=eval_docs, eval_records=eval_records, report=report)


def _render(record: dict[str, Any], renderer: ChatRenderer) -> Document:
    images = record.get("images", [])
    ids, mask = renderer.render(
        record["messages"], record.get("tools"), record.get("effort"), renderer.media_blocks(images)
    )
    return Document(uid=record["uid"], ids=ids, loss_mask=mask, images=images)


def pack(documents: list[Document], seq_len: int, pad_id: int) -> list[PackedRow]:
    return pack_documents([(d.ids, d.loss_mask) for d in documents], seq_len, pad_id)


def row_media(row: PackedRow, documents: list[Document]) -> list[MediaItem]:
    """The media entries of a packed row's documents, in row order (`documents`: what was packed)."""
    return [entry for index in row.document_indices for entry in documents[index].images]


class PackedStream:
    """Endless packed rows over `documents`, reshuffled every epoch; `cursor` / `seek` save and
    restore the position exactly."""

    def __init__(self, documents: list[Document], seq_len: int, pad_id: int, seed: int) -> None:
        if not documents:
            raise ValueError("no training documents: every row was skipped or held out for eval")
        self.documents = documents
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.seed = seed
        self.epoch = 0
        self.row = 0
        self._rows: list[tuple[PackedRow, list[str]]] | None = None
        self._images = {d.uid: d.images for d in documents if d.images}

    def _epoch_rows(self, epoch: int) -> list[tuple[PackedRow, list[str]]]:
        order = list(range(len(self.documents)))
        random.Random(f"sft-epoch:{self.seed}:{epoch}").shuffle(order)
        shuffled = [self.documents[i] for i in order]
        rows = pack(shuffled, self.seq_len, self.pad_id)
        return [(row, [shuffled[i].uid for i in row.document_indices]) for row in rows]

    def next(self) -> tuple[PackedRow, list[str]]:
        """The next packed row and the uids of its documents."""
        if self._rows is None:
            self._rows = self._epoch_rows(self.epoch)
        if self.row == len(self._rows):
            self.epoch, self.row = self.epoch + 1, 0
            self._rows = self._epoch_rows(self.epoch)
        item = self._rows[self.row]
        self.row += 1
        return item

    def media(self, uids: list[str]) -> list[MediaItem]:
        """The media entries of a row's documents (by `next`'s uids), in row order."""
        return [entry for uid in uids for entry in self._images.get(uid, ())]

    def cursor(self) -> dict[str, int]:
        return {"epoch": self.epoch, "row": self.row}

    def seek(self, cursor: dict[str, int]) -> None:
        self.epoch, self.row = int(cursor["epoch"]), int(cursor["row"])
        self._rows = None

    @property
    def epoch_fraction(self) -> float:
        """Epochs consumed so far (fractional)."""
        rows = len(self._rows) if self._rows is not None else len(self._epoch_rows(self.epoch))
        return self.epoch + self.row / rows
