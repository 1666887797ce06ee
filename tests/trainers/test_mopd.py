"""The `mopd` stage kind on the tiny K3: the reward reaches the loss as the spec writes it, only on
student tokens (never the prompt or tool results), multi-turn agent episodes are played with real
tools and scored by their teacher, and the whole stage writes eval.json and resumes bit for bit."""

from __future__ import annotations

import json
import logging
import math
import random
import statistics
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import posttrain.model  # noqa: F401  (registers kimi_k3 with AutoModelForCausalLM)
from posttrain.algos import paired_change_standard_error, token_mean_standard_error
from posttrain.algos.advantages import group_balance_weights, returns_to_go, subtract_group_mean
from posttrain.algos.policy_loss import PolicyLossConfig
from posttrain.data.batch import TokenBatch
from posttrain.data.chat import ChatRenderer
from posttrain.data.sample import DOMAINS, EFFORTS, Sample
from posttrain.engines import EmbeddedEngine, SamplingConfig
from posttrain.engines.testing import ScriptedTurns, save_tiny_k3
from posttrain.envs.environments import EnvironmentConfig, make_environment, play_episodes
from posttrain.envs.tasks import TASK_FAMILIES, Episode
from posttrain.metrics import read_metrics
from posttrain.qat import qat_config_of, restore_qat
from posttrain.stats import mean_standard_error
from posttrain.trainers import mopd
from posttrain.trainers.common import TrainState
from posttrain.trainers.mopd import Distiller, MOPDConfig, token_rewards
from posttrain.trainers.mopd_eval import episode_table, exact_results, pair_results, write_eval
from posttrain.trainers.mopd_teachers import TeacherConfig, TeacherPool, route_teachers
from posttrain.trainers.policy_step import micro_batch_loss

R_MAX = 5.0
# log-ratios on student tokens: the spec's two examples, two beyond the clip, one small
STUDENT_DELTAS = (math.log(0.6) - math.log(0.2), math.log(0.05) - math.log(0.2), 9.0, -9.0, 0.3)
EVAL_KEYS = {
    "kl_before", "kl_after", "kl_tokens_before", "kl_tokens_after",
    "accuracy_before", "accuracy_after", "tokens_before", "tokens_after",
    "kl_exact_before", "kl_exact_after",
    "accuracy_se_before", "accuracy_se_after", "tokens_se_before", "tokens_se_after",
    "accuracy_change", "accuracy_change_se", "tokens_change", "tokens_change_se", "accuracy_episodes",
}  # fmt: skip
# each throughput's seconds: `<stage>_tokens_per_s` is `<stage>_tokens` over them
SECONDS = {"rollout": "rollout_s", "teacher": "teacher_score_s", "train": "train_s"}
TIMINGS = {"time", *SECONDS.values(), *(f"{stage}_tokens_per_s" for stage in SECONDS)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, renderer) -> dict[str, Path]:
    """A student ("sft") and one teacher per effort, tiny K3 checkpoints."""
    root = tmp_path_factory.mktemp("mopd-models")
    found = {"sft": save_tiny_k3(root / "sft", renderer.tokenizer, seed=0, sharpen=4.0)}
    for seed, effort in enumerate(EFFORTS, start=1):
        found[effort] = save_tiny_k3(root / effort, renderer.tokenizer, seed=seed, sharpen=4.0)
    return found


def load(path: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    restore_qat(model)
    return model


def agent_trajectory(renderer: ChatRenderer) -> Sample:
    """A solved multi-turn agent episode (real tool results) as if the student had generated every
    assistant token: loss_mask 1 on them, 0 on the prompt, headers and tool results."""
    family = TASK_FAMILIES.get("agent/order_total")()
    prompt = family.make_prompt(random.Random(0), "high")
    ids, mask = renderer.render(family.demonstrate(prompt), prompt.tools, "high")
    assert any(m["role"] == "tool" for m in family.demonstrate(prompt))
    return Sample(
        uid="demo",
        domain="agent",
        effort="high",
        tokens=ids,
        prompt_length=mask.index(1),
        loss_mask=mask,
        rollout_logprobs=[0.0] * len(ids),
        policy_version=[0 if m else -1 for m in mask],
    )


def test_the_loss_is_the_policy_gradient_of_the_clipped_log_ratio_on_student_tokens_only(dirs, renderer):
    student = load(dirs["sft"])
    sample = agent_trajectory(renderer)
    sample.rollout_logprobs = EmbeddedEngine(student).score([sample])[0]  # the student's own, T=1
    trained = [i for i, m in enumerate(sample.loss_mask) if m and i >= sample.prompt_length]
    tool_tokens = [i for i in range(sample.prompt_length, len(sample.tokens)) if not sample.loss_mask[i]]
    assert trained and tool_tokens

    def with_teacher(outside: float) -> list[float]:
        deltas = [outside] * len(sample.tokens)  # would dominate the loss if it leaked in
        for k, i in enumerate(trained):
            deltas[i] = STUDENT_DELTAS[k % len(STUDENT_DELTAS)]
        sample.teacher_logprobs = [s + d for s, d in zip(sample.rollout_logprobs, deltas, strict=True)]
        return token_rewards([sample], R_MAX)[0][0].tolist()

    rewards = with_teacher(50.0)
    expected = [max(-R_MAX, min(R_MAX, STUDENT_DELTAS[k % len(STUDENT_DELTAS)])) for k in range(len(trained))]
    assert [rewards[i] for i in trained] == pytest.approx(expected, abs=1e-5)
    assert {rewards[i] for i in range(len(rewards)) if i not in trained} == {0.0}
    assert rewards[trained[0]] == pytest.approx(1.0986, abs=1e-4)
    assert rewards[trained[1]] == pytest.approx(-1.3863, abs=1e-4)

    student.train()
    batch = TokenBatch.of([sample], renderer.pad_id)
    out, _ = micro_batch_loss(student, batch, torch.tensor([rewards]), config=PolicyLossConfig())
    assert float(out.loss.detach()) == pytest.approx(-sum(expected) / len(expected), abs=1e-4)
    assert out.stats["log_ratio_abs_max"] < 1e-4  # trainer and engine agree: on-policy
    out.loss.backward()
    got = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}

    # The same gradient from a plain forward: d/dtheta of -(1/N) sum_t r_t log p_theta(y_t).
    student.zero_grad()
    logits = student(input_ids=torch.tensor([sample.tokens])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(sample.tokens[1:])[:, None])[:, 0]
    r = torch.tensor(with_teacher(-50.0)[1:])
    (-(r * logp).sum() / len(trained)).backward()
    for name, parameter in student.named_parameters():
        if parameter.grad is not None:
            torch.testing.assert_close(got[name], parameter.grad, atol=2e-5, rtol=2e-3)


def test_agent_episodes_run_real_tools_and_only_student_tokens_are_rewarded(dirs, renderer, tmp_path):
    cfg = EnvironmentConfig(families=["agent/order_total"], max_turns=2, max_tokens_per_turn=6)
    routes = route_teachers(
        MOPDConfig.model_validate({"domains": ["agent"], "efforts": ["high"], "train": {"steps": 1}}),
        {"rl-agent-high": dirs["high"]},
    )
    pool = TeacherPool(routes, tmp_path, max_retries=0, log=logging.getLogger("test-mopd"))
    student = EmbeddedEngine(load(dirs["sft"]), pad_token_id=renderer.pad_id)
    sampling = SamplingConfig(
        max_tokens=6,
        stop_token_ids=(renderer.end_of_turn_id,),
        tool_call_token_ids=(renderer.tool_calls_end_id,),
        seed=0,
    )
    with make_environment("agent", renderer, cfg, sandbox_dir=tmp_path / "sandboxes") as env:
        sample = env.start(env.prompts("train", 1, seed=3)[0], uid="ep/0", group="ep", effort="high")
        family = TASK_FAMILIES.get(sample.task["family"])()
        # The first turn calls the search tool (the family's own solution), as a trained student would.
        turn = renderer.render_assistant(next(family.demonstration(sample, Episode(family, sample, None))))
        scripted = ScriptedTurns(student)
        scripted.script(sample, turn, "tool_call")
        finished: list[list[str]] = []
        play_episodes(
            {"agent": env},
            scripted,
            [sample],
            {"agent": sampling},
            on_finished=lambda done: (finished.append([s.uid for s in done]), pool.score(done)),
        )
    pool.close()

    assert finished == [["ep/0"]] and sample.done and sample.reward is not None
    tool_messages = [m for m in sample.messages if m["role"] == "tool"]
    assert tool_messages and "price" in tool_messages[0]["content"]  # the shipped catalog, searched for real
    results = renderer.render_tool_results(tool_messages)
    start = sample.prompt_length + len(turn)
    assert sample.tokens[start : start + len(results)] == results
    second = sample.tokens[start + len(results) :]
    assert 1 <= len(second) <= 6 and sample.loss_mask[start + len(results) :] == [1] * len(second)
    assert len(sample.teacher_logprobs) == len(sample.tokens)
    rewards = token_rewards([sample], R_MAX)[0][0].tolist()
    assert rewards[start : start + len(results)] == [0.0] * len(results)
    assert rewards[: sample.prompt_length] == [0.0] * sample.prompt_length
    assert all(r != 0.0 for r in rewards[start + len(results) :])


def stage_body() -> dict:
    return {
        "train": {"steps": 2, "lr": 1e-4},
        "rollout": {"prompts_per_domain": 1},
        "eval": {"prompts_per_domain": 1, "accuracy_prompts_per_domain": 2, "samples_per_prompt": 1},
        "environments": {d: {"max_tokens_per_turn": 8, "max_turns": 2} for d in DOMAINS},
        "checkpoint_every": 1,
    }


def stage_inputs(dirs: dict[str, Path]) -> dict[str, Path]:
    return {"sft": dirs["sft"], **{f"rl-{d}-{e}": dirs[e] for d in DOMAINS for e in EFFORTS}}


@pytest.fixture(scope="module")
def uninterrupted(dirs, tmp_path_factory, stage_runner) -> tuple[Path, dict]:
    ctx = stage_runner.context(
        "mopd", tmp_path_factory.mktemp("run-a"), stage_body(), inputs=stage_inputs(dirs)
    )
    return ctx.stage_dir, stage_runner.run(ctx)


def test_the_stage_trains_the_sft_student_and_writes_eval_json(uninterrupted, dirs):
    stage_dir, final = uninterrupted
    report = json.loads((stage_dir / "eval.json").read_text())
    assert sorted(report) == sorted(f"{d}-{e}" for d in DOMAINS for e in EFFORTS)
    for values in report.values():
        assert set(values) == EVAL_KEYS and all(math.isfinite(v) for v in values.values())
        assert 0 < values["tokens_before"] <= 16 and 0 < values["tokens_after"] <= 16
    assert final["steps"] == 2.0 and final["teacher_retries"] == 0.0
    assert final["kl_before"] == pytest.approx(sum(v["kl_before"] for v in report.values()) / 9)
    # the episodes behind each pair's numbers, kept beside them: accuracy from the accuracy rows,
    # the sampled KL's token count from the sampled rows, before and after on the same uids
    episodes = json.loads((stage_dir / "eval_episodes.json").read_text())
    assert sorted(episodes) == sorted(report)
    for name, values in report.items():
        for when in ("before", "after"):
            rows = episodes[name][when]
            accuracy = rows["accuracy"]
            assert len(accuracy["uid"]) == values["accuracy_episodes"]
            assert sum(accuracy["reward"]) / len(accuracy["reward"]) == pytest.approx(
                values[f"accuracy_{when}"]
            )
            assert sum(rows["tokens"]) == values[f"kl_tokens_{when}"]
        assert episodes[name]["before"]["uid"] == episodes[name]["after"]["uid"]
        assert episodes[name]["before"]["accuracy"]["uid"] == episodes[name]["after"]["accuracy"]["uid"]

    steps = [r for r in read_metrics(stage_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert final["train_kl"] == pytest.approx(steps[-1]["kl"]) and final["train_kl"] > 0
    for record in steps:
        assert {f"response_length/{e}" for e in EFFORTS} | {
            f"kl/{d}-{e}" for d in DOMAINS for e in EFFORTS
        } <= set(record)
        assert record["teacher_retries"] == 0.0 and record["student_tokens"] > 0
        if record["reward_clipped_fraction"] == 0.0:  # unclipped: mean reward is minus the batch KL
            assert record["reward"] == pytest.approx(-record["kl"], abs=1e-6)
        # Throughput: the student sampled the tokens it trains on; its forward and the teachers'
        # prefill read the whole trajectories (prompts and tool results too).
        assert record["rollout_tokens"] == record["student_tokens"] == record["trained_tokens"]
        assert record["teacher_tokens"] == record["train_tokens"] > record["student_tokens"]
        for stage, seconds in SECONDS.items():
            rate = record[f"{stage}_tokens_per_s"]
            assert 0 < rate < math.inf and rate * record[seconds] == pytest.approx(record[f"{stage}_tokens"])
    for stage in SECONDS:
        assert final[f"{stage}_tokens_per_s_median"] == statistics.median(
            r[f"{stage}_tokens_per_s"] for r in steps
        )

    model = AutoModelForCausalLM.from_pretrained(str(stage_dir / ".model-tmp"))
    assert qat_config_of(model.config).scheme == "k3"
    trained = model.state_dict()["model.embed_tokens.weight"]
    start = load(dirs["sft"]).state_dict()["model.embed_tokens.weight"]
    other = load(dirs["low"]).state_dict()["model.embed_tokens.weight"]
    assert (
        0 < (trained - start).abs().max() < 0.1 * (trained - other).abs().max()
    )  # trained from the SFT model


def test_a_killed_stage_resumes_bit_for_bit(uninterrupted, dirs, tmp_path, stage_runner):
    stage_dir, _ = uninterrupted
    crashed = stage_runner.context("mopd", tmp_path, stage_body(), inputs=stage_inputs(dirs), crash_at=1)
    with pytest.raises(stage_runner.FakeCrash):
        stage_runner.run(crashed)
    stage_runner.run(stage_runner.context("mopd", tmp_path, stage_body(), inputs=stage_inputs(dirs)))

    assert (
        load_file(tmp_path / "mopd" / ".model-tmp" / "model.safetensors").keys()
        == load_file(stage_dir / ".model-tmp" / "model.safetensors").keys()
    )
    resumed = load_file(tmp_path / "mopd" / ".model-tmp" / "model.safetensors")
    for name, tensor in load_file(stage_dir / ".model-tmp" / "model.safetensors").items():
        assert torch.equal(tensor, resumed[name]), name

    def logged(directory: Path) -> list[dict]:
        return [
            {k: v for k, v in r.items() if k not in TIMINGS}
            for r in read_metrics(directory / "metrics.jsonl")
        ]

    assert logged(tmp_path / "mopd") == logged(stage_dir)
    for name in ("eval.json", "eval_episodes.json"):
        assert (tmp_path / "mopd" / name).read_text() == (stage_dir / name).read_text()


def test_a_stage_resumed_from_its_final_checkpoint_reports_its_last_step(
    uninterrupted, dirs, tmp_path, stage_runner
):
    _, straight = uninterrupted
    steps = stage_body()["train"]["steps"]
    crashed = stage_runner.context("mopd", tmp_path, stage_body(), inputs=stage_inputs(dirs), crash_at=steps)
    with pytest.raises(stage_runner.FakeCrash):  # killed after the final checkpoint, before the end
        stage_runner.run(crashed)
    resumed = stage_runner.run(
        stage_runner.context("mopd", tmp_path, stage_body(), inputs=stage_inputs(dirs))
    )
    assert resumed["train_loss"] == straight["train_loss"] and resumed["train_kl"] == straight["train_kl"]


def test_a_diverged_student_fails_the_next_step_saying_so_and_that_no_checkpoint_exists(
    dirs, tmp_path, stage_runner, monkeypatch
):
    real = TrainState.optimizer_step

    def diverging_step(self, step):  # injected fault: the update leaves a NaN weight behind
        metrics = real(self, step)
        with torch.no_grad():
            self.unwrapped.lm_head.weight[0, 0] = float("nan")
        return metrics

    monkeypatch.setattr(TrainState, "optimizer_step", diverging_step)
    body = stage_body() | {"checkpoint_every": 5}
    ctx = stage_runner.context("mopd", tmp_path, body, inputs=stage_inputs(dirs))
    with pytest.raises(ValueError) as error:
        stage_runner.run(ctx)
    message = str(error.value)
    assert message.startswith("step 2: NaN student log-prob") and "the student diverged" in message
    assert "no checkpoint was written yet" in message and "intact" not in message


def test_lora_trains_only_the_adapters_and_saves_them_merged(dirs, tmp_path, stage_runner):
    body = stage_body() | {"lora": {"r": 4, "alpha": 8}, "train": {"steps": 2, "lr": 1e-2}}
    ctx = stage_runner.context("mopd", tmp_path, body, inputs=stage_inputs(dirs))
    stage_runner.run(ctx)
    before = load_file(str(dirs["sft"] / "model.safetensors"))
    # the stage writes the released layout: the flat names under `language_model.`
    after = {
        n.removeprefix("language_model."): t
        for n, t in load_file(str(ctx.output_dir / "model.safetensors")).items()
    }
    assert after.keys() == before.keys()  # merged: a plain K3 checkpoint, no adapter tensors
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    linear = {n for n, t in before.items() if n.endswith(".weight") and t.dim() == 2}
    assert changed & linear
    # what is not an nn.Linear (embeddings, norms, the routed experts' batched 3-D weights) is frozen
    assert not {n for n in changed if before[n].dim() != 2 or "embed_tokens" in n or "lm_head" in n} - {
        n for n in before if n.endswith("e_score_correction_bias")
    }


def test_the_kl_is_estimated_from_samples_per_prompt_episodes_of_each_held_out_prompt(
    dirs, renderer, stage_runner, tmp_path
):
    body = stage_body() | {"eval": {"prompts_per_domain": 2, "samples_per_prompt": 3}}
    ctx = stage_runner.context("mopd", tmp_path, body, inputs=stage_inputs(dirs))
    pool = TeacherPool(route_teachers(ctx.config, ctx.inputs), tmp_path, 0, logging.getLogger("test-mopd"))
    distiller = Distiller(ctx, ctx.config, load(dirs["sft"]), renderer, pool)
    try:
        sampled = distiller.episodes(distiller.eval_prompts, "eval", copies=3)
        # every (domain, prompt, effort) three times, with distinct uids (distinct sampling noise)
        assert len(sampled) == len(DOMAINS) * 2 * len(EFFORTS) * 3
        assert len({s.uid for s in sampled}) == len(sampled)
        by_pair = {}
        for s in sampled:
            by_pair.setdefault((s.domain, s.effort), []).append(s.tokens)
        for tokens in by_pair.values():
            assert len(tokens) == 6 and sum(t == tokens[0] for t in tokens) == 3  # 2 prompts x 3 copies
        # one pair's six episodes: prompt 0's three copies, then (after 3 efforts x 3 copies) prompt 1's
        episodes = sampled[:3] + sampled[9:12]
        assert len({(s.domain, s.effort) for s in episodes}) == 1 and len({s.group for s in episodes}) == 2
        # kl_tokens counts exactly the student tokens the KL averages
        for s, last in zip(episodes, [-2.5, -2.0, -1.5, -1.5, -1.5, -1.5], strict=True):
            s.append([5, 6], generated=True, logprobs=[-1.0, -2.0], version=0)
            s.teacher_logprobs = [0.0] * (len(s.tokens) - 2) + [-1.5, last]
        results = pair_results(episodes)
        (pair,) = results
        # log-ratio sums per episode 1.0, 0.5, 0.0 (prompt 0) and 0.0 x 3 (prompt 1), 2 tokens each:
        # mean 1.5 / 12. The error's units are the two prompts (1.5 and 0.0 over 6 tokens each):
        # sqrt(2 * (0.75^2 + 0.75^2)) / 12, not the six copies' sd / sqrt(6)
        assert results[pair]["kl_tokens"] == 12.0 and results[pair]["kl"] == pytest.approx(0.125)
        assert results[pair]["kl_se"] == pytest.approx(0.125)
        # one prompt's copies alone are one unit: no error
        assert "kl_se" not in pair_results(episodes[:3])[pair]
    finally:
        distiller.close()


def test_the_exact_kl_is_the_full_vocabulary_reverse_kl_on_the_students_episodes(
    dirs, renderer, stage_runner, tmp_path
):
    body = stage_body() | {"eval": {"prompts_per_domain": 2, "accuracy_prompts_per_domain": 2}}
    ctx = stage_runner.context("mopd", tmp_path, body, inputs=stage_inputs(dirs))
    student = load(dirs["sft"])
    # every general pair taught by the student's own checkpoint: both estimates exactly 0
    own = {f"general-{e}": TeacherConfig(model=str(dirs["sft"])) for e in EFFORTS}
    config = ctx.config.model_copy(update={"teachers": own})
    pool = TeacherPool(route_teachers(config, ctx.inputs), tmp_path, 0, logging.getLogger("test-mopd"))
    distiller = Distiller(ctx, config, student, renderer, pool)
    try:
        sampled = distiller.episodes(distiller.eval_prompts, "eval", copies=1)
        distiller.rollout(sampled, temperature=1.0)
        exact = exact_results(episode_table(sampled, distiller.exact_kl_sums(sampled)))
        sampled_kl = pair_results(sampled)
        for effort in EFFORTS:
            assert exact[f"general-{effort}"]["kl_exact"] == pytest.approx(0.0, abs=1e-6)
            assert exact[f"general-{effort}"]["kl_exact_se"] == pytest.approx(0.0, abs=1e-6)
            # float32 rounding only: a turn's first log-prob comes from the prefill's last-position
            # lm_head (logits_to_keep=1), the teacher's from its full forward (seen: 2.3e-6)
            assert sampled_kl[f"general-{effort}"]["kl"] == pytest.approx(0.0, abs=1e-5)
        # another teacher: the token mean of the per-position full-vocabulary KL, recomputed here
        teacher = load(dirs["max"])
        episodes = []  # per episode, its student tokens' per-position KLs
        for s in [s for s in sampled if (s.domain, s.effort) == ("coding", "max")]:
            ids = torch.tensor([s.tokens])
            with torch.no_grad():
                ls = torch.log_softmax(student(input_ids=ids).logits.double()[0, :-1], -1)
                lt = torch.log_softmax(teacher(input_ids=ids).logits.double()[0, :-1], -1)
            kl = (ls.exp() * (ls - lt)).sum(-1)
            episodes.append([float(k) for k, m in zip(kl, s.generated_mask[1:], strict=True) if m])
        per_token = [k for episode in episodes for k in episode]
        assert len(episodes) == 2 and exact["coding-max"]["kl_exact"] > 0
        assert exact["coding-max"]["kl_exact"] == pytest.approx(sum(per_token) / len(per_token), rel=1e-4)
        sums = torch.tensor([sum(e) for e in episodes])
        error = token_mean_standard_error(sums, torch.tensor([len(e) for e in episodes]))
        # the se of two prompts' episodes is their difference: float32's 1e-4 of the KL, not of the se
        kl = exact["coding-max"]["kl_exact"]
        assert exact["coding-max"]["kl_exact_se"] == pytest.approx(error, rel=1e-4, abs=1e-4 * kl)
    finally:
        distiller.close()
        pool.close()


def test_eval_json_carries_the_paired_error_of_each_change(tmp_path):
    results = {"kl": 0.5, "kl_exact": 0.4, "kl_tokens": 10.0, "accuracy": 1.0, "tokens": 5.0}
    table = {"uid": ["a", "b", "c"], "kl": [1.0, 3.0, 2.0], "kl_exact": [1.0, 2.0, 1.0], "tokens": [2, 2, 4]}
    moved = {**table, "kl": [0.5, 2.0, 2.5], "kl_exact": [0.5, 1.5, 1.0], "tokens": [2, 3, 5]}
    pairs = ("general-low", "coding-max", "agent-high")
    before, after = {p: results for p in pairs}, {p: results for p in pairs}
    first = {k: v[:1] for k, v in table.items()}
    before_rows = {"general-low": table, "coding-max": table, "agent-high": first}
    after_rows = {"general-low": moved, "coding-max": {**moved, "uid": ["a", "b", "d"]}, "agent-high": first}
    report = write_eval(tmp_path / "eval.json", before, after, before_rows, after_rows)
    assert json.loads((tmp_path / "eval.json").read_text()) == report
    assert json.loads((tmp_path / "eval_episodes.json").read_text()) == {
        p: {"before": before_rows[p], "after": after_rows[p]} for p in pairs
    }
    expected = {
        kl: paired_change_standard_error(
            *(torch.tensor(r[k]) for r in (table, moved) for k in (kl, "tokens"))
        )
        for kl in ("kl", "kl_exact")
    }
    assert expected["kl"] > 0 and expected["kl_exact"] > 0
    assert report["general-low"]["kl_change_se"] == pytest.approx(expected["kl"])
    assert report["general-low"]["kl_exact_change_se"] == pytest.approx(expected["kl_exact"])
    # other episodes after than before (no pairing), or a single episode: no error of the change
    assert not {k for k in report["coding-max"] if "change" in k}
    assert not {k for k in report["agent-high"] if "change" in k}


def test_the_kl_errors_take_the_prompts_as_units_when_a_prompt_has_copies(tmp_path):
    results = {"kl": 0.5, "kl_exact": 0.4, "kl_tokens": 10.0, "accuracy": 1.0, "tokens": 5.0}
    # four episodes, prompt p's two copies carry most of the KL together
    table = {
        "uid": ["p", "p-1", "q", "r"],
        "prompt": ["p", "p", "q", "r"],
        "kl": [4.0, 5.0, 0.5, 0.2],
        "kl_exact": [3.0, 4.0, 0.4, 0.1],
        "tokens": [10, 12, 9, 11],
    }
    moved = {**table, "kl": [4.5, 5.5, 0.1, 0.1], "kl_exact": [3.5, 4.5, 0.2, 0.1], "tokens": [11, 12, 9, 10]}
    report = write_eval(
        tmp_path / "eval.json", {"a-low": results}, {"a-low": results}, {"a-low": table}, {"a-low": moved}
    )
    exact = exact_results({"a-low": table})["a-low"]

    def over_prompts(rows: dict, key: str) -> list[torch.Tensor]:
        sums = [rows[key][0] + rows[key][1], rows[key][2], rows[key][3]]
        tokens = [rows["tokens"][0] + rows["tokens"][1], rows["tokens"][2], rows["tokens"][3]]
        return [torch.tensor(sums, dtype=torch.float64), torch.tensor(tokens, dtype=torch.float64)]

    for kl in ("kl", "kl_exact"):
        by_prompt = paired_change_standard_error(*over_prompts(table, kl), *over_prompts(moved, kl))
        by_episode = paired_change_standard_error(
            *(torch.tensor(r[k], dtype=torch.float64) for r in (table, moved) for k in (kl, "tokens"))
        )
        assert report["a-low"][f"{kl}_change_se"] == pytest.approx(by_prompt)
        assert by_prompt != pytest.approx(by_episode)
    assert exact["kl_exact_se"] == pytest.approx(token_mean_standard_error(*over_prompts(table, "kl_exact")))
    # the copies of one prompt alone are one unit: an estimate, no error
    one = {k: v[:2] for k, v in table.items()}
    assert set(exact_results({"a-low": one})["a-low"]) == {"kl_exact"}


def test_two_evaluations_of_one_student_pair_episode_by_episode(dirs, renderer, stage_runner, tmp_path):
    body = stage_body() | {
        "eval": {
            "prompts_per_domain": 2,
            "accuracy_prompts_per_domain": 3,
            "accuracy_temperature": 0.6,
            "samples_per_prompt": 1,
        }
    }
    ctx = stage_runner.context("mopd", tmp_path, body, inputs=stage_inputs(dirs))
    pool = TeacherPool(route_teachers(ctx.config, ctx.inputs), tmp_path, 0, logging.getLogger("test-mopd"))
    distiller = Distiller(ctx, ctx.config, load(dirs["sft"]), renderer, pool)
    try:
        pool.start()
        (before, before_rows), (after, after_rows) = distiller.evaluate(), distiller.evaluate()
    finally:
        distiller.close()
        pool.close()
    # the same uids, hence the same sampling noise: the same episodes, row by row
    assert before_rows == after_rows and sorted(before_rows) == sorted(before)
    # accuracy episodes on more prompts than the KL's, sampled with the same noise, also paired
    assert all(len(rows["accuracy"]["uid"]) == 3 for rows in before_rows.values())
    report = write_eval(tmp_path / "eval.json", before, after, before_rows, after_rows)
    for name, rows in before_rows.items():
        assert len(rows["uid"]) == 2 and rows["kl"] != [0.0, 0.0]
        assert sum(rows["kl"]) / sum(rows["tokens"]) == pytest.approx(before[name]["kl"])
        assert sum(rows["kl_exact"]) / sum(rows["tokens"]) == pytest.approx(before[name]["kl_exact"])
        values = report[name]
        # each estimate has its own error, but an unchanged student's change has none
        assert values["kl_se_before"] > 0 and values["kl_change_se"] == 0.0
        assert values["kl_exact_change_se"] == 0.0
        assert values["accuracy_change"] == values["accuracy_change_se"] == values["tokens_change_se"] == 0.0
        assert values["tokens_se_before"] == pytest.approx(mean_standard_error(rows["accuracy"]["tokens"]))


def test_pair_balance_gives_every_domain_effort_pair_the_same_share_of_the_loss():
    def episode(uid: str, domain: str, effort: str, generated: int) -> Sample:
        return Sample(
            uid=uid,
            domain=domain,
            effort=effort,
            tokens=[1] * (3 + generated),
            prompt_length=3,
            loss_mask=[0] * 3 + [1] * generated,
            rollout_logprobs=[0.0] * (3 + generated),
            policy_version=[-1] * 3 + [0] * generated,
        )

    # general-low: 2 short episodes (10 tokens in all); agent-max: one long one (30 tokens)
    samples = [
        episode("a", "general", "low", 4),
        episode("b", "general", "low", 6),
        episode("c", "agent", "max", 30),
    ]
    mask = TokenBatch.of(samples, 0).generated
    weights = group_balance_weights(mask, [(s.domain, s.effort) for s in samples]).tolist()
    assert weights == pytest.approx([2.0, 2.0, 40 / 60])
    shares = {}
    for s, w in zip(samples, weights, strict=True):
        shares[s.domain] = shares.get(s.domain, 0.0) + w * sum(s.loss_mask)
    assert shares == pytest.approx({"general": 20.0, "agent": 20.0})  # equal, and the total stays 40


def test_the_pair_mean_baseline_centres_each_pairs_student_advantages():
    def episode(uid: str, domain: str, mask: list[int]) -> Sample:
        return Sample(
            uid=uid, domain=domain, effort="low", tokens=[1] * len(mask), prompt_length=1, loss_mask=mask
        )

    # general-low: student tokens 1.0, 3.0 | 5.0 (mean 3); agent-low: 2.0, -4.0 around a tool result (mean -1)
    samples = [
        episode("a", "general", [0, 1, 1]),
        episode("b", "general", [0, 1]),
        episode("c", "agent", [0, 1, 0, 1]),
    ]
    advantages = torch.tensor(
        [[0.0, 0.0, 1.0, 3.0], [0.0, 0.0, 0.0, 5.0], [0.0, 2.0, 0.0, -4.0]]
    )  # left-padded
    mask = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1], [0, 1, 0, 1]])
    centred = subtract_group_mean(advantages, mask, [s.domain for s in samples])
    assert centred.tolist() == [[0.0, 0.0, -2.0, 0.0], [0.0, 0.0, 0.0, 2.0], [0.0, 3.0, 0.0, -3.0]]
    assert advantages[0].tolist() == [0.0, 0.0, 1.0, 3.0]  # the input is left as it was


def test_returns_to_go_discount_over_later_student_tokens_and_skip_tool_results():
    # prompt (2), student (2), tool result (2), student (2)
    rewards = torch.tensor(
        [[0.0, 0.0, 1.0, -2.0, 0.0, 0.0, 0.5, 4.0], [0.0] * 7 + [2.0]], dtype=torch.float64
    )
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1], [0] * 7 + [1]])
    assert torch.equal(returns_to_go(rewards, mask, 0.0), rewards)  # discount 0: A_t = r_t
    g = 0.5
    a8 = 4.0
    a7 = 0.5 + g * a8
    a4 = -2.0 + g * a7  # the tool result's tokens are not steps: no decay across them
    a3 = 1.0 + g * a4
    assert returns_to_go(rewards, mask, g)[0].tolist() == pytest.approx([0, 0, a3, a4, 0, 0, a7, a8])
    assert returns_to_go(rewards, mask, 1.0)[0].tolist() == pytest.approx([0, 0, 3.5, 2.5, 0, 0, 4.5, 4.0])
    assert returns_to_go(rewards, mask, g)[1].tolist() == [0.0] * 7 + [2.0]  # rows are independent


@pytest.mark.parametrize("baseline", ["none", "pair_mean"])
def test_a_step_trains_on_the_discounted_return_of_the_rewards(
    dirs, renderer, stage_runner, tmp_path, monkeypatch, baseline
):
    body = {**stage_body(), "discount": 0.5, "baseline": baseline}
    ctx = stage_runner.context("mopd", tmp_path, body, inputs=stage_inputs(dirs))
    model = load(dirs["sft"])
    state = TrainState.create(ctx, model, ctx.config.train, ctx.config.accelerate, ctx.config.train.steps)
    sample = agent_trajectory(renderer)
    sample.rollout_logprobs = EmbeddedEngine(model).score([sample])[0]
    trained = [i for i, m in enumerate(sample.generated_mask) if m]
    sample.teacher_logprobs = list(sample.rollout_logprobs)
    for k, i in enumerate(trained):
        sample.teacher_logprobs[i] += STUDENT_DELTAS[k % len(STUDENT_DELTAS)]
    passed = []
    real = mopd.policy_step

    def spy(state, samples, advantages, **kwargs):
        passed.extend(advantages.tolist())
        return real(state, samples, advantages, **kwargs)

    monkeypatch.setattr(mopd, "policy_step", spy)
    mopd.train_on(state, [sample], ctx.config, 1, renderer.pad_id, 0)
    rewards = token_rewards([sample], R_MAX)[0][0].tolist()
    mask = sample.generated_mask
    expected = [0.0] * len(rewards)  # returns to go, written out: A_t = r_t + 0.5 A_(next student token)
    running = 0.0
    for t in reversed(trained):
        running = rewards[t] + 0.5 * running
        expected[t] = running
    assert expected != pytest.approx(rewards)
    if baseline == "pair_mean":  # one episode: its own mean over student tokens
        mean = sum(a for a, m in zip(expected, mask, strict=True) if m) / sum(mask)
        assert abs(mean) > 1e-3  # so the centred advantages differ from the raw ones
        expected = [a - mean if m else 0.0 for a, m in zip(expected, mask, strict=True)]
    assert passed == [pytest.approx(expected)]
