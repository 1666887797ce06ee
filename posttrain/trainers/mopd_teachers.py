"""Which teacher scores which MOPD trajectory, and the engines that do it.

MOPD distils nine specialists, one per (domain, effort); this module turns the stage file's
teacher keys into engines and keeps them serving:
- teacher domains (`TEACHER_DOMAINS`, filled with `@teacher_domain`): a domain's environment
  (prompt recipe, tools, verifier) and its teacher for each effort. The shipped ones, general,
  agent and coding, are registered below: each plays the RL stage's own environment (the student
  is distilled on the prompt families, tools and verifiers its teachers were trained on) and is
  taught at every effort by its RL specialist rl-<domain>-<effort>. A custom domain registers the
  same way from a plug-in (examples/math_domain.py is a worked one). A teacher's engine is any
  `ENGINES` name, built by posttrain.engines.build.build_engine;
- `TeacherRoutingConfig`, the routing keys of a `mopd` stage file, checked strictly: a pair without
  a teacher is an error before anything runs, naming the pair and the fix;
- `route_teachers`: (domain, effort) -> teacher model dir + backend, resolved against the needs;
- `TeacherPool`: one engine per distinct (checkpoint, backend), shared by the teachers using it;
  a failing engine is rebuilt and its trajectories re-scored, never skipped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from posttrain.config.stage_file import check_model_reference
from posttrain.data.chat import (
    DEFAULT_TOKENIZER_DIR,
    TokenIds,
    load_tokenizer,
    model_tokenizer_dir,
    token_ids_difference,
    tokenizer_files,
)
from posttrain.data.sample import EFFORTS, Sample
from posttrain.engines import ENGINES, Engine
from posttrain.engines.build import build_engine
from posttrain.envs.environments import AgentEnvironment, CodingEnvironment, Environment, GeneralEnvironment
from posttrain.model.released import flatten_released_config, is_released_config
from posttrain.registry import Registry
from posttrain.weight_files import RECOPY

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

Pair = tuple[str, str]  # (domain, effort)
EngineKey = tuple[str, str, str | None]  # (resolved model dir, engine name, server url)


def pair_name(pair: Pair) -> str:
    """'coding-max': the key of a (domain, effort) pair in stage files, eval.json and metrics."""
    return f"{pair[0]}-{pair[1]}"


# Teacher domains and backends ---------------------------------------------------------------------


@dataclass(frozen=True)
class TeacherDomain:
    """A registered teacher domain: its name; environment, the Environment subclass that makes and
    plays the domain's episodes (prompt recipe, tools, verifier); teachers, effort -> a need's
    stage id or a model dir."""

    name: str
    environment: type[Environment]
    teachers: Mapping[str, str]


TEACHER_DOMAINS: Registry[TeacherDomain] = Registry("teacher domain")


def teacher_domain(
    name: str | None = None, *, teachers: Mapping[str, str] | None = None
) -> Callable[[type[Environment]], type[Environment]]:
    """Class decorator registering an Environment subclass as teacher domain `name` (default: its
    `domain`). teachers: effort -> a need's stage id or a model dir; default rl-<name>-<effort> for
    every effort, the stage ids of the RL specialists an `rl` matrix over the domain produces."""

    def register(environment: type[Environment]) -> type[Environment]:
        domain = name or environment.domain
        if environment.domain != domain:
            raise ValueError(
                f"teacher domain {domain!r}: {environment.__name__}.domain is {environment.domain!r}; "
                "its prompts carry that domain, so the two names must be equal"
            )
        chosen = dict(teachers) if teachers is not None else {e: f"rl-{domain}-{e}" for e in EFFORTS}
        unknown = sorted(set(chosen) - set(EFFORTS))
        if unknown:
            raise ValueError(f"teacher domain {domain!r}: unknown efforts {unknown}; use {list(EFFORTS)}")
        TEACHER_DOMAINS.register(domain)(TeacherDomain(domain, environment, chosen))
        return environment

    return register


for _environment in (GeneralEnvironment, AgentEnvironment, CodingEnvironment):
    teacher_domain()(_environment)


# Configuration ------------------------------------------------------------------------------------


class TeacherConfig(BaseModel):
    """One (domain, effort) teacher declared in the stage file, over the domain's default."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="a need's stage id or a model dir; null: the domain's")
    engine: str | None = Field(
        None,
        description="embedded, vllm, vllm_server, trl_vllm (posttrain.engines.build); null: teacher_engine",
    )
    url: str | None = Field(None, description="trl_vllm: base URL of the `trl vllm-serve` server of `model`")

    @field_validator("engine")
    @classmethod
    def _backend(cls, engine: str | None) -> str | None:
        return None if engine is None else registered_engine(engine)


def registered_engine(name: str) -> str:
    if name not in ENGINES:
        raise ValueError(f"unknown teacher engine {name!r} (registered: {', '.join(ENGINES)})")
    return name


class TeacherRoutingConfig(BaseModel):
    """The teacher keys of a `mopd` stage file (MOPDConfig adds the rest): which (domain, effort)
    pairs are distilled and who teaches each."""

    model_config = ConfigDict(extra="forbid")
    domains: list[str] = Field(
        default_factory=lambda: ["general", "agent", "coding"],
        description="registered teacher domains trained on",
    )
    efforts: list[str] = Field(
        default_factory=lambda: list(EFFORTS), description="efforts each prompt is played at"
    )
    # before `teachers`, whose check reads it
    teacher_engine: str = Field("embedded", description="default teacher engine (an ENGINES name)")
    teachers: dict[str, TeacherConfig] = Field(
        default_factory=dict,
        validate_default=True,
        description="'<domain>-<effort>' -> teacher; other pairs use the domain's",
    )
    max_teacher_retries: int = Field(2, ge=0, description="engine rebuilds per scoring call before failing")

    @field_validator("domains")
    @classmethod
    def _registered(cls, domains: list[str]) -> list[str]:
        listed_once(domains, "domain", list(TEACHER_DOMAINS))
        for domain in domains:
            if domain not in TEACHER_DOMAINS:
                raise ValueError(
                    f"{domain!r} is not a registered teacher domain (registered: "
                    f"{', '.join(TEACHER_DOMAINS)}); register it with @teacher_domain in a plug-in "
                    "listed under `plugins:`"
                )
        return domains

    @field_validator("efforts")
    @classmethod
    def _known(cls, efforts: list[str]) -> list[str]:
        listed_once(efforts, "effort", list(EFFORTS))
        if set(efforts) - set(EFFORTS):
            raise ValueError(f"{sorted(set(efforts) - set(EFFORTS))} are not efforts; use {list(EFFORTS)}")
        return efforts

    @field_validator("teachers")
    @classmethod
    def _every_pair_has_a_teacher(cls, teachers: dict[str, TeacherConfig], info: ValidationInfo) -> dict:
        domains, efforts = info.data.get("domains"), info.data.get("efforts")
        if domains is None or efforts is None:
            return teachers  # their own errors are reported
        pairs = {pair_name((d, e)): (d, e) for d in domains for e in efforts}
        for key in sorted(set(teachers) - set(pairs)):
            raise ValueError(
                f"{key}: not a trained pair; keys are '<domain>-<effort>' with domain in {domains} and "
                f"effort in {efforts}"
            )
        missing = [
            key
            for key, (domain, effort) in pairs.items()
            if (key not in teachers or teachers[key].model is None)
            and effort not in TEACHER_DOMAINS.get(domain).teachers
        ]
        if missing:  # every missing pair at once: a new domain usually lacks several
            named = ", ".join(f"(domain {pairs[k][0]!r}, effort {pairs[k][1]!r})" for k in missing)
            registered = {pairs[k][0]: sorted(TEACHER_DOMAINS.get(pairs[k][0]).teachers) for k in missing}
            example = ", ".join(f"{k}: {{model: <need stage id or model dir>}}" for k in missing)
            efforts_named = ", ".join(repr(pairs[k][1]) for k in missing)
            raise ValueError(
                f"no teacher for {named}: "
                + "; ".join(f"the domain registers teachers for {v}" for v in registered.values())
                + f"; add `teachers: {{{example}}}` (a top-level key of the mopd stage file, beside "
                "`domains:`), register the teachers in the domain's @teacher_domain(teachers=...), "
                f"or remove {efforts_named} from `efforts`"
            )
        for domain, effort in pairs.values():
            check_model_reference(
                teacher_reference(domain, effort, teachers),
                info,
                f"teacher of (domain {domain!r}, effort {effort!r})",
            )
        default_engine = info.data.get("teacher_engine")
        if default_engine is not None:  # else its own error is reported
            check_servers(pairs, teachers, default_engine)
        return teachers

    @field_validator("teacher_engine")
    @classmethod
    def _backend(cls, engine: str) -> str:
        return registered_engine(engine)


def check_servers(pairs: Mapping[str, Pair], teachers: Mapping[str, TeacherConfig], default: str) -> None:
    """A trl_vllm teacher has its server's url, and only a trl_vllm teacher has one (another engine
    would ignore it: the pair would be scored by a model other than the one the url serves)."""
    without, unused = [], []
    for key in pairs:
        declared = teachers.get(key) or TeacherConfig()
        engine = declared.engine or default
        if engine == "trl_vllm" and not declared.url:
            without.append(key)
        elif engine != "trl_vllm" and declared.url:
            unused.append(f"{key} (engine {engine})")
    if without:
        example = ", ".join(f"{key}: {{url: http://host:port}}" for key in without)
        raise ValueError(
            f"teachers {', '.join(without)} use engine trl_vllm without the url of their `trl vllm-serve` "
            f"server; add `teachers: {{{example}}}`"
        )
    if unused:
        raise ValueError(
            f"teachers {', '.join(unused)} have a url, which only engine trl_vllm reads; set their "
            "engine: trl_vllm or drop the url"
        )


def listed_once(names: list[str], what: str, choices: list[str]) -> None:
    """A list of the pairs' domains or efforts names at least one, each once: with none the stage
    has nothing to distil, and a name listed twice would play its episodes twice under the same
    uids (the same sampling noise), doubling their weight."""
    if not names:
        raise ValueError(f"no {what} listed; list at least one of {choices}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"{repeated} listed more than once; list each {what} once")


# Routing ------------------------------------------------------------------------------------------


class TeacherRoutingError(ValueError):
    """A (domain, effort) pair has no usable teacher; the message names the pair and the fix."""


@dataclass(frozen=True)
class Teacher:
    """The teacher of one (domain, effort): a model dir served by an engine (at `url`, trl_vllm)."""

    domain: str
    effort: str
    model_dir: Path
    engine: str
    url: str | None = None

    @property
    def engine_key(self) -> EngineKey:
        """Teachers with equal keys share one engine (same checkpoint, same engine, same server)."""
        return (str(self.model_dir.resolve()), self.engine, self.url)


def teacher_reference(domain: str, effort: str, teachers: Mapping[str, TeacherConfig]) -> str:
    """The pair's teacher as the stage file gives it (a need's stage id or a model dir): its
    `teachers:` entry's model, else the domain's registered teacher."""
    declared = teachers.get(pair_name((domain, effort)))
    return (declared.model if declared else None) or TEACHER_DOMAINS.get(domain).teachers[effort]


def check_teacher_tokenizers(
    student: PreTrainedTokenizerFast, student_tokenizer: Path | None, teachers: Mapping[Pair, Path]
) -> None:
    """Refuse every pair whose teacher (model dir) was trained with a tokenizer that numbers tokens
    otherwise than the student's (`student`, loaded from `student_tokenizer`; None: the shipped
    one). MOPD's reward is log p_teacher - log p_student over the student's token ids: such a
    teacher scores ids that mean other text to it, and its rewards are noise that nothing else
    detects. A served teacher loads its tokenizer from the same dir (vllm, vllm_server); a
    `trl vllm-serve` server is trusted to serve the dir `model:` names (nothing it answers gives
    its tokenizer whole; docs/mopd.md). A teacher whose embedding and LM head (config.json's
    `vocab_size`) have fewer rows than the student has tokens is refused as well: a dir saved
    without tokenizer files passes the comparison (the shipped tokenizer is assumed), and its first
    scoring call, after SFT and the RL stages, would index past its embedding."""
    ours: TokenIds | None = None  # read when a teacher's files differ from the student's
    student_files = tokenizer_files(student_tokenizer)
    differences: dict[Path | None, str] = {}  # per teacher tokenizer: pairs may share one
    wrong, small = [], []
    for pair, model_dir in teachers.items():
        # config.json first: transformers reads it to load the tokenizer too, and a damaged one
        # would be reported as a damaged tokenizer
        rows = teacher_vocab_size(pair, model_dir)
        if rows is not None and rows < len(student):
            small.append(f"{pair_name(pair)}: {model_dir} (vocab_size {rows})")
        own = model_tokenizer_dir(model_dir)
        if own not in differences and tokenizer_files(own) == student_files:
            # the student's very files (every stage of one run saves the same): the same ids
            differences[own] = ""
        if own not in differences:
            try:
                theirs = load_tokenizer(own)
            except Exception as error:  # a damaged tokenizer.json: tokenizers' own message names no file
                raise TeacherRoutingError(
                    f"{pair_name(pair)}: the tokenizer of the teacher {model_dir} cannot be loaded "
                    f"({error}); save it again from the tokenizer the teacher was trained with"
                ) from error
            ours = ours or TokenIds.of(student)
            differences[own] = token_ids_difference(ours, TokenIds.of(theirs))
        difference = differences[own]
        if difference:
            shown = own or DEFAULT_TOKENIZER_DIR
            wrong.append(f"{pair_name(pair)}: {model_dir} (tokenizer {shown}: {difference})")
    if wrong:
        raise TeacherRoutingError(
            "teachers with another tokenizer than the student's "
            f"({student_tokenizer or DEFAULT_TOKENIZER_DIR}): {'; '.join(wrong)}. "
            "A teacher scores the student's token ids, so its rewards would be noise; give each such "
            "pair a teacher trained with the student's tokenizer (`teachers: "
            "{<pair>: {model: <need or dir>}}`), or a student (and `tokenizer:`) with the teachers'"
        )
    if small:
        raise TeacherRoutingError(
            f"teachers whose embeddings are smaller than the student's {len(student)} tokens "
            f"({student_tokenizer or DEFAULT_TOKENIZER_DIR}): {'; '.join(small)}. A teacher scores "
            "every id the student samples, and its first scoring call would fail; give each such pair "
            "a teacher trained with the student's tokenizer, or copy into its dir the tokenizer it "
            "was trained with (save_pretrained) so the difference is shown"
        )


def teacher_vocab_size(pair: Pair, model_dir: Path) -> int | None:
    """The rows of a teacher's embedding and LM head: config.json's `vocab_size` (under
    `text_config` in the released wrapper), read without its weights; None when it sets none."""
    config = model_dir / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TeacherRoutingError(
            f"{pair_name(pair)}: {config} cannot be read ({error}): {RECOPY}"
        ) from error
    if not isinstance(data, dict):
        raise TeacherRoutingError(f"{pair_name(pair)}: {config} is not a mapping of config keys: {RECOPY}")
    if is_released_config(data):
        data = flatten_released_config(data)
    rows = data.get("vocab_size")
    return rows if isinstance(rows, int) else None


def resolve_model(ref: str, inputs: Mapping[str, Path], what: str) -> Path:
    """A need's stage id -> its model dir; anything else must be a checkpoint dir."""
    if ref in inputs:
        return Path(inputs[ref])
    path = Path(ref).expanduser()
    if (path / "config.json").is_file():
        return path.resolve()
    raise TeacherRoutingError(
        f"{what}: {ref!r} is neither a need of this stage (needs: {', '.join(sorted(inputs)) or 'none'}) "
        "nor a model directory with config.json; add the stage that trains it to `needs` or give a path"
    )


def route_teachers(cfg: TeacherRoutingConfig, inputs: Mapping[str, Path]) -> dict[Pair, Teacher]:
    """Every trained (domain, effort) -> its Teacher, resolved against the stage's needs."""
    routes = {}
    for domain in cfg.domains:
        for effort in cfg.efforts:
            declared = cfg.teachers.get(pair_name((domain, effort))) or TeacherConfig()
            path = resolve_model(
                teacher_reference(domain, effort, cfg.teachers),
                inputs,
                f"teacher of (domain {domain!r}, effort {effort!r})",
            )
            engine = declared.engine or cfg.teacher_engine  # a trl_vllm one has its url (check_servers)
            routes[(domain, effort)] = Teacher(domain, effort, path, engine, declared.url)
    return routes


# Teacher engines ----------------------------------------------------------------------------------


class TeacherScoreError(RuntimeError):
    """A teacher could not score trajectories (after its rebuilds): the stage stops, untrained."""


class TeacherPool:
    """The routed teachers' engines, built once per distinct (checkpoint, backend).

    score(samples) sets each sample's teacher_logprobs with its (domain, effort) teacher. A backend
    that fails is closed, rebuilt and asked again, up to max_retries times per call; `retries`
    counts those rebuilds plus restarts a backend did by itself (the vLLM server engine restarts a
    dead server before it gives up).
    """

    def __init__(
        self,
        routes: Mapping[Pair, Teacher],
        work_dir: Path,
        max_retries: int,
        log: Any,
        *,
        device: torch.device | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        self.routes = dict(routes)
        # where embedded teachers run: the student's device and mixed precision
        self.device, self.autocast_dtype = device, autocast_dtype
        self.work_dir = work_dir
        self.max_retries = max_retries
        self.log = log
        self.retries = 0
        self.engines: dict[EngineKey, Engine] = {}

    def teacher_for(self, sample: Sample) -> Teacher:
        teacher = self.routes.get((sample.domain, sample.effort))
        if teacher is None:
            name = pair_name((sample.domain, sample.effort))
            raise TeacherRoutingError(
                f"sample {sample.uid}: (domain {sample.domain!r}, effort {sample.effort!r}) has no teacher "
                f"(routed: {', '.join(pair_name(p) for p in self.routes)}); add the domain to `domains` and "
                f"the effort to `efforts`, or declare `teachers: {{{name}: {{model: ...}}}}`"
            )
        return teacher

    def engine(self, key: EngineKey) -> Engine:
        if key not in self.engines:
            self.log.info("teacher engine %s for %s", key[1], key[0])
            model_dir = Path(key[0])
            name = f"vllm-teacher-{model_dir.parent.name or model_dir.name}"
            self.engines[key] = build_engine(
                key[1],
                model_dir,
                work_dir=self.work_dir,
                log_name=name,
                url=key[2],
                device=self.device,
                autocast_dtype=self.autocast_dtype,
            )
        return self.engines[key]

    def start(self) -> None:
        """Build every engine now, so a broken teacher fails before the first rollout."""
        for teacher in self.routes.values():
            self.engine(teacher.engine_key)

    def by_engine(self, samples: list[Sample]) -> dict[EngineKey, list[Sample]]:
        """The samples grouped by the engine of their teacher (one batched call each)."""
        groups: dict[EngineKey, list[Sample]] = {}
        for sample in samples:
            groups.setdefault(self.teacher_for(sample).engine_key, []).append(sample)
        return groups

    def score(self, samples: list[Sample]) -> None:
        for key, group in self.by_engine(samples).items():
            self._score_group(key, group)

    def _score_group(self, key: EngineKey, group: list[Sample]) -> None:
        for attempt in range(self.max_retries + 1):
            engine = self.engine(key)
            restarts = getattr(engine, "restarts", 0)
            try:
                scores = engine.score(group)
                check_teacher_scores(group, scores)
            except (ValueError, TypeError):
                raise  # a request the engine rejects: rebuilding it would not help
            except Exception as error:
                if attempt == self.max_retries:
                    raise TeacherScoreError(
                        f"teacher {key[1]}:{key[0]} failed {attempt + 1} times scoring "
                        f"{[s.uid for s in group]} ({error}); no trajectory is trained unscored"
                    ) from error
                self.retries += 1
                self.log.warning(
                    "teacher %s failed (%s); rebuilding it, re-scoring %d trajectories",
                    key[0],
                    error,
                    len(group),
                )
                self._drop(key)
                continue
            self.retries += getattr(engine, "restarts", 0) - restarts
            for sample, score in zip(group, scores, strict=True):
                sample.teacher_logprobs = [float(x) for x in score]
            return

    def _drop(self, key: EngineKey) -> None:
        engine = self.engines.pop(key, None)
        if engine is not None:
            try:
                engine.close()
            except Exception as error:  # a dead engine may fail to close; it is dropped either way
                self.log.warning("closing teacher engine %s failed: %s", key[0], error)

    def close(self) -> None:
        for key in list(self.engines):
            self._drop(key)


def check_teacher_scores(samples: list[Sample], scores: list[list[float]]) -> None:
    """Scores that do not fit the trajectories (a dying engine's output) are a failure."""
    if len(scores) != len(samples):
        raise TeacherScoreError(f"teacher returned {len(scores)} score rows for {len(samples)} samples")
    for sample, score in zip(samples, scores, strict=True):
        if len(score) != len(sample.tokens):
            raise TeacherScoreError(
                f"sample {sample.uid}: {len(score)} teacher log-probs, {len(sample.tokens)} tokens"
            )
        bad = [t for t, m in enumerate(sample.generated_mask) if m and not math.isfinite(score[t])]
        if bad:
            raise TeacherScoreError(
                f"sample {sample.uid}: non-finite teacher log-probs at positions {bad[:8]}"
            )
