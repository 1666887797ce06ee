"""Kimi Delta Attention ops with fla's names and layout (q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K];
beta [B,T,H]; state [B,H,K,V] float32): the naive spec, the chunked training path, the decode path
and K3's bounded gate."""

from posttrain.ops.kda.chunk import chunk_kda
from posttrain.ops.kda.fused_recurrent import fused_recurrent_kda
from posttrain.ops.kda.gate import kda_gate
from posttrain.ops.kda.naive import naive_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda", "kda_gate", "naive_recurrent_kda"]
