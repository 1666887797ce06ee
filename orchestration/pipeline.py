"""Stage files -> a validated DAG of stages.

`load_pipeline(file)` reads the file and, recursively, every stage file it `needs`, expands matrix
files into one stage per combination, imports plug-ins, applies command-line overrides and
validates every stage (generic keys, the kind's body, qat, model preset). All problems of all
files are collected and raised together as one ConfigError, before anything is written.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from posttrain.checkpoint import KEEP_CHECKPOINTS
from posttrain.config.errors import ConfigError, Issue, did_you_mean, key_path
from posttrain.config.overrides import apply_overrides, parse_overrides
from posttrain.config.stage_file import (
    GENERIC_KEYS,
    MATRIX_CONTEXT,
    NEEDS_CONTEXT,
    SEED_CONTEXT,
    SETS_MODEL_CONTEXT,
    STAGE_ID,
    STRUCTURAL_KEYS,
    StageHeader,
    expand_matrix,
    number_issues,
    pydantic_issues,
    relative_display,
    schema_paths,
    split_body,
)
from posttrain.config.yaml_source import KeyPath, line_of, load_yaml
from posttrain.files import hash_tree, sha256_file
from posttrain.registry import ENTRY_POINT_GROUP, RegistryError, import_plugin, load_plugins
from posttrain.stages import STAGE_KINDS
from posttrain.weight_files import weight_headers

STAGE_FILE_SUFFIXES = (".yaml", ".yml")
PRESET_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass
class Stage:
    """One validated stage, as the orchestrator and a worker process see it (JSON-serialisable).

    model: absolute path of a preset file or a model directory, or a need's stage id when
    `model_is_input`.
    body: the kind-specific keys after overrides (validated again by the worker).
    """

    id: str
    kind: str
    file: str
    needs: list[str]
    seed: int
    model: str | None
    model_is_input: bool
    resources: dict[str, float]
    qat: dict[str, Any] | None
    plugins: list[str]
    matrix: dict[str, Any]
    body: dict[str, Any]
    description: str = ""
    keep_checkpoints: int = KEEP_CHECKPOINTS
    config_hash: str = ""
    registered: bool = False


@dataclass
class Pipeline:
    """Stages in dependency order (every stage after its needs). `unregistered` holds, per stage
    whose kind no plug-in registered, the note saying its body could not be checked."""

    root: Path
    stages: dict[str, Stage]
    unregistered: dict[str, Issue] = field(default_factory=dict)

    def descendants(self, stage_id: str) -> set[str]:
        """Stages that need `stage_id`, directly or not."""
        found: set[str] = set()
        for sid, stage in self.stages.items():  # dependency order: needs come first
            if stage_id in stage.needs or found & set(stage.needs):
                found.add(sid)
        return found


@dataclass
class _Instance:
    id: str
    path: Path
    display: str
    data: dict[str, Any]
    lines: dict[KeyPath, int]
    matrix: dict[str, Any]
    refs: list[tuple[int, str, list[str] | None]] = field(default_factory=list)
    needs: list[str] = field(default_factory=list)


class _Loader:
    def __init__(self) -> None:
        self.files: dict[Path, list[str]] = {}
        self.instances: dict[str, _Instance] = {}
        self.issues: list[Issue] = []
        # Mistakes that do not stop validation (duplicate keys): reported with everything else.
        self.later: list[Issue] = []

    def load_file(self, path: Path) -> list[str]:
        resolved = path.resolve()
        if resolved in self.files:
            return self.files[resolved]  # a file needed twice (or in a cycle) is read once
        ids: list[str] = []
        self.files[resolved] = ids
        display = relative_display(path)
        try:
            data, lines, duplicates = load_yaml(path, display)
        except ConfigError as exc:
            self.issues.extend(exc.issues)
            return ids
        self.later.extend(duplicates)
        if not isinstance(data, dict):
            self.issues.append(
                Issue(display, "a stage file must be a mapping of keys (kind: ..., needs: ...)", line=1)
            )
            return ids
        instances, issues = expand_matrix(data, path.stem, display, lines)
        self.issues.extend(issues)
        fresh = []
        for values, inst in instances:
            structural = {k: v for k, v in inst.items() if k in STRUCTURAL_KEYS or k == "kind"}
            try:
                header = StageHeader.model_validate(structural)
            except ValidationError as exc:
                self.issues.extend(pydantic_issues(exc, StageHeader, display, lines, {}))
                continue
            sid = header.stage or path.stem
            if not STAGE_ID.match(sid):
                self.issues.append(
                    Issue(
                        display,
                        f"stage id {sid!r} may use letters, digits, '-' and '_' only",
                        key="stage",
                        line=line_of(lines, ("stage",)),
                    )
                )
                continue
            if sid in self.instances:
                other = self.instances[sid]
                self.issues.append(
                    Issue(
                        display,
                        f"stage id {sid!r} is also defined by {other.display}",
                        key="stage",
                        line=line_of(lines, ("stage",)),
                        hint="give one a different `stage:`",
                    )
                )
                continue
            instance = _Instance(sid, resolved, display, inst, lines, values)
            self.instances[sid] = instance
            ids.append(sid)
            fresh.append((instance, header))
        for instance, header in fresh:
            for index, ref in enumerate(header.needs):
                if ref.endswith(STAGE_FILE_SUFFIXES):
                    target = resolved.parent / ref
                    if not target.is_file():
                        self.issues.append(
                            _missing_file(display, lines, ("needs", index), target, "stage file")
                        )
                        continue
                    instance.refs.append((index, ref, self.load_file(target)))
                else:
                    instance.refs.append((index, ref, None))
        return ids

    def resolve_needs(self) -> None:
        for inst in self.instances.values():
            for index, ref, ids in inst.refs:
                if ids is None:
                    if ref not in self.instances:
                        hint = (
                            did_you_mean(ref, self.instances)
                            or "name a stage file (e.g. sft.yaml) or a stage id it defines"
                        )
                        self.issues.append(
                            Issue(
                                inst.display,
                                f"needs unknown stage {ref!r}",
                                key=f"needs[{index}]",
                                line=line_of(inst.lines, ("needs", index)),
                                hint=hint,
                            )
                        )
                        continue
                    ids = [ref]
                inst.needs.extend(i for i in ids if i not in inst.needs)

    def order(self) -> list[str]:
        """Dependency order; a cycle becomes an Issue naming it."""
        state: dict[str, int] = {}
        order: list[str] = []

        def visit(sid: str, trail: list[str]) -> None:
            if state.get(sid) == 2:
                return
            if state.get(sid) == 1:
                cycle = trail[trail.index(sid) :] + [sid]
                inst = self.instances[trail[-1]]
                self.issues.append(
                    Issue(
                        inst.display,
                        "needs form a cycle: " + " -> ".join(cycle),
                        key="needs",
                        line=line_of(inst.lines, ("needs",)),
                        hint="remove one of these needs",
                    )
                )
                return
            state[sid] = 1
            for need in self.instances[sid].needs:
                visit(need, [*trail, sid])
            state[sid] = 2
            order.append(sid)

        for sid in self.instances:
            visit(sid, [])
        return order


def load_pipeline(path: Path | str, overrides: list[str] | tuple[str, ...] = ()) -> Pipeline:
    """Load, expand and validate the DAG rooted at stage file `path`. Raises ConfigError."""
    path = Path(path)
    loader = _Loader()
    if not path.is_file():
        raise ConfigError(
            [
                Issue(
                    str(path),
                    "stage file does not exist",
                    hint=did_you_mean(path.name, _names(path.parent, STAGE_FILE_SUFFIXES)),
                )
            ]
        )
    loader.load_file(path)
    loader.resolve_needs()
    order = loader.order()
    if loader.issues:
        raise ConfigError(loader.issues + loader.later)
    _import_plugins(loader)
    parsed, issues = parse_overrides(overrides)
    known = {
        sid: schema_paths(StageHeader) | _kind_paths(inst.data.get("kind"))
        for sid, inst in loader.instances.items()
    }
    applied, more = apply_overrides(parsed, {sid: inst.data for sid, inst in loader.instances.items()}, known)
    issues += more
    if issues:
        raise ConfigError(issues + loader.later)
    unregistered: dict[str, Issue] = {}
    stages = {}
    for sid in order:
        stage = _validate(loader.instances[sid], applied[sid], loader.issues, unregistered)
        if stage is not None:
            stages[sid] = stage
    if loader.issues or loader.later:
        raise ConfigError(loader.issues + loader.later)
    return Pipeline(root=path.resolve(), stages=stages, unregistered=unregistered)


def _import_plugins(loader: _Loader) -> None:
    try:
        load_plugins()
    except Exception as exc:  # an installed plug-in package that does not import
        raise ConfigError(
            [
                Issue(
                    ENTRY_POINT_GROUP,
                    f"importing the plug-in packages failed: {type(exc).__name__}: {exc}",
                    hint="fix or uninstall the package named in the error",
                )
            ]
        ) from exc
    seen: set[str] = set()
    for inst in loader.instances.values():
        for index, spec in enumerate(inst.data.get("plugins") or []):
            resolved = str(inst.path.parent / spec) if spec.endswith(".py") else spec
            if resolved in seen:
                continue
            seen.add(resolved)
            where = dict(
                file=inst.display, key=f"plugins[{index}]", line=line_of(inst.lines, ("plugins", index))
            )
            if spec.endswith(".py") and not Path(resolved).is_file():
                loader.issues.append(
                    _missing_file(
                        inst.display, inst.lines, ("plugins", index), Path(resolved), "plug-in file"
                    )
                )
                continue
            try:
                import_plugin(resolved)
            except (RegistryError, TypeError) as exc:
                loader.issues.append(Issue(message=f"plug-in {spec!r} could not register: {exc}", **where))
            except Exception as exc:  # a user's plug-in may raise anything on import
                loader.issues.append(
                    Issue(message=f"importing plug-in {spec!r} failed: {type(exc).__name__}: {exc}", **where)
                )
    if loader.issues:
        raise ConfigError(loader.issues + loader.later)


def _kind_paths(kind: Any) -> set[tuple[str, ...]]:
    return (
        schema_paths(STAGE_KINDS.get(kind).config) if isinstance(kind, str) and kind in STAGE_KINDS else set()
    )


def _validate(
    inst: _Instance,
    overridden: dict[tuple[str, ...], str],
    issues: list[Issue],
    unregistered: dict[str, Issue],
) -> Stage | None:
    header_data, body = split_body(inst.data)
    try:
        header = StageHeader.model_validate(header_data)
    except ValidationError as exc:
        issues.extend(pydantic_issues(exc, StageHeader, inst.display, inst.lines, overridden, GENERIC_KEYS))
        header = None
    else:  # seed: true, keep_checkpoints: false, resources.cpus: .inf pass pydantic as 1, 0 and inf
        issues.extend(number_issues(header_data, StageHeader, inst.display, inst.lines, overridden))
    kind = inst.data["kind"]  # checked while loading: the DAG cannot be built without it
    registered = kind in STAGE_KINDS
    hashed_body = body
    if registered:
        config = STAGE_KINDS.get(kind).config
        try:
            # With the needs as context a kind checks its keys that name a need's model now, not when
            # the stage runs (posttrain.config.stage_file.check_model_reference).
            context = {
                NEEDS_CONTEXT: list(inst.needs),
                SETS_MODEL_CONTEXT: inst.data.get("model") is not None,
                SEED_CONTEXT: None if header is None else header.seed,
                MATRIX_CONTEXT: inst.matrix,
            }
            # The hash reads the body as the kind reads it, keys left at their defaults dropped: a
            # key written out with its default value is the same stage, not one to rerun.
            hashed_body = config.model_validate(body, context=context).model_dump(
                mode="json", exclude_defaults=True
            )
            schema = []
        except ValidationError as exc:
            schema = pydantic_issues(exc, config, inst.display, inst.lines, overridden, GENERIC_KEYS)
        numbers = number_issues(body, config, inst.display, inst.lines, overridden)
        # A NaN also fails a bound (`gt=0`): one problem, said once, as "must be a finite number".
        said = {(issue.file, issue.key) for issue in numbers}
        issues.extend([issue for issue in schema if (issue.file, issue.key) not in said] + numbers)
    else:
        for key in body:  # a misspelled generic key would otherwise pass as an unchecked body key
            hint = did_you_mean(key, GENERIC_KEYS)
            if hint:
                issues.append(
                    Issue(inst.display, "unknown key", key=key, line=line_of(inst.lines, (key,)), hint=hint)
                )
        known = ", ".join(STAGE_KINDS) or "none"
        unregistered[inst.id] = Issue(
            inst.display,
            f"kind {kind!r} is not registered: its keys ({', '.join(body) or 'none'}) cannot "
            "be checked and the stage cannot run",
            key="kind",
            line=line_of(inst.lines, ("kind",)),
            hint=f"registered kinds: {known}; list the module that registers it under plugins:",
        )
    if header is None:
        return None
    model, model_is_input = _resolve_model(inst, header, overridden, issues)
    hashed_qat = _check_qat(inst, header.qat, overridden, issues)
    stage = Stage(
        id=inst.id,
        kind=kind,
        file=str(inst.path),
        needs=list(inst.needs),
        seed=header.seed,
        model=model,
        model_is_input=model_is_input,
        resources=header.resources.model_dump(),
        qat=header.qat,
        plugins=[str(inst.path.parent / p) if p.endswith(".py") else p for p in header.plugins],
        matrix=inst.matrix,
        body=body,
        description=header.description,
        keep_checkpoints=header.keep_checkpoints,
        registered=registered,
    )
    stage.config_hash = config_hash(stage, hashed_body, hashed_qat)
    return stage


def _resolve_model(
    inst: _Instance, header: StageHeader, overridden: dict[tuple[str, ...], str], issues: list[Issue]
) -> tuple[str | None, bool]:
    value = header.model
    if value is None:
        return None, False
    from_cli = ("model",) in overridden
    where = dict(
        file=f"command line override {overridden[('model',)]!r}" if from_cli else inst.display,
        key="model",
        line=None if from_cli else line_of(inst.lines, ("model",)),
    )
    base = Path.cwd() if from_cli else inst.path.parent
    if value.endswith(PRESET_SUFFIXES):
        target = (base / value).resolve()
        if not target.is_file():
            issues.append(
                Issue(
                    message=f"model preset {value} does not exist ({target})",
                    hint=did_you_mean(target.name, _names(target.parent, PRESET_SUFFIXES))
                    or f"presets there: {', '.join(_names(target.parent, PRESET_SUFFIXES)) or 'none'}",
                    **where,
                )
            )
            return None, False
        # Its content too: a misspelt or mistyped key stopped the stage at its start, after its
        # needs had run. The message names the preset and its key.
        from posttrain.model.configuration_kimi_k3 import load_model_config  # transformers: not at the top

        try:
            load_model_config(target)
        except ValueError as error:
            issues.append(Issue(message=str(error), **where))
            return None, False
        return str(target), False
    if value not in inst.needs:
        directory = (base / value).resolve()
        if (directory / "config.json").is_file():
            # A pretrained model directory (Hugging Face format): the stage continues its weights,
            # so a shard lost or cut short is refused now, not when the stage starts.
            try:
                weight_headers(directory)
            except ValueError as error:
                issues.append(Issue(message=str(error), **where))
                return None, False
            return str(directory), False
        issues.append(
            Issue(
                message=f"model {value!r} is neither a preset file (.yaml/.json), a model directory "
                f"with config.json, nor one of this stage's needs ({', '.join(inst.needs) or 'none'})",
                hint=did_you_mean(value, inst.needs),
                **where,
            )
        )
        return None, False
    return value, True


def _check_qat(
    inst: _Instance, qat: dict[str, Any] | None, overridden: dict[tuple[str, ...], str], issues: list[Issue]
) -> dict[str, Any] | None:
    """Validate `qat:` with posttrain.qat.config.QATConfig; return it as the config hash reads it:
    keys left at their defaults dropped, as for the body (spelling out `block_size: 32` is the same
    stage), its scheme always kept (so `{scheme: k3}` hashes as it did when `qat:` was hashed as
    written). Invalid, it is returned as written: its issues stop the load."""
    if qat is None:
        return None
    from posttrain.qat.config import QATConfig  # here, not at the top: posttrain.qat imports torch

    try:
        config = QATConfig.model_validate(qat)
    except ValidationError as exc:
        for issue in pydantic_issues(exc, QATConfig, inst.display, _shift(inst.lines), _shift(overridden)):
            issues.append(
                Issue(
                    issue.file,
                    issue.message,
                    key=key_path(("qat", issue.key)) if issue.key else "qat",
                    line=issue.line
                    or (line_of(inst.lines, ("qat",)) if issue.file == inst.display else None),
                    hint=issue.hint,
                )
            )
        return qat
    return {"scheme": config.scheme, **config.model_dump(mode="json", exclude_defaults=True)}


def _shift(located: dict[Any, Any]) -> dict[Any, Any]:
    """Lines (or overrides) of the keys under `qat`, re-rooted so QATConfig's error locations find
    them."""
    return {path[1:]: where for path, where in located.items() if path[:1] == ("qat",)}


def config_hash(stage: Stage, body: dict[str, Any], qat: dict[str, Any] | None) -> str:
    """What decides a stage's result: kind, body (as its kind validated it, defaults left out, so
    spelling out a default changes nothing), seed, model (a preset's or model dir's content), qat
    (likewise, `_check_qat`), matrix values and needs. Resources, plug-in paths, the description
    and how many checkpoints are kept do not, so moving a run to a bigger machine does not
    invalidate it."""
    model: Any = stage.model
    if stage.model and not stage.model_is_input:
        path = Path(stage.model)
        model = {"preset": path.name, "sha256": hash_tree(path)[1] if path.is_dir() else sha256_file(path)}
    content = {
        "kind": stage.kind,
        "body": body,
        "seed": stage.seed,
        "model": model,
        "qat": qat,
        "matrix": stage.matrix,
        "needs": stage.needs,
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _names(directory: Path, suffixes: tuple[str, ...]) -> list[str]:
    return sorted(p.name for p in directory.glob("*") if p.suffix in suffixes) if directory.is_dir() else []


def _missing_file(display: str, lines: dict[KeyPath, int], path: KeyPath, target: Path, what: str) -> Issue:
    names = _names(target.parent, (target.suffix,))
    hint = did_you_mean(target.name, names) or (f"files there: {', '.join(names)}" if names else "")
    return Issue(
        display,
        f"{what} {target.name} does not exist ({relative_display(target)})",
        key=key_path(path),
        line=line_of(lines, path),
        hint=hint,
    )
