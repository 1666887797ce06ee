"""Moving routed-expert rows between (token, choice) order and expert-sorted order.

`naive.py` is the spec (plain indexing); `fused.py` the autograd ops the grouped MoE path uses, one
Triton kernel per pass on CUDA (`triton_rows.py`), the spec's arithmetic elsewhere.
"""

from posttrain.ops.expert_rows.fused import combine_rows, gather_rows
from posttrain.ops.expert_rows.naive import naive_combine_rows, naive_gather_rows

__all__ = ["combine_rows", "gather_rows", "naive_combine_rows", "naive_gather_rows"]
