"""Kimi Delta Attention ops with fla's names and layout (q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K];
beta [B,T,H]; state [B,H,K,V] float32)."""

from posttrain.ops.kda.gate import kda_gate
from posttrain.ops.kda.naive import naive_recurrent_kda

__all__ = ["kda_gate", "naive_recurrent_kda"]
