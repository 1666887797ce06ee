"""Data recipes: named mixtures of trajectory sources with weights, seeded shuffles and splits.

A recipe is registered by decorator (the shipped ones live in ``data_recipes/recipes.py``):

    @DATA_RECIPES.register("agent_sft")
    def agent_sft() -> Recipe:
        return Recipe(sources=(MixtureSource("path/to/file.jsonl", weight=1.0),), eval_fraction=0.1)

`build_mixture` turns a recipe into train and eval Datasets. A row's split depends only on
(seed, uid), never on which recipe or weights included it, so no recipe can train on another's
held-out rows. Weights resample a source's train rows: 0.5 keeps a seeded half, 2.0 repeats every
row twice, 1.5 repeats all once plus a seeded half.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.data.loading import SUPPORTED_FILES, data_builder, is_local_path, load_trajectories
from posttrain.data.trajectory import ValidationReport
from posttrain.registry import Registry, RegistryError

if TYPE_CHECKING:
    import datasets

    from posttrain.data.chat import ChatRenderer


@dataclass(frozen=True)
class MixtureSource:
    """One input of a mixture: a trajectory file, directory or hub id, its weight and an optional
    domain filter (the same file can feed several sources with different weights per domain)."""

    path: str
    weight: float = 1.0
    domains: tuple[str, ...] = ()
    split: str = "train"

    def __post_init__(self) -> None:
        if not self.weight > 0 or math.isinf(self.weight):
            raise ValueError(
                f"source {self.path}: weight must be a positive finite number, got {self.weight}"
            )


@dataclass(frozen=True)
class Recipe:
    sources: tuple[MixtureSource, ...]
    eval_fraction: float = 0.1
    description: str = ""

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("a recipe needs at least one source")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")


DATA_RECIPES: Registry[Callable[[], Recipe]] = Registry("data recipe")
# Held-out share of a file or `datasets` source named directly in a stage file's `data.recipes`.
DIRECT_EVAL_FRACTION = 0.05


def recipe_for(name: str) -> Recipe:
    """What a key of a stage file's `data.recipes` names: a registered recipe; a .jsonl / .json /
    .parquet file or a directory of them (relative paths from the directory `posttrain run` was
    started in); or a `datasets` dataset, `ID[:SPLIT]` (a hub id or a local dataset folder, split
    `train` unless given). A file or dataset is one source with DIRECT_EVAL_FRACTION held out. A
    name with a data file's suffix or written as a local path (./, ../, /, ~) is never looked up
    on the hub: missing, it is "no such file or directory"."""
    if name in DATA_RECIPES:
        return _registered(name)
    path = Path(name).expanduser()
    if path.exists():
        return Recipe(sources=(MixtureSource(str(path.resolve())),), eval_fraction=DIRECT_EVAL_FRACTION)
    spec, split = name, "train"
    if ":" in name and "/" not in name.rpartition(":")[2]:
        spec, _, split = name.rpartition(":")
    local = Path(spec).expanduser()
    if not local.exists() and (data_builder(path) is not None or is_local_path(spec)):
        raise FileNotFoundError(
            f"data.recipes: {name}: no such file or directory (relative to {Path.cwd()}); a file "
            f"is {SUPPORTED_FILES}, or a directory of them"
        )
    if "/" in spec or local.exists():
        source = MixtureSource(str(local.resolve()) if local.exists() else spec, split=split)
        return Recipe(sources=(source,), eval_fraction=DIRECT_EVAL_FRACTION)
    try:
        return _registered(name)
    except RegistryError as error:
        raise RegistryError(
            f"data.recipes: {error}; a key may also be a .jsonl/.json/.parquet file or a directory "
            "of them, or a datasets id like owner/name[:split]"
        ) from None


def _registered(name: str) -> Recipe:
    """What the registered recipe `name` returns, checked: a plug-in's recipe that returns a path
    string would otherwise fail later as an AttributeError naming no recipe."""
    recipe = DATA_RECIPES.get(name)()
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"data recipe {name!r} returned {type(recipe).__name__}, not Recipe; return "
            "Recipe(sources=(MixtureSource(path),)), or name the file itself under data.recipes"
        )
    return recipe


@dataclass
class Mixture:
    """train: weighted, shuffled rows; eval: every source's held-out rows once, in a seeded order.
    Columns as `load_trajectories` gives them (uid, domain, effort, record) plus `source`."""

    train: datasets.Dataset
    eval: datasets.Dataset
    report: ValidationReport = field(default_factory=ValidationReport)


def is_eval_row(uid: str, seed: int, eval_fraction: float) -> bool:
    """Held out or not, from a hash of (seed, uid): stable whatever else is in the mixture."""
    digest = hashlib.sha256(f"{seed}:{uid}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


def weighted_indices(count: int, weight: float, rng: random.Random) -> list[int]:
    """round(weight * count) row indices: whole repeats, then a seeded sample without replacement."""
    repeats, remainder = divmod(round(weight * count), count) if count else (0, 0)
    return list(range(count)) * repeats + sorted(rng.sample(range(count), remainder))


def build_mixture(
    recipe: Recipe | str,
    *,
    seed: int = 0,
    renderer: ChatRenderer | None = None,
    max_length: int | None = None,
    strict: bool = False,
) -> Mixture:
    """Load every source (validated, bad rows counted per reason), split, weight and shuffle."""
    if isinstance(recipe, str):
        recipe = recipe_for(recipe)
    report = ValidationReport()
    train_parts: list[datasets.Dataset] = []
    eval_parts: list[datasets.Dataset] = []
    for number, source in enumerate(recipe.sources):
        rows, source_report = load_trajectories(
            source.path, split=source.split, renderer=renderer, max_length=max_length, strict=strict
        )
        report.merge(source_report)
        if source.domains:
            rows = rows.select([i for i, domain in enumerate(rows["domain"]) if domain in source.domains])
            if len(rows) == 0:
                raise ValueError(f"source {source.path}: no rows of domains {list(source.domains)}")
        rows = rows.add_column("source", [source.path] * len(rows))
        held_out = [is_eval_row(uid, seed, recipe.eval_fraction) for uid in rows["uid"]]
        eval_parts.append(rows.select([i for i, flag in enumerate(held_out) if flag]))
        train = rows.select([i for i, flag in enumerate(held_out) if not flag])
        rng = random.Random(f"{seed}:{number}:{source.path}")
        train_parts.append(train.select(weighted_indices(len(train), source.weight, rng)))
    import datasets  # where data is loaded, as posttrain.data.loading.read_rows says why

    train = datasets.concatenate_datasets(train_parts).shuffle(seed=seed)
    eval_rows = datasets.concatenate_datasets(eval_parts).shuffle(seed=seed)
    if len(train) == 0:
        raise ValueError(f"the mixture has no training rows (eval_fraction {recipe.eval_fraction})")
    return Mixture(train=train, eval=eval_rows, report=report)
