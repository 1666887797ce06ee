"""Turn MX fake quantisation on or off in a model's routed experts.

The model exposes one hook pair per routed-experts module (class name ending in "Experts", 3-D
batched weights): `weight_fake_quant` runs on each 3-D weight and `act_fake_quant` on each expert
matmul's input activation, both at forward time. Setting them is all QAT needs: the parameters
(master weights) stay in full precision and receive straight-through gradients, and nothing else
in the model (attention, latent projections, shared experts, router, embeddings, LM head) is
touched. torchao's QAT swaps `nn.Linear` modules; K3's experts are not Linears, hence hooks.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from posttrain.qat.config import QATConfig
from posttrain.qat.mx import MXFormat, ScaleRule
from posttrain.qat.mx_fused import fake_quantize

QAT_CONFIG_KEY = "posttrain_qat"


@dataclass(frozen=True)
class MXFakeQuant:
    """MX fake quantisation (`fake_quantize`: one fused kernel on CUDA, the spec
    `quantize_dequantize` elsewhere, same values) with fixed settings: the Callable a hook holds.
    A dataclass rather than a lambda so a model with hooks set still pickles and prints clearly.

    `cache_inference` (weights only): under no_grad (rollouts, scoring, eval) the quantised copy
    of a tensor is reused until the tensor changes. Re-quantising every expert weight on every
    decode step was about half of decode time; the tensor's version counter moves on every
    in-place update (optimizer step, load_state_dict), so a stale copy is never returned.
    """

    fmt: MXFormat
    scale_rule: ScaleRule
    block_size: int = 32
    cache_inference: bool = field(default=False, compare=False)  # same numbers either way
    # id(tensor) -> (weak reference, version, quantised copy). Keyed by identity: tensors compare
    # element-wise, so they cannot be dictionary keys; the weak reference drops the entry with
    # the tensor and guards against a recycled id.
    _cache: dict[int, tuple[weakref.ref, int, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.cache_inference and not torch.is_grad_enabled()):
            return fake_quantize(x, self.fmt, self.block_size, self.scale_rule)
        key = id(x)
        hit = self._cache.get(key)
        if hit is not None and hit[0]() is x and hit[1] == x._version:
            return hit[2]
        out = fake_quantize(x, self.fmt, self.block_size, self.scale_rule)
        cache = self._cache
        self._cache[key] = (weakref.ref(x, lambda _ref: cache.pop(key, None)), x._version, out)
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.fmt, self.scale_rule, self.block_size, self.cache_inference))


def routed_expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> module, for every module that carries the routed-experts QAT hooks."""
    return {
        name: module
        for name, module in model.named_modules()
        if type(module).__name__.endswith("Experts")
        and hasattr(module, "weight_fake_quant")
        and hasattr(module, "act_fake_quant")
    }


def weight_fake_quant(cfg: QATConfig) -> MXFakeQuant | None:
    if not cfg.enabled:
        return None
    return MXFakeQuant(cfg.weight_format, cfg.weight_scale_rule, cfg.block_size, cache_inference=True)


def act_fake_quant(cfg: QATConfig) -> MXFakeQuant | None:
    return (
        MXFakeQuant(cfg.activation_format, cfg.activation_scale_rule, cfg.block_size) if cfg.enabled else None
    )


def apply_qat(model: nn.Module, cfg: QATConfig | Mapping[str, Any] | None) -> list[str]:
    """Set (scheme k3) or clear (scheme none / cfg None) the hooks of every routed-experts module.

    Returns the qualified names of the modules it set, sorted. The config is also recorded as
    model.config.posttrain_qat (see restore_qat). Raises ValueError when scheme k3 finds no such
    module, or when a routed-expert weight's last (reduction) dimension is not a multiple of the
    block size.
    """
    cfg = QATConfig(scheme="none") if cfg is None else QATConfig.model_validate(cfg)
    modules = routed_expert_modules(model)
    if cfg.enabled and not modules:
        raise ValueError(
            f"qat scheme {cfg.scheme!r}: {type(model).__name__} has no routed-experts module (a module "
            "whose class name ends in 'Experts' with attributes weight_fake_quant and act_fake_quant), "
            "so there is nothing to quantise. Use a K3 model (posttrain.model) or set `qat: {scheme: none}`."
        )
    if cfg.enabled:
        for name, module in modules.items():
            for pname, param in module.named_parameters(recurse=False):
                if param.dim() == 3 and param.shape[-1] % cfg.block_size:
                    raise ValueError(
                        f"qat: routed-expert weight {name}.{pname} has shape {tuple(param.shape)}; its last "
                        f"(reduction) dim must be a multiple of block_size={cfg.block_size}. Fix the model "
                        "config: routed_expert_hidden_size (or hidden_size) and moe_intermediate_size."
                    )
    wq, aq = weight_fake_quant(cfg), act_fake_quant(cfg)
    for module in modules.values():
        module.weight_fake_quant = wq
        module.act_fake_quant = aq
    if modules and hasattr(model, "config"):
        # Recorded in config.json by save_pretrained, so whoever loads the weights (a later stage,
        # a rollout engine) can restore_qat the same quantisation.
        setattr(model.config, QAT_CONFIG_KEY, cfg.model_dump())
    return sorted(modules)


def qat_config_of(config: Any) -> QATConfig | None:
    """The QAT config recorded in a model config (`posttrain_qat`), or None when there is none."""
    recorded = getattr(config, QAT_CONFIG_KEY, None)
    return None if recorded is None else QATConfig.model_validate(recorded)


def restore_qat(model: nn.Module) -> list[str]:
    """Re-apply the QAT recorded in model.config (after from_pretrained); no record means off."""
    return apply_qat(model, qat_config_of(getattr(model, "config", None)))
