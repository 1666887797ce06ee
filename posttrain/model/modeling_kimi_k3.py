"""The K3 text model as a transformers PreTrainedModel: decoder layers, Block Attention Residuals,
the causal-LM head, packing (cu_seqlens), left padding and cached generation.

Layer i (0-based) mixes tokens with KDA or gated MLA (`linear_attn_config`) and transforms them with
the dense SiTU MLP (`mlp`, i < first_k_dense_replace) or Stable LatentMoE (`block_sparse_moe`).
With `attn_res_block_size` set, the input of every sublayer is a softmax mix of the token embedding,
each completed block's sum and the current block's running sum (the schedule of vLLM's K3
`forward_attn_residual`); a last mix precedes the final norm. Module and parameter names are the
released checkpoint's (`model.layers.{i}.self_attn.q_proj.weight`, ...; see docs/model.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from posttrain.model.balancing import update_router_bias
from posttrain.model.cache import KimiK3Cache
from posttrain.model.checkpoint_layout import check_k3_weights
from posttrain.model.configuration_kimi_k3 import KimiK3Config
from posttrain.model.kda import KimiK3DeltaAttention, ShortConvolution
from posttrain.model.mla import KimiK3MLAAttention, build_mla_mask
from posttrain.model.mlp import KimiMLP, RMSNorm
from posttrain.model.moe import KimiK3Experts, KimiK3MoEGate, KimiK3SparseMoeBlock
from posttrain.ops.attn_res import attn_res_mix


class AttnResQuery(nn.Module):
    """A sublayer's Block-Attention-Residual scoring vector, stored as vLLM's `*_res_proj` (a
    1-output linear: weight [1, D]); zero-initialised so every mix starts uniform."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, dim))


@dataclass
class ForwardContext:
    """What every layer of one forward needs besides the hidden states."""

    token_mask: torch.Tensor | None  # [B, T] 1 real / 0 padding; None: all real
    cu_seqlens: torch.Tensor | None  # [N+1] packed documents (B == 1)
    mla_mask: torch.Tensor | None  # [B, 1, T, S] bool; None: causal over T == S (no cache)
    cache: KimiK3Cache | None


class KimiK3DecoderLayer(nn.Module):
    """One K3 layer: token mixer (`self_attn`) and feed-forward (`mlp` or `block_sparse_moe`)."""

    def __init__(self, config: KimiK3Config, layer_idx: int) -> None:
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.is_kda = config.is_kda_layer(layer_idx)
        self.self_attn = (KimiK3DeltaAttention if self.is_kda else KimiK3MLAAttention)(config, layer_idx)
        if config.is_moe_layer(layer_idx):
            self.block_sparse_moe = KimiK3SparseMoeBlock(config)
        else:
            self.mlp = KimiMLP(config, D, config.intermediate_size)
        # Both feed only the sublayer's projections (and the router's matmul).
        self.input_layernorm = RMSNorm(D, eps, config.compile_regions, feeds_matmuls=True)
        self.post_attention_layernorm = RMSNorm(D, eps, config.compile_regions, feeds_matmuls=True)
        self.block_size = config.attn_res_block_size
        self.compile_regions = config.compile_regions
        if self.block_size is not None:
            self.self_attention_res_norm = RMSNorm(D, eps, config.compile_regions)
            self.self_attention_res_proj = AttnResQuery(D)
            self.mlp_res_norm = RMSNorm(D, eps, config.compile_regions)
            self.mlp_res_proj = AttnResQuery(D)

    def token_mixer(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.input_layernorm(h)
        if self.is_kda:
            return self.self_attn(h, ctx.token_mask, ctx.cu_seqlens, ctx.cache)
        return self.self_attn(h, ctx.mla_mask, ctx.cache)

    def feed_forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.post_attention_layernorm(h)
        if hasattr(self, "block_sparse_moe"):
            return self.block_sparse_moe(h, ctx.token_mask)
        return self.mlp(h)

    def forward(
        self, ctx: ForwardContext, partial: torch.Tensor, *blocks: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Advance the residual state by one layer.

        Plain residuals: `partial` is the residual stream, `blocks` is empty.
        Block Attention Residuals: `blocks` are the completed sources (embedding first) and `partial`
        the running sum of the current block. At the first layer of a block the running sum becomes
        a completed source and a new running sum starts from this layer's outputs.

        Returns:
            (partial, *blocks) after this layer.
        """
        if self.block_size is None:
            partial = partial + self.token_mixer(partial, ctx)
            return (partial + self.feed_forward(partial, ctx),)
        eps = self.self_attention_res_norm.eps
        if self.layer_idx % self.block_size == 0:
            blocks = (*blocks, partial)
            sources = blocks
        else:
            sources = (*blocks, partial)
        cr = self.compile_regions
        mixed = attn_res_mix(
            sources, self.self_attention_res_norm.weight, self.self_attention_res_proj.weight[0], eps, cr
        )
        out = self.token_mixer(mixed, ctx)
        partial = out if self.layer_idx % self.block_size == 0 else partial + out
        mlp_sources = (*blocks, partial)
        mixed = attn_res_mix(mlp_sources, self.mlp_res_norm.weight, self.mlp_res_proj.weight[0], eps, cr)
        return (partial + self.feed_forward(mixed, ctx), *blocks)


def check_loaded_whole(source: str | Path, model: PreTrainedModel, info: dict[str, Any]) -> None:
    """Raise ValueError naming the tensors when from_pretrained's loading `info` (asked for with
    `output_loading_info=True, ignore_mismatched_sizes=True`) shows a weight missing, one the model
    does not have, or one of another shape: transformers only warns, leaving such a weight at its
    random init. A tied LM head is not missing (it is the embedding)."""
    text = getattr(model.config, "text_config", model.config)
    missing = sorted(
        name
        for name in info["missing_keys"]
        if not (text.tie_word_embeddings and name.endswith("lm_head.weight"))  # the embedding
    )
    unexpected = sorted(info["unexpected_keys"])
    mismatched = [
        f"{name} {list(stored)} (config.json: {list(built)})"
        for name, stored, built in sorted(info["mismatched_keys"])
    ]
    if missing or unexpected or mismatched:
        raise ValueError(
            f"{source}: the checkpoint does not match {type(model).__name__} built from its config.json: "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}, shapes stored {mismatched[:8]} (first 8 "
            f"of each; {len(missing)} missing, {len(mismatched)} mismatched in all). Is config.json the "
            "one these weights were saved with?"
        )


class StrictLoading:
    """`from_pretrained` for the K3 models (text and multimodal) that refuses a checkpoint it cannot
    load whole, instead of transformers' warning. Listed before PreTrainedModel in the bases."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' from_pretrained (any layout `checkpoint_layout` maps: flat or released
        names, per-expert or MXFP4-packed experts, one file or shards), but a checkpoint that leaves
        a weight missing, brings one the model does not have or holds one of another shape is a
        ValueError naming the tensors (transformers would only warn and leave missing weights
        randomly initialised); the weight files are checked from their headers first
        (`check_k3_weights`, against the text config)."""
        directory = Path(str(pretrained_model_name_or_path))
        if directory.is_dir():
            config = kwargs.get("config")
            if not isinstance(config, cls.config_class):
                # name_or_path, as AutoConfig passes it: a config error names the file
                config = cls.config_class.from_pretrained(directory, name_or_path=str(directory))
            check_k3_weights(directory, getattr(config, "text_config", config))
        wants_info = kwargs.pop("output_loading_info", False)
        # Mismatched shapes are reported in `info` and raised below with the tensors' names; left
        # False, transformers raises a RuntimeError pointing at a report it logged elsewhere.
        kwargs.setdefault("ignore_mismatched_sizes", True)
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs
        )
        check_loaded_whole(pretrained_model_name_or_path, model, info)
        return (model, info) if wants_info else model


class KimiK3PreTrainedModel(StrictLoading, PreTrainedModel):
    config: KimiK3Config
    config_class = KimiK3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KimiK3DecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _is_stateful = True
    _supports_sdpa = True
    # A released checkpoint's vision tower and projector: the text model has no module for them.
    _keys_to_ignore_on_load_unexpected = [r"^vision_tower\.", r"^mm_projector\."]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, KimiK3DeltaAttention):
            # fla's KDA initialisation: slopes A in [1, 16], dt_bias the inverse softplus of a
            # log-uniform step in [1e-3, 1e-1].
            init.copy_(module.A_log, init.uniform_(module.A_log, a=1.0, b=16.0).log())
            init.uniform_(module.dt_bias, a=math.log(1e-3), b=math.log(1e-1))
            dt = module.dt_bias.exp().clamp_min(1e-4)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))
        elif isinstance(module, ShortConvolution):
            # nn.Conv1d's own default for a depthwise conv (fan_in = kernel width).
            bound = 1.0 / math.sqrt(module.weight.shape[-1])
            init.uniform_(module.weight, a=-bound, b=bound)
        elif isinstance(module, KimiK3Experts):
            for w in (module.w1, module.w3, module.w2):
                init.normal_(w, mean=0.0, std=std)
        elif isinstance(module, KimiK3MoEGate):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, AttnResQuery):
            init.zeros_(module.weight)


class KimiK3Model(KimiK3PreTrainedModel):
    """Embedding, decoder layers, final attention-residual mix and norm: hidden states [B, T, D]."""

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__(config)
        D = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        self.layers = nn.ModuleList(KimiK3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps, config.compile_regions)
        if config.attn_res_block_size is not None:
            self.output_attn_res_norm = RMSNorm(D, config.rms_norm_eps, config.compile_regions)
            self.output_attn_res_proj = AttnResQuery(D)
        self.has_mla = not all(layer.is_kda for layer in self.layers)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.LongTensor | None = None,
        past_key_values: KimiK3Cache | None = None,
        use_cache: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """See `KimiK3ForCausalLM.forward`; returns the final-normed hidden states."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("KimiK3Model: pass exactly one of input_ids or inputs_embeds")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = h.shape[:2]
        if cu_seqlens is not None and (past_key_values is not None or use_cache):
            raise ValueError("cu_seqlens packs whole documents: pass it without past_key_values or use_cache")
        if cu_seqlens is not None:
            use_cache = False
        use_cache = self.config.use_cache if use_cache is None else use_cache
        cache = past_key_values
        if cache is None and use_cache and not self.training:
            cache = KimiK3Cache(self.config)
        if cache is not None and not isinstance(cache, KimiK3Cache):
            raise TypeError(f"past_key_values must be a KimiK3Cache, got {type(cache).__name__}")
        new_mask = self._new_token_mask(attention_mask, cache, B, T, h.device)
        if cu_seqlens is not None:
            self._check_packed(cu_seqlens, new_mask, B, T)
        ctx = ForwardContext(
            token_mask=None if bool(new_mask.all()) else new_mask,
            cu_seqlens=cu_seqlens,
            mla_mask=None,
            cache=cache,
        )
        key_mask = new_mask if cache is None else cache.extend_key_mask(new_mask)
        # Uncached, unpacked and unpadded (a training batch), the mask is plain causality: MLA then
        # passes none and SDPA's causal kernels skip the masked tiles instead of reading a [T, T] mask.
        plainly_causal = cache is None and cu_seqlens is None and ctx.token_mask is None
        if self.has_mla and not plainly_causal:
            ctx.mla_mask = build_mla_mask(key_mask, T, cu_seqlens)
        state: tuple[torch.Tensor, ...] = (h,)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                state = self._gradient_checkpointing_func(layer.__call__, ctx, *state)
            else:
                state = layer(ctx, *state)
        return BaseModelOutputWithPast(last_hidden_state=self.final_hidden(state), past_key_values=cache)

    def final_hidden(self, state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The last layer's residual state (partial, *blocks) -> final mix and norm [B, T, D]."""
        partial, *blocks = state
        if self.config.attn_res_block_size is not None:
            partial = attn_res_mix(
                (*blocks, partial),
                self.output_attn_res_norm.weight,
                self.output_attn_res_proj.weight[0],
                self.output_attn_res_norm.eps,
                self.config.compile_regions,
            )
        return self.norm(partial)

    @staticmethod
    def _new_token_mask(
        attention_mask: torch.Tensor | None, cache: KimiK3Cache | None, B: int, T: int, device: torch.device
    ) -> torch.Tensor:
        """The [B, T] 1/0 mask of this forward's tokens from a mask over all or only the new positions."""
        if attention_mask is None:
            return torch.ones(B, T, dtype=torch.long, device=device)
        if attention_mask.dim() != 2 or attention_mask.shape[0] != B:
            raise ValueError(f"attention_mask must be [B={B}, T] of 1/0, got {tuple(attention_mask.shape)}")
        past = 0 if cache is None else cache.get_seq_length()
        if attention_mask.shape[1] == past + T:
            return attention_mask[:, past:].long()
        if attention_mask.shape[1] == T:
            return attention_mask.long()
        raise ValueError(
            f"attention_mask has {attention_mask.shape[1]} positions; expected {T} (new tokens) or "
            f"{past + T} (cached + new)"
        )

    @staticmethod
    def _check_packed(cu_seqlens: torch.Tensor, new_mask: torch.Tensor, B: int, T: int) -> None:
        bounds = cu_seqlens.tolist()
        if B != 1:
            raise ValueError(f"cu_seqlens packs documents into one row: expected batch size 1, got {B}")
        if bounds[0] != 0 or bounds[-1] != T or any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(f"cu_seqlens must rise strictly from 0 to T={T}, got {bounds}")
        if not bool(new_mask.all()):
            raise ValueError("cu_seqlens and padding do not mix: a packed row has no padding")


class KimiK3ForCausalLM(KimiK3PreTrainedModel, GenerationMixin):
    """K3 text model with its LM head (`lm_head`, untied unless tie_word_embeddings)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__(config)
        self.model = KimiK3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.LongTensor | None = None,
        past_key_values: KimiK3Cache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits for every position (or the last `logits_to_keep`).

        Args:
            input_ids: [B, T] token ids (or inputs_embeds [B, T, D]).
            attention_mask: [B, T] or [B, cached + T], 1 real / 0 padding; LEFT padding.
            cu_seqlens: [N+1] document boundaries when B == 1 packs N documents; KDA state, conv
                and MLA attention never cross them (no cache, no padding with packing).
            past_key_values: a KimiK3Cache to continue (updated in place).
            use_cache: return a cache (a new one unless past_key_values is given); defaults to
                config.use_cache outside training.
            labels: [B, T] next-token targets aligned with input_ids (shifted here), -100 ignored;
                with cu_seqlens the prediction across a document boundary is ignored too.
            position_ids and other generate() kwargs are accepted and unused (K3 uses no positions).

        Returns:
            CausalLMOutputWithPast(loss, logits [B, T, V] float32, past_key_values).
        """
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cu_seqlens=cu_seqlens,
            past_key_values=past_key_values,
            use_cache=use_cache,
            inputs_embeds=inputs_embeds,
        )
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden).float()
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels, cu_seqlens)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)

    def update_router_bias(self) -> dict[str, float]:
        """Quantile Balancing step for every MoE gate; call after each optimizer step in training."""
        return update_router_bias(self)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs) -> None:
        if model_kwargs.get("past_key_values") is None and generation_config.use_cache is not False:
            model_kwargs["past_key_values"] = KimiK3Cache(self.config)
            return
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean next-token cross entropy: logits [B, T, V] at t predict labels[:, t + 1]; -100 ignored."""
    # The labels shift, not the logits: logits[:, :-1] would copy the largest tensor of the step.
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    if cu_seqlens is not None:
        # position end-1 of a document would predict the next document's first token
        ends = cu_seqlens[1:-1].to(targets.device) - 1
        targets[:, ends] = -100
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
