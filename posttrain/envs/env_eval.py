"""Held-out evaluation of a policy on one domain: accuracy and response length, with their errors.

Every RL specialist (and the SFT model it starts from) is measured on the same held-out prompts of
its domain, drawn with the eval seed and not the stage's, so the three efforts of a domain see the
same prompts; episodes are played through the domain's environment exactly as in training (real
tools, sandboxes, hidden verifiers). Each estimate comes with its standard error over prompts, and a
change between two evaluations of the same episodes (before and after training) with the paired
one: the prompts' difficulty, shared by both, cancels from it.

A sampled evaluation measures what RL optimizes, the expected reward at the sampling temperature,
where a greedy one measures only the policy's most likely path: on a prompt whose two routes the
SFT model weighs about evenly, greedy decoding turns that near tie into all or nothing, decided by
the training seed (bench/RESULTS.md). The embedded engine draws each token's noise from (seed, uid,
position), so the before and after evaluations of an episode share their noise (common random
numbers): where training left a token's distribution unchanged the same token is drawn, and the
paired error stays near a greedy evaluation's.

An evaluation is fixed by what `eval_protocol` records (the policy's weights, how it is run and
sampled, the environment and each episode's rendered prompt): the RL stages write their "before"
evaluation's protocol beside its episodes in eval.json, and MOPD, whose student is the same SFT
model on the RL stages' first held-out prompts, takes those episodes instead of replaying them
(posttrain.trainers.mopd_eval.taken_rows).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from posttrain.data.sample import Sample
from posttrain.engines.base import Engine
from posttrain.envs.environments import TRUNCATED, Environment, PromptSource
from posttrain.envs.tasks import TASK_FAMILIES, check_listed_once, registered_family
from posttrain.stats import mean_standard_error, paired_standard_error

if TYPE_CHECKING:
    import torch


class EvalSubset(BaseModel):
    """A second held-out evaluation on some of the domain's families, larger than their share of
    the domain's `prompts`: the visual questions are two of the general environment's seven
    families, about 27 of 96 prompts, too few to tell a specialist's change on them."""

    model_config = ConfigDict(extra="forbid")
    families: list[str] = Field(min_length=1, description="task families of one domain, each offered there")
    prompts: int = Field(96, gt=0, description="held-out prompts of these families, in turn")
    samples_per_prompt: int = Field(1, gt=0, description="episodes per prompt")

    @field_validator("families")
    @classmethod
    def _of_one_domain(cls, families: list[str]) -> list[str]:
        # Checked when the stage file is read: an unknown family stopped the stage at its start with
        # a KeyError, after its model and cold start were loaded.
        known = [TASK_FAMILIES.get(family) for family in families if family in TASK_FAMILIES]
        domains = {family.domain for family in known}
        for family in families:  # a typo's nearest spelling is looked for among its neighbours' domain
            registered_family(family, known[0].domain if known else None)
        check_listed_once(families)
        if len(domains) > 1:
            raise ValueError(
                f"its families belong to the domains {sorted(domains)}; a subset is evaluated by one "
                "domain's stages, so split it into one subset per domain"
            )
        return families


class EvalConfig(BaseModel):
    """Held-out prompts of the domain, the same for the three efforts (their own seed)."""

    model_config = ConfigDict(extra="forbid")
    prompts: int = Field(96, gt=0, description="held-out prompts of the domain")
    samples_per_prompt: int = Field(1, gt=0, description="episodes per held-out prompt")
    temperature: float = Field(
        0.0,
        ge=0,
        description="0: greedy; above 0 sampled, each episode's noise fixed by (stage seed, uid, "
        "position), so before and after draw the same noise (the embedded engine)",
    )
    seed: int = Field(
        0, description="draws the held-out prompts (not the stage seed: every effort sees the same)"
    )
    subsets: dict[str, EvalSubset] = Field(
        default_factory=dict,
        description="named extra evaluations (before and after, in eval.json and the report); a stage "
        "plays those whose families are its domain's, so one list serves a matrix over domains",
    )


def domain_subsets(cfg: EvalConfig, env: Environment | PromptSource) -> dict[str, EvalSubset]:
    """The subsets `env`'s stages play: those whose families belong to its domain (a subset's
    families are of one domain, `EvalSubset`). A subset naming a family the environment does not
    offer is a config error."""
    out = {}
    for name, subset in cfg.subsets.items():
        if TASK_FAMILIES.get(subset.families[0]).domain != env.domain:  # one domain's (EvalSubset)
            continue
        missing = [family for family in subset.families if family not in env.family_names]
        if missing:
            raise ValueError(
                f"eval.subsets.{name}: {missing} not offered by the {env.domain} environment; list "
                f"them under environments.{env.domain}.families (its episodes need the family)"
            )
        out[name] = subset
    return out


def subset_config(cfg: EvalConfig, subset: EvalSubset) -> EvalConfig:
    """The evaluation settings of one subset: the domain's, with its own episodes per prompt."""
    return cfg.model_copy(update={"samples_per_prompt": subset.samples_per_prompt, "subsets": {}})


def episode_rows(samples: Sequence[Sample]) -> dict[str, list]:
    """The evaluation's episodes in order: uid, reward (the verifier's; 0.0 when unscored, as in
    the accuracy) and tokens (policy-generated, tool results excluded)."""
    return {
        "uid": [s.uid for s in samples],
        "reward": [float(s.reward or 0.0) for s in samples],
        "tokens": [float(s.num_generated) for s in samples],
    }


def prompt_means(rows: Mapping[str, list], key: str) -> list[float]:
    """Per held-out prompt, in order, the mean of `key` over its episodes: the units of a standard
    error, since episodes of one prompt share its difficulty and are not independent draws. An
    episode's prompt is its uid less the last "/<copy>" (`eval_episodes`); other uids stand alone."""
    by_prompt: dict[str, list[float]] = {}
    for uid, value in zip(rows["uid"], rows[key], strict=True):
        by_prompt.setdefault(uid.rsplit("/", 1)[0], []).append(float(value))
    return [sum(values) / len(values) for values in by_prompt.values()]


def summary(rows: Mapping[str, list], suffix: str) -> dict[str, float]:
    """accuracy and mean_response_tokens of episode rows, each with its standard error over prompts."""
    n = max(len(rows["uid"]), 1)
    return {
        f"accuracy_{suffix}": sum(rows["reward"]) / n,
        f"accuracy_se_{suffix}": mean_standard_error(prompt_means(rows, "reward")),
        f"mean_response_tokens_{suffix}": sum(rows["tokens"]) / n,
        f"mean_response_tokens_se_{suffix}": mean_standard_error(prompt_means(rows, "tokens")),
    }


def paired_changes(before: Mapping[str, list], after: Mapping[str, list]) -> dict[str, float]:
    """accuracy_change and mean_response_tokens_change (after - before) with their paired standard
    errors over prompts; the two evaluations must hold the same episodes in the same order."""
    if before["uid"] != after["uid"]:
        raise ValueError("the two evaluations played different episodes; a paired change needs the same")
    n = max(len(before["uid"]), 1)
    out = {}
    for key, name in (("reward", "accuracy"), ("tokens", "mean_response_tokens")):
        out[f"{name}_change"] = (sum(after[key]) - sum(before[key])) / n
        out[f"{name}_change_se"] = paired_standard_error(prompt_means(before, key), prompt_means(after, key))
    return out


def eval_episodes(
    env: Environment, prompts: Sequence[Sample], effort: str, samples_per_prompt: int
) -> list[Sample]:
    """The evaluation's episodes, fresh from Environment.start: each prompt `samples_per_prompt`
    times, uids eval/<prompt uid>/<effort>/<k> (the uid fixes a sampled episode's noise: one
    prompt's episodes at the three efforts, played together by MOPD, draw apart)."""
    return [
        env.start(p, uid=f"eval/{p.uid}/{effort}/{k}", group=f"eval/{p.uid}", effort=effort)
        for p in prompts
        for k in range(samples_per_prompt)
    ]


def eval_family(uid: str) -> str:
    """The task family of an evaluation episode or group from its uid (`eval_episodes`: eval/<prompt
    uid>[/<effort>/<k>], a task family drawing prompt uids <family>-<hex>):
    eval/general/ordering-677fd05656/max/0 -> general/ordering. eval.json keeps only the uids, so
    per-family tables read it from them."""
    return uid.removeprefix("eval/").rsplit("-", 1)[0]


def family_sums(rows: Mapping[str, list], key: str = "reward") -> dict[str, float]:
    """Per task family (`eval_family`) and in all ("all"), the sum of `key` over episode rows
    (episode_rows, eval.json's episodes): with the reward, the episodes solved per family."""
    sums = {"all": 0.0}
    for uid, value in zip(rows["uid"], rows[key], strict=True):
        family = eval_family(uid)
        sums[family] = sums.get(family, 0.0) + value
        sums["all"] += value
    return sums


def eval_protocol(
    env: Environment,
    samples: Sequence[Sample],
    *,
    model: torch.nn.Module,
    policy: str,
    engine: str,
    autocast: object,
    temperature: float,
    seed: int,
) -> dict[str, Any]:
    """What fixes the episodes of an evaluation with one episode per prompt: the policy (`policy`:
    its weights' digest, posttrain.rewards.budget.model_digest), how it is run (the engine backend,
    the device type and QAT config of `model`, the autocast dtype), how it samples (the
    temperature; the seed when above 0), the domain's environment (turns, tokens per turn,
    submissions, harness), how a turn ends, and each episode's uid and rendered prompt (`samples`
    fresh from Environment.start: a digest of its tokens, which hold the question, tools, system
    prompt and effort marker). JSON-safe. Two evaluations with equal protocols, one's episodes a
    prefix of the other's, play the same episodes: greedy decoding draws no noise, and the embedded
    engine draws a sampled token's from (seed, uid, position), so only the float rounding of their
    batch composition differs between them (MOPD's and the RL stages' greedy rows agreed episode
    for episode on the default run; bench/RESULTS.md). Another engine's sampled episodes are the
    same draw in distribution only; the engine is part of the protocol."""
    from posttrain.qat.apply import QAT_CONFIG_KEY  # here: posttrain.qat imports torch

    turn = env.turn_sampling(temperature, seed)
    device = next(model.parameters()).device.type
    qat = getattr(getattr(model, "config", None), QAT_CONFIG_KEY, None)
    return json.loads(
        json.dumps(
            {
                "policy": policy,
                "engine": engine,
                "device": device,
                "autocast": str(autocast),
                "qat": qat,
                "sampling": {"temperature": temperature, "seed": seed if temperature > 0 else None},
                "domain": env.domain,
                "environment": env.config.model_dump(mode="json"),
                "turn": {
                    "max_tokens": turn.max_tokens,
                    "stop_token_ids": list(turn.stop_token_ids),
                    "tool_call_token_ids": list(turn.tool_call_token_ids),
                },
                "prompts": [
                    hashlib.sha256(json.dumps([s.uid, s.tokens]).encode()).hexdigest()[:16] for s in samples
                ],
            },
            default=str,
        )
    )


def same_episodes(protocol: Mapping[str, Any], played: Mapping[str, Any]) -> bool:
    """Whether an evaluation of `protocol` would play the first episodes of one `played` already
    (eval_protocol): everything equal, and its episodes the first of the played ones."""
    n = len(protocol["prompts"])
    return {k: v for k, v in protocol.items() if k != "prompts"} == {
        k: v for k, v in played.items() if k != "prompts"
    } and list(played.get("prompts", []))[:n] == list(protocol["prompts"])


def evaluate(
    env: Environment,
    engine: Engine,
    prompts: list[Sample],
    effort: str,
    cfg: EvalConfig,
    seed: int,
    suffix: str,
) -> tuple[dict[str, float], dict[str, list]]:
    """Play every held-out prompt `samples_per_prompt` times. Returns the metrics (`summary`, plus
    the truncated share, unscored episodes and seconds taken) and the episode rows, which pair this
    evaluation with another of the same prompts (`paired_changes`)."""
    samples = eval_episodes(env, prompts, effort, cfg.samples_per_prompt)
    started = time.perf_counter()
    # Processed log-probs, the rollouts' kind: a vLLM engine records one kind (the eval reads none).
    env.play(engine, samples, env.turn_sampling(cfg.temperature, seed, logprobs="processed"))
    rows = episode_rows(samples)
    metrics = {
        **summary(rows, suffix),
        f"truncated_{suffix}": sum(s.metrics.get(TRUNCATED, 0.0) for s in samples) / len(samples),
        f"eval_unscored_{suffix}": float(sum(s.reward is None for s in samples)),
        f"eval_s_{suffix}": time.perf_counter() - started,
    }
    return metrics, rows
