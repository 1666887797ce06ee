"""Block Attention Residuals: `naive_attn_res` is the spec, `attn_res_mix` the memory-lean twin."""

from posttrain.ops.attn_res.fused import attn_res_mix
from posttrain.ops.attn_res.naive import naive_attn_res

__all__ = ["attn_res_mix", "naive_attn_res"]
