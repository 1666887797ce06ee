"""The `mopd` stage kind: multi-teacher on-policy distillation, K3's last stage (K3_SPEC 2.3).

The nine RL specialists are merged into one student in policy space, not by averaging weights: the
student samples its own episodes with the reasoning effort as conditioning, the teacher of each
prompt's (domain, effort) prefills the student's trajectory, and every student-sampled token gets
r_t = clip(log p_teacher(y_t) - log p_student(y_t), -R_max, R_max), trained with the RL stage's
per-token policy loss on the rewards' discounted return. It is dense, on-policy reverse KL: the
student learns where it samples.

Which teacher scores which trajectory (teacher domains, routing, the pool of teacher engines that
survives a dying engine) is posttrain.trainers.mopd_teachers. Here, in reading order: the stage's
config, the episode loop over every domain at once (finished episodes are scored by their teachers
between turns, batched), the per-token rewards (posttrain.algos.mopd_reward on each trajectory),
the training step, and the stage with its before/after evaluation (DIR/mopd/eval.json). The
student starts from the `student` need, the SFT model by default.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from posttrain.algos.mismatch import mismatch_stats
from posttrain.algos.mopd_reward import (
    exact_reverse_kl,
    mopd_token_rewards,
    paired_change_standard_error,
    reverse_kl,
    token_mean_standard_error,
)
from posttrain.algos.policy_loss import PolicyLoss, PolicyLossConfig, policy_loss
from posttrain.checkpoint import atomic_write_text, remove_tree
from posttrain.config.stage_file import check_model_reference
from posttrain.data.chat import ChatRenderer, load_tokenizer
from posttrain.data.sample import Sample
from posttrain.engines import EmbeddedEngine, Engine, SamplingConfig
from posttrain.engines.embedded import left_pad, positions_from_mask
from posttrain.envs.environments import EPISODE_DONE, Environment, EnvironmentConfig
from posttrain.stages import StageContext, stage_kind
from posttrain.trainers.common import (
    AccelerateConfig,
    LoRAConfig,
    OptimConfig,
    TrainState,
    base_without_peft,
    load_policy,
    merged_model,
    save_final_model,
)
from posttrain.trainers.mopd_teachers import (
    TEACHER_DOMAINS,
    TeacherPool,
    TeacherRoutingConfig,
    TeacherScoreError,
    pair_name,
    resolve_model,
    route_teachers,
    student_mask,
)

EVAL_FILE = "eval.json"
RESULT_KEYS = ("kl", "kl_se", "kl_exact", "kl_exact_se", "kl_tokens", "accuracy", "tokens")


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
    temperature 1 for the KL, greedy for accuracy and length)."""

    model_config = ConfigDict(extra="forbid")
    prompts_per_domain: int = Field(4, gt=0, description="held-out prompts per domain")
    samples_per_prompt: int = Field(
        4,
        gt=0,
        description="sampled episodes per held-out prompt and effort for the KL: its estimate "
        "averages the student's tokens, so its noise falls as 1/sqrt(samples)",
    )
    seed: int = Field(0, description="draws them; the RL stages' held-out prompts use the same default")


class MOPDConfig(TeacherRoutingConfig):
    """Keys of a `mopd` stage file besides the generic ones (docs/mopd.md): the teacher routing
    keys (posttrain.trainers.mopd_teachers) and the student's."""

    model_config = ConfigDict(extra="forbid")
    student: str = Field(
        "sft",
        validate_default=True,
        description="a need's stage id or a model dir: the model the student starts from",
    )
    tokenizer: str | None = Field(None, description="tokenizer dir; null: the student's")
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
        return check_model_reference(student, info, "student")

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


# Episodes and what they measure --------------------------------------------------------------------


def mopd_sample_rewards(
    sample: Sample, r_max: float, student_logprobs: list[float] | None = None
) -> list[float]:
    """Per-token MOPD rewards of one scored trajectory, aligned with sample.tokens (for
    Sample.token_rewards): mopd_token_rewards on its student tokens, 0 elsewhere. Student log-probs
    default to sample.rollout_logprobs, which the engine records at temperature 1; pass recomputed
    ones when the student sampled at another temperature."""
    if sample.teacher_logprobs is None:
        raise ValueError(f"sample {sample.uid} has no teacher_logprobs: score it with its teacher first")
    student = sample.rollout_logprobs if student_logprobs is None else student_logprobs
    n = len(sample.tokens)
    if len(sample.teacher_logprobs) != n or len(student) != n or len(sample.loss_mask) != n:
        raise ValueError(
            f"sample {sample.uid}: {n} tokens, {len(sample.teacher_logprobs)} teacher log-probs, "
            f"{len(student)} student log-probs, {len(sample.loss_mask)} mask entries"
        )
    teacher = torch.tensor(
        [float("nan") if x is None else x for x in sample.teacher_logprobs], dtype=torch.float64
    )
    mask = torch.tensor(student_mask(sample), dtype=torch.bool)
    return mopd_token_rewards(teacher, torch.tensor(student, dtype=torch.float64), mask, r_max).tolist()


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


def pair_results(samples: list[Sample], with_kl: bool = True) -> dict[str, dict[str, float]]:
    """Per pair: accuracy, the mean verifier reward (0 when unscored); tokens, the mean
    student-generated tokens per episode (tool results excluded); with_kl (teacher-scored samples):
    kl, the reverse KL to its teacher (token mean over the student's tokens of
    log p_student - log p_teacher), kl_tokens, how many tokens that mean is over, and (from two
    episodes a pair) kl_se, its standard error with the episodes as units."""
    by_pair: dict[str, list[Sample]] = {}
    for sample in samples:
        by_pair.setdefault(pair_name((sample.domain, sample.effort)), []).append(sample)
    results = {}
    for name, group in by_pair.items():
        results[name] = {
            "accuracy": sum(s.reward or 0.0 for s in group) / len(group),
            "tokens": sum(s.num_generated for s in group) / len(group),
        }
        if with_kl:
            results[name]["kl"] = reverse_kl(
                torch.tensor([x for s in group for x in s.rollout_logprobs], dtype=torch.float64),
                torch.tensor([x for s in group for x in s.teacher_logprobs or []], dtype=torch.float64),
                torch.tensor([m for s in group for m in student_mask(s)], dtype=torch.bool),
            )
            results[name]["kl_tokens"] = float(sum(sum(student_mask(s)) for s in group))
            if len(group) > 1:
                sums = [log_ratio_sum(s) for s in group]
                results[name]["kl_se"] = standard_error(sums, [sum(student_mask(s)) for s in group])
    return results


def log_ratio_sum(sample: Sample) -> float:
    """Sum of log p_student - log p_teacher over one scored episode's student tokens."""
    pairs = zip(sample.rollout_logprobs, sample.teacher_logprobs or [], student_mask(sample), strict=True)
    return sum(student - teacher for student, teacher, on in pairs if on)


def standard_error(episode_sums: list[float], episode_tokens: list[int]) -> float:
    """token_mean_standard_error of per-episode sums; 0.0 when no episode has a student token."""
    if not any(episode_tokens):
        return 0.0
    return token_mean_standard_error(
        torch.tensor(episode_sums, dtype=torch.float64), torch.tensor(episode_tokens, dtype=torch.float64)
    )


def exact_results(table: Mapping[str, Mapping[str, list]]) -> dict[str, dict[str, float]]:
    """Per pair of an episode_table with exact sums: kl_exact, their token mean, and (from two
    episodes a pair) kl_exact_se, its standard error over episodes."""
    return {
        name: {
            "kl_exact": sum(rows["kl_exact"]) / max(sum(rows["tokens"]), 1),
            **(
                {"kl_exact_se": standard_error(rows["kl_exact"], rows["tokens"])}
                if len(rows["uid"]) > 1
                else {}
            ),
        }
        for name, rows in table.items()
    }


def episode_table(
    samples: list[Sample], exact_sums: Mapping[str, float] | None
) -> dict[str, dict[str, list]]:
    """Per pair, its teacher-scored episodes in order: uid, kl (the sum of log p_student -
    log p_teacher over its student tokens), kl_exact (the exact sum, where there is one) and
    tokens (how many student tokens). The before and after evaluations play the same uids, so
    write_eval pairs them row by row for the error of the change."""
    table: dict[str, dict[str, list]] = {}
    for sample in samples:
        rows = table.setdefault(
            pair_name((sample.domain, sample.effort)),
            {"uid": [], "kl": [], "tokens": [], **({"kl_exact": []} if exact_sums is not None else {})},
        )
        rows["uid"].append(sample.uid)
        rows["kl"].append(log_ratio_sum(sample))
        rows["tokens"].append(sum(student_mask(sample)))
        if exact_sums is not None:
            rows["kl_exact"].append(exact_sums[sample.uid])
    return table


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
    model: torch.nn.Module,
    samples: list[Sample],
    advantages: list[list[float]],
    loss: PolicyLossConfig,
    sample_weights: list[float] | None = None,
) -> PolicyLoss:
    """The per-token policy loss of one micro-batch with advantages A_t (`advantages`: the rewards
    or their discounted return, aligned with each sample's tokens), the student's recorded log-probs
    as behaviour, on student tokens only, each sample's tokens weighted by `sample_weights` (None:
    1). Its stats also hold the train/rollout mismatch (posttrain.algos.mismatch_stats)."""
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
    weights = None
    if sample_weights is not None:
        weights = padded([[w] * len(s.tokens) for s, w in zip(samples, sample_weights, strict=True)])
    out = policy_loss(logp, behaviour, padded(advantages), mask, token_weights=weights, config=loss)
    out.stats.update(mismatch_stats(logp, behaviour, mask, loss.tis_cap))
    return out


def returns_to_go(rewards: list[float], mask: list[int], discount: float) -> list[float]:
    """Per token, the discounted sum of the rewards of this and later student tokens (mask 1);
    tool-result and prompt tokens carry 0 and do not count as steps."""
    out, running = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        if mask[t]:
            running = rewards[t] + discount * running
            out[t] = running
    return out


def pair_balance_weights(samples: list[Sample]) -> list[float]:
    """Per sample, total / (pairs x its pair's tokens) (student tokens): a token-mean loss weighted
    by these is the mean over the step's (domain, effort) pairs of each pair's token-mean."""
    tokens: dict[tuple, int] = {}
    for sample in samples:
        key = (sample.domain, sample.effort)
        tokens[key] = tokens.get(key, 0) + sum(student_mask(sample))
    total = sum(tokens.values())
    return [total / (len(tokens) * max(tokens[(s.domain, s.effort)], 1)) for s in samples]


def subtract_pair_mean(samples: list[Sample], advantages: list[list[float]]) -> list[list[float]]:
    """Each student token's advantage minus the mean advantage over the student tokens of its
    (domain, effort) pair in `samples`; other tokens stay 0. E[b grad log p(y_t)] = 0 for a b that
    does not depend on y_t, so this keeps the gradient's expectation and removes the noise the
    mean return (negative, about -KL / (1 - discount)) adds by pushing every sampled token down.
    The mean includes the token's own episode, which shrinks that episode's expected gradient by
    about (return horizon) / (the pair's student tokens): ~1% at the shipped batch."""
    masks = [student_mask(s) for s in samples]
    sums: dict[tuple, list[float]] = {}
    for sample, row, mask in zip(samples, advantages, masks, strict=True):
        acc = sums.setdefault((sample.domain, sample.effort), [0.0, 0.0])
        acc[0] += sum(a for a, m in zip(row, mask, strict=True) if m)
        acc[1] += sum(mask)
    means = {pair: total / max(count, 1) for pair, (total, count) in sums.items()}
    return [
        [a - means[(sample.domain, sample.effort)] if m else 0.0 for a, m in zip(row, mask, strict=True)]
        for sample, row, mask in zip(samples, advantages, masks, strict=True)
    ]


def train_on(state: TrainState, samples: list[Sample], cfg: MOPDConfig, step: int) -> dict[str, float]:
    """One optimizer step over every trajectory of the step; the loss is the mean over all student
    tokens of the batch (micro-batch sums divided once by the batch's token count), each pair's
    tokens reweighted to an equal share under `train.balance: pair`, each token's advantage the
    discounted return of the rewards from it on (`discount`)."""
    rewards = [mopd_sample_rewards(s, cfg.r_max) for s in samples]
    advantages = [
        returns_to_go(row, student_mask(s), cfg.discount) for s, row in zip(samples, rewards, strict=True)
    ]
    if cfg.baseline == "pair_mean":
        advantages = subtract_pair_mean(samples, advantages)
    weights = pair_balance_weights(samples) if cfg.train.balance == "pair" else None
    loss_cfg = cfg.loss.model_copy(update={"reduction": "sum"})
    total = max(sum(sum(student_mask(s)) for s in samples), 1)
    sums: dict[str, float] = {"loss": 0.0}
    for start in range(0, len(samples), cfg.train.micro_batch_size):
        rows = samples[start : start + cfg.train.micro_batch_size]
        chunk = slice(start, start + len(rows))
        row_weights = None if weights is None else weights[chunk]
        out = distillation_loss(state.model, rows, advantages[chunk], loss_cfg, row_weights)
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
        greedy eval pass measures accuracy and length only). Returns timings."""
        started, scoring = time.perf_counter(), [0.0]

        def score(finished: list[Sample]) -> None:
            began = time.perf_counter()
            if scored:
                self.pool.score(finished)
            scoring[0] += time.perf_counter() - began

        sampling = {d: env.turn_sampling(temperature, self.seed) for d, env in self.envs.items()}
        play_episodes(self.envs, self.student, samples, sampling, score)
        unscored = [s.uid for s in samples if scored and s.teacher_logprobs is None]
        if unscored:
            raise TeacherScoreError(f"episodes {unscored} ended without a teacher score")
        return {"rollout_s": time.perf_counter() - started - scoring[0], "teacher_score_s": scoring[0]}

    def evaluate(self) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, list]]]:
        """Per pair on the held-out prompts: kl from episodes sampled at temperature 1 (the
        student's own distribution, which the reverse KL is defined on), accuracy and tokens from
        greedy episodes, the protocol of the RL stages' eval.json so the two compare. Same uids,
        hence the same sampling noise, every time. Also returns the sampled episodes' table
        (`episode_table`), which pairs the before and after evaluations episode by episode."""
        sampled = self.episodes(self.eval_prompts, "eval", copies=self.cfg.eval.samples_per_prompt)
        self.rollout(sampled, temperature=1.0)
        greedy = self.episodes(self.eval_prompts, "eval-greedy")
        self.rollout(greedy, temperature=0.0, scored=False)
        kl, decoded = pair_results(sampled), pair_results(greedy, with_kl=False)
        exact_sums = self.exact_kl_sums(sampled)
        table = episode_table(sampled, exact_sums)
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
                mask = torch.tensor(student_mask(sample)[1:], dtype=torch.bool)
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
    tokenizer = load_tokenizer(
        cfg.tokenizer or (start if (start / "tokenizer_config.json").is_file() else None)
    )
    renderer = ChatRenderer(tokenizer)
    policy = load_policy(ctx, len(tokenizer), lora=cfg.lora, model_path=start)
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
            before_episodes = checkpoint.extra["before_episodes"]
            pool.retries = int(checkpoint.extra["teacher_retries"])
        else:
            step, (before, before_episodes) = 0, distiller.evaluate()
            ctx.metrics.log(0, {f"eval/{k}_before/{p}": v[k] for p, v in before.items() for k in v})
        distiller.student.policy_version = step
        # The last step's metrics ride in the checkpoint: a resume from the final one runs no step.
        last: dict[str, float] = dict(checkpoint.extra.get("last", {})) if checkpoint is not None else {}
        while step < cfg.train.steps:
            step += 1
            samples = distiller.episodes(distiller.step_prompts(step), f"step{step}")
            timings = distiller.rollout(samples, cfg.rollout.temperature)
            last = train_on(state, samples, cfg, step)
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
    final = final_metrics(report, pool.retries, step)
    # train_kl: the last batch's KL to the teachers, the training curve's end (with a baseline,
    # train_loss is the policy loss of centred advantages, about 0 whatever the KL)
    return {**final, "train_loss": last["loss"], "train_kl": last["kl"]} if "loss" in last else final


def write_eval(
    path: Path,
    before: Mapping[str, Mapping[str, float]],
    after: Mapping[str, Mapping[str, float]],
    before_episodes: Mapping[str, Mapping[str, list]],
    after_episodes: Mapping[str, Mapping[str, list]],
) -> dict:
    """DIR/mopd/eval.json: {"<domain>-<effort>": {kl_before, kl_after, kl_tokens_before,
    kl_tokens_after, accuracy_before, accuracy_after, tokens_before, tokens_after}}, plus
    kl_exact_before / kl_exact_after where the engines gave full distributions, and, where a pair
    has two or more sampled episodes, the standard errors kl_se_* / kl_exact_se_* of each estimate
    and kl_change_se / kl_exact_change_se of its change (the same episodes before and after,
    `paired_change_standard_error`)."""
    report = {
        name: {
            f"{key}_{when}": float(values[name][key])
            for key in RESULT_KEYS
            if key in before[name] and key in after[name]
            for when, values in (("before", before), ("after", after))
        }
        for name in before
    }
    for name, values in report.items():
        rows = before_episodes[name], after_episodes[name]
        if (
            rows[0]["uid"] != rows[1]["uid"]
            or len(rows[0]["uid"]) < 2
            or not all(sum(r["tokens"]) for r in rows)
        ):
            continue  # an error needs two paired episodes with student tokens
        for kl in ("kl", "kl_exact"):
            if all(kl in r for r in rows):
                columns = [torch.tensor(r[key], dtype=torch.float64) for r in rows for key in (kl, "tokens")]
                values[f"{kl}_change_se"] = paired_change_standard_error(*columns)
    atomic_write_text(path, json.dumps(report, indent=1, sort_keys=True) + "\n")
    return report


def final_metrics(report: Mapping[str, Mapping[str, float]], retries: int, steps: int) -> dict[str, float]:
    """Means over pairs, how many pairs moved closer to their teacher (by each KL estimate),
    retries and steps."""
    keys = [k for k in next(iter(report.values())) if "_se" not in k]  # errors do not average
    final = {k: sum(r[k] for r in report.values()) / len(report) for k in keys}
    for kl in ("kl", "kl_exact"):
        if all(f"{kl}_before" in r for r in report.values()):
            improved = sum(r[f"{kl}_after"] < r[f"{kl}_before"] for r in report.values())
            final[f"pairs_{kl}_improved"] = float(improved)
    return {**final, "teacher_retries": float(retries), "steps": float(steps)}
