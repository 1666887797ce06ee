"""The `sft` stage kind: supervised fine-tuning of K3 on agent trajectories.

Documents from the registered data recipes are rendered by the K3 chat renderer (loss on assistant
tokens only: thinking, content, tool calls, end of turn), packed into fixed-length rows with
document boundaries (`cu_seqlens`: KDA state and MLA attention never cross documents) and trained
with AdamW under `accelerate`: gradient accumulation with every trained token weighted equally,
warm-up + cosine LR, clipping, QAT hooks from the stage's `qat:` block, Quantile Balancing of the
router bias after each optimizer step. Eval loss on held-out trajectories and tool-task success on
held-out prompts are measured before and after training and land in the stage manifest.

Why not TRL's SFTTrainer: see docs/sft.md (packing reaches our model's forward under the wrong
keyword, and checkpoint / resume would bypass the stage's CheckpointManager).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn

from posttrain.algos.sft import sft_loss
from posttrain.data.chat import ChatRenderer, TokenizerDir, load_tokenizer, model_tokenizer_dir
from posttrain.data.images import MediaItem
from posttrain.data.packing import PackedRow
from posttrain.model.vision_config import load_vision_config
from posttrain.model.vision_model import media_inputs
from posttrain.parallel.config import ParallelConfig
from posttrain.stages import StageContext, stage_kind
from posttrain.trainers.common import (
    AccelerateConfig,
    LoRAConfig,
    OptimConfig,
    TrainState,
    base_without_peft,
    engine_autocast,
    load_policy,
    renderer_for,
)
from posttrain.trainers.sft_data import (
    DataConfig,
    PackedStream,
    load_sft_data,
    local_data_paths,
    pack,
    row_media,
)
from posttrain.trainers.tool_eval import tool_task_prompts, tool_task_success


class TrainConfig(OptimConfig):
    """The optimisation loop; one optimizer step = `grad_accum` packed rows of `micro_batch_tokens`."""

    steps: int = Field(gt=0, description="optimizer steps")
    micro_batch_tokens: int = Field(1024, gt=1, description="tokens per packed row (one row per micro-batch)")
    grad_accum: int = Field(1, gt=0, description="packed rows per optimizer step")
    gradient_checkpointing: bool = Field(
        False, description="recompute each layer's activations in the backward (non-reentrant): less memory"
    )
    seed: int | None = Field(None, description="data order seed; null: the stage's seed")


class EvalConfig(BaseModel):
    """Tool-task success on held-out prompts (eval loss always uses every held-out trajectory)."""

    model_config = ConfigDict(extra="forbid")
    tool_prompts: int = Field(16, ge=0, description="held-out prompts played as episodes; 0: skip")
    max_new_tokens: int = Field(96, gt=0, description="tokens per assistant turn")
    max_turns: int = Field(4, gt=0, description="assistant turns per episode")


class SFTConfig(BaseModel):
    """Keys of an `sft` stage file besides the generic ones (docs/sft.md)."""

    model_config = ConfigDict(extra="forbid")
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig
    lora: LoRAConfig | None = Field(
        None,
        description="train low-rank adapters (merged into the final model) instead of every weight; "
        "the routed experts, not nn.Linear, stay frozen",
    )
    accelerate: AccelerateConfig = Field(default_factory=AccelerateConfig)
    tokenizer: TokenizerDir = Field(
        None, description="tokenizer dir; null: the model dir's, else the shipped one"
    )
    vision: str | None = Field(
        None,
        description="vision preset file (e.g. models/vision-tiny.yaml: a fresh MoonViT-V2 + projector) or "
        "pretrained vision dir (e.g. ../data_recipes/vision_base: its tower + projector) under the text "
        "model, for data with images, relative to stages/ or the run dir; null: none",
    )
    checkpoint_every: int = Field(50, gt=0, description="optimizer steps between checkpoints")
    eval_every: int = Field(
        0, ge=0, description="optimizer steps between eval-loss measurements; 0: only at the ends"
    )
    eval: EvalConfig = Field(default_factory=EvalConfig)
    parallel: ParallelConfig | None = Field(
        None, description="expert parallelism (FSDP2 over the rest with accelerate.fsdp) across processes"
    )

    @field_validator("vision")
    @classmethod
    def _vision_preset_exists(cls, vision: str | None) -> str | None:
        # A check of the key, not of the whole config: the error points at the `vision:` line or
        # the override that set it (a model check pointed at line 1 of the stage file).
        if vision is not None:
            preset = vision_preset(vision)
            if preset.is_file():
                # read now: a text model's preset (models/small.yaml) passed `plan` and stopped the
                # stage after the model load, naming the file's key but not `vision:`
                try:
                    load_vision_config(preset)
                except yaml.YAMLError as error:
                    raise ValueError(f"{vision}: not a YAML vision preset ({error})") from error
        return vision

    @model_validator(mode="after")
    def _fits_in_a_row(self) -> SFTConfig:
        if self.data.max_length is not None and self.data.max_length > self.train.micro_batch_tokens:
            raise ValueError(
                f"data.max_length ({self.data.max_length}) > train.micro_batch_tokens "
                f"({self.train.micro_batch_tokens}): a trajectory must fit in one packed row; lower "
                "data.max_length or raise train.micro_batch_tokens"
            )
        if self.parallel is not None and self.lora is not None:
            raise ValueError("parallel: trains the full model; remove lora (adapters are not sharded)")
        return self


STAGES_DIR = Path(__file__).resolve().parents[2] / "stages"


def vision_preset(value: str) -> Path:
    """What `vision:` names, a preset file or a pretrained vision directory: a path from the run
    dir, else one under stages/."""
    from posttrain.model.vision_model import is_vision_dir

    for candidate in (Path(value), STAGES_DIR / value):
        if candidate.is_file() or is_vision_dir(candidate):
            return candidate.resolve()
    raise ValueError(
        f"{value}: no preset file or vision dir (relative to {Path.cwd()} or {STAGES_DIR}); "
        "e.g. models/vision-tiny.yaml or ../data_recipes/vision_base"
    )


@torch.no_grad()
def eval_loss(model: nn.Module, rows: list[PackedRow], media: list[list[MediaItem]] | None = None) -> float:
    """Mean loss per trained token over packed rows (every token weighted equally); media[i]: row
    i's media entries (None: text rows)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device  # rows are packed on the CPU; the model may be on a GPU
    try:
        for index, row in enumerate(rows):
            ids, mask, cu = (t.to(device) for t in (row.input_ids, row.loss_mask, row.cu_seqlens))
            extra = media_inputs(model, [media[index]]) if media else {}
            logits = model(input_ids=ids, cu_seqlens=cu, use_cache=False, **extra).logits
            out = sft_loss(logits, ids, mask, reduction="sum", cu_seqlens=cu)
            total += float(out.loss)
            count += int(out.num_tokens)
    finally:
        model.train(was_training)
    return total / max(count, 1)


def _tokenizer_dir(cfg: SFTConfig, ctx: StageContext) -> Path | None:
    """`tokenizer:`, else the starting model dir's own (None, the shipped one, for a model dir
    without tokenizer files, a preset file or no model)."""
    if cfg.tokenizer:
        return Path(cfg.tokenizer)
    return model_tokenizer_dir(Path(ctx.model)) if ctx.model is not None else None


class Evaluator:
    """Eval loss and tool-task success of the model being trained, under one name suffix."""

    def __init__(
        self,
        cfg: EvalConfig,
        renderer: ChatRenderer,
        rows: list[PackedRow],
        records: list[dict],
        media: list[list[MediaItem]] | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        self.cfg = cfg
        self.autocast_dtype = autocast_dtype
        self.renderer = renderer
        self.rows = rows
        self.media = media
        # 0 skips the tool eval: the records are not even looked at
        self.prompts = tool_task_prompts(records, cfg.tool_prompts) if cfg.tool_prompts else []

    def loss(self, model: nn.Module, suffix: str) -> dict[str, float]:
        return {f"eval_loss_{suffix}": eval_loss(model, self.rows, self.media)} if self.rows else {}

    def __call__(self, model: nn.Module, suffix: str) -> dict[str, float]:
        metrics = self.loss(model, suffix)
        if self.prompts:
            result = tool_task_success(
                model,
                self.renderer,
                self.prompts,
                max_new_tokens=self.cfg.max_new_tokens,
                max_turns=self.cfg.max_turns,
                autocast_dtype=self.autocast_dtype,
            )
            metrics.update(result.metrics(suffix))
        return metrics


def sft_data_files(cfg: SFTConfig) -> list[Path]:
    """The user's data files and directories the stage trains on (their content joins its inputs)."""
    return local_data_paths(cfg.data)


@stage_kind("sft", config=SFTConfig, data_files=sft_data_files)
def run_sft(ctx: StageContext) -> dict[str, float]:
    """Supervised fine-tuning on agent trajectories (packed rows, loss on assistant tokens)."""
    cfg: SFTConfig = ctx.config
    train = cfg.train
    seed = ctx.seed if train.seed is None else train.seed
    vision = vision_preset(cfg.vision) if cfg.vision is not None else None
    tokenizer = load_tokenizer(_tokenizer_dir(cfg, ctx), media=vision is not None)
    renderer = ChatRenderer(tokenizer)
    policy = load_policy(
        ctx,
        len(tokenizer),
        lora=cfg.lora,
        gradient_checkpointing=train.gradient_checkpointing,
        vision=vision,
        media_pad_id=renderer.media_token_ids.get("media_pad"),
    )
    renderer = renderer_for(tokenizer, policy.model)
    data = load_sft_data(cfg.data, renderer, seed, cfg.data.max_length or train.micro_batch_tokens, ctx.log)
    if cfg.parallel is not None:
        from posttrain.parallel.train_state import ShardedTrainState

        state = ShardedTrainState.create(
            ctx, policy.model, train, cfg.accelerate, cfg.parallel, train.steps, train.grad_accum
        )
        if state.accelerator.num_processes > 1 and cfg.eval.tool_prompts:
            # generation runs the sharded forward a data-dependent number of times per rank
            raise ValueError(
                f"stage {ctx.stage_id}: eval.tool_prompts must be 0 with parallel: across processes"
            )
    else:
        state = TrainState.create(ctx, policy.model, train, cfg.accelerate, train.steps, train.grad_accum)
    model = base_without_peft(state.unwrapped)
    stream = PackedStream(data.train, train.micro_batch_tokens, renderer.pad_id, seed)
    eval_rows = pack(data.eval, train.micro_batch_tokens, renderer.pad_id)
    eval_media = [row_media(row, data.eval) for row in eval_rows] if renderer.processor else None
    evaluate = Evaluator(
        cfg.eval, renderer, eval_rows, data.eval_records, eval_media, engine_autocast(cfg.accelerate)
    )
    ctx.log.info(
        "SFT: %s model, %d trainable parameters, %d steps x %d rows x %d tokens",
        policy.source,
        sum(p.numel() for p in state.model.parameters() if p.requires_grad),
        train.steps,
        train.grad_accum,
        train.micro_batch_tokens,
    )

    checkpoint = state.restore()
    if checkpoint is not None:
        step, before = checkpoint.step, dict(checkpoint.extra["before"])
        stream.seek(checkpoint.extra["data"])
    else:
        step, before = 0, evaluate(model, "before")
        ctx.metrics.log(0, before)
        ctx.log.info("before training: %s", _shown(before))

    # The last step's metrics ride in the checkpoint: a resume from the final one runs no step.
    last: dict[str, float] = dict(checkpoint.extra.get("last", {})) if checkpoint is not None else {}
    while step < train.steps:
        last = _train_step(state, stream, train, step + 1)
        step += 1
        if cfg.eval_every and step % cfg.eval_every == 0 and step < train.steps and evaluate.rows:
            last["eval_loss"] = eval_loss(model, evaluate.rows, evaluate.media)
        ctx.metrics.log(step, last)
        if step % cfg.checkpoint_every == 0 or step == train.steps:
            state.save_checkpoint(step, extra={"data": stream.cursor(), "before": before, "last": last})
        ctx.progress(step, train.steps, loss=last["loss"], lr=last["lr"])

    after = evaluate(model, "after")
    ctx.metrics.log(step, after)
    ctx.log.info("after training: %s", _shown(after))
    state.save_model(tokenizer, ctx.output_dir, renderer.stop_token_ids)
    final = {**before, **after, **data.report.metrics(), "steps": float(step)}
    final.update({f"train_{k}": v for k, v in last.items() if k in ("loss", "tokens_per_s")})
    return final


def _train_step(state: TrainState, stream: PackedStream, train: TrainConfig, step: int) -> dict[str, float]:
    """One optimizer step over `grad_accum` packed rows; the loss is the mean over every trained
    token of the step (summed per row, divided once by the step's token count across processes)."""
    started = time.perf_counter()
    accelerator = state.accelerator
    # Every process walks the same stream and trains on its own share of the step's rows, so the
    # cursor in a checkpoint is the same on all of them.
    step_rows = [stream.next() for _ in range(train.grad_accum * accelerator.num_processes)]
    rows = step_rows[accelerator.process_index :: accelerator.num_processes]
    trained = torch.stack([row.loss_mask.sum() for row, _ in rows]).sum()
    total = accelerator.reduce(trained.to(accelerator.device), reduction="sum").clamp(min=1)
    # accelerate divides by grad_accum in backward and DDP averages over processes: undo both so the
    # gradient is sum(token losses) / total.
    scale = train.grad_accum * accelerator.num_processes / total
    loss_sum = torch.zeros(())
    metrics: dict[str, float] = {}
    for index, (row, uids) in enumerate(rows):
        with accelerator.accumulate(state.model):
            logits = state.model(
                input_ids=row.input_ids.to(accelerator.device),
                cu_seqlens=row.cu_seqlens.to(accelerator.device),
                **media_inputs(state.unwrapped, [stream.media(uids)]),
            ).logits
            out = sft_loss(
                logits,
                row.input_ids.to(logits.device),
                row.loss_mask.to(logits.device),
                reduction="sum",
                cu_seqlens=row.cu_seqlens,
            )
            state.check_finite(out.loss, step, detail=f" (packed documents {', '.join(uids)})")
            state.backward(out.loss * scale)
            loss_sum += out.loss.detach().float().cpu()
            if index == len(rows) - 1:
                metrics = state.optimizer_step(step)
    elapsed = time.perf_counter() - started
    real_tokens = sum(int(row.cu_seqlens[row.num_documents]) for row, _ in rows)
    # the step's loss over every process's tokens (equal to one process's on the whole step)
    loss_total = accelerator.reduce(loss_sum.to(accelerator.device), reduction="sum")
    return {
        "loss": float(loss_total) / float(total),
        "tokens_per_s": real_tokens / elapsed,
        "trained_tokens": float(trained),
        "epoch": stream.epoch_fraction,
        **metrics,
    }


def _shown(metrics: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, float) and math.isfinite(v))
