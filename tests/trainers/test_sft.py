"""The `sft` stage kind run for real on the tiny K3: it learns, saves a loadable model, resumes bit
for bit, and fails clearly on NaN losses and bad data. Runs are a few steps on a small slice of the
shipped trajectories, with one torch thread (the machine is shared; threads fighting cost more)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from data_recipes.agent_tasks import FAMILIES
from orchestration.pipeline import load_pipeline
from posttrain.config.errors import ConfigError
from posttrain.data.chat import CHAT_TEMPLATE, DEFAULT_TOKENIZER_DIR
from posttrain.data.mixture import DATA_RECIPES, MixtureSource, Recipe
from posttrain.data.trajectory import BadTrajectoryError
from posttrain.engines.testing import tiny_k3
from posttrain.metrics import read_metrics
from posttrain.model import KimiK3ForCausalLM
from posttrain.trainers.common import AccelerateConfig, NonFiniteLossError, WarmupCosine, accelerator_plugins
from posttrain.trainers.sft import EvalConfig, Evaluator, SFTConfig

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "data_recipes" / "data" / "agent_sft.jsonl"
BAD_ROW_INDEX = 3 * len(FAMILIES)  # 3 rows per shipped family come first


@pytest.fixture(scope="module")
def small_recipe(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A recipe over 3 shipped trajectories per task family plus, after them, one whose tool-call
    arguments are not JSON. Returns (recipe name, file)."""
    rows = [json.loads(line) for line in SHIPPED.read_text().splitlines()]
    by_family: dict[str, list[dict]] = {}
    for row in rows:
        by_family.setdefault(row["task"]["family"], []).append(row)
    chosen = [row for family in sorted(by_family) for row in by_family[family][:3]]
    assert len(chosen) == BAD_ROW_INDEX
    # an arithmetic row the chosen ones leave out that takes the calculator route (the other states
    # its result in the thinking, no tool call)
    left_out = by_family["general/arithmetic"][3:]
    calculator = next(row for row in left_out if "tool_calls" in row["messages"][2])
    bad = json.loads(json.dumps(calculator))
    bad["uid"] = "bad-arguments"
    bad["messages"][2]["tool_calls"][0]["function"]["arguments"] = "{expression: 8*16"
    path = tmp_path_factory.mktemp("sft-data") / "small.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [*chosen, bad]))
    name = f"test-sft-small-{path.parent.name}"
    DATA_RECIPES.register(name)(lambda: Recipe(sources=(MixtureSource(str(path)),), eval_fraction=0.25))
    return name, path


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded tiny K3 saved with save_pretrained (a need's model dir)."""
    path = tmp_path_factory.mktemp("tiny-k3")
    tiny_k3(3).save_pretrained(str(path))
    return path


def body(recipe: str, **train) -> dict:
    return {
        "data": {"recipes": {recipe: 1.0}},
        "train": {"steps": 4, "micro_batch_tokens": 512, "lr": 5e-3, "warmup_steps": 1, **train},
        "checkpoint_every": 2,
        "eval": {"tool_prompts": 0},
    }


def test_sft_learns_and_saves_a_loadable_model(tmp_path, small_recipe, stage_runner):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, _ = small_recipe
    cfg = body(name, steps=8)
    cfg["eval"] = {"tool_prompts": 2, "max_new_tokens": 8, "max_turns": 2}
    ctx = stage_runner.context("sft", tmp_path, cfg)
    final = stage_runner.run(ctx)

    assert final["eval_loss_after"] < final["eval_loss_before"] - 0.3
    for when in ("before", "after"):
        assert 0.0 <= final[f"tool_success_{when}"] <= 1.0
    assert final["data/kept"] == BAD_ROW_INDEX and final["data/skipped/malformed_tool_call_json"] == 1
    logged = {r["step"]: r for r in read_metrics(ctx.stage_dir / "metrics.jsonl") if "loss" in r}
    assert sorted(logged) == list(range(1, 9))
    assert all(math.isfinite(r["grad_norm"]) and r["tokens_per_s"] > 0 for r in logged.values())
    assert logged[1]["lr"] == pytest.approx(5e-3 / 2) and logged[2]["lr"] == pytest.approx(5e-3)

    model = AutoModelForCausalLM.from_pretrained(str(ctx.output_dir))
    assert type(model).__name__ == "KimiK3ForCausalLM"
    assert any(
        float(b.abs().max()) > 0 for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")
    )
    tokenizer = AutoTokenizer.from_pretrained(str(ctx.output_dir))
    assert tokenizer.chat_template == CHAT_TEMPLATE
    stops = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|tool_calls_section_end|>"])
    assert sorted(model.generation_config.eos_token_id) == sorted(stops)


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path, small_recipe, stage_runner):
    name, _ = small_recipe
    cfg = body(name, steps=4, grad_accum=2, micro_batch_tokens=256)
    cfg["data"]["max_length"] = 256
    straight = stage_runner.context("sft", tmp_path / "straight", cfg)
    stage_runner.run(straight)

    crashed = stage_runner.context("sft", tmp_path / "resumed", cfg, crash_at=3)
    with pytest.raises(stage_runner.FakeCrash):
        stage_runner.run(crashed)
    assert crashed.checkpoints.latest_step() == 2
    resumed = stage_runner.context("sft", tmp_path / "resumed", cfg)
    final = stage_runner.run(resumed)

    expected = load_file(str(straight.output_dir / "model.safetensors"))
    got = load_file(str(resumed.output_dir / "model.safetensors"))
    assert sorted(got) == sorted(expected)
    different = [name for name in expected if not torch.equal(expected[name], got[name])]
    assert different == []
    resumed_metrics = read_metrics(resumed.stage_dir / "metrics.jsonl")
    assert [r["step"] for r in resumed_metrics if "loss" in r] == [1, 2, 3, 4]
    assert final["eval_loss_before"] == resumed_metrics[0]["eval_loss_before"]
    assert (
        final["eval_loss_before"] == read_metrics(straight.stage_dir / "metrics.jsonl")[0]["eval_loss_before"]
    )


def test_nan_loss_names_the_step_and_the_fix(tmp_path, small_recipe, tiny_model_dir, stage_runner):
    broken = tmp_path / "nan-model"
    model = KimiK3ForCausalLM.from_pretrained(str(tiny_model_dir))
    with torch.no_grad():
        model.lm_head.weight[5] = float("nan")
    model.save_pretrained(str(broken))
    ctx = stage_runner.context("sft", tmp_path / "from-nan", body(small_recipe[0], steps=2), model=broken)
    # a diverged checkpoint is refused as it loads, not blamed on this stage's learning rate
    with pytest.raises(ValueError, match=r"nan-model: 1 weights hold NaN or inf values"):
        stage_runner.run(ctx)
    # a learning rate that diverges on the first update: the second step's loss names the fix
    ctx = stage_runner.context("sft", tmp_path / "diverged", body(small_recipe[0], steps=2, lr=1e30))
    with pytest.raises(NonFiniteLossError, match=r" is (nan|inf) at optimizer step 2 .*train\.lr"):
        stage_runner.run(ctx)


def test_strict_data_fails_naming_file_row_and_reason(tmp_path, small_recipe, stage_runner):
    name, path = small_recipe
    cfg = body(name)
    cfg["data"]["strict"] = True
    with pytest.raises(BadTrajectoryError) as error:
        stage_runner.run(stage_runner.context("sft", tmp_path, cfg))
    assert f"{path} line {BAD_ROW_INDEX + 1}: malformed_tool_call_json" in str(error.value)


def test_lora_trains_only_the_adapters(tmp_path, small_recipe, tiny_model_dir, stage_runner):
    cfg = body(small_recipe[0], steps=2)
    cfg["lora"] = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "o_proj"]}
    ctx = stage_runner.context("sft", tmp_path, cfg, model=tiny_model_dir)
    stage_runner.run(ctx)
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    # the stage writes the released layout: the flat names under `language_model.`
    after = {
        n.removeprefix("language_model."): t
        for n, t in load_file(str(ctx.output_dir / "model.safetensors")).items()
    }
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    targeted = {n for n in before if n.endswith(("q_proj.weight", "o_proj.weight"))}
    assert targeted and changed - targeted <= {n for n in before if n.endswith("e_score_correction_bias")}
    assert targeted <= changed


def test_lora_target_modules_that_name_no_module_are_refused_naming_the_key(
    tmp_path, small_recipe, tiny_model_dir, stage_runner
):
    # peft trained q_proj alone, skipping the misspelled name without a word
    cfg = body(small_recipe[0], steps=1)
    cfg["lora"] = {"target_modules": ["q_proj", "o_porj"]}
    ctx = stage_runner.context("sft", tmp_path, cfg, model=tiny_model_dir)
    with pytest.raises(ValueError, match=r"lora.target_modules \['o_porj'\] name no module .* o_proj, "):
        stage_runner.run(ctx)


def test_gradient_checkpointing_changes_memory_not_the_result(
    tmp_path, small_recipe, tiny_model_dir, stage_runner
):
    runs = {}
    for flag in (False, True):
        ctx = stage_runner.context(
            "sft",
            tmp_path / f"gc-{flag}",
            body(small_recipe[0], steps=2, gradient_checkpointing=flag),
            model=tiny_model_dir,
        )
        stage_runner.run(ctx)
        losses = [r["loss"] for r in read_metrics(ctx.stage_dir / "metrics.jsonl") if "loss" in r]
        runs[flag] = (load_file(str(ctx.output_dir / "model.safetensors")), losses)
    (plain, plain_losses), (checkpointed, checkpointed_losses) = runs[False], runs[True]
    assert checkpointed_losses == pytest.approx(plain_losses, rel=1e-6)
    for name, tensor in plain.items():
        torch.testing.assert_close(checkpointed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_sharding_configs_reach_accelerate_plugins_or_fall_back_without_cuda(tmp_path, caplog):
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    config = tmp_path / "zero2.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1}))
    cases = [
        ({"deepspeed_config": str(config)}, "deepspeed_plugin", DeepSpeedPlugin),
        ({"fsdp": {"version": 2}}, "fsdp_plugin", FullyShardedDataParallelPlugin),
    ]
    for accelerate, key, plugin in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            kwargs = accelerator_plugins(
                AccelerateConfig.model_validate(accelerate), 4, logging.getLogger("t")
            )
        assert kwargs["mixed_precision"] == "no" and kwargs["gradient_accumulation_steps"] == 4
        if torch.cuda.is_available():
            assert isinstance(kwargs[key], plugin)
        else:
            assert key not in kwargs and "no CUDA: running as one plain process" in caplog.text
    with pytest.raises(ValidationError, match="set deepspeed_config or fsdp, not both"):
        AccelerateConfig.model_validate({"deepspeed_config": str(config), "fsdp": {}})


def test_fp16_without_cuda_is_refused_naming_the_key(monkeypatch):
    # accelerate trained in float32 under fp16 on the CPU, silently
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    log = logging.getLogger("test")
    with pytest.raises(ValueError, match="accelerate.mixed_precision fp16 needs CUDA .*set bf16 or no"):
        accelerator_plugins(AccelerateConfig(mixed_precision="fp16"), 1, log)
    assert accelerator_plugins(AccelerateConfig(mixed_precision="bf16"), 1, log)["mixed_precision"] == "bf16"


def test_config_errors_name_the_key():
    good = {"train": {"steps": 1}}
    SFTConfig.model_validate(good)
    with pytest.raises(ValidationError, match="train.stpes"):
        SFTConfig.model_validate({"train": {"steps": 1, "stpes": 2}})
    with pytest.raises(ValidationError, match="data.max_length .*train.micro_batch_tokens"):
        SFTConfig.model_validate(
            {"train": {"steps": 1, "micro_batch_tokens": 128}, "data": {"max_length": 256}}
        )
    with pytest.raises(ValidationError, match="accelerate.deepspeed_config: /nowhere/ds.json does not exist"):
        SFTConfig.model_validate({**good, "accelerate": {"deepspeed_config": "/nowhere/ds.json"}})


def test_plan_refuses_a_bad_tokenizer_dir_vision_or_betas_at_their_lines(tmp_path):
    # Each passed `plan` (vision at line 1) and stopped the stage at its start with a library error.
    stage = tmp_path / "sft-bad.yaml"
    stage.write_text(
        "kind: sft\n"
        f"tokenizer: {tmp_path / 'tok'}\n"
        "vision: models/vision-tny.yaml\n"
        "train:\n"
        "  steps: 1\n"
        "  betas: [1.5, 0.9]\n"
    )
    with pytest.raises(ConfigError) as error:
        load_pipeline(stage)
    text = str(error.value)
    assert "sft-bad.yaml:2: tokenizer: no tokenizer_config.json in that dir" in text
    assert "sft-bad.yaml:3: vision: models/vision-tny.yaml: no preset file or vision dir" in text
    assert "sft-bad.yaml:6: train.betas[0]: Input should be less than 1 (got 1.5)" in text


def test_plan_refuses_a_text_model_preset_as_vision_at_its_line(tmp_path):
    # it passed `plan` and stopped the stage after the model load, not naming `vision:`
    stage = tmp_path / "sft-text-vision.yaml"
    stage.write_text("kind: sft\nvision: models/small.yaml\ntrain: {steps: 1}\n")
    with pytest.raises(
        ConfigError, match=r"sft-text-vision.yaml:2: vision: vision config .*unknown key 'vocab_size'"
    ):
        load_pipeline(stage)
    stage.write_text(
        f"kind: sft\ntokenizer: {DEFAULT_TOKENIZER_DIR}\ntrain: {{steps: 1, betas: [0, 0.999]}}\n"
    )
    load_pipeline(stage)


def test_warmup_then_cosine_schedule():
    schedule = WarmupCosine(warmup=4, total=14, min_ratio=0.1)
    assert [schedule(s) for s in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert schedule(4) == pytest.approx(1.0)
    assert schedule(9) == pytest.approx(0.1 + 0.9 * 0.5)
    assert schedule(14) == pytest.approx(0.1) and schedule(20) == pytest.approx(0.1)


def test_data_files_are_the_local_files_and_dirs_the_recipes_name(tmp_path, monkeypatch):
    """What the run hashes as the SFT stage's data: files and directories named directly (relative
    ones from the working directory), not registered recipes (code) or hub ids (nothing local)."""
    from posttrain.trainers.sft import sft_data_files

    (tmp_path / "mine.jsonl").write_text("{}\n")
    (tmp_path / "shards").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = SFTConfig.model_validate(
        {
            "train": {"steps": 1},
            "data": {"recipes": {"agent_sft": 1.0, "mine.jsonl": 1.0, "shards": 2.0, "owner/set:train": 1.0}},
        }
    )
    assert sft_data_files(cfg) == [tmp_path / "mine.jsonl", tmp_path / "shards"]


def test_no_tool_prompts_reads_no_records(renderer):
    """`eval.tool_prompts: 0` skips the tool eval without reading the held-out records' tasks (a
    plain-string `task` crashed every such run in tool_task_prompts before)."""
    assert Evaluator(EvalConfig(tool_prompts=0), renderer, [], [{"task": "arithmetic"}]).prompts == []
