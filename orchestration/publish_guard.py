"""The last check before a stage's model is published: refuse weights that diverged.

A stage kind checks its loss, but a step that computes no loss (an RL iteration whose groups have
no reward variance) checks nothing, so a diverged policy could be renamed into place as done and
fail one stage later. Before `model/` is published the worker checks, per tensor:

1. every floating-point tensor of every `*.safetensors` file is finite (any stage kind);
2. for a transformers model (a `config.json` that AutoModelForCausalLM loads): a forward pass over
   a few token ids gives finite logits;
3. when the stage continues an input model and trains with posttrain's AdamW (`train:` holds `lr`,
   `betas`, `weight_decay`, `steps`), no trained parameter moved from the input further than its
   optimizer steps can explain (`adamw_movement_bound`).

A refused model raises `DivergedModelError` naming the stage, the tensor and the fix; the stage
ends failed and nothing is published.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# Probe for check 2: a few token ids, enough to pass every block once.
PROBE_TOKENS = 16
# fp32 rounding: each step may round a weight by half an ulp (2**-24 relative); a margin of 4x.
ROUNDING = 2.0**-22


class DivergedModelError(RuntimeError):
    """The stage's trained model is non-finite or moved further than its updates can explain."""


def adamw_movement_bound(
    lr: float, betas: tuple[float, float], weight_decay: float, steps: int, start_abs_max: float
) -> float:
    """The most AdamW can move one weight in `steps` steps at learning rates <= `lr`.

    Bias-corrected Adam's step on a weight is lr_t * m_hat / (sqrt(v_hat) + eps). By
    Cauchy-Schwarz over the gradient history,
        |m_hat_t / sqrt(v_hat_t)| <= B_t = (1 - b1) sqrt(1 - b2^t) / ((1 - b1^t) sqrt(1 - b2))
                                          * sqrt(sum_{k<t} (b1^2 / b2)^k)
    whatever the gradients (B_1 = 1; B_t -> 1.17 for betas (0.9, 0.95)); eps only shrinks it.
    Decoupled decay first scales the weight by (1 - lr_t wd), moving it by at most
    lr_t wd |w_{t-1}| <= lr_t wd (start_abs_max + D_{t-1}). Every schedule posttrain builds
    (warm-up, cosine) stays at or below the peak lr, so the peak bounds each step:
        D_t = D_{t-1} + lr (B_t + wd (start_abs_max + D_{t-1})).
    Gradient clipping, accumulation and skipped steps only lower the true movement. The bound is
    tight (a gradient of constant sign moves a weight lr per early step: a real 4-step rl run came
    to 0.999 of it), so it gets 0.01% plus fp32 rounding as slack.
    """
    b1, b2 = betas
    ratio = b1 * b1 / b2
    moved, series = 0.0, 0.0
    for t in range(1, steps + 1):
        series += ratio ** (t - 1)
        adam = (1 - b1) * math.sqrt(1 - b2**t) / ((1 - b1**t) * math.sqrt(1 - b2)) * math.sqrt(series)
        moved += lr * (adam + weight_decay * (start_abs_max + moved))
    return moved * (1 + 1e-4) + ROUNDING * steps * (start_abs_max + moved)


def check_publishable(
    stage_id: str, config: Any, output: Path, inputs: dict[str, Path], model: Path | None
) -> list[str]:
    """Raise DivergedModelError when the model in `output` must not be published; returns notes
    on what could not be checked (for the stage log). `inputs`, `model`: the stage context's."""
    _check_finite_files(stage_id, output, config)
    trained = _load_causal_lm(output)
    if trained is None:
        return []
    _check_probe_forward(stage_id, trained, config)
    return _check_movement(stage_id, trained, config, start_model(config, inputs, model))


def start_model(config: Any, inputs: dict[str, Path], model: Path | None) -> Path | None:
    """The model dir a stage continues: the need or dir named by its `init` (rl) or `student`
    (mopd) key, else its `model:` when that is a directory (sft); None for a preset."""
    for key in ("init", "student"):
        name = getattr(config, key, None)
        if isinstance(name, str) and name in inputs:
            return inputs[name]
        if isinstance(name, str) and Path(name).is_dir():
            return Path(name)
    return model if model is not None and model.is_dir() else None


def _fix(stage_id: str, config: Any) -> str:
    train = getattr(config, "train", None)
    lr = getattr(train, "lr", None)
    lower = f"lower train.lr (now {lr:g}) or raise train.warmup_steps" if lr else "fix the training"
    return f"the training diverged: {lower}, then rerun with --restart {stage_id}"


def _check_finite_files(stage_id: str, output: Path, config: Any) -> None:
    import torch
    from safetensors import safe_open

    for path in sorted(output.rglob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                tensor = handle.get_tensor(name)
                if not tensor.is_floating_point():
                    continue
                bad = int((~torch.isfinite(tensor)).sum())
                if bad:
                    raise DivergedModelError(
                        f"stage {stage_id}: refusing to publish its model: tensor {name} in "
                        f"{path.relative_to(output)} holds {bad} non-finite value{'s' * (bad > 1)} "
                        f"(NaN/inf) of {tensor.numel()}; nothing was published; {_fix(stage_id, config)}"
                    )


def _load_causal_lm(directory: Path) -> Any:
    """The model in `directory` as transformers loads it, or None when it is not one."""
    if not (directory / "config.json").is_file():
        return None
    from transformers import AutoConfig, AutoModelForCausalLM

    import posttrain.model  # noqa: F401  (registers kimi_k3 with the Auto classes)

    try:
        AutoConfig.from_pretrained(str(directory))
    except (ValueError, KeyError, OSError):
        return None  # a config.json of some other format: only the files' finiteness applies
    import torch

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def _check_probe_forward(stage_id: str, model: Any, config: Any) -> None:
    import torch

    vocab = int(model.config.vocab_size)
    ids = (torch.arange(PROBE_TOKENS) * 7919 % vocab)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    bad = int((~torch.isfinite(logits)).sum())
    if bad:
        largest, name = max((float(p.detach().abs().max()), n) for n, p in model.named_parameters())
        raise DivergedModelError(
            f"stage {stage_id}: refusing to publish its model: a forward pass over {PROBE_TOKENS} tokens "
            f"gives {bad} non-finite logits of {logits.numel()} (largest |weight| {largest:.3g}, in "
            f"tensor {name}); "
            f"nothing was published; {_fix(stage_id, config)}"
        )


def optimizer_steps(config: Any) -> int | None:
    """Optimizer steps a stage takes at most, for a `train:` block of posttrain's AdamW settings
    (None otherwise): `steps`, times `updates_per_iteration` where an iteration has several (rl)."""
    train = getattr(config, "train", None)
    if train is None or not all(hasattr(train, k) for k in ("lr", "betas", "weight_decay", "steps")):
        return None
    return int(train.steps) * int(getattr(train, "updates_per_iteration", 1))


def _check_movement(stage_id: str, model: Any, config: Any, start: Path | None) -> list[str]:
    train = getattr(config, "train", None)
    steps = optimizer_steps(config)
    if steps is None:
        return []
    if getattr(config, "lora", None) is not None:
        return ["movement check skipped: LoRA adapters merged into the weights move them as a product"]
    accelerate = getattr(config, "accelerate", None)
    if getattr(accelerate, "deepspeed_config", None):
        return ["movement check skipped: DeepSpeed builds its own optimizer from its config file"]
    initial = _load_causal_lm(start) if start is not None else None
    if initial is None:
        return []
    before = dict(initial.named_parameters())
    for name, param in model.named_parameters():
        old = before.get(name)
        if old is None or old.shape != param.shape:
            continue
        start_max = float(old.detach().abs().max())
        decay = float(train.weight_decay) if param.dim() >= 2 else 0.0  # as build_optimizer groups
        bound = adamw_movement_bound(float(train.lr), tuple(train.betas), decay, steps, start_max)
        moved = float((param.detach() - old.detach()).abs().max())
        if moved > bound:
            raise DivergedModelError(
                f"stage {stage_id}: refusing to publish its model: tensor {name} moved {moved:.4g} from "
                f"the input model ({start}), more than the {bound:.4g} that {steps} AdamW steps at "
                f"train.lr={float(train.lr):g} can move it; nothing was published; "
                f"{_fix(stage_id, config)}"
            )
    return []
