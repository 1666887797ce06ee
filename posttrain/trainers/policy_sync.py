"""The engine an RL stage samples from, and how it comes to sample the trainer's current weights.

The embedded engine shares the trained module itself, QAT hooks included, so only its policy
version advances with each update. Every other engine (posttrain.engines.build_engine: vLLM in this
process, a vLLM server, a `trl vllm-serve` server) holds its own copy and is sent the weights after
every update, named as save_pretrained writes them, the names the engine loaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers.core_model_loading import revert_weight_conversion
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from posttrain.data.chat import ChatRenderer
from posttrain.engines import EmbeddedEngine, Engine
from posttrain.engines.build import build_engine
from posttrain.qat import qat_config_of
from posttrain.qat.export import dequantized_state_dict
from posttrain.stages import StageContext


def rollout_engine(
    name: str,
    url: str | None,
    policy: nn.Module,
    init: Path,
    renderer: ChatRenderer,
    ctx: StageContext,
    autocast_dtype: torch.dtype | None = None,
) -> Engine:
    """The engine rollouts, the cold start and evaluation sample from (`rollout.engine` `name`,
    `rollout.url`).

    embedded shares the trained module `policy`, its forwards under `autocast_dtype` (the
    trainer's mixed precision). The others (posttrain.engines.build_engine) serve
    the `init` checkpoint (the architecture they load; the weights come from `publish_policy`) and
    record processed log-probs: of the distribution sampled at rollout.temperature, which the
    trainer recomputes.
    """
    if name == "embedded":
        return EmbeddedEngine(policy, pad_token_id=renderer.pad_id, autocast_dtype=autocast_dtype)
    # vllm_server and trl_vllm send token ids only; the in-process vllm engine sends each image
    # beside its placeholder (posttrain.engines.vllm_media)
    if renderer.processor is not None and name != "vllm":
        raise ValueError(
            f"stage {ctx.stage_id}: rollout.engine {name} serves text only, and the policy has a vision "
            "tower; use rollout.engine: vllm or embedded for a multimodal policy"
        )
    ctx.log.info("rollout engine: %s for %s (logs and weights under %s)", name, init, ctx.stage_dir)
    return build_engine(
        name,
        init,
        work_dir=ctx.stage_dir,
        log_name="vllm-rollout",
        seed=ctx.seed,
        logprobs_mode="processed",
        url=url,
    )


def rollout_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s weights named as save_pretrained writes them, the names a vLLM engine loaded (K3's
    batched routed experts split per expert, tied copies dropped). Under QAT the routed experts
    hold their MXFP4 values (`dequantized_state_dict`): a vLLM engine computes with the weights the
    trainer's forward uses, though not with its MXFP8 activation rounding."""
    qat = qat_config_of(getattr(model, "config", None))
    if qat is not None and qat.enabled:
        state = dequantized_state_dict(model, qat)
    else:
        state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    return revert_weight_conversion(model, state)


def serve_policy(engine: Engine, model: nn.Module, version: int) -> None:
    """Point the engine at `model`'s current weights as policy `version` (start and resume)."""
    publish_policy(engine, model)
    engine.policy_version = version


def publish_policy(engine: Engine, model: nn.Module) -> None:
    """Make the next rollouts sample `model`'s current weights under the next policy version: an
    embedded engine over the module itself already does (only its version advances); any other
    engine is sent the weights (`update_weights`, which advances its version)."""
    if isinstance(engine, EmbeddedEngine) and engine.model is model:
        engine.policy_version += 1
    else:
        engine.update_weights(rollout_weights(model))
