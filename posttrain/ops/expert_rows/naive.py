"""The spec of the routed experts' row movement, as plain indexing (autograd does the backward).

The grouped MoE path sorts the N x k (token, choice) rows by expert: sorted row r is choice
`order[r] % k` of token `token[r] = order[r] // k`, and `inverse[n, j]` is the sorted row of
choice j of token n (the inverse permutation, viewed [N, k]).
"""

from __future__ import annotations

import torch


def naive_gather_rows(x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """x [N, D], token [R] -> x[token] [R, D]: each sorted row's token input."""
    return x[token]


def naive_combine_rows(y: torch.Tensor, weight: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """y [R, D] expert outputs in sorted order, weight [R] their mixture weights (float32),
    inverse [N, k] -> out [N, D] = sum_j weight[inverse[n, j]] * y[inverse[n, j]], summed in
    (at least) float32 and returned in y's dtype."""
    acc = torch.promote_types(y.dtype, torch.float32)
    picked = y[inverse].to(acc) * weight[inverse][..., None].to(acc)
    return picked.sum(1).to(y.dtype)
