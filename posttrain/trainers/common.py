"""What every trainer (SFT, RL, MOPD) sets up the same way: the policy model, its optimiser and LR
schedule, the `accelerate` wrapper, one optimizer step, and checkpoints that resume bit for bit.

A trainer builds a `TrainState` from its config blocks and then only writes its own loop:

    policy = load_policy(ctx, tokenizer, lora=cfg.lora, gradient_checkpointing=...)
    state = TrainState.create(ctx, policy.model, cfg.train, cfg.accelerate, total_steps=...)
    restored = state.restore()                       # None on a fresh start
    ...  state.backward(loss) per micro-batch ...
    metrics = state.optimizer_step()                 # clip, step, schedule, router balancing
    state.save_checkpoint(step, extra={"data": cursor})

Exact resume rests on three rules kept here: a checkpoint is written only between optimizer steps
(no half-accumulated gradients, no pending router statistics), it holds every piece of state the
rest of the run reads (weights incl. the router bias buffer, optimizer moments, scheduler position,
global RNGs, plus the trainer's own `extra` such as its data cursor), and nothing else a run
depends on lives outside it (accelerate's global state is reset when a stage builds its own).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from posttrain.checkpoint import Checkpoint
from posttrain.stages import StageContext

CONFIG_FILE = "config.json"


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN/inf loss or gradient norm; the message names the step and the fix."""


AdamBeta = Annotated[float, Field(ge=0, lt=1)]


class OptimConfig(BaseModel):
    """AdamW with a linear warm-up then a cosine decay to `min_lr_ratio * lr`, and norm clipping."""

    model_config = ConfigDict(extra="forbid")
    lr: float = Field(1e-3, gt=0, description="peak learning rate")
    warmup_steps: int = Field(
        0,
        ge=0,
        description="optimizer steps of linear warm-up to lr: step s (from 0) uses lr*(s+1)/(warmup_steps+1)",
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    weight_decay: float = Field(0.0, ge=0, description="decoupled decay on matrices (not norms, biases)")
    # in [0, 1) as torch's AdamW requires: checked here, a bad one fails `plan`, not the stage start
    betas: tuple[AdamBeta, AdamBeta] = Field((0.9, 0.95), description="AdamW's moment decay rates, in [0, 1)")
    eps: float = Field(1e-8, gt=0, description="AdamW's denominator epsilon")
    grad_clip: float | None = Field(1.0, gt=0, description="max global grad norm; null: no clipping")
    freeze_vision: bool = Field(
        False,
        description="keep the vision tower and projector as loaded (a pretrained tower: at the text "
        "model's lr, AdamW's unit-size steps erase its features before the text model reads them)",
    )


class FSDPConfig(BaseModel):
    """Options passed to accelerate's FullyShardedDataParallelPlugin (GPU runs)."""

    model_config = ConfigDict(extra="forbid")
    version: Literal[1, 2] = 2
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    state_dict_type: Literal["FULL_STATE_DICT", "SHARDED_STATE_DICT"] = "FULL_STATE_DICT"
    activation_checkpointing: bool = False
    wrap_classes: list[str] = Field(
        default_factory=lambda: ["KimiK3DecoderLayer"], description="module classes sharded as units"
    )


class AccelerateConfig(BaseModel):
    """How `accelerate` runs the model. DeepSpeed and FSDP are for GPU runs started with
    `accelerate launch`; on a machine without CUDA the stage runs as one plain process and says so
    in its log (the config is still checked, so a typo fails here and not on the cluster)."""

    model_config = ConfigDict(extra="forbid")
    mixed_precision: Literal["no", "bf16", "fp16"] = Field("no", description="accelerate's mixed precision")
    deepspeed_config: str | None = Field(
        None, description="path of a DeepSpeed JSON config (ZeRO stage etc.)"
    )
    fsdp: FSDPConfig | None = Field(None, description="shard the model with FSDP (GPU runs); null: no FSDP")

    @model_validator(mode="after")
    def _one_sharding(self) -> AccelerateConfig:
        if self.deepspeed_config and self.fsdp:
            raise ValueError("accelerate: set deepspeed_config or fsdp, not both")
        if self.deepspeed_config and not Path(self.deepspeed_config).is_file():
            raise ValueError(
                f"accelerate.deepspeed_config: {self.deepspeed_config} does not exist "
                "(give an absolute path or one relative to the directory `posttrain run` starts in)"
            )
        return self


def engine_autocast(accelerate: AccelerateConfig) -> torch.dtype | None:
    """The dtype accelerate's mixed precision autocasts the trainer's forward to, for the embedded
    engines of the stage (rollouts, evals, teachers): they then compute what training computes,
    and on a GPU the routed experts run as grouped GEMMs, which the captured decode step needs."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerate.mixed_precision)


class LoRAConfig(BaseModel):
    """Low-rank adapters through peft; only the adapters train and the final model is merged."""

    model_config = ConfigDict(extra="forbid")
    r: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names (e.g. [q_proj, o_proj]) or every Linear but the LM head"
    )


# Model -----------------------------------------------------------------------------------------


@dataclass
class Policy:
    """The model being trained and where it came from ("preset" or "pretrained")."""

    model: nn.Module
    source: str


def load_policy(
    ctx: StageContext,
    vocab_size: int,
    *,
    lora: LoRAConfig | None = None,
    gradient_checkpointing: bool = False,
    model_path: Path | None = None,
    vision: Path | None = None,
    media_pad_id: int | None = None,
) -> Policy:
    """The stage's model, ready to train: a fresh seeded KimiK3ForCausalLM from a preset file, or
    from_pretrained from a model dir (`model_path`, default ctx.model; K3 or any transformers causal
    LM); embeddings grown to `vocab_size` when the tokenizer has more tokens; QAT hooks from ctx.qat;
    LoRA adapters. A model dir that `sees_images` (vision weights its tokenizer can feed) loads as
    the multimodal KimiK3ForConditionalGeneration; `vision` puts a MoonViT-V2 and projector under a
    text model, with `media_pad_id` (the tokenizer's `<|media_pad|>`) as its media placeholder:
    fresh seeded ones for a vision preset file, the pretrained ones of a vision directory
    (`data_recipes/vision_base/`).

    QAT quantises K3's routed experts: asked of a model without them (`qat: {scheme: k3}` on a
    Llama) it is an error naming the stage and the fix. Router balancing needs no request: it runs
    after each optimizer step on models that have it (`update_router_bias`) and is absent otherwise.
    """
    import posttrain.model as k3
    from posttrain.qat import apply_qat, qat_config_of

    path = Path(model_path or ctx.model) if (model_path or ctx.model) else None
    if path is None:
        raise ValueError(
            f"stage {ctx.stage_id}: no `model` in the stage file; set it to a preset (models/tiny.yaml) "
            "or to the stage id of a need whose model this stage continues"
        )
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"stage {ctx.stage_id}: model dir {path} has no {CONFIG_FILE}")
        from posttrain.model.vision_model import load_pretrained

        model = load_pretrained(path)
        source = "pretrained"
    else:
        config = k3.load_model_config(path)
        config.vocab_size = max(config.vocab_size, vocab_size)
        torch.manual_seed(ctx.seed)
        model = k3.KimiK3ForCausalLM(config)
        source = "preset"
    if model.get_input_embeddings().num_embeddings < vocab_size:
        model.resize_token_embeddings(vocab_size)
    if vision is not None:
        model = _with_vision(ctx, model, vision, media_pad_id)
    try:
        applied = apply_qat(model, ctx.qat)
    except ValueError as error:
        raise ValueError(f"stage {ctx.stage_id} (model {path}): {error}") from error
    qat = qat_config_of(model.config)  # what apply_qat recorded, already validated
    if applied and qat is not None and qat.enabled:
        ctx.log.info("QAT %s on %d routed-expert modules", qat.scheme, len(applied))
    elif applied:
        ctx.log.info("QAT off: %d routed-expert modules run unquantised", len(applied))
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        _check_lora_targets(ctx, model, lora)
        model = get_peft_model(
            model,
            PeftLoraConfig(
                r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules
            ),
        )
    model.train()
    return Policy(model=model, source=source)


def _check_lora_targets(ctx: StageContext, model: nn.Module, lora: LoRAConfig) -> None:
    """Every name in `lora.target_modules` names a module of the model (peft's rule: the module's
    name or its dotted suffix). peft silently skipped a misspelled one beside a good one, and with
    none good stopped the stage with an error naming neither the key nor the model's names."""
    if lora.target_modules == "all-linear":
        return
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in lora.target_modules if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(
            f"stage {ctx.stage_id}: lora.target_modules {missing} name no module of the model; its "
            f"Linear modules are {', '.join(linear)} (or target_modules: all-linear)"
        )


def _with_vision(ctx: StageContext, model: nn.Module, vision: Path, media_pad_id: int | None) -> nn.Module:
    from posttrain.model import KimiK3ForCausalLM
    from posttrain.model.vision_config import load_vision_config
    from posttrain.model.vision_model import is_vision_dir, load_vision_dir, with_vision

    if hasattr(model, "vision_tower"):
        raise ValueError(
            f"stage {ctx.stage_id}: `vision: {vision}` asks for a new vision tower but the model already "
            "has one; drop `vision:` to continue the model's own"
        )
    if not isinstance(model, KimiK3ForCausalLM) or media_pad_id is None:
        raise ValueError(
            f"stage {ctx.stage_id}: `vision:` needs a K3 text model and a tokenizer with the media tokens "
            f"(load_tokenizer(media=True)); got {type(model).__name__}, media pad {media_pad_id}"
        )
    weights = None
    if is_vision_dir(vision):
        config, weights = load_vision_dir(vision, model.config.hidden_size)
        ctx.log.info("vision tower and projector: pretrained, from %s", vision)
    else:
        config = load_vision_config(vision, text_hidden_size=model.config.hidden_size)
    torch.manual_seed(ctx.seed)
    return with_vision(model, config, media_pad_id, weights)


def renderer_for(tokenizer: Any, model: nn.Module) -> Any:
    """The policy's ChatRenderer: with the image processor of its vision tower when it has one,
    so prompts size their images as the tower cuts them."""
    from posttrain.data.chat import ChatRenderer
    from posttrain.model.vision_model import image_processor

    if isinstance(getattr(model, "vision_tower", None), nn.Module):
        return ChatRenderer(tokenizer, image_processor(model.config))
    return ChatRenderer(tokenizer)


def merged_model(model: nn.Module) -> nn.Module:
    """The plain transformers model to save: a peft model has its LoRA adapters merged in."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        return model.merge_and_unload()
    return model


def save_final_model(model: nn.Module, tokenizer: Any, output_dir: Path, stop_token_ids: list[int]) -> None:
    """Write the stage's model with its tokenizer and chat template; `generate` stops on the chat's
    end-of-turn tokens and pads with the tokenizer's pad.

    A K3 model is written in the released layout (`posttrain.model.released`: the wrapper config,
    `language_model.*` names, per-expert routed weights, untied LM head), which `vllm serve` loads
    and `AutoModelForCausalLM.from_pretrained` (after `import posttrain.model`) reads back; the
    master weights are written as they are (QAT is recorded in `posttrain_qat`, not applied).
    Any other transformers model is written with its own save_pretrained."""
    from posttrain.model import KimiK3ForCausalLM, save_released
    from posttrain.model.vision_model import KimiK3ForConditionalGeneration, save_multimodal

    model.config.pad_token_id = tokenizer.pad_token_id
    # the multimodal model generates through its text model, whose generation config is written
    text = model.language_model if isinstance(model, KimiK3ForConditionalGeneration) else model
    text.generation_config.pad_token_id = tokenizer.pad_token_id
    text.generation_config.eos_token_id = list(stop_token_ids)
    if isinstance(model, KimiK3ForCausalLM):
        save_released(model, output_dir, tokenizer=tokenizer)
        return
    if isinstance(model, KimiK3ForConditionalGeneration):
        save_multimodal(model, output_dir, tokenizer=tokenizer)
        return
    model.save_pretrained(str(output_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(output_dir))


# Optimisation ----------------------------------------------------------------------------------


def build_optimizer(model: nn.Module, cfg: OptimConfig, fused: bool = False) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; matrices decay, vectors (norms, biases, gates' scalars)
    do not: decaying a norm's gain pulls it to 0, which no one wants. With `cfg.freeze_vision`
    the vision tower and projector stop being trainable first (`freeze_vision`).

    fused: torch's fused AdamW (one kernel over all tensors of a group), what the stages use on
    CUDA: the per-parameter loop was the largest item of a K3 GPU step (89 ms of 470 at 2.8B
    parameters, bench/RESULTS.md), since the MoE's total size, not its active size, sets it.
    Otherwise the per-parameter loop, whose CPU results the tests and reruns compare bit for bit."""
    if cfg.freeze_vision:
        freeze_vision(model)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameter")
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        foreach=False,
        fused=fused,
    )


def freeze_vision(model: nn.Module) -> None:
    """The vision tower and projector get no gradient and no update; the text model trains.

    Why: the vision SFT from the pre-aligned tower (data_recipes/vision_base) with them trained at
    the text model's lr ended with features that no longer told the drawn answers apart (a
    nearest-class-mean probe of the tallest bar: 0.95 before SFT, 0.34 after) and answered at
    chance; frozen, the same trajectories teach the text model to read them (bench/RESULTS.md)."""
    parts = [getattr(model, name, None) for name in ("vision_tower", "mm_projector")]
    if not all(isinstance(part, nn.Module) for part in parts):
        raise ValueError(
            f"train.freeze_vision: {type(model).__name__} has no vision tower and projector; drop the key"
        )
    for part in parts:
        part.requires_grad_(False)


@dataclass(frozen=True)
class WarmupCosine:
    """LR multiplier at optimizer step s (from 0): (s + 1)/(warmup + 1) during warm-up, then a
    cosine from 1 at step `warmup` to min_ratio at `total` steps (flat after). A class, not a
    lambda, so the scheduler pickles."""

    warmup: int
    total: int
    min_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int, log: logging.Logger
) -> Any:
    schedule = WarmupCosine(cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    if cfg.warmup_steps >= total_steps:
        # Accepted (a smoke run shortens train.steps and keeps the file's warm-up), but the LR then
        # never reaches train.lr and never decays: said once, so a short run's numbers are not
        # read as the peak lr's.
        log.info(
            "train.warmup_steps %d >= the stage's %d optimizer steps: the run ends inside the warm-up, "
            "its last step at %.3g x train.lr (%g); the cosine decay never starts",
            cfg.warmup_steps,
            total_steps,
            schedule(total_steps - 1),
            cfg.lr,
        )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


# accelerate ------------------------------------------------------------------------------------


def accelerator_plugins(cfg: AccelerateConfig, grad_accum: int, log: logging.Logger) -> dict[str, Any]:
    """Keyword arguments for `accelerate.Accelerator`: mixed precision and, on CUDA machines, the
    DeepSpeed or FSDP plugin built from the stage's config."""
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    if cfg.mixed_precision == "fp16" and not torch.cuda.is_available():
        # accelerate takes fp16 on the CPU and trains in float32 without a word (it has no CPU grad
        # scaler), while the stage's engines would generate under fp16 autocast (engine_autocast)
        raise ValueError(
            "accelerate.mixed_precision fp16 needs CUDA and this machine has none; set bf16 or no"
        )
    kwargs: dict[str, Any] = {
        "mixed_precision": cfg.mixed_precision,
        "gradient_accumulation_steps": grad_accum,
    }
    plugin: Any = None
    if cfg.deepspeed_config:
        plugin = DeepSpeedPlugin(hf_ds_config=str(Path(cfg.deepspeed_config).resolve()))
        plugin.deepspeed_config["gradient_accumulation_steps"] = grad_accum
        key = "deepspeed_plugin"
    elif cfg.fsdp is not None:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=cfg.fsdp.version,
            reshard_after_forward=cfg.fsdp.reshard_after_forward,
            cpu_offload=cfg.fsdp.cpu_offload,
            state_dict_type=cfg.fsdp.state_dict_type,
            activation_checkpointing=cfg.fsdp.activation_checkpointing,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=cfg.fsdp.wrap_classes,
        )
        key = "fsdp_plugin"
    if plugin is not None:
        if torch.cuda.is_available():
            kwargs[key] = plugin
        else:
            log.warning(
                "accelerate: %s accepted, but this machine has no CUDA: running as one plain process", key
            )
    return kwargs


def build_accelerator(cfg: AccelerateConfig, grad_accum: int, log: logging.Logger) -> Any:
    """A fresh `accelerate.Accelerator`. accelerate keeps process-global state (the first
    Accelerator's plugins win); a stage owns its process, so it resets what an earlier one left."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    # Several processes without CUDA (`torchrun` on a CPU machine): accelerate's gloo path, which it
    # only takes when asked for the CPU.
    cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    return Accelerator(cpu=cpu, **accelerator_plugins(cfg, grad_accum, log))


# The train state -------------------------------------------------------------------------------


class TrainState:
    """Model, optimizer, LR schedule and accelerator of one stage, and their checkpoints."""

    def __init__(
        self,
        ctx: StageContext,
        model: nn.Module,
        optimizer: Any,
        scheduler: Any,
        accelerator: Any,
        grad_clip: float | None,
    ) -> None:
        self.ctx = ctx
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.accelerator = accelerator
        self.grad_clip = grad_clip

    @classmethod
    def create(
        cls,
        ctx: StageContext,
        model: nn.Module,
        optim: OptimConfig,
        accelerate: AccelerateConfig,
        total_steps: int,
        grad_accum: int = 1,
    ) -> TrainState:
        accelerator = build_accelerator(accelerate, grad_accum, ctx.log)
        optimizer = build_optimizer(model, optim, fused=accelerator.device.type == "cuda")
        model, optimizer = accelerator.prepare(model, optimizer)
        # The schedule counts optimizer steps itself (accelerate's prepared scheduler would step
        # once per process and change the LR curve with the world size).
        scheduler = build_scheduler(optimizer, optim, total_steps, ctx.log)
        return cls(ctx, model, optimizer, scheduler, accelerator, optim.grad_clip)

    @property
    def unwrapped(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def check_finite(
        self, loss: torch.Tensor, step: int, what: str = "loss", detail: str = "", agreed: bool = False
    ) -> None:
        """Raise NonFiniteLossError when `loss` is NaN/inf here or on any other process: every
        rank must stop at the same check, or the ones that go on wait in the backward's collectives
        for the one that stopped (NCCL until its timeout; gloo fails them on a closed connection).
        agreed: the value is already the same on every rank (a global gradient norm), so no
        all-reduce is needed."""
        value = float(loss.detach())
        finite = math.isfinite(value)
        bad_ranks = [] if agreed else non_finite_ranks(finite, loss.device)
        if finite and not bad_ranks:
            return
        peak = self.optimizer.param_groups[0]["initial_lr"]
        if finite:  # another rank's value; this rank's detail names its own rows, not the bad ones
            where = f"not finite on rank(s) {bad_ranks} at optimizer step {step}"
        else:
            where = f"{value} at optimizer step {step}{detail}"
        raise NonFiniteLossError(
            f"stage {self.ctx.stage_id}: {what} is {where}. "
            f"Lower the learning rate (train.lr, now {peak:g}) or "
            "increase warm-up (train.warmup_steps), and check the data of this step for broken rows; "
            f"{self.resume_note()}."
        )

    def resume_note(self) -> str:
        """What a rerun of the failed stage starts from: its newest checkpoint, or nothing."""
        latest = self.ctx.checkpoints.latest_step()
        if latest is None:
            return "no checkpoint was written yet, so a rerun starts the stage over"
        return f"checkpoint step {latest} is intact and a rerun resumes from it"

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def optimizer_step(self, step: int) -> dict[str, float]:
        """Clip, step, advance the schedule, clear gradients, then re-balance the routers with the
        statistics of this step's forwards. Returns grad_norm, lr and the router metrics."""
        lr = self.lr
        if self.grad_clip is not None:
            norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        else:
            grads = [p.grad.detach().norm() for p in self.model.parameters() if p.grad is not None]
            norm = torch.stack(grads).norm() if grads else torch.zeros(())
        # DeepSpeed clips inside its engine and may not report the norm (None). A clipped norm is
        # the whole model's on every process; the unclipped one sums this process's gradients only.
        if norm is not None:
            agreed = self.grad_clip is not None
            self.check_finite(torch.as_tensor(norm), step, "the gradient norm", agreed=agreed)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {"lr": lr} if norm is None else {"grad_norm": float(norm), "lr": lr}
        update = getattr(base_without_peft(self.unwrapped), "update_router_bias", None)
        if update is not None:
            metrics.update(update())
        return metrics

    def save_checkpoint(self, step: int, extra: dict[str, Any] | None = None) -> Path | None:
        return self.ctx.checkpoints.save(
            step, model=self.unwrapped, optimizer=self.optimizer, scheduler=self.scheduler, extra=extra or {}
        )

    def restore(self) -> Checkpoint | None:
        """Load the newest intact checkpoint into model, optimizer, scheduler and the RNGs."""
        return self.ctx.checkpoints.load(
            model=self.unwrapped, optimizer=self.optimizer, scheduler=self.scheduler
        )

    def save_model(self, tokenizer: Any, output_dir: Path, stop_token_ids: list[int]) -> None:
        """The stage's final model (LoRA merged) to output_dir: `save_final_model`."""
        save_final_model(merged_model(self.unwrapped), tokenizer, output_dir, stop_token_ids)


def non_finite_ranks(finite: bool, device: torch.device) -> list[int]:
    """The ranks whose value was not finite, agreed by every process of the default group (one
    all-reduce); [] in a single process, whose caller has its own `finite`."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return []
    flags = torch.zeros(dist.get_world_size(), device=device)
    flags[dist.get_rank()] = 0.0 if finite else 1.0
    dist.all_reduce(flags)
    return [rank for rank, flag in enumerate(flags.tolist()) if flag]


def base_without_peft(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper, without merging (shares the training weights)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model
