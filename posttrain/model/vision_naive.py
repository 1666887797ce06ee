"""Reference twins of MoonViT-V2's packed paths: the spec the fast code in `vision.py` is tested
against (forward and gradients), written the obvious way and never used for training.

- `naive_packed_attention`: one dense softmax over the whole packed sequence with a block-diagonal
  mask, instead of one SDPA call per media item.
- `naive_patch_embed`: a real stride-p `conv2d` over the reassembled frame, instead of one matmul
  over pre-cut patches (so it also checks the processor's patch order).
- `naive_patch_merge`: an explicit loop over merged tokens and window offsets, instead of a
  reshape and permute.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scale: float
) -> torch.Tensor:
    """q, k, v [N, H, K]; token i attends to token j iff both lie in the same item (in float64)."""
    N = q.shape[0]
    item = torch.zeros(N, dtype=torch.long, device=q.device)
    for index, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)):
        item[start:end] = index
    same = item[:, None] == item[None, :]
    scores = torch.einsum("ihk,jhk->hij", q.double(), k.double()) * scale
    probs = scores.masked_fill(~same, float("-inf")).softmax(dim=-1)
    return torch.einsum("hij,jhk->ihk", probs, v.double()).to(q.dtype)


def naive_patch_embed(frame: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """frame [3, H, W] (H, W multiples of p) -> [H/p * W/p, D] in row-major patch order."""
    out = F.conv2d(frame[None], weight, bias, stride=weight.shape[-1])  # [1, D, H/p, W/p]
    return out[0].flatten(1).T


def naive_patch_merge(
    x: torch.Tensor, grids: list[tuple[int, int, int]], kernel: tuple[int, int]
) -> torch.Tensor:
    """[sum t*h*w, D] -> [sum (h/kh)*(w/kw), kh*kw, D]: token (i, j) lists the frame means of
    patches (i*kh + a, j*kw + b) for a, b in row-major order."""
    kh, kw = kernel
    tokens = []
    offset = 0
    for t, h, w in grids:
        frames = x[offset : offset + t * h * w].view(t, h, w, -1)
        for i in range(h // kh):
            for j in range(w // kw):
                window = [frames[:, i * kh + a, j * kw + b].mean(dim=0) for a in range(kh) for b in range(kw)]
                tokens.append(torch.stack(window))
        offset += t * h * w
    return torch.stack(tokens)
