"""The `mopd` stage kind: multi-teacher on-policy distillation, K3's last stage (docs/k3.md section 2).

The nine RL specialists are merged into one student in policy space, not by averaging weights: the
student samples its own episodes with the reasoning effort as conditioning, the teacher of each
prompt's (domain, effort) prefills the student's trajectory, and every student-sampled token gets
r_t = clip(log p_teacher(y_t) - log p_student(y_t), -R_max, R_max), trained with the RL stage's
per-token policy loss on the rewards' discounted return. It is dense, on-policy reverse KL: the
student learns where it samples.

Which teacher scores which trajectory (teacher domains, routing, the pool of teacher engines that
survives a dying engine) is posttrain.trainers.mopd_teachers; what the evaluation measures is
posttrain.trainers.mopd_eval. Here, in reading order: the stage's config, the per-token rewards
(posttrain.algos.mopd_reward) and their advantages, the training step (the policy step RL uses,
posttrain.trainers.policy_step), and the stage: every domain's episodes played at once by the
episode loop (posttrain.envs.environments.play_episodes; finished episodes are scored by their
teachers between turns, batched) and the before/after evaluation (DIR/mopd/eval.json). The
student starts from the `student` need, the SFT model by default.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from posttrain.algos.advantages import group_balance_weights, returns_to_go, subtract_group_mean
from posttrain.algos.mopd_reward import NonFiniteLogprobError, exact_reverse_kl, mopd_token_rewards
from posttrain.algos.policy_loss import PolicyLossConfig
from posttrain.config.stage_file import NEEDS_CONTEXT, SEED_CONTEXT, check_model_reference, error_at_key
from posttrain.data.batch import left_pad_values
from posttrain.data.chat import ChatRenderer, TokenizerDir, load_tokenizer, model_tokenizer_dir
from posttrain.data.sample import Sample
from posttrain.engines import EmbeddedEngine
from posttrain.envs.env_eval import eval_episodes, eval_protocol
from posttrain.envs.environments import (
    Environment,
    EnvironmentConfig,
    PromptCountError,
    PromptSource,
    draw_in_turn,
    play_episodes,
)
from posttrain.files import remove_tree
from posttrain.rewards.budget import model_digest
from posttrain.stages import EVAL_FILE, StageContext, stage_kind
from posttrain.trainers.common import (
    AccelerateConfig,
    LoRAConfig,
    OptimConfig,
    TrainState,
    base_without_peft,
    engine_autocast,
    load_policy,
    merged_model,
    renderer_for,
    save_final_model,
)
from posttrain.trainers.mopd_eval import (
    accuracy_rows,
    by_pair,
    episode_table,
    exact_results,
    final_metrics,
    pair_results,
    played_before,
    row_results,
    taken_rows,
    write_eval,
)
from posttrain.trainers.mopd_teachers import (
    TEACHER_DOMAINS,
    TeacherPool,
    TeacherRoutingConfig,
    TeacherScoreError,
    check_teacher_tokenizers,
    pair_name,
    resolve_model,
    route_teachers,
    teacher_reference,
)
from posttrain.trainers.policy_step import policy_step

# Per-step rates whose medians the stage returns (bench/RESULTS.md reports them for GPU runs).
THROUGHPUT = ("rollout_tokens_per_s", "teacher_tokens_per_s", "train_tokens_per_s")
# The keys whose values set each domain's prompt counts: held out, the larger of the two (the KL's
# prompts are the first of the accuracy ones); for training, their product.
HELD_OUT_COUNT_KEYS = ("eval.prompts_per_domain", "eval.accuracy_prompts_per_domain")
TRAIN_COUNT_KEYS = ("train.steps", "rollout.prompts_per_domain")


class RolloutConfig(BaseModel):
    """What the student samples each step: prompts of every domain, each at every effort."""

    model_config = ConfigDict(extra="forbid")
    prompts_per_domain: int = Field(2, gt=0, description="new prompts per domain per step")
    temperature: float = Field(1.0, gt=0, description="student sampling temperature (log-probs stay at T=1)")


class MOPDTrainConfig(OptimConfig):
    """One optimizer step of the policy loss per batch of episodes."""

    steps: int = Field(gt=0, description="optimizer steps (one rollout batch each)")
    micro_batch_size: int = Field(16, gt=0, description="trajectories per forward/backward")
    balance: Literal["pair", "token"] = Field(
        "pair",
        description="pair: each (domain, effort) pair of a step carries the same share of the loss "
        "(the mean over its student tokens), so short general episodes are not outweighed by long "
        "agent ones; token: the mean over all student tokens of the step",
    )


class EvalConfig(BaseModel):
    """Held-out prompts of each domain, played at every effort before and after (sampled at
    temperature 1 for the KL; for accuracy and length, as the RL stages' evaluation plays them)."""

    model_config = ConfigDict(extra="forbid")
    prompts_per_domain: int = Field(4, gt=0, description="held-out prompts per domain for the KL")
    accuracy_prompts_per_domain: int = Field(
        96,
        gt=0,
        description="held-out prompts per domain played once at every effort for accuracy and "
        "length (the first prompts_per_domain are the KL's; the RL stages' first held-out prompts)",
    )
    accuracy_temperature: float = Field(
        0.0,
        ge=0,
        description="their sampling temperature, 0 greedy: the RL stages' eval.temperature, so the "
        "student's accuracy compares with its teachers' (the same uids and seed draw the same noise)",
    )
    samples_per_prompt: int = Field(
        4,
        gt=0,
        description="sampled episodes per held-out prompt and effort for the KL. Its error is over "
        "prompts (one prompt's copies share its context), so copies shrink only the noise within a "
        "prompt; more prompts at one copy each shrink the rest for the same episodes",
    )
    seed: int = Field(0, description="draws them; the RL stages' held-out prompts use the same default")
    reuse_before: bool = Field(
        True,
        description="before training, take a pair's accuracy episodes from a need's eval.json that played "
        "the same ones (an RL stage's before-evaluation: the same student weights, engine, harness and "
        "rendered prompts) instead of replaying them; false: always play them",
    )


class MOPDConfig(TeacherRoutingConfig):
    """Keys of a `mopd` stage file besides the generic ones (docs/mopd.md): the teacher routing
    keys (posttrain.trainers.mopd_teachers) and the student's."""

    model_config = ConfigDict(extra="forbid")
    # before `student`, whose check compares it with the teachers' tokenizers
    tokenizer: TokenizerDir = Field(None, description="tokenizer dir; null: the student's")
    student: str = Field(
        "sft",
        validate_default=True,
        description="a need's stage id or a model dir: the model the student starts from",
    )
    r_max: float = Field(5.0, gt=0, description="clip bound R_max of the per-token reward")
    discount: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="A_t = sum over later student tokens k of discount^(k-t) r_k; 0: A_t = r_t",
    )
    baseline: Literal["none", "pair_mean"] = Field(
        "none",
        description="pair_mean: subtract from each A_t the mean A over its (domain, effort) pair's "
        "student tokens of the step (a control variate: same expected gradient, less noise)",
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    environments: dict[str, EnvironmentConfig] = Field(
        default_factory=dict, description="domain -> environment settings (turns, tokens, harness)"
    )
    loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    lora: LoRAConfig | None = Field(
        None,
        description="train low-rank adapters (merged into the final model) instead of every weight; "
        "the routed experts, not nn.Linear, stay frozen",
    )
    train: MOPDTrainConfig
    accelerate: AccelerateConfig = Field(default_factory=AccelerateConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint_every: int = Field(5, gt=0, description="optimizer steps between checkpoints")

    @field_validator("student")
    @classmethod
    def _student_is_a_need_or_a_model(cls, student: str, info: ValidationInfo) -> str:
        check_model_reference(student, info, "student")
        needs = (info.context or {}).get(NEEDS_CONTEXT)
        if needs is None or not {"domains", "efforts", "teachers", "tokenizer"} <= set(info.data):
            return student  # re-validated in the stage (checked at its start) or their own errors
        tokenizer = info.data["tokenizer"]
        if tokenizer is None and student in needs:
            return student  # the need's tokenizer exists once it ran: checked at the stage's start
        teachers = {
            (domain, effort): Path(reference).expanduser()
            for domain in info.data["domains"]
            for effort in info.data["efforts"]
            if (reference := teacher_reference(domain, effort, info.data["teachers"])) not in needs
        }
        if teachers:  # directories named in the stage file: refused by `plan`, not hours later
            source = Path(tokenizer) if tokenizer else model_tokenizer_dir(Path(student).expanduser())
            check_teacher_tokenizers(load_tokenizer(source), source, teachers)
        return student

    @field_validator("environments")
    @classmethod
    def _trained_domains(cls, environments: dict[str, EnvironmentConfig], info: ValidationInfo) -> dict:
        unknown = sorted(set(environments) - set(info.data.get("domains") or []))
        if unknown:
            raise ValueError(f"{unknown} are not in `domains`")
        if any(env.reward != "verifier" for env in environments.values()):
            raise ValueError("MOPD measures accuracy with each domain's verifier; set reward: verifier")
        for domain, env in environments.items():  # domains were checked registered before
            TEACHER_DOMAINS.get(domain).environment.check_config(env)
        return environments

    @model_validator(mode="after")
    def _enough_prompts(self, info: ValidationInfo) -> MOPDConfig:
        # The stage's own draws, when the stage file is read: a count the domains' families cannot
        # meet was refused only at the stage's start, after the specialists had run.
        seed = (info.context or {}).get(SEED_CONTEXT)
        if seed is None:
            return self
        sources = {
            d: TEACHER_DOMAINS.get(d).environment.prompt_source(self.environment_of(d)) for d in self.domains
        }
        try:
            draw_prompts({d: s for d, s in sources.items() if s is not None}, self, seed)
        except PromptCountError as error:
            if error.split == "train":
                keys = TRAIN_COUNT_KEYS
            else:  # the one of the two that asked for more than the families hold, or both
                asked = dict(zip(HELD_OUT_COUNT_KEYS, self.held_out_counts(), strict=True))
                keys = tuple(key for key, count in asked.items() if count > error.drawn)
            raise error_at_key(type(self), keys, str(error), error.count) from None
        return self

    def held_out_counts(self) -> tuple[int, int]:
        return self.eval.prompts_per_domain, self.eval.accuracy_prompts_per_domain

    def environment_of(self, domain: str) -> EnvironmentConfig:
        return self.environments.get(domain) or EnvironmentConfig()


def draw_prompts(
    sources: Mapping[str, Environment | PromptSource], cfg: MOPDConfig, seed: int
) -> tuple[dict[str, list[Sample]], dict[str, list[Sample]]]:
    """Each domain's held-out and training prompts: drawn by the stage, and first when its stage
    file is read (`MOPDConfig._enough_prompts`). One held-out draw: prompts() is prefix-stable, so
    the KL's prompts are the first of the accuracy ones."""
    held_out = draw_in_turn(
        {
            d: source.draws(
                "eval", max(cfg.held_out_counts()), cfg.eval.seed, key=" and ".join(HELD_OUT_COUNT_KEYS)
            )
            for d, source in sources.items()
        }
    )
    count = cfg.train.steps * cfg.rollout.prompts_per_domain
    train = draw_in_turn(
        {
            d: source.draws("train", count, seed, exclude=held_out[d], key=" x ".join(TRAIN_COUNT_KEYS))
            for d, source in sources.items()
        }
    )
    return held_out, train


# Episodes and what they measure --------------------------------------------------------------------


def token_rewards(samples: list[Sample], r_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, T] float64 per-token MOPD rewards, [N, T] bool student-token mask) of teacher-scored
    samples, left-padded as posttrain.data.batch.TokenBatch pads them: mopd_token_rewards of the
    teacher's and the student's recorded log-probs (the engine records them at temperature 1)."""
    for sample in samples:
        if sample.teacher_logprobs is None:
            raise ValueError(f"sample {sample.uid} has no teacher_logprobs: score it with its teacher first")
        sample.check()
    width = max(len(s.tokens) for s in samples)
    mask = left_pad_values([s.generated_mask for s in samples], width, torch.bool)
    teacher = left_pad_values([teacher_row(s) for s in samples], width, torch.float64)
    student = left_pad_values([s.rollout_logprobs for s in samples], width, torch.float64)
    try:
        return mopd_token_rewards(teacher, student, mask, r_max), mask
    except NonFiniteLogprobError as error:
        raise NonFiniteLogprobError(
            f"{error}; trajectories {[samples[row].uid for row in error.rows[:4]]}", error.rows
        ) from error


def teacher_row(sample: Sample) -> list[float]:
    """The sample's teacher log-probs with NaN for positions a teacher left unscored (None)."""
    return [float("nan") if x is None else x for x in sample.teacher_logprobs or []]


def advantages_of(
    samples: list[Sample], rewards: torch.Tensor, mask: torch.Tensor, cfg: MOPDConfig
) -> torch.Tensor:
    """[N, T] A_t: the discounted return of the rewards from each student token on (`discount`),
    minus its (domain, effort) pair's mean under `baseline: pair_mean`."""
    advantages = returns_to_go(rewards, mask, cfg.discount)
    if cfg.baseline == "pair_mean":
        advantages = subtract_group_mean(advantages, mask, [(s.domain, s.effort) for s in samples])
    return advantages


def batch_metrics(samples: list[Sample], rewards: torch.Tensor, mask: torch.Tensor, r_max: float) -> dict:
    """Reward and reverse KL of a training batch (overall, per pair), response length per effort."""
    width = rewards.shape[1]
    teacher = left_pad_values([teacher_row(s) for s in samples], width, torch.float64)
    student = left_pad_values([s.rollout_logprobs for s in samples], width, torch.float64)
    deltas = (teacher - student)[mask]
    n = max(int(mask.sum()), 1)
    metrics = {
        "reward": float(rewards[mask].sum()) / n,
        "reward_clipped_fraction": float((deltas.abs() > r_max).sum()) / n,
        "kl": -float(deltas.sum()) / n,
        "accuracy": sum(s.reward or 0.0 for s in samples) / len(samples),
        "student_tokens": float(mask.sum()),
    }
    metrics.update({f"kl/{name}": result["kl"] for name, result in pair_results(samples).items()})
    for effort in dict.fromkeys(s.effort for s in samples):
        group = [s for s in samples if s.effort == effort]
        metrics[f"response_length/{effort}"] = sum(s.num_generated for s in group) / len(group)
    return metrics


def train_on(
    state: TrainState, samples: list[Sample], cfg: MOPDConfig, step: int, pad_id: int, policy_version: int
) -> dict[str, float]:
    """One optimizer step (posttrain.trainers.policy_step) over every trajectory of the step, on
    `advantages_of` its rewards; the loss is the mean over all student tokens of the batch, each
    pair's tokens reweighted to an equal share under `train.balance: pair`."""
    try:
        rewards, mask = token_rewards(samples, cfg.r_max)
    except NonFiniteLogprobError as error:
        raise NonFiniteLogprobError(f"step {step}: {error}; {state.resume_note()}", error.rows) from error
    pairs = [(s.domain, s.effort) for s in samples]
    metrics = policy_step(
        state,
        samples,
        advantages_of(samples, rewards, mask, cfg),
        step=step,
        loss=cfg.loss,
        micro_batch_size=cfg.train.micro_batch_size,
        pad_id=pad_id,
        sample_weights=group_balance_weights(mask, pairs) if cfg.train.balance == "pair" else None,
        policy_version=policy_version,
    )
    return {**metrics, **batch_metrics(samples, rewards, mask, cfg.r_max)}


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
        policy: str | None = None,
    ) -> None:
        """policy: the starting weights' digest (posttrain.rewards.budget.model_digest), with
        which the first evaluation takes the accuracy episodes the needs already played
        (`eval.reuse_before`); None: it plays them all."""
        self.cfg, self.renderer, self.pool, self.seed = cfg, renderer, pool, ctx.seed
        self.policy, self.log = policy, ctx.log
        # what the needs played (their stage dirs: DIR/<need>, the parent of DIR/<need>/model)
        self.played = (
            played_before(dict.fromkeys(path.parent for path in ctx.inputs.values()))
            if policy is not None and cfg.eval.reuse_before
            else []
        )
        self.reused: dict[str, str] = {}  # pair -> the need whose accuracy episodes it took
        self.student = EmbeddedEngine(
            model, pad_token_id=renderer.pad_id, autocast_dtype=engine_autocast(cfg.accelerate)
        )
        sandboxes = ctx.stage_dir / "sandboxes"
        remove_tree(sandboxes)  # snapshots of an interrupted attempt: never resumed, episodes restart
        self.envs = {
            d: TEACHER_DOMAINS.get(d).environment(renderer, cfg.environment_of(d), sandbox_dir=sandboxes)
            for d in cfg.domains
        }
        held_out, self.train_prompts = draw_prompts(self.envs, cfg, ctx.seed)
        self.eval_prompts = {d: p[: cfg.eval.prompts_per_domain] for d, p in held_out.items()}  # the KL's
        self.accuracy_prompts = {d: p[: cfg.eval.accuracy_prompts_per_domain] for d, p in held_out.items()}

    def episodes(self, prompts: Mapping[str, list[Sample]], tag: str, copies: int = 1) -> list[Sample]:
        """Fresh trajectories, each prompt at every effort `copies` times (distinct uids, hence
        distinct sampling noise); routed now, so an unrouted pair fails here."""
        # Copy 0 keeps the uid a single episode always had, so its sampling noise is unchanged.
        samples = [
            self.envs[d].start(
                p, uid=f"{tag}-{d}-{e}-{i}" + (f"-{c}" if c else ""), group=f"{tag}-{p.uid}", effort=e
            )
            for d, group in prompts.items()
            for i, p in enumerate(group)
            for e in self.cfg.efforts
            for c in range(copies)
        ]
        for sample in samples:
            self.pool.teacher_for(sample)
        return samples

    def step_prompts(self, step: int) -> dict[str, list[Sample]]:
        n = self.cfg.rollout.prompts_per_domain
        return {d: prompts[(step - 1) * n : step * n] for d, prompts in self.train_prompts.items()}

    def rollout(self, samples: list[Sample], temperature: float, scored: bool = True) -> dict[str, float]:
        """Play every episode; each is teacher-scored in the turn it ends (unless not `scored`: the
        accuracy pass measures accuracy and length only). Returns timings and throughput: the
        student's sampled tokens over rollout_s (tools and verifiers included), the tokens the
        teachers prefilled (whole trajectories) over teacher_score_s (retries included)."""
        started, scoring = time.perf_counter(), [0.0]

        def score(finished: list[Sample]) -> None:
            began = time.perf_counter()
            if scored:
                self.pool.score(finished)
            scoring[0] += time.perf_counter() - began

        sampling = {d: env.turn_sampling(temperature, self.seed) for d, env in self.envs.items()}
        play_episodes(self.envs, self.student, samples, sampling, on_finished=score)
        unscored = [s.uid for s in samples if scored and s.teacher_logprobs is None]
        if unscored:
            raise TeacherScoreError(f"episodes {unscored} ended without a teacher score")
        rollout_s = time.perf_counter() - started - scoring[0]
        sampled = sum(s.num_generated for s in samples)  # fresh episodes: all sampled in this call
        timings = {
            "rollout_s": rollout_s,
            "teacher_score_s": scoring[0],
            "rollout_tokens": float(sampled),
            "rollout_tokens_per_s": sampled / rollout_s,
        }
        if scored:  # each episode prefilled once, whole, when it ended
            prefilled = sum(len(s.tokens) for s in samples)
            timings.update(teacher_tokens=float(prefilled), teacher_tokens_per_s=prefilled / scoring[0])
        return timings

    def evaluate(self, reuse: bool = False) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, list]]]:
        """Per pair on the held-out prompts: kl from episodes sampled at temperature 1 (the
        student's own distribution, which the reverse KL is defined on), accuracy and tokens from
        one episode a prompt at `eval.accuracy_temperature`, the RL stages' evaluation (uids, seed,
        harness) so the two compare. Same uids, hence the same sampling noise, every time. Also
        returns the sampled episodes' table (`episode_table`), which pairs the before and after
        evaluations episode by episode. reuse: the student still holds the starting weights, so a
        pair's accuracy episodes that a need played already (`taken_before`) are taken, not
        replayed."""
        sampled = self.episodes(self.eval_prompts, "eval", copies=self.cfg.eval.samples_per_prompt)
        self.rollout(sampled, temperature=1.0)
        decoding = self.accuracy_episodes()
        taken = self.taken_before(decoding) if reuse else {}
        played = [s for s in decoding if pair_name((s.domain, s.effort)) not in taken]
        if played:
            self.rollout(played, temperature=self.cfg.eval.accuracy_temperature, scored=False)
        accuracy_table = {**accuracy_rows(played), **taken}
        kl = pair_results(sampled)
        decoded = {pair: row_results(rows) for pair, rows in accuracy_table.items()}
        exact_sums = self.exact_kl_sums(sampled)
        table = episode_table(sampled, exact_sums)
        for pair, rows in accuracy_table.items():
            table[pair]["accuracy"] = rows
        exact = exact_results(table) if exact_sums is not None else {}
        results = {
            pair: {
                **decoded[pair],
                **{k: v for k, v in kl[pair].items() if k.startswith("kl")},
                **exact.get(pair, {}),
            }
            for pair in kl
        }
        return results, table

    def accuracy_episodes(self) -> list[Sample]:
        """The accuracy pass's fresh episodes: each domain's accuracy prompts at every effort, one
        episode each with the RL stages' evaluation uids (posttrain.envs.env_eval.eval_episodes),
        routed to their teachers like every episode of the stage."""
        samples = [
            sample
            for d, prompts in self.accuracy_prompts.items()
            for e in self.cfg.efforts
            for sample in eval_episodes(self.envs[d], prompts, e, 1)
        ]
        for sample in samples:
            self.pool.teacher_for(sample)
        return samples

    def taken_before(self, decoding: list[Sample]) -> dict[str, dict[str, list]]:
        """Per pair whose accuracy episodes a need already played with the starting weights (the
        same eval_protocol, its episodes among the first the need played), those episodes' rows
        (posttrain.trainers.mopd_eval.taken_rows)."""
        if self.policy is None or not self.played:
            return {}
        taken = {}
        for name, group in by_pair(decoding).items():
            protocol = eval_protocol(
                self.envs[group[0].domain],
                group,
                model=self.student.model,
                policy=self.policy,
                engine="embedded",
                autocast=self.student.autocast_dtype,
                temperature=self.cfg.eval.accuracy_temperature,
                seed=self.seed,
            )
            found = taken_rows(protocol, self.played)
            if found is not None:
                self.reused[name], taken[name] = found
        if taken:
            sources = sorted(set(self.reused.values()))
            self.log.info(
                "evaluation before training: the accuracy episodes of %d of %d pairs taken from %s "
                "(the same student, engine, harness and prompts), not replayed",
                len(taken),
                len(by_pair(decoding)),
                ", ".join(sources),
            )
        return taken

    def exact_kl_sums(self, samples: list[Sample]) -> dict[str, float] | None:
        """Per episode uid: the exact per-position reverse KL (posttrain.algos.exact_reverse_kl)
        summed over its student tokens, the quantity `kl` estimates without the sampled token's
        noise. Only where the student and every teacher engine give full next-token distributions
        (embedded engines); None otherwise (a vLLM teacher returns the sampled token's log-prob
        alone)."""
        groups = self.pool.by_engine(samples)
        engines = {key: self.pool.engine(key) for key in groups}
        if not all(hasattr(e, "next_token_logprobs") for e in [self.student, *engines.values()]):
            return None
        sums: dict[str, float] = {}
        for key, group in groups.items():
            student = self.student.next_token_logprobs(group)
            teacher = engines[key].next_token_logprobs(group)
            for sample, s_lp, t_lp in zip(group, student, teacher, strict=True):
                mask = torch.tensor(sample.generated_mask[1:], dtype=torch.bool)
                sums[sample.uid] = float(exact_reverse_kl(s_lp, t_lp)[mask].sum())
        return sums

    def close(self) -> None:
        for env in self.envs.values():
            env.close()


@stage_kind("mopd", config=MOPDConfig)
def run_mopd(ctx: StageContext) -> dict[str, float]:
    """Multi-teacher on-policy distillation of the (domain, effort) specialists into one student."""
    cfg: MOPDConfig = ctx.config
    routes = route_teachers(cfg, ctx.inputs)
    # The student's weights and architecture are the `student` model's (the SFT need by default).
    start = resolve_model(cfg.student, ctx.inputs, f"stage {ctx.stage_id}: student")
    source = Path(cfg.tokenizer) if cfg.tokenizer else model_tokenizer_dir(start)
    tokenizer = load_tokenizer(source)
    # the teachers that are needs exist only now (directories were checked by `plan` as well)
    check_teacher_tokenizers(tokenizer, source, {pair: teacher.model_dir for pair, teacher in routes.items()})
    policy = load_policy(ctx, len(tokenizer), lora=cfg.lora, model_path=start)
    renderer = renderer_for(tokenizer, policy.model)  # sizes images when the student has a vision tower
    state = TrainState.create(ctx, policy.model, cfg.train, cfg.accelerate, cfg.train.steps)
    pool = TeacherPool(
        routes,
        ctx.stage_dir,
        cfg.max_teacher_retries,
        ctx.log,
        device=state.accelerator.device,
        autocast_dtype=engine_autocast(cfg.accelerate),
    )
    ctx.log.info(
        "MOPD: student %s; teachers %s", start, {pair_name(p): str(t.model_dir) for p, t in routes.items()}
    )
    # The student's starting weights, which the RL stages' before-evaluations played greedily
    # (with LoRA the sampled model carries adapters: never taken as the same).
    policy = model_digest(start) if cfg.lora is None else None
    distiller = Distiller(ctx, cfg, base_without_peft(state.unwrapped), renderer, pool, policy=policy)
    try:
        pool.start()
        checkpoint = state.restore()
        last: dict[str, float] = {}  # the newest step's metrics, checkpointed with it
        if checkpoint is not None:
            step, before = checkpoint.step, checkpoint.extra["before"]
            last = dict(checkpoint.extra["last"])
            before_episodes = checkpoint.extra["before_episodes"]
            pool.retries = int(checkpoint.extra["teacher_retries"])
        else:
            step, (before, before_episodes) = 0, distiller.evaluate(reuse=True)
            ctx.metrics.log(0, {f"eval/{k}_before/{p}": v[k] for p, v in before.items() for k in v})
        distiller.student.policy_version = step
        while step < cfg.train.steps:
            step += 1
            samples = distiller.episodes(distiller.step_prompts(step), f"step{step}")
            timings = distiller.rollout(samples, cfg.rollout.temperature)
            last = train_on(state, samples, cfg, step, renderer.pad_id, distiller.student.policy_version)
            last.update(timings, teacher_retries=float(pool.retries))
            distiller.student.policy_version = step
            ctx.metrics.log(step, last)
            if step % cfg.checkpoint_every == 0 or step == cfg.train.steps:
                state.save_checkpoint(
                    step,
                    extra={
                        "before": before,
                        "before_episodes": before_episodes,
                        "teacher_retries": pool.retries,
                        "last": last,
                    },
                )
            ctx.progress(step, cfg.train.steps, kl=last["kl"], reward=last["reward"])
        after, after_episodes = distiller.evaluate()
        ctx.metrics.log(step, {f"eval/{k}_after/{p}": v[k] for p, v in after.items() for k in v})
    finally:
        distiller.close()
        pool.close()
    report = write_eval(ctx.stage_dir / EVAL_FILE, before, after, before_episodes, after_episodes)
    save_final_model(merged_model(state.unwrapped), tokenizer, ctx.output_dir, renderer.stop_token_ids)
    throughput = ctx.metrics.medians(THROUGHPUT)
    ctx.log.info("tokens/s, median over steps: %s", ", ".join(f"{k}={v:.4g}" for k, v in throughput.items()))
    final = {**final_metrics(report, pool.retries, step), **throughput}
    # train_kl: the last batch's KL to the teachers, the training curve's end (with a baseline,
    # train_loss is the policy loss of centred advantages, about 0 whatever the KL)
    return {**final, "train_loss": last["loss"], "train_kl": last["kl"]} if "loss" in last else final
