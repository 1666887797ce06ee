"""Budget reward (posttrain.rewards.budget): the -1 boundary, tau annealing, per-domain usage counting, and
b0 from cold-start samples. The cache the `rl` stage keeps b0 in is tested in
tests/rewards/test_budget_cache.py."""

import math

import numpy as np
import pytest
from pydantic import ValidationError

from posttrain.data.sample import Sample
from posttrain.rewards.budget import (
    BaseBudget,
    BudgetConfig,
    anneal,
    base_budget,
    budget_reward,
    estimate_base_budget,
    quantile,
    sample_budget_reward,
    tau_at,
    usage_tokens,
)

THINK, END_THINK = 900, 901


def agent_trajectory(domain: str = "agent", effort: str = "high", group: str = "p0") -> Sample:
    """Prompt ending in an assistant header, a turn that thinks, calls a tool, a tool result, and
    a second turn that thinks briefly and answers."""
    s = Sample(uid="u", domain=domain, effort=effort, group=group)
    s.append([1, 2, 3], generated=False)  # system/user/assistant header
    s.prompt_length = 3
    s.append([THINK, 10, 11, 12, END_THINK], generated=True)  # 3 thinking tokens
    s.append([20, 21, 22, 23], generated=True)  # tool call: name + arguments + end
    s.append([30, 31, 32, THINK], generated=False)  # tool result, next header opens thinking
    s.append([40, END_THINK, 41, 42, 43], generated=True)  # thinking opened by the header: 1
    return s


def test_exactly_tau_times_b0_is_within_budget():
    assert budget_reward(0.7, usage=10, b0=5.0, tau=2.0) == 0.7
    assert budget_reward(0.7, usage=11, b0=5.0, tau=2.0) == -1.0
    assert budget_reward(0.0, usage=6, b0=4.0, tau=1.5) == 0.0
    assert budget_reward(1.0, usage=7, b0=4.0, tau=1.5) == -1.0


def test_anneal_endpoints_and_shapes():
    for shape in ("linear", "cosine"):
        assert anneal(0, 100, 2.0, 0.5, shape) == 2.0
        assert anneal(100, 100, 2.0, 0.5, shape) == 0.5
        assert anneal(250, 100, 2.0, 0.5, shape) == 0.5
        assert anneal(-3, 100, 2.0, 0.5, shape) == 2.0
        assert anneal(50, 100, 2.0, 0.5, shape) == pytest.approx(1.25)
    assert anneal(25, 100, 2.0, 0.5, "linear") == pytest.approx(1.625)
    assert anneal(25, 100, 2.0, 0.5, "cosine") == pytest.approx(0.5 + 1.5 * (1 + math.cos(math.pi / 4)) / 2)
    with pytest.raises(ValueError, match="total_steps must be > 0"):
        anneal(0, 0, 1.0, 1.0)
    with pytest.raises(ValueError, match="'linear' or 'cosine'"):
        anneal(0, 10, 1.0, 1.0, "step")


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_effort_order_holds_at_every_step(schedule):
    cfg = BudgetConfig(schedule=schedule)
    for step in range(0, 41):
        low, high, top = (tau_at(cfg, e, step, 40) for e in ("low", "high", "max"))
        assert top > high > low
    assert tau_at(cfg, "low", 0, 40) == cfg.tau["low"].tau_start
    assert tau_at(cfg, "low", 40, 40) == cfg.tau["low"].tau_end


def test_config_rejects_a_wrong_effort_order_or_set():
    bad = {
        "low": {"tau_start": 1.0, "tau_end": 1.2},
        "high": {"tau_start": 1.5, "tau_end": 1.1},
        "max": {"tau_start": 2.0, "tau_end": 2.0},
    }
    with pytest.raises(ValidationError, match="tau_end must order max > high > low"):
        BudgetConfig(tau=bad)
    with pytest.raises(ValidationError, match="exactly the efforts"):
        BudgetConfig(tau={"low": {"tau_start": 1.0, "tau_end": 1.0}})
    with pytest.raises(ValidationError, match="extra"):
        BudgetConfig(taus={})
    with pytest.raises(ValueError, match="unknown effort 'medium'"):
        tau_at(BudgetConfig(), "medium", 0, 10)


def test_a_domain_can_replace_the_tau_of_some_efforts():
    cfg = BudgetConfig(tau_by_domain={"agent": {"low": {"tau_start": 0.9, "tau_end": 0.7}}})
    agent = cfg.for_domain("agent")
    assert agent.tau["low"].tau_end == 0.7 and agent.tau["high"] == cfg.tau["high"]
    assert tau_at(agent, "low", 10, 10) == 0.7 and tau_at(cfg, "low", 10, 10) == cfg.tau["low"].tau_end
    assert cfg.for_domain("general") is cfg
    # the merged table must still order the efforts, and name only known ones
    with pytest.raises(ValidationError, match=r"tau_by_domain.agent \(over tau\): \*.tau_end must order"):
        BudgetConfig(tau_by_domain={"agent": {"low": {"tau_start": 0.9, "tau_end": 1.2}}})
    with pytest.raises(ValidationError, match="tau_by_domain.agent: unknown efforts"):
        BudgetConfig(tau_by_domain={"agent": {"medium": {"tau_start": 0.9, "tau_end": 0.7}}})


def test_usage_counts_per_domain():
    s = agent_trajectory()
    # thinking: 10, 11, 12 in turn one and 40 in turn two (its header, not generated, opened the span)
    assert usage_tokens(s, "thinking", (THINK, END_THINK)) == 4
    # output: every generated token, markers, tool call and answer included
    assert usage_tokens(s, "output") == 5 + 4 + 5
    # a tool result arriving inside an open thinking span is not generated: it does not count
    interrupted = Sample(uid="v")
    interrupted.append([THINK, 5], generated=True)
    interrupted.append([6, 7], generated=False)
    interrupted.append([8, END_THINK, 9], generated=True)
    assert usage_tokens(interrupted, "thinking", (THINK, END_THINK)) == 2
    cfg = BudgetConfig()
    assert cfg.usage_kind("general") == "thinking"
    assert cfg.usage_kind("coding") == cfg.usage_kind("agent") == "output"
    with pytest.raises(ValueError, match="domain 'vision' has no budget usage counting"):
        cfg.usage_kind("vision")
    with pytest.raises(ValueError, match="thinking_markers"):
        usage_tokens(s, "thinking")


def test_sample_budget_reward_uses_domain_counting_and_annealed_tau():
    cfg = BudgetConfig()
    general = agent_trajectory(domain="general", effort="low")  # T = 4 thinking tokens
    # low effort: tau 1.0 at step 0 -> limit 4.0 (within); tau 0.5 at the end -> limit 2.0 (over)
    assert sample_budget_reward(general, 0.8, 4.0, cfg, 0, 10, (THINK, END_THINK)) == (0.8, 4, 4.0, False)
    assert sample_budget_reward(general, 0.8, 4.0, cfg, 10, 10, (THINK, END_THINK)) == (-1.0, 4, 2.0, True)
    coding = agent_trajectory(domain="coding", effort="max")  # T = 14 output tokens, tau 2.0
    assert sample_budget_reward(coding, 1.0, 7.0, cfg, 5, 10).reward == 1.0
    assert sample_budget_reward(coding, 1.0, 6.9, cfg, 5, 10).reward == -1.0


@pytest.mark.parametrize("q", [0.1, 0.5, 0.9, 1.0])
def test_quantile_matches_numpy(q):
    values = [7.0, 1.0, 30.0, 4.0, 12.0, 12.0]
    assert quantile(values, q) == pytest.approx(float(np.quantile(values, q)))


def test_base_budget_from_successes_with_fallback_and_floor():
    usages = [10, 20, 30, 40, 100]
    cfg = BudgetConfig(quantile=0.9)
    b = base_budget(usages, [True, True, False, True, False], cfg)
    assert b == BaseBudget(tokens=36.0, quantile=0.9, num_samples=5, num_successes=3, source="successes")
    median = base_budget(usages, [False] * 5, BudgetConfig())
    assert (median.tokens, median.source, median.num_successes) == (30.0, "all", 0)
    floored = base_budget([0, 0], [True, True], BudgetConfig(min_budget_tokens=8))
    assert floored.tokens == 8
    with pytest.raises(ValueError, match="2 usages but 1 success flags"):
        base_budget([1, 2], [True], cfg)


def test_estimate_base_budget_from_cold_start_samples():
    samples = [agent_trajectory(domain="general"), agent_trajectory(domain="general")]
    samples[1].append([THINK, 50, 51, END_THINK], generated=True)  # 6 thinking tokens
    b = estimate_base_budget(samples, [True, True], BudgetConfig(), (THINK, END_THINK))
    assert b.tokens == 5.0
    samples[1].group = "other"
    with pytest.raises(ValueError, match="must share a group"):
        estimate_base_budget(samples, [True, True], BudgetConfig(), (THINK, END_THINK))


def test_a_custom_domains_usage_is_added_to_the_shipped_domains():
    # rl.yaml with math in its matrix writes only math's rule (docs/mopd.md): agent and coding
    # must still count output tokens, general thinking ones
    cfg = BudgetConfig(usage={"math": "thinking"})
    assert cfg.usage_kind("math") == "thinking" and cfg.usage_kind("general") == "thinking"
    assert cfg.usage_kind("coding") == cfg.usage_kind("agent") == "output"
    # a shipped domain's rule can still be changed
    assert BudgetConfig(usage={"agent": "thinking"}).usage_kind("agent") == "thinking"


def test_tau_by_domain_names_a_domain_with_usage_counting():
    # a misspelled domain would leave agent's runs on the general tau, silently
    misspelled = r"tau_by_domain.agnet: 'agnet' is not a domain .* did you mean 'agent'"
    with pytest.raises(ValidationError, match=misspelled):
        BudgetConfig(tau_by_domain={"agnet": {"low": {"tau_start": 1.2, "tau_end": 1.2}}})
    with pytest.raises(ValidationError, match=r"add budget.usage.math for a custom domain"):
        BudgetConfig(tau_by_domain={"math": {"low": {"tau_start": 0.5, "tau_end": 0.3}}})
    low = {"low": {"tau_start": 0.5, "tau_end": 0.3}}
    custom = {"usage": {"math": "thinking"}, "tau_by_domain": {"math": low}}
    assert BudgetConfig.model_validate(custom).for_domain("math").tau["low"].tau_end == 0.3
