"""The `rl` stage kind: one RL specialist (a domain x a reasoning effort) trained from the SFT model.

Nine stages (stages/rl.yaml: general, agent, coding x low, high, max) run this loop (K3 spec
section 2.2):

1. Prompts of the domain's task families (posttrain.envs.environments), a fixed training pool and
   a held-out set shared by the three efforts; the effort is a conditioning input (the renderer's
   effort marker in the system header), not a different model or prompt.
2. Budget: the SFT policy samples every training prompt n times once; b0(x) is a quantile of the
   successful samples' token usage, cached on disk for all nine runs (posttrain.rewards.budget).
   A trajectory over tau(effort, step) * b0(x) tokens gets reward -1, tau annealed per effort.
3. Each iteration: new prompt groups start beside the partial rollouts queued by the previous one
   (posttrain.trainers.rollout), episodes run against real tools and sandboxes, generation pauses
   once a fraction lambda has ended; complete groups are scored (hidden verifier or GenRM, then
   the budget), get group-relative advantages, and one optimizer step of the per-token policy loss
   (truncated IS against the behaviour log-probs, per-token log-ratio penalty, loss on
   policy-generated tokens only), followed by router balancing.
4. The policy sampled is the policy trained (`rollout.engine`): the embedded engine shares the
   trained module, QAT hooks included; a vLLM engine (in-process or a server) is sent the weights
   after every iteration's update. Either way the policy version advances with each update.
5. Held-out accuracy and response length before (the SFT model) and after, in eval.json, each with
   its standard error and the change with its paired one (posttrain.envs.env_eval).

Checkpoints hold weights, optimizer, schedule, RNGs, the policy version, the pre-training eval and
the rollout queue with its sandbox snapshots, so a killed stage resumes bit for bit (checked with
the embedded engine; a vLLM engine is sent the restored weights, its numerics are its own).
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from posttrain.algos import group_advantages
from posttrain.algos.policy_loss import PolicyLossConfig
from posttrain.config.errors import did_you_mean
from posttrain.config.stage_file import (
    MATRIX_CONTEXT,
    NEEDS_CONTEXT,
    SEED_CONTEXT,
    SETS_MODEL_CONTEXT,
    error_at_key,
)
from posttrain.data.chat import ChatRenderer, TokenizerDir, load_tokenizer, model_tokenizer_dir
from posttrain.data.sample import DOMAINS, EFFORTS, Sample
from posttrain.engines import Engine
from posttrain.envs.env_eval import (
    EvalConfig,
    domain_subsets,
    eval_episodes,
    eval_protocol,
    evaluate,
    paired_changes,
    subset_config,
)
from posttrain.envs.environments import (
    ENVIRONMENTS,
    Environment,
    EnvironmentConfig,
    PromptCountError,
    PromptSource,
    make_environment,
)
from posttrain.files import atomic_write_text, remove_tree
from posttrain.rewards.budget import BudgetConfig, base_budgets, model_digest, trajectory_rewards
from posttrain.rewards.genrm import GenRM, GenRMConfig, stage_judge
from posttrain.stages import EVAL_FILE, StageContext, stage_kind
from posttrain.trainers.common import (
    AccelerateConfig,
    OptimConfig,
    TrainState,
    base_without_peft,
    engine_autocast,
    load_policy,
    renderer_for,
    save_final_model,
)
from posttrain.trainers.policy_step import policy_step
from posttrain.trainers.policy_sync import publish_policy, rollout_engine, serve_policy
from posttrain.trainers.rollout import PartialRolloutConfig, RolloutQueue

Effort = Literal["low", "high", "max"]
# Per-iteration rates whose medians the stage returns (bench/RESULTS.md reports them for GPU runs).
THROUGHPUT = ("rollout/tokens_per_s", "train_tokens_per_s")


class RLTrainConfig(OptimConfig):
    """The optimisation of each iteration's complete groups."""

    steps: int = Field(gt=0, description="iterations")
    updates_per_iteration: int = Field(
        1, gt=0, description="optimizer steps over each iteration's batch (PPO epochs; 1: on-policy)"
    )
    micro_batch_size: int = Field(16, gt=0, description="trajectories per forward/backward")


class RolloutConfig(BaseModel):
    """Which prompts, how many samples, how they are sampled, and partial rollouts."""

    model_config = ConfigDict(extra="forbid")
    prompts: int = Field(16, gt=0, description="training prompt pool (drawn in turn, reshuffled each epoch)")
    groups_per_step: int = Field(4, gt=0, description="new prompt groups started each iteration")
    group_size: int = Field(4, ge=2, description="trajectories per prompt (advantages are group-relative)")
    temperature: float = Field(
        1.0, gt=0, description="sampling temperature; the trainer scores tokens at the same temperature"
    )
    engine: Literal["embedded", "vllm", "vllm_server", "trl_vllm"] = Field(
        "embedded",
        description="embedded: the trained module itself; vllm: vllm.LLM in this process; vllm_server: "
        "vLLM's OpenAI server as a subprocess; trl_vllm: a `trl vllm-serve` server at `url` (the last "
        "three are sent the trainer's weights after every update)",
    )
    url: str | None = Field(None, description="trl_vllm: base URL of the `trl vllm-serve` server")
    partial: PartialRolloutConfig = Field(default_factory=PartialRolloutConfig)

    @model_validator(mode="after")
    def _url_with_trl(self) -> RolloutConfig:
        if (self.engine == "trl_vllm") != (self.url is not None):
            raise ValueError(
                "rollout.url is the `trl vllm-serve` server's base URL: set it with rollout.engine "
                "trl_vllm, "
                f"and only then (engine is {self.engine!r}, url {self.url!r})"
            )
        return self

    @model_validator(mode="after")
    def _distinct_groups(self) -> RolloutConfig:
        if self.groups_per_step > self.prompts:
            raise ValueError(
                f"rollout.groups_per_step ({self.groups_per_step}) > rollout.prompts ({self.prompts}): an "
                "iteration would start two groups of one prompt; raise prompts or lower groups_per_step"
            )
        return self


class AdvantageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scale_by_std: bool = Field(True, description="divide each group's advantages by its reward std")
    leave_one_out: bool = Field(False, description="RLOO: the baseline is the mean of the group's others")


class RLConfig(BaseModel):
    """Keys of an `rl` stage file besides the generic ones (docs/rl.md)."""

    model_config = ConfigDict(extra="forbid")
    domain: str | None = Field(None, description="null: the matrix value `domain`")
    effort: Effort | None = Field(None, description="null: the matrix value `effort`")
    init: str = Field(
        "sft", description="the need whose model the specialist starts from (and the cold start)"
    )
    train: RLTrainConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    # before `environments`, whose check needs it
    genrm: GenRMConfig | None = Field(None, description="the judge, for environments with reward: genrm")
    environments: dict[str, EnvironmentConfig] = Field(
        default_factory=dict, description="domain -> environment settings (the stage uses its domain's)"
    )
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    advantages: AdvantageConfig = Field(default_factory=AdvantageConfig)
    kl_to_init: float = Field(
        0.0,
        ge=0.0,
        description="beta_ref: weight of a per-token KL(pi_theta || pi_init) to the frozen init model "
        "(k2: (log pi_theta - log pi_init)^2 / 2) on every trained token, zero-advantage ones too; 0: none",
    )
    eval: EvalConfig = Field(default_factory=EvalConfig)
    accelerate: AccelerateConfig = Field(default_factory=AccelerateConfig)
    tokenizer: TokenizerDir = Field(None, description="tokenizer dir; null: the init model's")
    checkpoint_every: int = Field(1, gt=0, description="iterations between checkpoints")

    @field_validator("init")
    @classmethod
    def _init_is_a_need(cls, init: str, info: ValidationInfo) -> str:
        # When the stage file is read: a misspelled init passed `plan` and stopped the stage at its
        # start, after its needs had run. A stage that sets `model:` may start from that instead.
        context = info.context or {}
        needs = context.get(NEEDS_CONTEXT)
        if needs is None or context.get(SETS_MODEL_CONTEXT) or init in needs:
            return init
        raise ValueError(
            f"{init!r} is not one of this stage's needs ({', '.join(needs) or 'none'}); "
            + (did_you_mean(init, needs) or "add the stage file that trains it to `needs`")
        )

    @field_validator("domain")
    @classmethod
    def _domain_has_an_environment(cls, domain: str | None) -> str | None:
        if domain is not None:
            registered_domain(domain)
        return domain

    @field_validator("environments")
    @classmethod
    def _playable(cls, environments: dict[str, EnvironmentConfig], info: ValidationInfo) -> dict:
        # A key that is no domain would be ignored by every stage of the matrix, its settings lost.
        for name in environments:
            registered_domain(name)
        domain = info.data.get("domain")
        if domain in environments:  # the stage's own domain; a matrix's other stages check theirs
            ENVIRONMENTS.get(domain).check_config(environments[domain])
            if environments[domain].reward == "genrm" and info.data.get("genrm") is None:
                # when the stage file is read, not at the stage's start after its needs have run
                raise ValueError(
                    f"environments.{domain}.reward is genrm; add a `genrm:` block (the judge; its keys: "
                    "docs/rl.md), or set the reward to verifier"
                )
        return environments

    @field_validator("budget")
    @classmethod
    def _domain_counts_usage(cls, budget: BudgetConfig, info: ValidationInfo) -> BudgetConfig:
        # A custom domain needs budget.usage.<domain>: checked when the stage file is read, and
        # reported at `budget:` (the key to edit), not at the top of the file.
        domain = info.data.get("domain")
        if domain is not None:
            budget.usage_kind(domain)
        return budget

    @model_validator(mode="after")
    def _one_logprob_kind_per_vllm_engine(self) -> RLConfig:
        # vLLM records one kind of log-prob per engine: processed ones, for the rollouts (and the
        # evaluation, which reads none). The cold start requests raw ones, the same numbers only
        # when sampling is plain.
        if self.rollout.engine == "embedded":
            return self
        temperature = self.budget.cold_start.temperature
        if temperature not in (0.0, 1.0):
            raise ValueError(
                f"budget.cold_start.temperature is {temperature} but rollout.engine "
                f"{self.rollout.engine!r} can only sample the cold start at temperature 0 (greedy) or 1; "
                "set it to one of those, or use rollout.engine: embedded"
            )
        return self

    @model_validator(mode="after")
    def _enough_prompts(self, info: ValidationInfo) -> RLConfig:
        # The stage's own draws, when the stage file is read: a count its families cannot meet was
        # refused only at the stage's start, after its needs had run.
        context = info.context or {}
        seed = context.get(SEED_CONTEXT)
        domain = stage_domain(self, context.get(MATRIX_CONTEXT) or {})
        if seed is None or domain not in ENVIRONMENTS:  # no pipeline, or a domain reported elsewhere
            return self
        source = ENVIRONMENTS.get(domain).prompt_source(self.environments.get(domain, EnvironmentConfig()))
        if source is not None:
            try:
                draw_prompts(source, self, seed)
            except PromptCountError as error:
                raise error_at_key(type(self), error.key, str(error), error.count) from None
        return self


def registered_domain(name: str) -> None:
    """Raise ValueError unless `name` is a domain with a registered environment."""
    if name not in ENVIRONMENTS:
        raise ValueError(
            f"{name!r} is not a domain with a registered environment ({', '.join(ENVIRONMENTS)}); "
            + (
                did_you_mean(name, ENVIRONMENTS)
                or "register its environment in a plug-in listed under `plugins:`"
            )
        )


# Setup -----------------------------------------------------------------------------------------


def draw_prompts(
    source: Environment | PromptSource, cfg: RLConfig, seed: int
) -> tuple[list[Sample], dict[str, list[Sample]], list[Sample]]:
    """The stage's held-out prompts, its evaluation subsets' and its training prompts (none of the
    others'): drawn by the stage, and first when its stage file is read (`_enough_prompts`)."""
    held_out = source.prompts("eval", cfg.eval.prompts, cfg.eval.seed, key="eval.prompts")
    subset_prompts = {
        name: source.prompts(
            "eval", s.prompts, cfg.eval.seed, families=s.families, key=f"eval.subsets.{name}.prompts"
        )
        for name, s in domain_subsets(cfg.eval, source).items()
    }
    excluded = held_out + [p for prompts in subset_prompts.values() for p in prompts]
    train = source.prompts("train", cfg.rollout.prompts, seed, exclude=excluded, key="rollout.prompts")
    return held_out, subset_prompts, train


def stage_domain(cfg: RLConfig, matrix: dict[str, Any]) -> str | None:
    """The stage's domain: its `domain` key, else the matrix value (the stage and its file's check
    read it alike)."""
    return cfg.domain or matrix.get("domain")


def _route(cfg: RLConfig, ctx: StageContext) -> tuple[str, str]:
    domain = stage_domain(cfg, ctx.matrix)
    effort = cfg.effort or ctx.matrix.get("effort")
    if domain is None or effort is None:
        raise ValueError(
            f"stage {ctx.stage_id}: set `domain` and `effort` in the stage file (or a matrix over them), "
            f"e.g. domain: general, effort: high (domains {', '.join(DOMAINS)}; efforts {', '.join(EFFORTS)})"
        )
    if effort not in EFFORTS:
        raise ValueError(f"stage {ctx.stage_id}: effort {effort!r} is not one of {', '.join(EFFORTS)}")
    return str(domain), str(effort)


def _init_dir(cfg: RLConfig, ctx: StageContext) -> Path:
    if ctx.model is not None and Path(ctx.model).is_dir():
        return Path(ctx.model)
    if cfg.init not in ctx.inputs:
        raise ValueError(
            f"stage {ctx.stage_id}: init {cfg.init!r} is not a need of this stage (needs: "
            f"{', '.join(ctx.inputs) or 'none'}); add it to `needs` or set `init` to one of them"
        )
    return ctx.inputs[cfg.init]


# The loop --------------------------------------------------------------------------------------


@stage_kind("rl", config=RLConfig)
def run_rl(ctx: StageContext) -> dict[str, float]:
    """An RL specialist for one domain and reasoning effort (budget reward, partial rollouts)."""
    cfg: RLConfig = ctx.config
    domain, effort = _route(cfg, ctx)
    init = _init_dir(cfg, ctx)
    tokenizer = load_tokenizer(cfg.tokenizer or model_tokenizer_dir(init))
    policy = load_policy(ctx, len(tokenizer), model_path=init)
    renderer = renderer_for(tokenizer, policy.model)  # sizes images when the policy has a vision tower
    state = TrainState.create(
        ctx, policy.model, cfg.train, cfg.accelerate, cfg.train.steps * cfg.train.updates_per_iteration
    )
    model = base_without_peft(state.unwrapped)
    # The KL anchor: a frozen copy of the init weights (taken before any checkpoint is restored).
    reference = _frozen_copy(model) if cfg.kl_to_init > 0 else None
    judge: GenRM | None = None
    env_cfg = cfg.environments.get(domain, EnvironmentConfig())
    if env_cfg.reward == "genrm":
        if cfg.genrm is None:
            raise ValueError(
                f"stage {ctx.stage_id}: environments.{domain}.reward is genrm; add a `genrm:` block"
            )
        judge = stage_judge(cfg.genrm, ctx)
    sandbox_dir = ctx.stage_dir / "sandboxes"
    remove_tree(sandbox_dir)
    with (
        rollout_engine(
            cfg.rollout.engine, cfg.rollout.url, model, init, renderer, ctx, engine_autocast(cfg.accelerate)
        ) as engine,
        make_environment(domain, renderer, env_cfg, sandbox_dir=sandbox_dir, judge=judge) as env,
    ):
        # From the first rollout on the engine samples the trainer's weights (a vLLM engine loaded
        # the init checkpoint as written, without QAT's rounding).
        serve_policy(engine, model, version=0)
        # Behaviour log-probs of the distribution actually sampled, which the trainer recomputes.
        sampling = env.turn_sampling(cfg.rollout.temperature, ctx.seed, logprobs="processed")
        held_out, subset_prompts, train_prompts = draw_prompts(env, cfg, ctx.seed)
        subsets = {name: cfg.eval.subsets[name] for name in subset_prompts}  # this domain's
        subset_cfgs = {name: subset_config(cfg.eval, s) for name, s in subsets.items()}
        ctx.log.info(
            "RL %s/%s from %s: %d training prompts, %d held out",
            domain,
            effort,
            init,
            len(train_prompts),
            len(held_out),
        )
        # Before restoring: the policy still holds the init weights, the cold-start policy.
        init_digest = model_digest(init)
        before_protocol = _before_protocol(env, held_out, effort, cfg, model, init_digest, ctx.seed)
        budgets, budget_metrics = base_budgets(
            env,
            engine,
            train_prompts,
            cfg.budget,
            seed=ctx.seed,
            policy_id=init_digest,
            cache_dir=Path(cfg.budget.cache_dir) if cfg.budget.cache_dir else ctx.run_dir / "budget_cache",
        )
        ctx.log.info("budget: %s", _shown(budget_metrics))
        queue = RolloutQueue(env, engine, sampling, cfg.rollout.partial)
        checkpoint = state.restore()
        # The metrics of the newest iteration are checkpointed with it: a stage resumed from its
        # final checkpoint reports them too.
        last: dict[str, float] = {}
        if checkpoint is not None:
            step, before = checkpoint.step, dict(checkpoint.extra["before"])
            before_rows = dict(checkpoint.extra["before_episodes"])
            subsets_before = dict(checkpoint.extra["subsets_before"])
            last = dict(checkpoint.extra["last"])
            serve_policy(engine, model, version=int(checkpoint.extra["policy_version"]))
            queue.restore(checkpoint)
        else:
            step, (before, before_rows) = (
                0,
                evaluate(env, engine, held_out, effort, cfg.eval, ctx.seed, "before"),
            )
            subsets_before = {
                name: evaluate(
                    env, engine, subset_prompts[name], effort, subset_cfgs[name], ctx.seed, "before"
                )
                for name in subsets
            }
            ctx.metrics.log(0, {**before, **_prefixed(subsets_before), **budget_metrics})
            ctx.log.info("before training (the %s model): %s", cfg.init, _shown(before))
            for name, (metrics, _) in subsets_before.items():
                ctx.log.info("before training, eval subset %s: %s", name, _shown(metrics))
        while step < cfg.train.steps:
            step += 1
            groups = _new_groups(env, train_prompts, step, cfg.rollout, effort, ctx.seed)
            rollout = queue.step([s for group in groups for s in group])
            last = {
                **rollout.metrics,
                **_train_step(
                    state, engine, rollout.samples, budgets, cfg, domain, step, renderer, reference
                ),
            }
            if judge is not None:
                last.update({f"genrm/{k}": float(v) for k, v in judge.counts.items()})
            ctx.metrics.log(step, last)
            if step % cfg.checkpoint_every == 0 or step == cfg.train.steps:
                ctx.checkpoints.save(
                    step,
                    model=state.unwrapped,
                    optimizer=state.optimizer,
                    scheduler=state.scheduler,
                    extra={
                        "before": before,
                        "before_episodes": before_rows,
                        "subsets_before": subsets_before,
                        "policy_version": engine.policy_version,
                        "last": last,
                    },
                    samples=queue.samples(),
                    write_files=queue.write_files,
                )
            ctx.progress(
                step,
                cfg.train.steps,
                reward=last.get("reward_mean", 0.0),
                acc=last.get("task_reward_mean", 0.0),
            )
        last["rollout/discarded"] = float(queue.clear())
        after, after_rows = evaluate(env, engine, held_out, effort, cfg.eval, ctx.seed, "after")
        subsets_after = {
            name: evaluate(env, engine, subset_prompts[name], effort, subset_cfgs[name], ctx.seed, "after")
            for name in subsets
        }
    changes = paired_changes(before_rows, after_rows)  # after - before, with paired standard errors
    subset_reports = {}
    for name, subset in subsets.items():
        (sub_before, sub_before_rows), (sub_after, sub_after_rows) = subsets_before[name], subsets_after[name]
        subset_reports[name] = {
            "families": subset.families,
            "prompts": subset.prompts,
            "samples_per_prompt": subset.samples_per_prompt,
            **_evaluation(
                sub_before,
                sub_before_rows,
                sub_after,
                sub_after_rows,
                paired_changes(sub_before_rows, sub_after_rows),
            ),
        }
    subset_metrics = {  # the after estimates and the paired changes, with their errors
        f"{name}/{key}": value
        for name, report in subset_reports.items()
        for key, value in report.items()
        if isinstance(value, float)
    }
    ctx.metrics.log(step, {**after, **changes, **subset_metrics})
    ctx.log.info("after training: %s", _shown(after))
    for name, report in subset_reports.items():
        ctx.log.info("after training, eval subset %s: %s", name, _shown(report["after"]))
    throughput = ctx.metrics.medians(THROUGHPUT)
    ctx.log.info("tokens/s, median over iterations: %s", _shown(throughput))
    report = {
        "stage": ctx.stage_id,
        "domain": domain,
        "effort": effort,
        "prompts": len(held_out),
        "temperature": cfg.eval.temperature,  # 0: greedy
        "samples_per_prompt": cfg.eval.samples_per_prompt,
        **_evaluation(before, before_rows, after, after_rows, changes),
    }
    if subset_reports:
        report["subsets"] = subset_reports
    if before_protocol is not None:  # MOPD takes these episodes instead of replaying them
        report["before_protocol"] = before_protocol
    atomic_write_text(ctx.stage_dir / EVAL_FILE, json.dumps(report, indent=1, sort_keys=True))
    save_final_model(state.unwrapped, tokenizer, ctx.output_dir, renderer.stop_token_ids)
    return {
        **before,
        **after,
        **changes,
        **subset_metrics,
        **budget_metrics,
        **throughput,
        "steps": float(step),
        **{k: v for k, v in last.items() if k in ("reward_mean", "task_reward_mean", "over_budget_fraction")},
    }


def _evaluation(
    before: dict[str, float],
    before_rows: dict[str, list],
    after: dict[str, float],
    after_rows: dict[str, list],
    changes: dict[str, float],
) -> dict[str, Any]:
    """eval.json's record of one held-out evaluation: the trained policy's accuracy and length, the
    init model's, the paired changes (`paired_changes` of the same episodes before and after) and the
    episodes."""
    return {
        "accuracy": after["accuracy_after"],
        "accuracy_se": after["accuracy_se_after"],
        "mean_response_tokens": after["mean_response_tokens_after"],
        "mean_response_tokens_se": after["mean_response_tokens_se_after"],
        "sft": {
            "accuracy": before["accuracy_before"],
            "accuracy_se": before["accuracy_se_before"],
            "mean_response_tokens": before["mean_response_tokens_before"],
            "mean_response_tokens_se": before["mean_response_tokens_se_before"],
        },
        **changes,
        "before": before,
        "after": after,
        "episodes": {"before": before_rows, "after": after_rows},
    }


def _prefixed(evaluations: dict[str, tuple[dict[str, float], dict[str, list]]]) -> dict[str, float]:
    """Each named evaluation's metrics under "<name>/" (the eval subsets' in metrics.jsonl)."""
    return {
        f"{name}/{key}": value for name, (metrics, _) in evaluations.items() for key, value in metrics.items()
    }


def _before_protocol(
    env: Environment,
    held_out: list[Sample],
    effort: str,
    cfg: RLConfig,
    model: torch.nn.Module,
    init_digest: str,
    seed: int,
) -> dict[str, Any] | None:
    """The "before" evaluation's eval_protocol (the init model's episodes, which the MOPD stage
    reuses); None unless it plays one episode per prompt."""
    if cfg.eval.samples_per_prompt != 1:
        return None
    return eval_protocol(
        env,
        eval_episodes(env, held_out, effort, 1),
        model=model,
        policy=init_digest,
        engine=cfg.rollout.engine,
        autocast=engine_autocast(cfg.accelerate),
        temperature=cfg.eval.temperature,
        seed=seed,
    )


def _new_groups(
    env: Environment, prompts: list[Sample], step: int, cfg: RolloutConfig, effort: str, seed: int
) -> list[list[Sample]]:
    """The groups iteration `step` starts: prompts in a seeded order, reshuffled each epoch."""
    groups = []
    for j in range(cfg.groups_per_step):
        index = (step - 1) * cfg.groups_per_step + j
        epoch, position = divmod(index, len(prompts))
        order = list(range(len(prompts)))
        random.Random(f"rl-order:{seed}:{epoch}").shuffle(order)
        prompt = prompts[order[position]]
        group = f"{prompt.uid}@{step}"
        groups.append(
            [env.start(prompt, uid=f"{group}/{k}", group=group, effort=effort) for k in range(cfg.group_size)]
        )
    return groups


def _train_step(
    state: TrainState,
    engine: Engine,
    samples: list[Sample],
    budgets: dict[str, float],
    cfg: RLConfig,
    domain: str,
    step: int,
    renderer: ChatRenderer,
    reference: torch.nn.Module | None = None,
) -> dict[str, float]:
    """Score and advantage the iteration's complete groups, then `updates_per_iteration` optimizer
    steps over all of them (posttrain.trainers.policy_step)."""
    scored, rewards, metrics = trajectory_rewards(
        samples, budgets, cfg.budget.for_domain(domain), step, cfg.train.steps, renderer
    )
    if not scored:
        return {**metrics, "skipped": 1.0}
    advantages = group_advantages(
        rewards,
        [s.group for s in scored],
        scale_by_std=cfg.advantages.scale_by_std,
        leave_one_out=cfg.advantages.leave_one_out,
    )
    metrics.update(signal_stats(rewards, [s.group for s in scored], advantages))
    if not advantages.abs().max() > 0:
        # Every group's rewards are equal: no policy gradient, only rounding noise in the penalty,
        # which Adam's normalisation would blow up into a full-size step in a random direction.
        return {**metrics, "skipped": 1.0}
    width = max(len(s.tokens) for s in scored)
    trained = [p for p in state.unwrapped.parameters() if p.requires_grad]
    start = weights_snapshot(trained)
    metrics.update(
        policy_step(
            state,
            scored,
            advantages[:, None].expand(-1, width),  # one outcome advantage for every token
            step=step,
            loss=cfg.loss,
            micro_batch_size=cfg.train.micro_batch_size,
            pad_id=renderer.pad_id,
            temperature=cfg.rollout.temperature,
            updates=cfg.train.updates_per_iteration,
            policy_version=engine.policy_version,
            reference=reference,
            reference_coef=cfg.kl_to_init,
        )
    )
    metrics["update_norm"] = update_norm(trained, start)
    synced = time.perf_counter()
    publish_policy(engine, base_without_peft(state.unwrapped))
    metrics.update(weight_sync_s=time.perf_counter() - synced, policy_version=float(engine.policy_version))
    return metrics


def weights_snapshot(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The trained weights before an iteration's updates, kept for `update_norm` only: in host
    memory, so that on a GPU the metric does not hold a second copy of every trained weight in
    device memory (14 GB at 3.5B parameters in float32). The copies are non-blocking into pinned
    memory (torch's caching host allocator reuses it every iteration): pageable copies took 3.0 s an
    iteration at 1B parameters on an H100, these 0.15 s (bench/update_norm_gpu.py). Reading the
    snapshot back is ordered after them on the same stream, so nothing waits for them here."""
    return [p.detach().to("cpu", non_blocking=True, copy=True) for p in params]


def update_norm(params: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    """The L2 norm of the iteration's whole update, every trained weight together; the snapshot
    goes back to the device one parameter at a time."""
    norms = [
        (p.detach() - p0.to(p.device, non_blocking=True)).norm() for p, p0 in zip(params, start, strict=True)
    ]
    return float(torch.stack(norms).norm())


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    return reference.eval()


def signal_stats(rewards: torch.Tensor, groups: list[str], advantages: torch.Tensor) -> dict[str, float]:
    """How much reward signal an iteration's batch holds: the share of its complete groups whose
    rewards are all equal (their advantages are 0) and the trajectories with a nonzero advantage."""
    by_group: dict[str, list[float]] = {}
    for group, reward in zip(groups, rewards.tolist(), strict=True):
        by_group.setdefault(group, []).append(reward)
    flat = sum(1 for values in by_group.values() if max(values) == min(values))
    return {
        "groups_zero_variance_fraction": flat / max(len(by_group), 1),
        "advantage_nonzero_trajectories": float((advantages != 0).sum()),
    }


def _shown(metrics: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, float))
