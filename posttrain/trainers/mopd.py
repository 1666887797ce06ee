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
- the episode loop over every domain at once, the training step, the before/after evaluation
  written to DIR/mopd/eval.json.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from posttrain.algos.policy_loss import PolicyLossConfig, policy_loss
from posttrain.checkpoint import atomic_write_text
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


def pair_name(pair: Pair) -> str:
    """"coding-max": the key of a (domain, effort) pair in stage files, eval.json and metrics."""
    return f"{pair[0]}-{pair[1]}"


# Teacher domains ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TeacherDomain:
    """A domain MOPD distils: its environment class (prompt recipe, tools, verifier; see
    posttrain.envs.environments) and its teacher per effort, each a need's stage id or a model dir."""

    name: str
    environment: type[Environment]
    teachers: Mapping[str, str]


TEACHER_DOMAINS: Registry[TeacherDomain] = Registry("teacher domain")
# name -> build(model_dir, work_dir) -> Engine; the shipped backends live in teachers/backends.py.
TeacherBackend = Callable[[Path, Path], Engine]
TEACHER_BACKENDS: Registry[TeacherBackend] = Registry("teacher backend")


def teacher_domain(
    name: str | None = None, *, teachers: Mapping[str, str] | None = None
) -> Callable[[type[Environment]], type[Environment]]:
    """Class decorator registering an Environment subclass as the teacher domain `name` (default:
    its `domain`). teachers: effort -> need stage id or model dir; default rl-<name>-<effort> for
    every effort, the RL specialists' stage ids."""

    def register(environment: type[Environment]) -> type[Environment]:
        domain = name or environment.domain
        if environment.domain != domain:
            raise ValueError(
                f"teacher domain {domain!r}: {environment.__name__}.domain is {environment.domain!r}; "
                "the prompts it makes carry that domain, so the two names must be equal"
            )
        chosen = dict(teachers) if teachers is not None else {e: f"rl-{domain}-{e}" for e in EFFORTS}
        unknown = sorted(set(chosen) - set(EFFORTS))
        if unknown:
            raise ValueError(f"teacher domain {domain!r}: unknown efforts {unknown}; use {list(EFFORTS)}")
        TEACHER_DOMAINS.register(domain)(TeacherDomain(domain, environment, chosen))
        return environment

    return register


# Configuration ----------------------------------------------------------------------------------


class TeacherConfig(BaseModel):
    """One (domain, effort) teacher declared in the stage file, over the domain's default."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="a need's stage id or a model dir; null: the domain's teacher")
    engine: str | None = Field(None, description="teacher backend (embedded, vllm, vllm_server); null: teacher_engine")


class RolloutConfig(BaseModel):
    """What the student samples each step: every domain's prompts at every effort."""

    model_config = ConfigDict(extra="forbid")
    prompts_per_domain: int = Field(2, gt=0, description="prompts per domain per step, each played at every effort")
    temperature: float = Field(1.0, gt=0, description="student sampling temperature (log-probs stay at T=1)")


class MOPDTrainConfig(OptimConfig):
    """Optimisation: one policy-gradient step per batch of episodes."""

    steps: int = Field(gt=0, description="optimizer steps (one rollout batch each)")
    micro_batch_size: int = Field(16, gt=0, description="trajectories per forward/backward")


class EvalConfig(BaseModel):
    """Held-out prompts of each domain, played at every effort before and after training."""

    model_config = ConfigDict(extra="forbid")
    prompts_per_domain: int = Field(4, gt=0, description="held-out prompts per domain")
    seed: int | None = Field(None, description="prompt and sampling seed; null: the stage's seed")


class MOPDConfig(BaseModel):
    """Keys of a `mopd` stage file besides the generic ones (docs/mopd.md)."""

    model_config = ConfigDict(extra="forbid")
    domains: list[str] = Field(default_factory=lambda: ["general", "agent", "coding"])
    efforts: list[str] = Field(default_factory=lambda: list(EFFORTS))
    teachers: dict[str, TeacherConfig] = Field(
        default_factory=dict, description="'<domain>-<effort>' -> teacher; unlisted pairs use the domain's"
    )
    teacher_engine: str = Field("embedded", description="default teacher backend")
    max_teacher_retries: int = Field(2, ge=0, description="engine rebuilds per scoring call before failing")
    student: str | None = Field(None, description="a need's stage id or model dir; null: the SFT model")
    tokenizer: str | None = Field(None, description="tokenizer dir; null: the student's")
    r_max: float = Field(5.0, gt=0, description="clip bound R_max of the per-token reward")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    environments: dict[str, EnvironmentConfig] = Field(
        default_factory=dict, description="per-domain environment settings over `environment`"
    )
    loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    train: MOPDTrainConfig
    accelerate: AccelerateConfig = Field(default_factory=AccelerateConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint_every: int = Field(5, gt=0, description="optimizer steps between checkpoints")

    @model_validator(mode="after")
    def _every_pair_has_a_teacher(self) -> MOPDConfig:
        for effort in self.efforts:
            if effort not in EFFORTS:
                raise ValueError(f"efforts: unknown effort {effort!r}; use {list(EFFORTS)}")
        for domain in self.domains:
            if domain not in TEACHER_DOMAINS:
                raise ValueError(
                    f"domains: {domain!r} is not a registered teacher domain "
                    f"(registered: {', '.join(TEACHER_DOMAINS)}); register it with "
                    "@teacher_domain in a plug-in listed under `plugins:`"
                )
        pairs = {pair_name((d, e)): (d, e) for d in self.domains for e in self.efforts}
        for key in self.teachers:
            if key not in pairs:
                raise ValueError(
                    f"teachers.{key}: not a trained (domain, effort) pair; keys are '<domain>-<effort>' "
                    f"with domain in {self.domains} and effort in {self.efforts}"
                )
        for key, (domain, effort) in pairs.items():
            declared = self.teachers.get(key)
            if (declared is None or declared.model is None) and effort not in TEACHER_DOMAINS.get(domain).teachers:
                raise ValueError(
                    f"no teacher for (domain {domain!r}, effort {effort!r}): the domain registers teachers for "
                    f"{sorted(TEACHER_DOMAINS.get(domain).teachers)}; add `teachers: {{{key}: {{model: <need "
                    f"stage id or model dir>}}}}` or remove {effort!r} from `efforts`"
                )
        for engine in {self.teacher_engine, *(t.engine for t in self.teachers.values() if t.engine)}:
            if engine not in TEACHER_BACKENDS:
                raise ValueError(f"unknown teacher backend {engine!r} (registered: {', '.join(TEACHER_BACKENDS)})")
        for name, env in {"environment": self.environment, **self.environments}.items():
            if env.reward != "verifier":
                raise ValueError(f"{name}.reward: MOPD's accuracy uses the verifier; set reward: verifier")
        unknown = sorted(set(self.environments) - set(self.domains))
        if unknown:
            raise ValueError(f"environments: {unknown} are not in `domains` {self.domains}")
        return self

    def environment_of(self, domain: str) -> EnvironmentConfig:
        return self.environments.get(domain, self.environment)


# Routing ----------------------------------------------------------------------------------------


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
    """A need's stage id -> its model dir; otherwise `ref` must be a checkpoint dir."""
    if ref in inputs:
        return Path(inputs[ref])
    path = Path(ref).expanduser()
    if (path / "config.json").is_file():
        return path.resolve()
    needs = ", ".join(sorted(inputs)) or "none"
    raise TeacherRoutingError(
        f"{what}: {ref!r} is neither a need of this stage (needs: {needs}) nor a model directory "
        "with config.json; add the stage that trains it to `needs` or give a checkpoint path"
    )


def route_teachers(cfg: MOPDConfig, inputs: Mapping[str, Path]) -> dict[Pair, Teacher]:
    """Every trained (domain, effort) -> its Teacher, resolved against the stage's needs."""
    routes = {}
    for domain in cfg.domains:
        defaults = TEACHER_DOMAINS.get(domain).teachers
        for effort in cfg.efforts:
            declared = cfg.teachers.get(pair_name((domain, effort))) or TeacherConfig()
            ref = declared.model or defaults[effort]
            path = resolve_model(ref, inputs, f"teacher of (domain {domain!r}, effort {effort!r})")
            routes[(domain, effort)] = Teacher(domain, effort, path, declared.engine or cfg.teacher_engine)
    return routes


# Teacher engines ----------------------------------------------------------------------------------


class TeacherScoreError(RuntimeError):
    """A teacher engine kept failing after its rebuilds; the stage stops rather than train unscored."""


class TeacherPool:
    """The routed teachers' engines: built once per distinct (checkpoint, backend), scoring with
    restart-and-rescore on failure.

    score(samples) sets sample.teacher_logprobs for each sample via its (domain, effort) teacher.
    retries counts engine rebuilds here plus restarts a backend did by itself (a vLLM server
    engine restarts a dead server before it gives up).
    """

    def __init__(self, routes: Mapping[Pair, Teacher], work_dir: Path, max_retries: int, log: Any) -> None:
        self.routes = dict(routes)
        self.work_dir = work_dir
        self.max_retries = max_retries
        self.log = log
        self.retries = 0
        self._engines: dict[tuple[str, str], Engine] = {}

    def teacher_for(self, sample: Sample) -> Teacher:
        teacher = self.routes.get((sample.domain, sample.effort))
        if teacher is None:
            routed = ", ".join(pair_name(p) for p in self.routes)
            raise TeacherRoutingError(
                f"sample {sample.uid}: (domain {sample.domain!r}, effort {sample.effort!r}) has no teacher "
                f"(routed: {routed}); add the domain to `domains` and the effort to `efforts`, or declare "
                f"`teachers: {{{pair_name((sample.domain, sample.effort))}: {{model: ...}}}}`"
            )
        return teacher

    def engine(self, key: tuple[str, str]) -> Engine:
        if key not in self._engines:
            model_dir, backend = key
            self.log.info("teacher engine %s for %s", backend, model_dir)
            self._engines[key] = TEACHER_BACKENDS.get(backend)(Path(model_dir), self.work_dir)
        return self._engines[key]

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
                _check_scores(group, scores)
            except (ValueError, TypeError):
                raise  # a bad request, not a dead engine: rebuilding would not help
            except Exception as error:
                if attempt == self.max_retries:
                    uids = [s.uid for s in group]
                    raise TeacherScoreError(
                        f"teacher {key[1]} {key[0]} failed {attempt + 1} times scoring {uids} ({error}); "
                        "no trajectory is trained without a teacher score"
                    ) from error
                self.retries += 1
                self.log.warning("teacher %s failed (%s); rebuilding it and re-scoring %d trajectories",
                                 key[0], error, len(group))
                self._drop(key)
                continue
            self.retries += getattr(engine, "restarts", 0) - restarts
            for sample, score in zip(group, scores, strict=True):
                sample.teacher_logprobs = [float(x) for x in score]
            return

    def _drop(self, key: tuple[str, str]) -> None:
        engine = self._engines.pop(key, None)
        if engine is not None:
            try:
                engine.close()
            except Exception as error:  # a dead engine may fail to close; it is dropped either way
                self.log.warning("closing failed teacher engine %s: %s", key[0], error)

    def close(self) -> None:
        for key in list(self._engines):
            self._drop(key)


class TeacherOutputError(RuntimeError):
    """A teacher returned scores that do not fit the trajectory (a failing engine)."""


def _check_scores(samples: list[Sample], scores: list[list[float]]) -> None:
    if len(scores) != len(samples):
        raise TeacherOutputError(f"teacher returned {len(scores)} score rows for {len(samples)} samples")
    for sample, score in zip(samples, scores, strict=True):
        if len(score) != len(sample.tokens):
            raise TeacherOutputError(f"sample {sample.uid}: {len(score)} teacher log-probs, {len(sample.tokens)} tokens")
        bad = [t for t in range(sample.prompt_length, len(score)) if sample.loss_mask[t] and not math.isfinite(score[t])]
        if bad:
            raise TeacherOutputError(f"sample {sample.uid}: non-finite teacher log-probs at positions {bad[:8]}")


# Episodes -----------------------------------------------------------------------------------------


def act_on_turn(ended: int) -> bool:
    """Environment.play's should_pause, asked right after it acted on a turn generated outside it:
    stop before generating, so every domain's next turn is decoded in one batch here."""
    return True


def play_episodes(
    envs: Mapping[str, Environment],
    student: Engine,
    samples: list[Sample],
    sampling: Mapping[str, SamplingConfig],
    on_finished: Callable[[list[Sample]], None],
) -> None:
    """Play every sample's episode to its end, turn by turn, all domains decoding together (decode
    cost at this size is per step, not per row). Each domain's environment acts on the turn (tools,
    tool results appended, verifier at the end); `on_finished` gets the episodes that just ended."""
    going = list(samples)
    while going:
        for config in dict.fromkeys(sampling[s.domain] for s in going):
            student.generate([s for s in going if sampling[s.domain] == config], config)
        for domain, env in envs.items():
            mine = [s for s in going if s.domain == domain]
            if mine:
                env.play(student, mine, sampling[domain], should_pause=act_on_turn)
        finished = [s for s in going if s.metrics.get(EPISODE_DONE)]
        if finished:
            on_finished(finished)
        going = [s for s in going if not s.metrics.get(EPISODE_DONE)]


def student_mask(sample: Sample) -> list[int]:
    """1 on the tokens the student sampled (after the prompt, not tool results)."""
    return [0] * sample.prompt_length + sample.loss_mask[sample.prompt_length :]


def pair_results(samples: list[Sample]) -> dict[str, dict[str, float]]:
    """Per pair: reverse KL to its teacher (token mean over student tokens), accuracy (verifier
    reward, 0 when unscored) and mean student tokens per episode."""
    by_pair: dict[str, list[Sample]] = {}
    for sample in samples:
        by_pair.setdefault(pair_name((sample.domain, sample.effort)), []).append(sample)
    results = {}
    for name, group in by_pair.items():
        student = torch.tensor([lp for s in group for lp in s.rollout_logprobs], dtype=torch.float64)
        teacher = torch.tensor([lp for s in group for lp in s.teacher_logprobs or []], dtype=torch.float64)
        mask = torch.tensor([m for s in group for m in student_mask(s)], dtype=torch.bool)
        results[name] = {
            "kl": reverse_kl(student, teacher, mask),
            "accuracy": sum(s.reward or 0.0 for s in group) / len(group),
            "tokens": sum(s.num_generated for s in group) / len(group),
        }
    return results


# The stage ----------------------------------------------------------------------------------------


class Distiller:
    """The student, its environments, its teachers and the prompt streams of one MOPD stage."""

    def __init__(self, ctx: StageContext, cfg: MOPDConfig, state: TrainState, renderer: ChatRenderer,
                 pool: TeacherPool) -> None:
        self.ctx, self.cfg, self.state, self.renderer, self.pool = ctx, cfg, state, renderer, pool
        self.student = EmbeddedEngine(base_without_peft(state.unwrapped), pad_token_id=renderer.pad_id)
        self.envs = {
            d: TEACHER_DOMAINS.get(d).environment(renderer, cfg.environment_of(d), sandbox_dir=ctx.stage_dir / "sandboxes")
            for d in cfg.domains
        }
        self.eval_seed = ctx.seed if cfg.eval.seed is None else cfg.eval.seed
        self.eval_prompts = {
            d: env.prompts("eval", cfg.eval.prompts_per_domain, self.eval_seed) for d, env in self.envs.items()
        }
        count = cfg.train.steps * cfg.rollout.prompts_per_domain
        self.train_prompts = {
            d: env.prompts("train", count, ctx.seed, exclude=self.eval_prompts[d]) for d, env in self.envs.items()
        }

    def sampling(self, temperature: float) -> dict[str, SamplingConfig]:
        return {
            d: SamplingConfig(
                max_tokens=self.cfg.environment_of(d).max_tokens_per_turn,
                temperature=temperature,
                stop_token_ids=(self.renderer.end_of_turn_id,),
                tool_call_token_ids=(self.renderer.tool_calls_end_id,),
                seed=self.ctx.seed,
                logprobs="raw",
            )
            for d in self.cfg.domains
        }

    def episodes(self, prompts: Mapping[str, list[Sample]], tag: str) -> list[Sample]:
        """Fresh trajectories: each prompt at every effort, routed (a pair without teacher fails here)."""
        samples = [
            self.envs[d].start(p, uid=f"{tag}-{d}-{e}-{i}", group=f"{tag}-{p.uid}", effort=e)
            for d, group in prompts.items()
            for i, p in enumerate(group)
            for e in self.cfg.efforts
        ]
        for sample in samples:
            self.pool.teacher_for(sample)
        return samples

    def rollout(self, samples: list[Sample], temperature: float) -> dict[str, float]:
        """Play and teacher-score every sample; returns timings."""
        started = time.perf_counter()
        scoring = [0.0]

        def score(finished: list[Sample]) -> None:
            began = time.perf_counter()
            self.pool.score(finished)
            scoring[0] += time.perf_counter() - began

        play_episodes(self.envs, self.student, samples, self.sampling(temperature), score)
        unscored = [s.uid for s in samples if s.teacher_logprobs is None]
        if unscored:
            raise TeacherScoreError(f"episodes {unscored} ended without a teacher score")
        return {"rollout_s": time.perf_counter() - started - scoring[0], "teacher_score_s": scoring[0]}

    def evaluate(self) -> dict[str, dict[str, float]]:
        samples = self.episodes(self.eval_prompts, "eval")
        self.rollout(samples, temperature=1.0)
        return pair_results(samples)

    def step_prompts(self, step: int) -> dict[str, list[Sample]]:
        n = self.cfg.rollout.prompts_per_domain
        return {d: pool[(step - 1) * n : step * n] for d, pool in self.train_prompts.items()}

    def close(self) -> None:
        for env in self.envs.values():
            env.close()


def train_on(state: TrainState, samples: list[Sample], cfg: MOPDConfig, step: int) -> dict[str, float]:
    """One optimizer step of the per-token policy loss with A_t = r_t over every trajectory; the
    loss is the mean over all student tokens of the batch (micro-batches summed, divided once)."""
    rewards = [mopd_sample_rewards(s, cfg.r_max) for s in samples]
    loss_cfg = cfg.loss.model_copy(update={"reduction": "sum"})
    total = max(sum(sum(student_mask(s)) for s in samples), 1)
    device = state.accelerator.device
    sums: dict[str, float] = {}
    size = cfg.train.micro_batch_size
    for start in range(0, len(samples), size):
        rows, row_rewards = samples[start : start + size], rewards[start : start + size]
        ids, attention = left_pad([s.tokens for s in rows], 0)
        width = ids.shape[1]

        def padded(values: list[list[float]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor([[0] * (width - len(v)) + list(v) for v in values], dtype=dtype)

        mask = padded([student_mask(s) for s in rows], torch.bool)
        logits = state.model(
            input_ids=ids.to(device), attention_mask=attention.to(device),
            position_ids=positions_from_mask(attention).to(device),
        ).logits.float()
        picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None].to(device)).squeeze(-1)
        logp = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
        out = policy_loss(
            logp, padded([s.rollout_logprobs for s in rows]).to(device), padded(row_rewards).to(device),
            mask.to(device), config=loss_cfg,
        )
        state.check_finite(out.loss, step, detail=f" (trajectories {[s.uid for s in rows]})")
        state.backward(out.loss / total)
        for key, value in out.stats.items():
            sums[key] = sums.get(key, 0.0) + value * out.stats["num_tokens"]
        sums["loss"] = sums.get("loss", 0.0) + float(out.loss.detach())
    metrics = {key: value / total for key, value in sums.items() if key != "num_tokens"}
    metrics.update(state.optimizer_step(step))
    metrics.update(batch_metrics(samples, rewards, cfg.r_max))
    return metrics


def batch_metrics(samples: list[Sample], rewards: list[list[float]], r_max: float) -> dict[str, float]:
    """Reward, reverse KL and response length of a batch, overall and per effort / pair."""
    metrics: dict[str, float] = {"num_tokens": float(sum(sum(student_mask(s)) for s in samples))}
    deltas = [
        (r, s.teacher_logprobs[t] - s.rollout_logprobs[t])
        for s, row in zip(samples, rewards, strict=True)
        for t, (r, m) in enumerate(zip(row, student_mask(s), strict=True))
        if m
    ]
    if deltas:
        metrics["reward"] = sum(r for r, _ in deltas) / len(deltas)
        metrics["reward_clipped_fraction"] = sum(abs(d) > r_max for _, d in deltas) / len(deltas)
    for name, result in pair_results(samples).items():
        metrics[f"kl/{name}"] = result["kl"]
    metrics["kl"] = -sum(d for _, d in deltas) / max(len(deltas), 1)
    for effort in dict.fromkeys(s.effort for s in samples):
        group = [s for s in samples if s.effort == effort]
        metrics[f"response_length/{effort}"] = sum(s.num_generated for s in group) / len(group)
    metrics["accuracy"] = sum(s.reward or 0.0 for s in samples) / max(len(samples), 1)
    return metrics


def student_dir(cfg: MOPDConfig, ctx: StageContext) -> Path:
    """The student's starting model: `student`, else the SFT model (a need "sft", else the SFT stage
    of this run dir, which every rl-* teacher needs, so a change to it reaches this stage through
    the teachers' hashes), else the stage's `model` when it is a need's dir."""
    if cfg.student:
        return resolve_model(cfg.student, ctx.inputs, "student")
    if "sft" in ctx.inputs:
        return Path(ctx.inputs["sft"])
    upstream = ctx.run_dir / "sft" / "model"
    if (upstream / "config.json").is_file():
        return upstream
    if ctx.model is not None and Path(ctx.model).is_dir():
        return Path(ctx.model)
    raise TeacherRoutingError(
        f"stage {ctx.stage_id}: no student model: set `student:` to a need's stage id or a model dir, "
        "or add sft.yaml to `needs` (the default student is the SFT model)"
    )


@stage_kind("mopd", config=MOPDConfig)
def run_mopd(ctx: StageContext) -> dict[str, float]:
    """Multi-teacher on-policy distillation of the (domain, effort) specialists into one student."""
    cfg: MOPDConfig = ctx.config
    routes = route_teachers(cfg, ctx.inputs)
    start_from = student_dir(cfg, ctx)
    tokenizer = load_tokenizer(cfg.tokenizer or start_from)
    renderer = ChatRenderer(tokenizer)
    policy = load_policy(ctx, len(tokenizer), model_path=start_from)
    state = TrainState.create(ctx, policy.model, cfg.train, cfg.accelerate, cfg.train.steps)
    pool = TeacherPool(routes, ctx.stage_dir, cfg.max_teacher_retries, ctx.log)
    ctx.log.info("MOPD: student %s; teachers %s", start_from,
                 {pair_name(p): f"{t.engine}:{t.model_dir}" for p, t in routes.items()})
    distiller = Distiller(ctx, cfg, state, renderer, pool)
    try:
        pool.start()
        checkpoint = state.restore()
        if checkpoint is not None:
            step, before = checkpoint.step, checkpoint.extra["before"]
            pool.retries = int(checkpoint.extra["teacher_retries"])
        else:
            step, before = 0, distiller.evaluate()
            ctx.metrics.log(0, {f"eval/{k}/{p}_before": v[k] for p, v in before.items() for k in v})
        last: dict[str, float] = {}
        while step < cfg.train.steps:
            step += 1
            samples = distiller.episodes(distiller.step_prompts(step), f"step{step}")
            timings = distiller.rollout(samples, cfg.rollout.temperature)
            last = {**train_on(state, samples, cfg, step), **timings, "teacher_retries": float(pool.retries)}
            ctx.metrics.log(step, last)
            if step % cfg.checkpoint_every == 0 or step == cfg.train.steps:
                state.save_checkpoint(step, extra={"before": before, "teacher_retries": pool.retries})
            ctx.progress(step, cfg.train.steps, kl=last["kl"], reward=last.get("reward", 0.0))
        after = distiller.evaluate()
        ctx.metrics.log(step, {f"eval/{k}/{p}_after": v[k] for p, v in after.items() for k in v})
    finally:
        distiller.close()
        pool.close()
    report = write_eval(ctx.stage_dir / EVAL_FILE, before, after)
    save_final_model(state.unwrapped, tokenizer, ctx.output_dir, renderer.stop_token_ids)
    return final_metrics(report, last, pool.retries, step)


def write_eval(path: Path, before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]) -> dict:
    """DIR/mopd/eval.json: {"<domain>-<effort>": {kl_before, kl_after, accuracy_before,
    accuracy_after, tokens_before, tokens_after}}."""
    report = {
        name: {f"{key}_{when}": float(values[name][key]) for key in ("kl", "accuracy", "tokens")
               for when, values in (("before", before), ("after", after))}
        for name in before
    }
    atomic_write_text(path, json.dumps(report, indent=1, sort_keys=True) + "\n")
    return report


def final_metrics(report: dict, last: Mapping[str, float], retries: int, steps: int) -> dict[str, float]:
    """Means over pairs, how many pairs moved closer to their teacher, and the last step's loss."""
    n = max(len(report), 1)
    final = {f"{key}_{when}": sum(r[f"{key}_{when}"] for r in report.values()) / n
             for key in ("kl", "accuracy", "tokens") for when in ("before", "after")}
    final["pairs_kl_improved"] = float(sum(r["kl_after"] < r["kl_before"] for r in report.values()))
    final["teacher_retries"] = float(retries)
    final["steps"] = float(steps)
    if "loss" in last:
        final["train_loss"] = last["loss"]
    return final
