"""Held-out evaluation of a policy on one domain: accuracy and response length.

Every RL specialist (and the SFT model it starts from) is measured on the same held-out prompts of
its domain, drawn with the eval seed and not the stage's, so the three efforts of a domain see the
same prompts; episodes are played through the domain's environment exactly as in training (real
tools, sandboxes, hidden verifiers).
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

from posttrain.data.sample import Sample
from posttrain.engines.base import Engine
from posttrain.envs.environments import TRUNCATED, Environment


class EvalConfig(BaseModel):
    """Held-out prompts of the domain, the same for the three efforts (their own seed)."""

    model_config = ConfigDict(extra="forbid")
    prompts: int = Field(16, gt=0, description="held-out prompts of the domain")
    samples_per_prompt: int = Field(1, gt=0, description="episodes per held-out prompt")
    temperature: float = Field(0.0, ge=0, description="0: greedy")
    seed: int = Field(
        0, description="draws the held-out prompts (not the stage seed: every effort sees the same)"
    )


def evaluate(
    env: Environment,
    engine: Engine,
    prompts: list[Sample],
    effort: str,
    cfg: EvalConfig,
    seed: int,
    suffix: str,
) -> dict[str, float]:
    """accuracy (mean task reward: the share solved under 0/1 verifiers) and mean_response_tokens
    (policy-generated tokens per trajectory, tool results excluded) on the held-out prompts."""
    samples = [
        env.start(p, uid=f"eval/{p.uid}/{k}", group=f"eval/{p.uid}", effort=effort)
        for p in prompts
        for k in range(cfg.samples_per_prompt)
    ]
    started = time.perf_counter()
    env.play(engine, samples, env.turn_sampling(cfg.temperature, seed))
    scored = [s for s in samples if s.reward is not None]
    n = max(len(scored), 1)
    return {
        f"accuracy_{suffix}": sum(float(s.reward) for s in scored) / n,
        f"mean_response_tokens_{suffix}": sum(s.num_generated for s in samples) / len(samples),
        f"truncated_{suffix}": sum(s.metrics.get(TRUNCATED, 0.0) for s in samples) / len(samples),
        f"eval_unscored_{suffix}": float(len(samples) - len(scored)),
        f"eval_s_{suffix}": time.perf_counter() - started,
    }
