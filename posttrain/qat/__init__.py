"""MX quantisation-aware training for K3's routed experts: formats, hooks, export.

`mx` holds the number formats (fake quantisation with straight-through gradients, MXFP4 packing),
`apply` sets the model's routed-expert hooks from a `QATConfig`, `export` writes and reads the
compressed-tensors MXFP4 checkpoint layout.
"""

from posttrain.qat.apply import MXFakeQuant, apply_qat, qat_config_of, restore_qat, routed_expert_modules
from posttrain.qat.config import QATConfig
from posttrain.qat.mx import mx_scale_exponents, pack_mxfp4, quantize_dequantize, unpack_mxfp4

__all__ = [
    "MXFakeQuant",
    "QATConfig",
    "apply_qat",
    "mx_scale_exponents",
    "pack_mxfp4",
    "qat_config_of",
    "quantize_dequantize",
    "restore_qat",
    "routed_expert_modules",
    "unpack_mxfp4",
]
