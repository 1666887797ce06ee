"""The Kimi K3 text model as a transformers model; importing this package registers it with
AutoConfig / AutoModelForCausalLM under model_type "kimi_k3", together with the checkpoint layouts
`from_pretrained` reads (flat or released names, per-expert or MXFP4-packed experts)."""

from transformers import AutoConfig, AutoModelForCausalLM

from posttrain.model.balancing import QuantileBalancer, update_router_bias
from posttrain.model.cache import KimiK3Cache
from posttrain.model.checkpoint_layout import register_checkpoint_layout
from posttrain.model.configuration_kimi_k3 import KimiK3Config, load_model_config
from posttrain.model.modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3Model
from posttrain.model.params import count_parameters
from posttrain.model.released import save_released

AutoConfig.register("kimi_k3", KimiK3Config, exist_ok=True)
AutoModelForCausalLM.register(KimiK3Config, KimiK3ForCausalLM, exist_ok=True)
register_checkpoint_layout()

__all__ = [
    "KimiK3Cache",
    "KimiK3Config",
    "KimiK3ForCausalLM",
    "KimiK3Model",
    "QuantileBalancer",
    "count_parameters",
    "load_model_config",
    "save_released",
    "update_router_bias",
]
