"""The generic part of a stage file, matrix expansion, and pydantic errors as `Issue`s.

A stage file is one YAML mapping. The generic keys below are the same for every kind; all other
top-level keys are the kind's body, validated by the pydantic class the kind registered
(posttrain.stages). Keeping both in one flat mapping lets a user write `steps: 3` instead of
nesting it under the kind's name, and lets an override say `train.steps=3`.
"""

from __future__ import annotations

import collections.abc
import copy
import itertools
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo
from pydantic_core import InitErrorDetails, PydanticCustomError

from posttrain.checkpoint import KEEP_CHECKPOINTS
from posttrain.config.errors import Issue, did_you_mean, key_path
from posttrain.config.yaml_source import KeyPath, line_of
from posttrain.weight_files import weight_headers

STAGE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
MATRIX_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")

Scalar = str | int | float | bool


class Resources(BaseModel):
    """What one stage asks a Ray cluster for (the local executor runs one process per stage)."""

    model_config = ConfigDict(extra="forbid")
    cpus: float = Field(1.0, ge=0)
    gpus: float = Field(0.0, ge=0)


class StageHeader(BaseModel):
    """Keys every stage file may have, whatever its kind."""

    model_config = ConfigDict(extra="forbid")
    stage: str | None = Field(None, description="stage id; default: the file's stem (plus matrix values)")
    kind: str = Field(description="registered stage kind, e.g. sft, rl, mopd")
    description: str = ""
    needs: list[str] = Field(
        default_factory=list, description="stage files (relative to this file) or stage ids this stage needs"
    )
    model: str | None = Field(
        None,
        description="preset file or pretrained model dir (relative to this file), or a need's stage id",
    )
    seed: int = 0
    resources: Resources = Field(default_factory=Resources)
    qat: dict[str, Any] | None = None
    keep_checkpoints: int = Field(
        KEEP_CHECKPOINTS,
        ge=0,
        description="resume checkpoints the stage keeps while it runs (its newest N; 0 writes none, so an "
        "interrupted stage starts over); a done stage's are removed once its model is published",
    )
    plugins: list[str] = Field(
        default_factory=list, description="modules or .py files (relative to this file) to import"
    )
    matrix: dict[str, list[Scalar]] | None = Field(
        None, description="name -> values; one stage per combination, ${name} substituted in the body"
    )


GENERIC_KEYS: frozenset[str] = frozenset(StageHeader.model_fields)
# Keys that shape the DAG itself: a command-line override may not change them.
STRUCTURAL_KEYS: frozenset[str] = frozenset({"stage", "kind", "needs", "plugins", "matrix"})
# Validation-context key under which the orchestrator passes a stage's need ids to its kind's
# config, so keys naming a need's model are checked when the pipeline loads, not when the stage runs.
NEEDS_CONTEXT = "needs"
# And whether the stage file sets `model:`, from which a kind may start instead of a need's model.
SETS_MODEL_CONTEXT = "sets_model"
# And the stage's seed and matrix values: a kind makes the draws that depend on them (its prompts)
# when the stage file is read.
SEED_CONTEXT = "seed"
MATRIX_CONTEXT = "matrix"
# The error type of `error_at_key` located at several keys, one of which `pydantic_issues` keeps.
AT_ONE_OF_KEYS = "value_error_at_one_of_keys"


def error_at_key(
    model: type[BaseModel], keys: str | collections.abc.Sequence[str], message: str, value: Any
) -> ValidationError:
    """A model validator's error located at a key (dotted, e.g. rollout.prompts): raised from the
    validator, it is reported at that key's line, or at the override that set it, not at the top
    of the file. Several keys (a value they set together, e.g. train.steps x
    rollout.prompts_per_domain): said once, at the one a command-line override set, else the first."""
    keys = [keys] if isinstance(keys, str) else list(keys)
    kind = AT_ONE_OF_KEYS if len(keys) > 1 else "value_error"
    error = PydanticCustomError(kind, "{message}", {"message": message})
    details = [InitErrorDetails(type=error, loc=tuple(key.split(".")), input=value) for key in keys]
    return ValidationError.from_exception_data(model.__name__, details)


def check_model_reference(ref: str, info: ValidationInfo, what: str) -> str:
    """`ref` if it names one of the stage's needs or a model directory (with config.json and
    readable weight files, `weight_headers`), for a kind's key whose value is "a need's stage id or
    a model dir". Validated without the needs
    context (a test, or the stage process re-validating) it passes: the kind resolves it when it
    runs, with the same rule."""
    needs = (info.context or {}).get(NEEDS_CONTEXT)
    if needs is None or ref in needs:
        return ref
    if (Path(ref).expanduser() / "config.json").is_file():
        weight_headers(Path(ref).expanduser())  # a lost or cut-short shard: its file, named now
        return ref
    hint = did_you_mean(ref, needs)
    raise ValueError(
        f"{what} {ref!r} is neither one of this stage's needs ({', '.join(needs) or 'none'}) nor a "
        "model directory with config.json; "
        + (hint or "add the stage file that trains it to `needs` or give a model dir")
    )


def split_body(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(generic keys, kind-specific body) of one stage mapping."""
    header = {k: v for k, v in data.items() if k in GENERIC_KEYS}
    body = {k: v for k, v in data.items() if k not in GENERIC_KEYS}
    return header, body


def expand_matrix(
    data: dict[str, Any], stem: str, file: str, lines: dict[KeyPath, int]
) -> tuple[list[tuple[dict[str, Any], dict[str, Any]]], list[Issue]]:
    """[(matrix values, stage mapping with ${name} substituted)]; one entry when there is no matrix.

    The stage id defaults to the file stem, followed by the values in matrix order
    (rl.yaml with domain x effort -> rl-general-low, ...).
    """
    matrix = data.get("matrix")
    if matrix is None:
        used = _variables(data)
        if used:  # left as written, a ${name} would reach the stage as literal text
            return [], [
                Issue(
                    file,
                    f"${{{name}}} is used but this file has no matrix:",
                    key=key_path(path),
                    line=line_of(lines, path),
                    hint=f"add matrix: {{{name}: [...]}} or write the value itself",
                )
                for path, name in used
            ]
        body = dict(data)
        body.setdefault("stage", stem)
        return [({}, body)], []
    if (
        not isinstance(matrix, dict)
        or not matrix
        or not all(isinstance(v, list) and v for v in matrix.values())
    ):
        return [], [
            Issue(
                file,
                "matrix must map each name to a non-empty list of values",
                key="matrix",
                line=line_of(lines, ("matrix",)),
                hint="e.g. matrix: {domain: [general, agent], effort: [low, high]}",
            )
        ]
    issues = []
    template = data.get("stage") or stem + "".join(f"-${{{name}}}" for name in matrix)
    if isinstance(template, str):
        missing = [n for n, values in matrix.items() if len(values) > 1 and f"${{{n}}}" not in template]
        if missing:
            issues.append(
                Issue(
                    file,
                    f"a matrix stage id must use every matrix name with several values; {missing} unused",
                    key="stage",
                    line=line_of(lines, ("stage",)),
                    hint="e.g. stage: " + stem + "".join(f"-${{{n}}}" for n in matrix),
                )
            )
    unknown = sorted({m for m in MATRIX_VARIABLE.findall(str(data)) if m not in matrix})
    for name in unknown:
        issues.append(
            Issue(
                file,
                f"${{{name}}} is not a matrix name",
                key="matrix",
                line=line_of(lines, ("matrix",)),
                hint=did_you_mean(name, matrix) or f"matrix names: {', '.join(matrix)}",
            )
        )
    if issues:
        return [], issues
    instances = []
    names = list(matrix)
    for values in itertools.product(*(matrix[n] for n in names)):
        chosen = dict(zip(names, values, strict=True))
        clashes: list[KeyPath] = []
        body = {k: _substitute(v, chosen, (k,), clashes) for k, v in data.items() if k != "matrix"}
        if clashes:
            shown = ", ".join(f"{n}={v}" for n, v in chosen.items())
            return [], [
                Issue(
                    file,
                    f"with {shown} two keys of {key_path(path[:-1]) or 'the file'} become {path[-1]!r}",
                    key=key_path(path[:-1]),
                    line=line_of(lines, path[:-1]),
                    hint="a ${name} key must not equal another key for any matrix value",
                )
                for path in clashes
            ]
        body["stage"] = _substitute(template, chosen, ("stage",), clashes)
        body["matrix"] = copy.deepcopy(matrix)
        instances.append((chosen, body))
    return instances, []


def _substitute(value: Any, chosen: dict[str, Any], path: KeyPath, clashes: list[KeyPath]) -> Any:
    """`value` with every ${name} of `chosen` replaced, in mapping keys too (a per-domain block
    `environments: {${domain}: ...}` is the common case: a key left as written was a silently ignored
    setting); a key that becomes another key of its mapping is appended to `clashes`."""
    if isinstance(value, str):
        whole = MATRIX_VARIABLE.fullmatch(value)
        if whole and whole.group(1) in chosen:
            return chosen[whole.group(1)]  # "${effort}" alone keeps the value's type
        return _in_text(value, chosen)
    if isinstance(value, list):
        return [_substitute(v, chosen, (*path, i), clashes) for i, v in enumerate(value)]
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for key, item in value.items():
            new = _in_text(key, chosen) if isinstance(key, str) else key  # keys stay strings
            if new in out:
                clashes.append((*path, new))
            out[new] = _substitute(item, chosen, (*path, key), clashes)
        return out
    return value


def _in_text(text: str, chosen: dict[str, Any]) -> str:
    return MATRIX_VARIABLE.sub(lambda m: str(chosen.get(m.group(1), m.group(0))), text)


def _variables(value: Any, path: KeyPath = ()) -> list[tuple[KeyPath, str]]:
    """(key path, name) of every ${name} in a mapping's keys and string values."""
    if isinstance(value, str):
        return [(path, name) for name in MATRIX_VARIABLE.findall(value)]
    if isinstance(value, list):
        return [found for i, v in enumerate(value) for found in _variables(v, (*path, i))]
    if isinstance(value, dict):
        return [
            found
            for key, item in value.items()
            for found in (
                [((*path, key), name) for name in MATRIX_VARIABLE.findall(str(key))]
                + _variables(item, (*path, key))
            )
        ]
    return []


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The BaseModel classes inside an annotation (through Optional, list, dict, unions)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in models_in(arg)]


def fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names valid at `loc` inside `model` (for "did you mean"); [] when unknown."""
    current: list[type[BaseModel]] = [model]
    for part in loc:
        if isinstance(part, int) or not current:
            continue
        nxt = []
        for cls in current:
            info = cls.model_fields.get(str(part))
            if info is not None:
                nxt.extend(models_in(info.annotation))
        if nxt:
            current = nxt
    return sorted({name for cls in current for name in cls.model_fields})


# In a schema path, the segment of a mapping's key: `environments.*.max_turns`, whose `*` is an
# entry's name (a domain, a teacher pair, an eval subset).
ENTRY = "*"


def schema_paths(
    model: type[BaseModel], prefix: tuple[str, ...] = (), depth: int = 6
) -> set[tuple[str, ...]]:
    """Every dotted key path a model accepts (intermediate and leaf), for overrides; a mapping of
    models (`dict[str, EnvironmentConfig]`) has ENTRY where its keys go."""
    paths = set()
    for name, info in model.model_fields.items():
        path = (*prefix, name)
        paths.add(path)
        if depth > 1:
            keyed = _is_mapping(info.annotation)
            for nested in models_in(info.annotation):
                paths |= schema_paths(nested, (*path, ENTRY) if keyed else path, depth - 1)
    return paths


def _is_mapping(annotation: Any) -> bool:
    """Whether the models in `annotation` are a mapping's values (through Optional and unions)."""
    if typing.get_origin(annotation) in (dict, collections.abc.Mapping):
        return True
    return any(_is_mapping(arg) for arg in typing.get_args(annotation))


def pydantic_issues(
    error: ValidationError,
    model: type[BaseModel],
    file: str,
    lines: dict[KeyPath, int],
    overridden: dict[tuple[str, ...], str],
    extra_names: frozenset[str] = frozenset(),
) -> list[Issue]:
    """One Issue per pydantic error, located at the file line (or the override that set the key).

    extra_names: more names valid at the top level (the generic keys, when validating a body).
    """
    issues = []
    for err in _said_once(error.errors(), overridden):
        loc = tuple(p for p in err["loc"] if isinstance(p, int | str))
        source = _override_of(loc, overridden)
        where = file if source is None else f"command line override {source!r}"
        line = None if source is not None else line_of(lines, loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            valid = fields_at(model, loc[:-1]) + (sorted(extra_names) if len(loc) == 1 else [])
            hint = did_you_mean(str(loc[-1]), valid) or f"valid keys: {', '.join(valid)}"
            issues.append(Issue(where, "unknown key", key=key_path(loc), line=line, hint=hint))
        elif kind == "missing":
            issues.append(Issue(where, "required key is missing", key=key_path(loc), line=line))
        else:
            got = err.get("input")
            # A block's own check (a model or mapping validator) gets the whole block as input: its
            # message says what is wrong, the line says where, and the block's text would bury both.
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            # pydantic prefixes a validator's ValueError with "Value error, ": not the user's concern
            message = err["msg"].removeprefix("Value error, ")
            issues.append(Issue(where, f"{message}{shown}", key=key_path(loc), line=line))
    return issues


def _said_once(errors: list[Any], overridden: dict[tuple[str, ...], str]) -> list[Any]:
    """`errors` with each error of `error_at_key` at several keys kept once: at the key a
    command-line override set, else at the first."""
    kept, said = [], set()
    for err in errors:
        if err["type"] != AT_ONE_OF_KEYS:
            kept.append(err)
        elif err["msg"] not in said:
            said.add(err["msg"])
            same = [e for e in errors if e["type"] == AT_ONE_OF_KEYS and e["msg"] == err["msg"]]
            kept.append(next((e for e in same if _override_of(e["loc"], overridden)), err))
    return kept


def _override_of(loc: tuple[Any, ...], overridden: dict[tuple[str, ...], str]) -> str | None:
    """The command-line override that set the key at `loc` (or a block above it), if one did."""
    return next((text for path, text in overridden.items() if tuple(loc[: len(path)]) == path), None)


def relative_display(path: Path) -> str:
    """`path` relative to the working directory when it is inside it (shorter messages)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def number_issues(
    data: Any,
    model: type[BaseModel],
    file: str,
    lines: dict[KeyPath, int],
    overridden: dict[tuple[str, ...], str],
    prefix: tuple[str, ...] = (),
) -> list[Issue]:
    """Values YAML reads as numbers that pydantic's number fields would accept but are not sane:
    `true`/`false` for an int or float (pydantic takes them as 1 and 0: `steps=true` ran one
    step) and a non-finite float (`lr=.inf`). Walks nested models and mappings of models."""
    issues: list[Issue] = []
    if not isinstance(data, dict):
        return issues
    for name, info in model.model_fields.items():
        if name not in data:
            continue
        value, path = data[name], (*prefix, name)
        types = _plain_types(info.annotation)
        problem = ""
        if isinstance(value, bool) and types & {int, float} and bool not in types:
            problem = f"expects a number, got {str(value).lower()}"
        elif isinstance(value, float) and float in types and not math.isfinite(value):
            problem = f"must be a finite number, got {value}"
        if problem:
            source = next((t for p, t in overridden.items() if path[: len(p)] == p), None)
            where = file if source is None else f"command line override {source!r}"
            line = None if source is not None else line_of(lines, path)
            issues.append(Issue(where, problem, key=key_path(path), line=line))
        for nested in models_in(info.annotation):
            if isinstance(value, dict) and set(value) & set(nested.model_fields):
                issues += number_issues(value, nested, file, lines, overridden, path)
            elif isinstance(value, dict):
                for key, item in value.items():
                    issues += number_issues(item, nested, file, lines, overridden, (*path, str(key)))
    return issues


def _plain_types(annotation: Any) -> set[type]:
    """The plain types an annotation admits: int | None -> {int, NoneType}."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set().union(*(_plain_types(a) for a in args))
    if typing.get_origin(annotation) is typing.Annotated:
        return _plain_types(args[0])
    return {annotation} if isinstance(annotation, type) else set()
