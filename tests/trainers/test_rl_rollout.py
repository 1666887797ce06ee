"""Partial rollouts for real: the tiny K3 through the embedded engine, shipped task families, real
sandboxes and checkpoints. Extra stop tokens give the untrained model a spread of turn lengths, so
some trajectories finish early and the rest are paused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.checkpoint import CheckpointManager
from posttrain.data.chat import ChatRenderer
from posttrain.data.sample import Sample
from posttrain.engines import SamplingConfig
from posttrain.engines.testing import ScriptedTurns
from posttrain.envs.environments import EnvironmentConfig, HarnessConfig, make_environment
from posttrain.trainers.rollout import PartialRolloutConfig, RolloutQueue, version_span

EXTRA_STOPS = tuple(range(200, 420))  # about one draw in ten ends the turn


def groups_of(env, prompts: list[Sample], size: int) -> list[Sample]:
    return [
        env.start(p, uid=f"{p.uid}/{k}", group=p.uid, effort="high") for p in prompts for k in range(size)
    ]


def test_paused_trajectories_resume_under_the_next_policy_as_if_never_paused(
    tmp_path, renderer, tiny_k3_engine
):
    sampling = SamplingConfig(
        max_tokens=40,
        stop_token_ids=(renderer.end_of_turn_id, *EXTRA_STOPS),
        tool_call_token_ids=(renderer.tool_calls_end_id,),
        seed=5,
    )
    with make_environment("general", renderer, EnvironmentConfig(), sandbox_dir=tmp_path / "sb") as env:
        prompts = env.prompts("train", 4, seed=0)
        tiny_k3_engine.policy_version = 0
        synchronous = RolloutQueue(env, tiny_k3_engine, sampling, PartialRolloutConfig(fraction=1.0))
        reference = {s.uid: s for s in synchronous.step(groups_of(env, prompts, 3)).samples}
        assert len(reference) == 12 and synchronous.waiting == []

        queue = RolloutQueue(env, tiny_k3_engine, sampling, PartialRolloutConfig(fraction=0.5))
        first = queue.step(groups_of(env, prompts, 3))
        paused = [s for s in queue.waiting if s.finish_reason == "paused"]
        assert first.metrics["rollout/paused"] == len(paused) > 0
        assert len(first.samples) + len(queue.waiting) == 12
        assert all(all(s.finish_reason != "paused" for s in group) for group in first.groups)
        kept = {s.uid: (list(s.tokens), list(s.rollout_logprobs)) for s in paused}
        sampled_before_pause = sum(s.num_generated for s in paused)

        manager = CheckpointManager(tmp_path / "ckpt")
        manager.save(1, samples=queue.samples(), write_files=queue.write_files, rng=False)
        # max_staleness 1: a trajectory paused under version 0 is played to its end under version 1.
        bounded = PartialRolloutConfig(fraction=0.5, max_staleness=1)
        resumed_queue = RolloutQueue(env, tiny_k3_engine, sampling, bounded)
        resumed_queue.restore(manager.load(restore_rng=False))
        assert [s.to_json() for s in resumed_queue.waiting] == [s.to_json() for s in queue.waiting]

        tiny_k3_engine.policy_version = 1  # the optimizer stepped (weights kept, so tokens must match)
        second = resumed_queue.step([])
    assert second.metrics["rollout/resumed"] == second.metrics["rollout/overdue"] == len(paused)
    assert resumed_queue.waiting == []
    finished = {s.uid: s for s in first.samples + second.samples}
    assert sorted(finished) == sorted(reference)
    # Every trajectory is trained exactly once: a resumed one is not counted twice in its group.
    assert len(first.samples) + len(second.samples) == 12
    assert all(len({s.uid for s in group}) == len(group) == 3 for group in first.groups + second.groups)
    for uid, sample in finished.items():
        assert sample.tokens == reference[uid].tokens
        assert sample.rollout_logprobs == pytest.approx(reference[uid].rollout_logprobs, abs=1e-4)
    for uid, (tokens, logprobs) in kept.items():
        sample = finished[uid]
        assert sample.tokens[: len(tokens)] == tokens and sample.rollout_logprobs[: len(logprobs)] == logprobs
        new = [
            v
            for v, m in zip(
                sample.policy_version[len(tokens) :], sample.loss_mask[len(tokens) :], strict=True
            )
            if m
        ]
        assert new and set(new) == {1}
        assert version_span(sample) == 1
    assert second.metrics["rollout/max_span"] == 1.0
    assert second.metrics["rollout/partial_fraction"] > 0

    # Each call counts the tokens it sampled: a resumed trajectory only what it added, so the two
    # partial iterations together sampled what the synchronous one did.
    def generated(rollout) -> float:
        return rollout.metrics["rollout/generated_tokens"]

    assert generated(first) == sum(s.num_generated for s in first.samples + queue.waiting)
    resumed_sampled = sum(finished[uid].num_generated for uid in kept) - sampled_before_pause
    assert generated(second) == resumed_sampled > 0
    assert generated(first) + generated(second) == sum(s.num_generated for s in reference.values())
    assert generated(second) / second.metrics["rollout/generate_s"] == second.metrics["rollout/tokens_per_s"]


def test_a_paused_agent_resumes_from_a_checkpoint_with_its_sandbox_files(tmp_path, renderer, tiny_k3_engine):
    harness = HarnessConfig(tool_sets=[["read_file"]])
    cfg = EnvironmentConfig(families=["agent/staff_office"], max_turns=4, harness=harness)
    sampling = SamplingConfig(
        max_tokens=4,
        stop_token_ids=(renderer.end_of_turn_id,),
        tool_call_token_ids=(renderer.tool_calls_end_id,),
    )
    with make_environment("agent", renderer, cfg, sandbox_dir=tmp_path / "live-1") as env:
        prompt = env.prompts("train", 1, seed=2)[0]
        quick, agent = (env.start(prompt, uid=f"a/{k}", group="a", effort="high") for k in range(2))
        engine = ScriptedTurns(tiny_k3_engine)
        _turn(engine, quick, renderer, "Done.", None, "stop")
        path, city = agent.task["path"], agent.task["answer"]
        _turn(engine, agent, renderer, "", ("write_file", {"path": path, "content": city}), "tool_call")
        queue = RolloutQueue(env, engine, sampling, PartialRolloutConfig(fraction=0.5))
        rollout = queue.step([quick, agent])
        assert rollout.groups == [] and agent.finish_reason == "paused"
        # the tool's results are in the trajectory but not among the tokens the engine sampled
        sampled = quick.num_generated + agent.num_generated
        assert (
            rollout.metrics["rollout/generated_tokens"]
            == sampled
            < quick.response_length + agent.response_length
        )
        snapshot = Path(agent.sandbox_snapshot)
        assert (snapshot / "files" / path).read_text() == city
        paused_tokens = list(agent.tokens)
        assert paused_tokens[-2:] == renderer.assistant_header  # tool results appended, nothing generated
        manager = CheckpointManager(tmp_path / "ckpt")
        manager.save(1, samples=queue.samples(), write_files=queue.write_files, rng=False)

    with make_environment("agent", renderer, cfg, sandbox_dir=tmp_path / "live-2") as env:
        queue = RolloutQueue(env, tiny_k3_engine, sampling, PartialRolloutConfig(fraction=0.5))
        queue.restore(manager.load(restore_rng=False))
        agent = next(s for s in queue.waiting if s.uid == "a/1")
        assert Path(agent.sandbox_snapshot).parent == tmp_path / "live-2"
        assert agent.tokens == paused_tokens
        # The next turn reads the file back from the sandbox restored in this new environment.
        _turn(engine, agent, renderer, "", ("read_file", {"path": path}), "tool_call")
        env.play(engine, [agent], sampling)
    assert agent.tokens[: len(paused_tokens)] == paused_tokens
    assert [m["content"] for m in agent.messages if m["role"] == "tool"][-1] == city
    assert agent.reward == 1.0  # verified on the restored sandbox's final files
    assert not Path(agent.sandbox_snapshot or tmp_path / "none").exists()


def _turn(
    engine: ScriptedTurns,
    sample: Sample,
    renderer: ChatRenderer,
    content: str,
    call: tuple | None,
    finish: str,
) -> None:
    """Make one assistant turn the sample's next, as if the engine generated it."""
    message = {"role": "assistant", "reasoning_content": "", "content": content}
    if call is not None:
        index = sum(len(m.get("tool_calls") or []) for m in sample.messages if m["role"] == "assistant")
        name, arguments = call
        message["tool_calls"] = [
            {
                "id": f"functions.{name}:{index}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        ]
    engine.script(sample, renderer.render_assistant(message), finish)
