"""KimiK3Config: the K3 text model's hyper-parameters under the released `text_config` key names.

The names are the released ones verbatim (vLLM's `KimiLinearConfig`, which its K3 loader reads), so a
config we write is a config other K3 tooling reads. `from_dict` (what `from_pretrained` calls) also
reads the released multimodal config.json, whose text keys sit under `text_config`
(`posttrain.model.released`). Defaults are the released full-size K3 (93 layers, 2.78T parameters);
`stages/models/tiny.yaml` is the CPU-sized one. A config that cannot build
a model raises `ValueError` naming the key and the fix, at construction, not deep inside a forward.
"""

from __future__ import annotations

import difflib
import inspect
import json
from pathlib import Path
from typing import Any

import yaml
from transformers import PretrainedConfig

from posttrain.model.released import flatten_released_config, is_released_config

SUPPORTED_ACTIVATIONS = ("situ", "silu")
# Keys a model file may set that are not released K3 keys (how this process runs the model).
RUNTIME_KEYS = ("compile_regions",)

# Layers 4, 8, ..., 92 and 93 are MLA (1-based); the rest are KDA: 69 KDA + 24 MLA.
_K3_FULL_ATTN_LAYERS = [*range(4, 93, 4), 93]
_K3_KDA_LAYERS = [i for i in range(1, 94) if i not in _K3_FULL_ATTN_LAYERS]


def _default_linear_attn_config() -> dict[str, Any]:
    return {
        "kda_layers": list(_K3_KDA_LAYERS),
        "full_attn_layers": list(_K3_FULL_ATTN_LAYERS),
        "num_heads": 96,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    }


class KimiK3Config(PretrainedConfig):
    """Hyper-parameters of the Kimi K3 text backbone (KDA + gated MLA hybrid, Stable LatentMoE).

    Layer indices in `linear_attn_config` (`kda_layers`, `full_attn_layers`) are 1-based, as released;
    `is_kda_layer(i)` takes the 0-based index used by module names (`model.layers.{i}`).
    """

    model_type = "kimi_k3"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 163840,
        hidden_size: int = 7168,
        intermediate_size: int = 33792,
        num_hidden_layers: int = 93,
        num_attention_heads: int = 96,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "situ",
        activation_situ_beta: float | None = 4.0,
        activation_situ_linear_beta: float | None = 25.0,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-5,
        use_cache: bool = True,
        pad_token_id: int | None = 0,
        bos_token_id: int | None = 1,
        eos_token_id: int | list[int] | None = 2,
        tie_word_embeddings: bool = False,
        max_position_embeddings: int = 1048576,
        linear_attn_config: dict[str, Any] | None = None,
        q_lora_rank: int | None = 1536,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        mla_use_nope: bool = True,
        mla_use_output_gate: bool = True,
        num_experts: int | None = 896,
        num_experts_per_token: int = 16,
        moe_intermediate_size: int = 3072,
        routed_expert_hidden_size: int | None = 3584,
        num_shared_experts: int | None = 2,
        latent_moe_use_norm: bool = True,
        moe_router_activation_func: str = "sigmoid",
        topk_method: str = "noaux_tc",
        moe_renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        first_k_dense_replace: int = 1,
        moe_layer_freq: int = 1,
        use_grouped_topk: bool = True,
        num_expert_group: int = 1,
        topk_group: int = 1,
        num_nextn_predict_layers: int = 0,
        attn_res_block_size: int | None = 12,
        **kwargs: Any,
    ) -> None:
        _check_types(locals())  # first: the derived keys below (head_dim) compute with them
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads if head_dim is None else head_dim
        self.hidden_act = hidden_act
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.max_position_embeddings = max_position_embeddings
        self.linear_attn_config = (
            _default_linear_attn_config() if linear_attn_config is None else dict(linear_attn_config)
        )
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_use_output_gate = mla_use_output_gate
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.moe_intermediate_size = moe_intermediate_size
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.num_shared_experts = num_shared_experts
        self.latent_moe_use_norm = latent_moe_use_norm
        self.moe_router_activation_func = moe_router_activation_func
        self.topk_method = topk_method
        self.moe_renormalize = moe_renormalize
        self.routed_scaling_factor = routed_scaling_factor
        self.first_k_dense_replace = first_k_dense_replace
        self.moe_layer_freq = moe_layer_freq
        self.use_grouped_topk = use_grouped_topk
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.attn_res_block_size = attn_res_block_size
        # Not a released key (the signature holds exactly vLLM's): how this process runs the
        # elementwise regions (posttrain/ops/fusion.py); None compiles CUDA training forwards.
        self.compile_regions = kwargs.pop("compile_regions", None)
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate_k3()

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> KimiK3Config:
        """Build from a flat config dict or a released wrapper one (`text_config`, `vision_config`).

        A released MXFP4 `quantization_config` is dropped: the loader dequantises the packed
        experts into full-precision weights (modeling_kimi_k3's checkpoint layout), so the loaded
        model is not quantised. Any other quantization format is a ValueError naming it.
        """
        data = dict(config_dict)
        if is_released_config(data):
            data = flatten_released_config(data)
        try:
            quantization = data.pop("quantization_config", None)
            if quantization is not None:
                check_released_quantization(quantization)
            return super().from_dict(data, **kwargs)
        except ValueError as error:
            # from_pretrained passes the directory: name the file whose key is wrong
            where = kwargs.get("name_or_path")
            raise ValueError(f"{Path(where) / 'config.json'}: {error}" if where else str(error)) from error

    # -- layer kinds ---------------------------------------------------------------------------

    def is_kda_layer(self, layer_idx: int) -> bool:
        """Whether 0-based layer `layer_idx` is a KDA layer (else gated MLA)."""
        return (layer_idx + 1) in self.linear_attn_config["kda_layers"]

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether 0-based layer `layer_idx` has a LatentMoE block (else the dense SiTU MLP)."""
        return (
            self.num_experts is not None
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    # -- validation ----------------------------------------------------------------------------

    def validate_k3(self) -> None:
        """Raise ValueError naming the offending key and the fix if no model can be built."""
        if self.compile_regions not in (None, True, False):
            raise ValueError(
                f"compile_regions={self.compile_regions!r}: must be true, false or null (null: "
                "compile the elementwise regions of CUDA training forwards; see posttrain/ops/fusion.py)"
            )
        L = self.num_hidden_layers
        if L < 1:
            raise ValueError(f"num_hidden_layers={L}: must be >= 1")
        self._validate_layer_lists(L)
        lac = self.linear_attn_config
        for key in ("num_heads", "head_dim", "short_conv_kernel_size"):
            if not isinstance(lac.get(key), int) or lac[key] < 1:
                raise ValueError(
                    f"linear_attn_config.{key}={lac.get(key)!r}: must be a positive integer "
                    f"(K3: num_heads 96, head_dim 128, short_conv_kernel_size 4)"
                )
        bound = lac.get("gate_lower_bound")
        if bound is None or not -5.0 <= float(bound) < 0:
            raise ValueError(
                f"linear_attn_config.gate_lower_bound={bound!r}: must be in [-5.0, 0); the bounded "
                "gate is what keeps chunked KDA finite (K3 uses -5.0)"
            )
        lac.setdefault("use_full_rank_gate", True)
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"hidden_act={self.hidden_act!r}: use one of {SUPPORTED_ACTIVATIONS} (K3: 'situ')"
            )
        if (
            self.hidden_act == "situ"
            and self.activation_situ_beta is not None
            and self.activation_situ_beta <= 0
        ):
            raise ValueError(f"activation_situ_beta={self.activation_situ_beta}: must be > 0 (K3: 4)")
        if self.activation_situ_linear_beta is not None and self.activation_situ_linear_beta <= 0:
            raise ValueError(
                f"activation_situ_linear_beta={self.activation_situ_linear_beta}: "
                "must be > 0 or null (K3: 25)"
            )
        self._validate_mla()
        self._validate_moe(L)
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise ValueError(
                f"attn_res_block_size={self.attn_res_block_size}: must be >= 1, or null for plain residuals"
            )
        if self.num_nextn_predict_layers != 0:
            raise ValueError(
                f"num_nextn_predict_layers={self.num_nextn_predict_layers}: multi-token-prediction "
                "layers are not part of this model; set it to 0"
            )

    def _validate_layer_lists(self, L: int) -> None:
        lac = self.linear_attn_config
        for key in ("kda_layers", "full_attn_layers"):
            if not isinstance(lac.get(key), list | tuple):
                raise ValueError(f"linear_attn_config.{key} is missing: give a list of 1-based layer indices")
        kda, full = list(lac["kda_layers"]), list(lac["full_attn_layers"])
        for key, layers in (("kda_layers", kda), ("full_attn_layers", full)):
            bad = [i for i in layers if not isinstance(i, int) or not 1 <= i <= L]
            if bad:
                raise ValueError(
                    f"linear_attn_config.{key} has {bad} outside 1..{L} (indices are 1-based, "
                    f"num_hidden_layers={L}): fix the indices or num_hidden_layers"
                )
            if len(set(layers)) != len(layers):
                raise ValueError(f"linear_attn_config.{key} lists a layer twice: remove the duplicates")
        overlap = sorted(set(kda) & set(full))
        if overlap:
            raise ValueError(
                f"linear_attn_config: layers {overlap} are in both kda_layers and full_attn_layers; "
                "each layer is exactly one kind, remove them from one list"
            )
        missing = sorted(set(range(1, L + 1)) - set(kda) - set(full))
        if missing:
            raise ValueError(
                f"linear_attn_config: layers {missing} are in neither kda_layers nor full_attn_layers; "
                "add each to one of the lists (1-based)"
            )

    def _validate_mla(self) -> None:
        if not self.mla_use_nope:
            raise ValueError(
                "mla_use_nope=false: rotary MLA is not implemented; K3's MLA uses no position encoding "
                "(KDA supplies order), set mla_use_nope: true"
            )
        for key in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, key) is None or getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)!r}: must be a positive integer")
        if self.qk_rope_head_dim is None or self.qk_rope_head_dim < 0:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim!r}: must be >= 0 (K3: 64)")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank={self.q_lora_rank}: must be >= 1, or null for a full-rank q_proj")

    def _validate_moe(self, L: int) -> None:
        if not 0 <= self.first_k_dense_replace <= L:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace}: must be in 0..{L}")
        if self.num_experts is None:
            return
        E, k = self.num_experts, self.num_experts_per_token
        if E < 1 or k < 1:
            raise ValueError(f"num_experts={E}, num_experts_per_token={k}: both must be >= 1")
        if k > E:
            raise ValueError(
                f"num_experts_per_token={k} > num_experts={E}: a token cannot pick more experts than exist; "
                "lower num_experts_per_token or raise num_experts"
            )
        if self.moe_intermediate_size is None or self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size!r}: must be >= 1")
        latent = self.routed_expert_hidden_size
        if latent is not None and (latent < 1 or latent > self.hidden_size or self.hidden_size % latent):
            raise ValueError(
                f"routed_expert_hidden_size={latent} does not divide hidden_size={self.hidden_size} evenly: "
                "LatentMoE compresses the width by an integer factor (K3: 7168 -> 3584); pick a divisor "
                "of hidden_size, or null for experts at full width"
            )
        if self.moe_router_activation_func not in ("sigmoid", "softmax"):
            raise ValueError(
                f"moe_router_activation_func={self.moe_router_activation_func!r}: "
                "use 'sigmoid' (K3) or 'softmax'"
            )
        if self.topk_method != "noaux_tc":
            raise ValueError(
                f"topk_method={self.topk_method!r}: only 'noaux_tc' (bias used for selection only) "
                "is implemented"
            )
        if self.moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq={self.moe_layer_freq}: must be >= 1")
        groups = self.num_expert_group if self.use_grouped_topk else 1
        if groups < 1 or E % groups:
            raise ValueError(
                f"num_expert_group={self.num_expert_group} does not divide num_experts={E}: pick a divisor"
            )
        if self.use_grouped_topk and not 1 <= self.topk_group <= groups:
            raise ValueError(f"topk_group={self.topk_group}: must be in 1..num_expert_group={groups}")
        if self.use_grouped_topk and k > self.topk_group * (E // groups):
            raise ValueError(
                f"num_experts_per_token={k} exceeds the experts in topk_group={self.topk_group} groups of "
                f"{E // groups}: raise topk_group"
            )
        if self.num_shared_experts is not None and self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts={self.num_shared_experts}: must be >= 0")


def _check_types(values: dict[str, Any]) -> None:
    """Each key's value has a type its annotation allows: a quoted number ("64") or a null where a
    size belongs would otherwise fail as a TypeError inside the arithmetic and checks."""
    for key, allowed in _KEY_TYPES.items():
        value = values[key]
        if not any(_has_type(value, kind) for kind in allowed):
            numeric = " (a number, without quotes)" if {"int", "float"} & set(allowed) else ""
            raise ValueError(
                f"{key}={value!r} is a {type(value).__name__}; it must be {' or '.join(allowed)}{numeric}"
            )


# The Python types of the annotations' alternatives ("None" and "bool" are handled on their own).
_PYTHON_TYPES = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "dict[str, Any]": (dict,),
    "list[int]": (list,),
}


def _has_type(value: Any, kind: str) -> bool:
    """Whether `value` is of one alternative of an annotation (`int`, `float`, `list[int]`, ...);
    a bool is not a number here, though Python counts it as an int."""
    if kind == "None":
        return value is None
    if isinstance(value, bool):
        return kind == "bool"
    return kind != "bool" and isinstance(value, _PYTHON_TYPES[kind])


# key -> the alternatives its annotation allows, e.g. ("int", "None"), read once from the signature.
_KEY_TYPES = {
    name: tuple(str(parameter.annotation).split(" | "))
    for name, parameter in inspect.signature(KimiK3Config.__init__).parameters.items()
    if name not in ("self", "kwargs")
}


def load_model_config(path: str | Path) -> KimiK3Config:
    """Read a KimiK3Config from a .yaml/.yml/.json file (flat text_config keys, or a released
    multimodal config.json with the keys under `text_config`).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: unknown extension, not YAML or JSON, not a mapping, or an invalid configuration
            (the message names the file and the key).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model config {path} does not exist")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ValueError(f"model config {path}: not valid YAML: {error}") from None
    elif path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"model config {path}: not valid JSON: {error}") from None
    else:
        raise ValueError(f"model config {path}: use a .yaml, .yml or .json file")
    if not isinstance(data, dict):
        raise ValueError(f"model config {path}: expected a mapping of K3 config keys at the top level")
    if is_released_config(data):
        data = flatten_released_config(data)
    data = {k: v for k, v in data.items() if k not in ("model_type", "architectures", "quantization_config")}
    if path.suffix != ".json":
        # YAML is written by hand: a misspelt key must not silently fall back to a default.
        # (.json files come from save_pretrained or a release and carry transformers' own keys.)
        _reject_unknown_keys(path, data)
    try:
        return KimiK3Config(**data)
    except ValueError as err:
        raise ValueError(f"model config {path}: {err}") from err


def _reject_unknown_keys(path: Path, data: dict[str, Any]) -> None:
    known = set(inspect.signature(KimiK3Config.__init__).parameters) - {"self", "kwargs"}
    known |= set(PretrainedConfig().to_dict()) | set(RUNTIME_KEYS)
    for key in data:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"model config {path}: unknown key {key!r}{hint}")


def check_released_quantization(quantization: dict[str, Any]) -> None:
    """Accept the released compressed-tensors MXFP4 config (group 32); raise ValueError otherwise."""
    fmt = quantization.get("format")
    groups = quantization.get("config_groups") or {}
    sizes = {(g.get("weights") or {}).get("group_size") for g in groups.values()}
    method = quantization.get("quant_method")
    if method != "compressed-tensors" or fmt != "mxfp4-pack-quantized" or sizes != {32}:
        raise ValueError(
            f"config.json quantization_config: quant_method {method!r}, format "
            f"{fmt!r}, group sizes {sorted(sizes, key=str)}; posttrain reads the released K3 layout "
            "(compressed-tensors 'mxfp4-pack-quantized', group 32) or unquantised weights. Dequantise the "
            "checkpoint first or export it with `posttrain export --format mxfp4`."
        )
