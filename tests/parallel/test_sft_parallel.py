"""The `sft` stage with `parallel:` launched by torchrun in 2 gloo processes (EP 2, FSDP2 over the
rest) against the same stage in one process on the same global batch (2 rows per step: one per rank,
or two accumulated): losses and final weights within fp32 tolerance, the sharded checkpoint resumed
bit for bit after a kill mid-run, and the stage's model/ the gather-free export that
`from_pretrained` reads. Routing is whatever the data gives: the ranks' rows differ in length and
trained tokens, so the experts receive uneven row counts from each rank."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from sft_support import launch, register_recipe, run_stage, stage_context

from posttrain.metrics import read_metrics
from posttrain.model import KimiK3ForCausalLM
from posttrain.model.balancing import QuantileBalancer
from posttrain.parallel.train_state import check_parallel_config
from posttrain.trainers.common import AccelerateConfig
from posttrain.trainers.sft import SFTConfig

SHIPPED = Path(__file__).resolve().parents[2] / "data_recipes" / "data" / "agent_sft.jsonl"
STEPS = 4
LR = 5e-3
NUM_BINS = inspect.signature(QuantileBalancer).parameters["num_bins"].default  # what training used


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(name, file) of a recipe over 3 shipped trajectories per task family, registered here too."""
    rows = [json.loads(line) for line in SHIPPED.read_text().splitlines()]
    by_family: dict[str, list[dict]] = {}
    for row in rows:
        by_family.setdefault(row["task"]["family"], []).append(row)
    path = tmp_path_factory.mktemp("parallel-sft-data") / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for f in sorted(by_family) for r in by_family[f][:3]))
    name = f"test-parallel-sft-{path.parent.name}"
    register_recipe(name, str(path))
    return name, str(path)


def body(recipe: str, grad_accum: int, **extra) -> dict:
    return {
        "data": {"recipes": {recipe: 1.0}, "max_length": 256},
        "train": {
            "steps": STEPS,
            "micro_batch_tokens": 256,
            "grad_accum": grad_accum,
            "lr": LR,
            "warmup_steps": 1,
        },
        "checkpoint_every": 2,
        "eval": {"tool_prompts": 0},
        **extra,
    }


def losses(stage_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(stage_dir / "metrics.jsonl") if "loss" in r]


def relative_gap(values: list[float], reference: list[float]) -> float:
    """The largest relative difference of two loss curves, step by step."""
    return max(abs(v - r) / abs(r) for v, r in zip(values, reference, strict=True))


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return KimiK3ForCausalLM.from_pretrained(model_dir).state_dict()


def test_two_ranks_match_one_process_and_resume_bit_exact(tmp_path, recipe) -> None:
    name, data = recipe
    one = stage_context(tmp_path / "one", body(name, 2, parallel={"expert_parallel": 1}))
    reference = run_stage(one)["final"]

    sharded = body(name, 1, parallel={"expert_parallel": 2}, accelerate={"fsdp": {}})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    runs = [
        {"run_dir": str(straight), "body": sharded},
        {"run_dir": str(resumed), "body": sharded, "crash_at": 3},
        {"run_dir": str(resumed), "body": sharded},
    ]
    first, crashed, resumed_run = launch({"recipe": name, "data": data, "runs": runs}, 2, tmp_path)

    # 2 ranks against 1 process: every step's loss, the eval losses, every final weight
    final = first["final"]
    assert losses(straight / "sft") == pytest.approx(losses(tmp_path / "one" / "sft"), rel=1e-5)
    for key in ("eval_loss_before", "eval_loss_after", "train_loss"):
        assert final[key] == pytest.approx(reference[key], rel=1e-5), key
    assert final["eval_loss_after"] < final["eval_loss_before"] - 0.1  # it trained
    out = straight / "sft" / ".model-tmp"
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == [
        "model-dense.safetensors",
        "model-experts-1-of-2.safetensors",
        "model-experts-2-of-2.safetensors",
    ]
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "KimiK3ForConditionalGeneration"
    ]
    expected, got = weights(one.output_dir), weights(out)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if key.endswith("e_score_correction_bias"):
            # Two ranks read the balancing quantile off a pooled histogram, one process sorts: they
            # may differ by a bin width or two (posttrain/model/balancing.py's bound).
            assert (got[key] - value).abs().max() <= 2 * (2 + value.abs().max() * 2) / NUM_BINS, key
            continue
        off = ~torch.isclose(got[key], value, atol=2e-5, rtol=1e-4)
        assert (got[key] - value).abs().max() <= STEPS * LR, key
        if ".block_sparse_moe." in key:
            # A token whose router scores tie to the last bit can pick another expert when the two
            # setups sum its scores in another order: one such flip per layer changes the two
            # experts it swapped, the gate rows of the K=2 experts picked either way (3 at most)
            # and the shared latent projections; every other expert and gate row stays equal.
            if ".experts.w" in key:
                assert len(off.flatten(1).any(1).nonzero()) <= 2, (key, off.flatten(1).any(1).tolist())
            elif key.endswith("gate.weight"):
                assert int(off.any(1).sum()) <= 3, (key, off.any(1).tolist())
            continue
        # Adam divides by the root of the squared gradient, so an element whose gradient nearly
        # cancels (a rare token's embedding row) steps by up to lr from the order in which the two
        # setups sum it: a handful such elements may move by up to the steps' lr, no more.
        assert off.sum() <= max(1, off.numel() // 10_000), (key, int(off.sum()))

    # killed after step 3 (its newest checkpoint: step 2), resumed at step 3: bit for bit
    assert crashed["crashed"] and crashed["steps"] == [1, 2, 3]
    assert resumed_run["steps"] == [3, 4]
    timing = ("train_tokens_per_s",)
    assert {k: v for k, v in resumed_run["final"].items() if k not in timing} == {
        k: v for k, v in final.items() if k not in timing
    }
    assert losses(resumed / "sft") == losses(straight / "sft")
    resumed_out = resumed / "sft" / ".model-tmp"
    for file in files:
        a, b = load_file(out / file), load_file(resumed_out / file)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), file
    # one process cannot resume the 2-rank checkpoint, and says what to do
    with pytest.raises(ValueError, match="resume with the same number of processes"):
        run_stage(stage_context(resumed, sharded))


def test_bf16_activation_checkpointing_and_qat_under_fsdp2(tmp_path, recipe) -> None:
    """2 ranks, 2 steps each: activation checkpointing changes nothing of the result (fp32 equal to
    one process), nor does all-reducing the dense gradients instead of FSDP2; bf16 compute and
    reduction (FSDP2's MixedPrecisionPolicy, experts cast to the bf16 rows) within bf16 tolerance
    of the fp32 losses; QAT k3 on the sharded experts gives the one-process QAT run's losses (the
    fake quantisation is applied to each rank's experts as to the whole tensor)."""
    name, data = recipe
    steps = {"steps": 2}

    def two_steps(grad_accum: int, **extra) -> dict:
        cfg = body(name, grad_accum, **extra)
        cfg["train"].update(steps)
        return cfg

    fp32 = stage_context(tmp_path / "fp32", two_steps(2, parallel={"expert_parallel": 1}))
    run_stage(fp32)
    qat = stage_context(tmp_path / "qat", two_steps(2, parallel={"expert_parallel": 1}), qat=True)
    run_stage(qat)

    ep = {"parallel": {"expert_parallel": 2}}
    checkpointed = {"fsdp": {"activation_checkpointing": True}}
    runs = [
        {"run_dir": str(tmp_path / "ac"), "body": two_steps(1, **ep, accelerate=checkpointed)},
        {
            "run_dir": str(tmp_path / "bf16"),
            "body": two_steps(
                1,
                parallel={"expert_parallel": 2, "reduce_dtype": "bfloat16"},
                accelerate={"mixed_precision": "bf16", **checkpointed},
            ),
        },
        {"run_dir": str(tmp_path / "qat2"), "body": two_steps(1, **ep, accelerate={"fsdp": {}}), "qat": True},
        {"run_dir": str(tmp_path / "allreduce"), "body": two_steps(1, **ep)},  # no fsdp: dense all-reduced
    ]
    launch({"recipe": name, "data": data, "runs": runs}, 2, tmp_path)

    reference = losses(tmp_path / "fp32" / "sft")
    same_math = [losses(tmp_path / run / "sft") for run in ("ac", "allreduce")]
    for run_losses in same_math:
        assert run_losses == pytest.approx(reference, rel=1e-5)
    # how far runs of the same math fall apart (reduction order): QAT's change must stand above it
    float_noise = max(relative_gap(run_losses, reference) for run_losses in same_math)
    bf16 = losses(tmp_path / "bf16" / "sft")
    assert bf16 == pytest.approx(reference, rel=1e-2)
    # it did compute in bf16: on the shipped fixture rows its losses differ by 5e-6 to 8e-6 relative
    assert bf16 != pytest.approx(reference, rel=1e-6)
    qat_losses = losses(tmp_path / "qat" / "sft")
    assert losses(tmp_path / "qat2" / "sft") == pytest.approx(qat_losses, rel=1e-5)
    # the fake quantisation changed the loss: on the shipped fixture rows by 6e-6 relative at most
    # in these first steps (under a fixed tolerance of 1e-5), while the same math gave equal losses
    assert relative_gap(qat_losses, reference) > 10 * float_noise
    qat_out = tmp_path / "qat2" / "sft" / ".model-tmp"
    assert json.loads((qat_out / "config.json").read_text())["posttrain_qat"]["scheme"] == "k3"
    # MX fake quantisation is a step function: an fp32 rounding difference between the sharded and
    # the whole-tensor sums can flip one quantised activation, which changes the gradient of the
    # elements it feeds; Adam divides by the root of the squared gradient, so an element whose
    # gradient nearly cancels can step by up to lr either way. Those elements are few and move by at
    # most the steps' lr; every other element agrees to a small part of one update.
    expected, got = weights(qat.output_dir), weights(qat_out)
    for key, value in expected.items():
        diff = (got[key] - value).abs()
        off = int((diff > 5e-4).sum())
        assert diff.max() <= steps["steps"] * LR, (key, float(diff.max()))
        assert off <= max(1, value.numel() // 1000), (key, off, value.numel())


def test_a_nan_loss_on_one_rank_stops_every_rank_at_that_step(tmp_path, recipe) -> None:
    # Without the collective check the rank with the NaN raised alone and the other went on into the
    # backward's collectives: here gloo failed it with a closed connection (seen); NCCL waits until
    # its timeout. Now both stop at the same check, each with the error that names the fix.
    name, data = recipe
    sharded = body(name, 1, parallel={"expert_parallel": 2}, accelerate={"fsdp": {}})
    runs = [{"run_dir": str(tmp_path / "nan"), "body": sharded, "nan_loss_fault": [1, 2]}]
    (rank0,) = launch({"recipe": name, "data": data, "runs": runs}, 2, tmp_path, timeout=240)
    rank1 = json.loads((tmp_path / "result-0-rank1.json").read_text())
    assert rank0["final"] is None and rank1["final"] is None
    assert rank0["steps"] == rank1["steps"] == [1], "both stopped at step 2, before its progress report"
    assert "loss is not finite on rank(s) [1] at optimizer step 2" in rank0["non_finite"]
    assert "loss is nan at optimizer step 2 (packed documents" in rank1["non_finite"]
    assert all("train.lr" in r["non_finite"] and "a rerun" in r["non_finite"] for r in (rank0, rank1))


def test_parallel_config_errors_name_the_key() -> None:
    with pytest.raises(ValidationError, match="parallel: trains the full model; remove lora"):
        SFTConfig.model_validate({"train": {"steps": 1}, "parallel": {}, "lora": {}})
    with pytest.raises(ValidationError, match="parallel.expert_parallel"):
        SFTConfig.model_validate({"train": {"steps": 1}, "parallel": {"expert_parallel": 0}})
    cases = {
        "remove accelerate.deepspeed_config": {"deepspeed_config": __file__},
        "not fp16": {"mixed_precision": "fp16", "fsdp": {}},
        "needs accelerate.fsdp": {"mixed_precision": "bf16"},
        "cpu_offload false": {"fsdp": {"cpu_offload": True}},
    }
    for message, accelerate in cases.items():
        with pytest.raises(ValueError, match=message):
            check_parallel_config(AccelerateConfig.model_validate(accelerate), "stage sft")


def test_expert_parallel_on_one_process_is_refused_naming_the_key(tmp_path, recipe) -> None:
    # `posttrain run` starts one process: the split was silently not made, every expert trained here
    ctx = stage_context(tmp_path, body(recipe[0], 1, parallel={"expert_parallel": 2}))
    with pytest.raises(ValueError, match=r"parallel.expert_parallel is 2 but the stage runs as one process"):
        run_stage(ctx)
