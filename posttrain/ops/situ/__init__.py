"""SiTU-GLU (K3's bounded GLU): `naive_situ_glu` is the spec, `situ_glu` the memory-lean twin."""

from posttrain.ops.situ.fused import situ_glu
from posttrain.ops.situ.naive import naive_situ_glu

__all__ = ["naive_situ_glu", "situ_glu"]
