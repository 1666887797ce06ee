"""The `mopd` stage kind: multi-teacher on-policy distillation, K3's last stage (K3_SPEC 2.3).

The nine RL specialists are merged into one student in policy space, not by averaging weights: the
student samples its own episodes with the reasoning effort as conditioning, the teacher of each
prompt's (domain, effort) prefills the student's trajectory, and every student-sampled token gets
r_t = clip(log p_teacher(y_t) - log p_student(y_t), -R_max, R_max), trained with the RL stage's
per-token policy loss. It is dense, on-policy reverse KL: the student learns where it samples.

In reading order:
- teacher domains (`TEACHER_DOMAINS`, filled by plug-ins; the shipped ones live in teachers/): a
  domain's environment (prompt recipe, tools, verifier) and its teacher for each effort;
- routing: (domain, effort) -> teacher model dir + backend, strict: a pair without a teacher is an
  error before anything runs, naming the pair and the fix;
- `TeacherPool`: one engine per distinct (checkpoint, backend), shared by the teachers using it;
  a failing engine is rebuilt and its trajectories re-scored, never skipped;
- the episode loop over every domain at once (finished episodes are scored by their teachers
  between turns, batched), the training step, the before/after evaluation (DIR/mopd/eval.json).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from posttrain.algos.mismatch import mismatch_stats
from posttrain.algos.policy_loss import PolicyLoss, PolicyLossConfig, policy_loss
from posttrain.checkpoint import atomic_write_text, remove_tree
from posttrain.data.chat import ChatRenderer, load_tokenizer
from posttrain.data.sample import EFFORTS, Sample
from posttrain.engines import EmbeddedEngine, Engine, SamplingConfig
from posttrain.engines.embedded import left_pad, positions_from_mask
from posttrain.envs.environments import EPISODE_DONE, Environment, EnvironmentConfig
from posttrain.registry import Registry
from posttrain.stages import StageContext, stage_kind
from posttrain.trainers.common import (
    AccelerateConfig,
    OptimConfig,
    TrainState,
    base_without_peft,
    load_policy,
    save_final_model,
)
from rewards.mopd import mopd_sample_rewards, reverse_kl

Pair = tuple[str, str]  # (domain, effort)
EVAL_FILE = "eval.json"
RESULT_KEYS = ("kl", "accuracy", "tokens")


def pair_name(pair: Pair) -> str:
    """'coding-max': the key of a (domain, effort) pair in stage files, eval.json and metrics."""
    return f"{pair[0]}-{pair[1]}"


# Teacher domains and backends ---------------------------------------------------------------------


class TeacherDomain(Protocol):
    """A registered teacher domain as MOPD reads it (`teachers.teacher_domain` registers them): the
    environment class that makes and plays the domain's episodes (prompt recipe, tools, verifier),
    and effort -> its teacher, a need's stage id or a model dir."""

    environment: type[Environment]
    teachers: Mapping[str, str]


TEACHER_DOMAINS: Registry[TeacherDomain] = Registry("teacher domain")
# backend name -> build(model_dir, work_dir) -> Engine; the shipped ones are in teachers/backends.py
TEACHER_BACKENDS: Registry[Callable[[Path, Path], Engine]] = Registry("teacher backend")


# Configuration ------------------------------------------------------------------------------------


class TeacherConfig(BaseModel):
    """One (domain, effort) teacher declared in the stage file, over the domain's default."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="a need's stage id or a model dir; null: the domain's")
    engine: str | None = Field(None, description="embedded, vllm, vllm_server; null: teacher_engine")

    @field_validator("engine")
    @classmethod
    def _backend(cls, engine: str | None) -> str | None:
        return None if engine is None else registered_backend(engine)


def registered_backend(name: str) -> str:
    if name not in TEACHER_BACKENDS:
        raise ValueError(f"unknown teacher backend {name!r} (registered: {', '.join(TEACHER_BACKENDS)})")
    return name


class RolloutConfig(BaseModel):
    """What the student samples each step: prompts of every domain, each at every effort."""

    model_config = ConfigDict(extra="forbid")
    prompts_per_domain: int = Field(2, gt=0, description="new prompts per domain per step")
    temperature: float = Field(1.0, gt=0, description="student sampling temperature (log-probs stay at T=1)")


class MOPDTrainConfig(OptimConfig):
    """One optimizer step of the policy loss per batch of episodes."""

    steps: int = Field(gt=0, description="optimizer steps (one rollout batch each)")
    micro_batch_size: int = Field(16, gt=0, description="trajectories per forward/backward")


class EvalConfig(BaseModel):
    """Held-out prompts of each domain, played at every effort (temperature 1) before and after."""

    model_config = ConfigDict(extra="forbid")
    prompts_per_domain: int = Field(4, gt=0, description="held-out prompts per domain")
    seed: int = Field(0, description="draws them; the RL stages' held-out prompts use the same default")


class MOPDConfig(BaseModel):
    """Keys of a `mopd` stage file besides the generic ones (docs/mopd.md)."""

    model_config = ConfigDict(extra="forbid")
    domains: list[str] = Field(default_factory=lambda: ["general", "agent", "coding"])
    efforts: list[str] = Field(default_factory=lambda: list(EFFORTS))
    teachers: dict[str, TeacherConfig] = Field(
        default_factory=dict,
        validate_default=True,
        description="'<domain>-<effort>' -> teacher; other pairs use the domain's",
    )
    teacher_engine: str = Field("embedded", description="default teacher backend")
    max_teacher_retries: int = Field(2, ge=0, description="engine rebuilds per scoring call before failing")
    student: str | None = Field(None, description="a need's stage id or model dir; null: the SFT model")
    tokenizer: str | None = Field(None, description="tokenizer dir; null: the student's")
    r_max: float = Field(5.0, gt=0, description="clip bound R_max of the per-token reward")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    environments: dict[str, EnvironmentConfig] = Field(
        default_factory=dict, description="domain -> environment settings (turns, tokens, harness)"
    )
    loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    train: MOPDTrainConfig
    accelerate: AccelerateConfig = Field(default_factory=AccelerateConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint_every: int = Field(5, gt=0, description="optimizer steps between checkpoints")

    @field_validator("domains")
    @classmethod
    def _registered(cls, domains: list[str]) -> list[str]:
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
        for key, (domain, effort) in pairs.items():
            registered = TEACHER_DOMAINS.get(domain).teachers
            if (key not in teachers or teachers[key].model is None) and effort not in registered:
                raise ValueError(
                    f"no teacher for (domain {domain!r}, effort {effort!r}): the domain registers teachers "
                    f"for {sorted(registered)}; add `teachers: {{{key}: {{model: <need stage id or model "
                    f"dir>}}}}` or remove {effort!r} from `efforts`"
                )
        return teachers

    @field_validator("teacher_engine")
    @classmethod
    def _backend(cls, engine: str) -> str:
        return registered_backend(engine)

    @field_validator("environments")
    @classmethod
    def _trained_domains(cls, environments: dict[str, EnvironmentConfig], info: ValidationInfo) -> dict:
        unknown = sorted(set(environments) - set(info.data.get("domains") or []))
        if unknown:
            raise ValueError(f"{unknown} are not in `domains`")
        if any(env.reward != "verifier" for env in environments.values()):
            raise ValueError("MOPD measures accuracy with each domain's verifier; set reward: verifier")
        return environments

    def environment_of(self, domain: str) -> EnvironmentConfig:
        return self.environments.get(domain) or EnvironmentConfig()


# Routing ------------------------------------------------------------------------------------------


class TeacherRoutingError(ValueError):
    """A (domain, effort) pair has no usable teacher; the message names the pair and the fix."""


@dataclass(frozen=True)
class Teacher:
    """The teacher of one (domain, effort): a model dir served by a backend."""

    domain: str
    effort: str
    model_dir: Path
    engine: str

    @property
    def engine_key(self) -> tuple[str, str]:
        """Teachers with equal keys share one engine (same checkpoint, same backend)."""
        return (str(self.model_dir.resolve()), self.engine)


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


def route_teachers(cfg: MOPDConfig, inputs: Mapping[str, Path]) -> dict[Pair, Teacher]:
    """Every trained (domain, effort) -> its Teacher, resolved against the stage's needs."""
    routes = {}
    for domain in cfg.domains:
        registered = TEACHER_DOMAINS.get(domain).teachers
        for effort in cfg.efforts:
            declared = cfg.teachers.get(pair_name((domain, effort))) or TeacherConfig()
            path = resolve_model(
                declared.model or registered[effort],
                inputs,
                f"teacher of (domain {domain!r}, effort {effort!r})",
            )
            routes[(domain, effort)] = Teacher(domain, effort, path, declared.engine or cfg.teacher_engine)
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

    def __init__(self, routes: Mapping[Pair, Teacher], work_dir: Path, max_retries: int, log: Any) -> None:
        self.routes = dict(routes)
        self.work_dir = work_dir
        self.max_retries = max_retries
        self.log = log
        self.retries = 0
        self.engines: dict[tuple[str, str], Engine] = {}

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

    def engine(self, key: tuple[str, str]) -> Engine:
        if key not in self.engines:
            self.log.info("teacher engine %s for %s", key[1], key[0])
            self.engines[key] = TEACHER_BACKENDS.get(key[1])(Path(key[0]), self.work_dir)
        return self.engines[key]

    def start(self) -> None:
        """Build every engine now, so a broken teacher fails before the first rollout."""
        for teacher in self.routes.values():
            self.engine(teacher.engine_key)

    def score(self, samples: list[Sample]) -> None:
        groups: dict[tuple[str, str], list[Sample]] = {}
        for sample in samples:
            groups.setdefault(self.teacher_for(sample).engine_key, []).append(sample)
        for key, group in groups.items():
            self._score_group(key, group)

    def _score_group(self, key: tuple[str, str], group: list[Sample]) -> None:
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

    def _drop(self, key: tuple[str, str]) -> None:
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
        bad = [t for t, m in enumerate(student_mask(sample)) if m and not math.isfinite(score[t])]
        if bad:
            raise TeacherScoreError(
                f"sample {sample.uid}: non-finite teacher log-probs at positions {bad[:8]}"
            )


# Episodes and what they measure --------------------------------------------------------------------


def student_mask(sample: Sample) -> list[int]:
    """1 on the tokens the student sampled (after the prompt; tool results are 0 in loss_mask)."""
    return [0] * sample.prompt_length + sample.loss_mask[sample.prompt_length :]


def act_on_turn(ended: int) -> bool:
    """Environment.play's should_pause: asked right after it acted on the turns generated outside
    it (and before it would generate), so the next turn of every domain is decoded in one batch."""
    return True


def play_episodes(
    envs: Mapping[str, Environment],
    student: Engine,
    samples: list[Sample],
    sampling: Mapping[str, SamplingConfig],
    on_finished: Callable[[list[Sample]], None],
) -> None:
    """Play every sample's episode to its end, turn by turn, all domains decoding together (at this
    size a decoding step costs the same for 6 rows or 36). Each domain's environment acts on the
    last turn (tools run in its sandboxes, results appended, the verifier at the end) and leaves
    the others "paused" before their next turn; `on_finished` gets the episodes that just ended.
    Samples may be fresh prompts or carry a turn not yet acted on (finish_reason set)."""
    going = list(samples)
    while going:
        for domain, env in envs.items():
            mine = [s for s in going if s.domain == domain]
            if mine:
                env.play(student, mine, sampling[domain], should_pause=act_on_turn)
        finished = [s for s in going if s.metrics.get(EPISODE_DONE)]
        if finished:
            on_finished(finished)
        going = [s for s in going if not s.metrics.get(EPISODE_DONE)]
        for config in dict.fromkeys(sampling[s.domain] for s in going):
            student.generate([s for s in going if sampling[s.domain] == config], config)


def pair_results(samples: list[Sample]) -> dict[str, dict[str, float]]:
    """Per pair: kl, the reverse KL to its teacher (token mean over the student's tokens of
    log p_student - log p_teacher); accuracy, the mean verifier reward (0 when unscored); tokens,
    the mean student-generated tokens per episode (tool results excluded)."""
    by_pair: dict[str, list[Sample]] = {}
    for sample in samples:
        by_pair.setdefault(pair_name((sample.domain, sample.effort)), []).append(sample)
    results = {}
    for name, group in by_pair.items():
        results[name] = {
            "kl": reverse_kl(
                torch.tensor([x for s in group for x in s.rollout_logprobs], dtype=torch.float64),
                torch.tensor([x for s in group for x in s.teacher_logprobs or []], dtype=torch.float64),
                torch.tensor([m for s in group for m in student_mask(s)], dtype=torch.bool),
            ),
            "accuracy": sum(s.reward or 0.0 for s in group) / len(group),
            "tokens": sum(s.num_generated for s in group) / len(group),
        }
    return results


def batch_metrics(samples: list[Sample], rewards: list[list[float]], r_max: float) -> dict[str, float]:
    """Reward and reverse KL of a training batch (overall, per pair), response length per effort."""
    deltas = [
        (r, s.teacher_logprobs[t] - s.rollout_logprobs[t])
        for s, row in zip(samples, rewards, strict=True)
        for t, (r, m) in enumerate(zip(row, student_mask(s), strict=True))
        if m
    ]
    n = max(len(deltas), 1)
    metrics = {
        "reward": sum(r for r, _ in deltas) / n,
        "reward_clipped_fraction": sum(abs(d) > r_max for _, d in deltas) / n,
        "kl": -sum(d for _, d in deltas) / n,
        "accuracy": sum(s.reward or 0.0 for s in samples) / len(samples),
        "student_tokens": float(len(deltas)),
    }
    metrics.update({f"kl/{name}": result["kl"] for name, result in pair_results(samples).items()})
    for effort in dict.fromkeys(s.effort for s in samples):
        group = [s for s in samples if s.effort == effort]
        metrics[f"response_length/{effort}"] = sum(s.num_generated for s in group) / len(group)
    return metrics


# Training -----------------------------------------------------------------------------------------


def distillation_loss(
    model: torch.nn.Module, samples: list[Sample], rewards: list[list[float]], loss: PolicyLossConfig
) -> PolicyLoss:
    """The per-token policy loss of one micro-batch with A_t = r_t (`rewards`, aligned with each
    sample's tokens), the student's recorded log-probs as behaviour, on student tokens only. Its
    stats also hold the train/rollout mismatch (posttrain.algos.mismatch_stats)."""
    device = next(model.parameters()).device
    ids, attention = left_pad([s.tokens for s in samples], 0)
    width = ids.shape[1]

    def padded(rows: list[list[float]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor([[0] * (width - len(r)) + list(r) for r in rows], dtype=dtype, device=device)

    logits = model(
        input_ids=ids.to(device),
        attention_mask=attention.to(device),
        position_ids=positions_from_mask(attention).to(device),
    ).logits.float()
    picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None].to(device)).squeeze(-1)
    logp = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
    mask = padded([student_mask(s) for s in samples], torch.bool)
    behaviour = padded([s.rollout_logprobs for s in samples])
    out = policy_loss(logp, behaviour, padded(rewards), mask, config=loss)
    out.stats.update(mismatch_stats(logp, behaviour, mask, loss.tis_cap))
    return out


def train_on(state: TrainState, samples: list[Sample], cfg: MOPDConfig, step: int) -> dict[str, float]:
    """One optimizer step over every trajectory of the step; the loss is the mean over all student
    tokens of the batch (micro-batch sums divided once by the batch's token count)."""
    rewards = [mopd_sample_rewards(s, cfg.r_max) for s in samples]
    loss_cfg = cfg.loss.model_copy(update={"reduction": "sum"})
    total = max(sum(sum(student_mask(s)) for s in samples), 1)
    sums: dict[str, float] = {"loss": 0.0}
    for start in range(0, len(samples), cfg.train.micro_batch_size):
        rows = samples[start : start + cfg.train.micro_batch_size]
        out = distillation_loss(state.model, rows, rewards[start : start + len(rows)], loss_cfg)
        state.check_finite(out.loss, step, detail=f" (trajectories {[s.uid for s in rows][:4]} ...)")
        state.backward(out.loss / total)
        sums["loss"] += float(out.loss.detach()) / total
        for key, value in out.stats.items():
            if key.endswith("_max"):
                sums[key] = max(sums.get(key, 0.0), value)
            elif key != "num_tokens":
                sums[key] = sums.get(key, 0.0) + value * float(out.num_tokens) / total
    return {**sums, **state.optimizer_step(step), **batch_metrics(samples, rewards, cfg.r_max)}


# The stage ----------------------------------------------------------------------------------------


class Distiller:
    """The student engine, the domains' environments, the teachers and the prompt streams."""

    def __init__(
        self,
        ctx: StageContext,
        cfg: MOPDConfig,
        model: torch.nn.Module,
        renderer: ChatRenderer,
        pool: TeacherPool,
    ) -> None:
        self.cfg, self.renderer, self.pool, self.seed = cfg, renderer, pool, ctx.seed
        self.student = EmbeddedEngine(model, pad_token_id=renderer.pad_id)
        sandboxes = ctx.stage_dir / "sandboxes"
        remove_tree(sandboxes)  # snapshots of an interrupted attempt: never resumed, episodes restart
        self.envs = {
            d: TEACHER_DOMAINS.get(d).environment(renderer, cfg.environment_of(d), sandbox_dir=sandboxes)
            for d in cfg.domains
        }
        self.eval_prompts = {
            d: e.prompts("eval", cfg.eval.prompts_per_domain, cfg.eval.seed) for d, e in self.envs.items()
        }
        count = cfg.train.steps * cfg.rollout.prompts_per_domain
        self.train_prompts = {
            d: env.prompts("train", count, ctx.seed, exclude=self.eval_prompts[d])
            for d, env in self.envs.items()
        }

    def episodes(self, prompts: Mapping[str, list[Sample]], tag: str) -> list[Sample]:
        """Fresh trajectories, each prompt at every effort; routed now, so an unrouted pair fails here."""
        samples = [
            self.envs[d].start(p, uid=f"{tag}-{d}-{e}-{i}", group=f"{tag}-{p.uid}", effort=e)
            for d, group in prompts.items()
            for i, p in enumerate(group)
            for e in self.cfg.efforts
        ]
        for sample in samples:
            self.pool.teacher_for(sample)
        return samples

    def step_prompts(self, step: int) -> dict[str, list[Sample]]:
        n = self.cfg.rollout.prompts_per_domain
        return {d: prompts[(step - 1) * n : step * n] for d, prompts in self.train_prompts.items()}

    def rollout(self, samples: list[Sample], temperature: float) -> dict[str, float]:
        """Play every episode; each is teacher-scored in the turn it ends. Returns timings."""
        started, scoring = time.perf_counter(), [0.0]

        def score(finished: list[Sample]) -> None:
            began = time.perf_counter()
            self.pool.score(finished)
            scoring[0] += time.perf_counter() - began

        sampling = {
            d: SamplingConfig(
                max_tokens=self.cfg.environment_of(d).max_tokens_per_turn,
                temperature=temperature,
                stop_token_ids=(self.renderer.end_of_turn_id,),
                tool_call_token_ids=(self.renderer.tool_calls_end_id,),
                seed=self.seed,
            )
            for d in self.cfg.domains
        }
        play_episodes(self.envs, self.student, samples, sampling, score)
        unscored = [s.uid for s in samples if s.teacher_logprobs is None]
        if unscored:
            raise TeacherScoreError(f"episodes {unscored} ended without a teacher score")
        return {"rollout_s": time.perf_counter() - started - scoring[0], "teacher_score_s": scoring[0]}

    def evaluate(self) -> dict[str, dict[str, float]]:
        """pair_results on the held-out prompts; the same uids (hence sampling noise) every time."""
        samples = self.episodes(self.eval_prompts, "eval")
        self.rollout(samples, temperature=1.0)
        return pair_results(samples)

    def close(self) -> None:
        for env in self.envs.values():
            env.close()


def student_dir(cfg: MOPDConfig, ctx: StageContext) -> Path:
    """The student's starting model: `student`; else the SFT model: the need "sft", or this run's
    sft stage (every rl-* teacher needs it, so a change to it reaches this stage through the
    teachers' hashes); else the stage's `model` when that is a need's dir."""
    if cfg.student:
        return resolve_model(cfg.student, ctx.inputs, "student")
    if "sft" in ctx.inputs:
        return Path(ctx.inputs["sft"])
    if (ctx.run_dir / "sft" / "model" / "config.json").is_file():
        return ctx.run_dir / "sft" / "model"
    if ctx.model is not None and Path(ctx.model).is_dir():
        return Path(ctx.model)
    raise TeacherRoutingError(
        f"stage {ctx.stage_id}: no student model; set `student:` to a need's stage id or a model dir, "
        "or add sft.yaml to `needs` (the default student is the SFT model)"
    )


@stage_kind("mopd", config=MOPDConfig)
def run_mopd(ctx: StageContext) -> dict[str, float]:
    """Multi-teacher on-policy distillation of the (domain, effort) specialists into one student."""
    cfg: MOPDConfig = ctx.config
    routes = route_teachers(cfg, ctx.inputs)
    start = student_dir(cfg, ctx)
    tokenizer = load_tokenizer(
        cfg.tokenizer or (start if (start / "tokenizer_config.json").is_file() else None)
    )
    renderer = ChatRenderer(tokenizer)
    policy = load_policy(ctx, len(tokenizer), model_path=start)
    state = TrainState.create(ctx, policy.model, cfg.train, cfg.accelerate, cfg.train.steps)
    pool = TeacherPool(routes, ctx.stage_dir, cfg.max_teacher_retries, ctx.log)
    ctx.log.info(
        "MOPD: student %s; teachers %s", start, {pair_name(p): str(t.model_dir) for p, t in routes.items()}
    )
    distiller = Distiller(ctx, cfg, base_without_peft(state.unwrapped), renderer, pool)
    try:
        pool.start()
        checkpoint = state.restore()
        if checkpoint is not None:
            step, before = checkpoint.step, checkpoint.extra["before"]
            pool.retries = int(checkpoint.extra["teacher_retries"])
        else:
            step, before = 0, distiller.evaluate()
            ctx.metrics.log(0, {f"eval/{k}_before/{p}": v[k] for p, v in before.items() for k in v})
        distiller.student.policy_version = step
        last: dict[str, float] = {}
        while step < cfg.train.steps:
            step += 1
            samples = distiller.episodes(distiller.step_prompts(step), f"step{step}")
            timings = distiller.rollout(samples, cfg.rollout.temperature)
            last = {**train_on(state, samples, cfg, step), **timings, "teacher_retries": float(pool.retries)}
            distiller.student.policy_version = step
            ctx.metrics.log(step, last)
            if step % cfg.checkpoint_every == 0 or step == cfg.train.steps:
                state.save_checkpoint(step, extra={"before": before, "teacher_retries": pool.retries})
            ctx.progress(step, cfg.train.steps, kl=last["kl"], reward=last["reward"])
        after = distiller.evaluate()
        ctx.metrics.log(step, {f"eval/{k}_after/{p}": v[k] for p, v in after.items() for k in v})
    finally:
        distiller.close()
        pool.close()
    report = write_eval(ctx.stage_dir / EVAL_FILE, before, after)
    save_final_model(state.unwrapped, tokenizer, ctx.output_dir, renderer.stop_token_ids)
    final = final_metrics(report, pool.retries, step)
    return {**final, "train_loss": last["loss"]} if "loss" in last else final


def write_eval(
    path: Path, before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
) -> dict:
    """DIR/mopd/eval.json: {"<domain>-<effort>": {kl_before, kl_after, accuracy_before,
    accuracy_after, tokens_before, tokens_after}}."""
    report = {
        name: {
            f"{key}_{when}": float(values[name][key])
            for key in RESULT_KEYS
            for when, values in (("before", before), ("after", after))
        }
        for name in before
    }
    atomic_write_text(path, json.dumps(report, indent=1, sort_keys=True) + "\n")
    return report


def final_metrics(report: Mapping[str, Mapping[str, float]], retries: int, steps: int) -> dict[str, float]:
    """Means over pairs, how many pairs moved closer to their teacher, retries and steps."""
    final = {k: sum(r[k] for r in report.values()) / len(report) for k in next(iter(report.values()))}
    final["pairs_kl_improved"] = float(sum(r["kl_after"] < r["kl_before"] for r in report.values()))
    return {**final, "teacher_retries": float(retries), "steps": float(steps)}
