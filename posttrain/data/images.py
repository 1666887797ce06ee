"""MoonViT-V2's image processor, with Pillow only: images and short videos -> patches and token counts.

Native resolution: an image keeps its aspect ratio and is only shrunk (bicubic) when it exceeds the
patch budget (`in_patch_limit` patches in all, `patch_limit_on_one_side` per side), then padded with
black on the right and bottom to a multiple of patch_size * merge_kernel_size (28 px), so an
H x W image gives (H/14) x (W/14) patches and a quarter as many visual tokens. A video is a list of
frames cut into chunks of `temporal_merge_kernel_size` frames; each chunk is one media item whose
frames the tower averages after attention, so it costs the tokens of one frame.

The resize arithmetic and the patch layout (patch order frame, row, column; pixels
`(value / 255 - image_mean) / image_std`, channels first) are those of vLLM's Kimi processor
(`navit_resize_image` / `navit_resize_video`, `KimiK25FusedVisionProcessor`), key names included,
so the prompt we render has exactly the media tokens vLLM would insert for the same image.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

# An image reference as a Sample stores it: a file path or a data URI ("data:image/png;base64,...").
MediaRef = str
# One media entry of a Sample: an image, or a short video as its frames.
MediaItem = MediaRef | list[MediaRef]


@dataclass(frozen=True)
class MediaBlock:
    """What the chat renderer writes for one media item: `<|media_begin|>{kind} {width}x{height}
    <|media_content|>` + num_tokens x `<|media_pad|>` + `<|media_end|>` (width, height: the
    original size, as vLLM writes it)."""

    kind: str  # "image" or "video_chunk"
    width: int
    height: int
    num_tokens: int

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "width": self.width, "height": self.height, "num_tokens": self.num_tokens}


@dataclass(frozen=True)
class ResizePlan:
    """Resized size, right/bottom padding and the resulting grid for one image or video chunk."""

    new_width: int
    new_height: int
    pad_width: int
    pad_height: int
    patch_size: int
    merge_kernel_size: int

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, cols) of patches."""
        p = self.patch_size
        return (self.new_height + self.pad_height) // p, (self.new_width + self.pad_width) // p

    @property
    def num_tokens(self) -> int:
        rows, cols = self.grid
        return (rows // self.merge_kernel_size) * (cols // self.merge_kernel_size)


@dataclass(frozen=True)
class MediaBatch:
    """The tower's input for a list of media items: pixel_values [sum t*h*w, 3, p, p] float32,
    grid_thws [n, 3] long, and the renderer's blocks (a list per Sample media entry)."""

    pixel_values: torch.Tensor
    grid_thws: torch.Tensor
    blocks: list[list[MediaBlock]]

    @property
    def num_tokens(self) -> int:
        return sum(block.num_tokens for entry in self.blocks for block in entry)


@dataclass(frozen=True)
class MoonViTImageProcessor:
    """Images / video frame lists -> MediaBatch. Field names are vLLM's `media_proc_cfg` keys.

    patch_size and merge_kernel_size must match the model's vision_config (`from_vision_config`).
    The limits and normalisation are this repository's defaults (MoonViT's 0.5 mean and std).
    """

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    temporal_merge_kernel_size: int = 4
    in_patch_limit_each_frame: int | None = None
    in_patch_limit_video: int | None = None
    fixed_output_tokens: int | None = None
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def from_vision_config(cls, config: Any, **overrides: Any) -> MoonViTImageProcessor:
        """A processor whose patch and merge sizes are the model's (`KimiK3VisionConfig`), with
        video chunks of `init_pos_emb_time` frames (the most the position embedding covers)."""
        kh, kw = config.merge_kernel_size
        if kh != kw:
            raise ValueError(f"vision_config.merge_kernel_size={[kh, kw]}: the processor pads square windows")
        overrides.setdefault("temporal_merge_kernel_size", config.init_pos_emb_time)
        if overrides["temporal_merge_kernel_size"] > config.init_pos_emb_time:
            raise ValueError(
                f"temporal_merge_kernel_size={overrides['temporal_merge_kernel_size']} exceeds "
                f"vision_config.init_pos_emb_time={config.init_pos_emb_time}: chunks cannot be longer"
            )
        return cls(patch_size=config.patch_size, merge_kernel_size=kh, **overrides)

    def media_proc_cfg(self) -> dict[str, Any]:
        """The `media_proc_cfg` dict of a preprocessor_config.json (vLLM's processor reads it)."""
        return {
            "patch_size": self.patch_size,
            "merge_kernel_size": self.merge_kernel_size,
            "in_patch_limit": self.in_patch_limit,
            "patch_limit_on_one_side": self.patch_limit_on_one_side,
            "temporal_merge_kernel_size": self.temporal_merge_kernel_size,
            "in_patch_limit_each_frame": self.in_patch_limit_each_frame,
            "in_patch_limit_video": self.in_patch_limit_video,
            "fixed_output_tokens": self.fixed_output_tokens,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
        }

    # Sizes --------------------------------------------------------------------------------------

    def plan(self, width: int, height: int, patch_limit: int | None = None) -> ResizePlan:
        """Resize and padding for a width x height image under `patch_limit` patches (default
        in_patch_limit): scale = min(1, sqrt(limit / patches), side limits), then pad to 28 px."""
        p, m, side = self.patch_size, self.merge_kernel_size, self.patch_limit_on_one_side
        limit = self.in_patch_limit if patch_limit is None else patch_limit
        scale = min(
            1.0,
            math.sqrt(limit / (max(1.0, width // p) * max(1.0, height // p))),
            side * p / width,
            side * p / height,
        )
        new_w = min(max(1, int(width * scale)), side * p)
        new_h = min(max(1, int(height * scale)), side * p)
        factor = m * p
        return ResizePlan(
            new_w, new_h, (factor - new_w % factor) % factor, (factor - new_h % factor) % factor, p, m
        )

    def video_chunk_plan(self, width: int, height: int, num_frames: int) -> ResizePlan:
        """Plan for one chunk of num_frames frames (the per-frame limit, shared out of
        in_patch_limit_video when that is set), as vLLM's navit_resize_video."""
        limit = (
            self.in_patch_limit if self.in_patch_limit_each_frame is None else self.in_patch_limit_each_frame
        )
        if self.in_patch_limit_video is not None:
            limit = min(round(self.in_patch_limit_video / num_frames), limit)
        return self.plan(width, height, limit)

    def _num_tokens(self, plan: ResizePlan) -> int:
        return plan.num_tokens if self.fixed_output_tokens is None else self.fixed_output_tokens

    # Processing ---------------------------------------------------------------------------------

    def blocks(
        self, entries: Sequence[MediaItem | Image.Image | list[Image.Image]]
    ) -> list[list[MediaBlock]]:
        """The renderer's media blocks, one list per entry (a video: one block per chunk)."""
        return [[block for block, _, _ in self._items(entry, index)] for index, entry in enumerate(entries)]

    def __call__(self, entries: Sequence[MediaItem | Image.Image | list[Image.Image]]) -> MediaBatch:
        """pixel_values, grid_thws and blocks for the entries, in order."""
        patches, grids, blocks = [], [], []
        for index, entry in enumerate(entries):
            entry_blocks = []
            for block, plan, frames in self._items(entry, index):
                patches.append(self._patchify(frames, plan))
                grids.append([len(frames), *plan.grid])
                entry_blocks.append(block)
            blocks.append(entry_blocks)
        p = self.patch_size
        pixel_values = torch.cat(patches) if patches else torch.empty(0, 3, p, p)
        grid_thws = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        return MediaBatch(pixel_values, grid_thws, blocks)

    def _items(self, entry: Any, index: int) -> list[tuple[MediaBlock, ResizePlan, list[Image.Image]]]:
        if isinstance(entry, list | tuple):
            if not entry:
                raise ValueError(f"media entry {index}: a video needs at least one frame")
            frames = [load_image(frame, f"media entry {index}, frame {i}") for i, frame in enumerate(entry)]
            sizes = {frame.size for frame in frames}
            if len(sizes) != 1:
                raise ValueError(
                    f"media entry {index}: video frames differ in size {sorted(sizes)}; resize them"
                )
            width, height = frames[0].size
            k = self.temporal_merge_kernel_size
            out = []
            for start in range(0, len(frames), k):
                chunk = frames[start : start + k]
                plan = self.video_chunk_plan(width, height, len(chunk))
                out.append((MediaBlock("video_chunk", width, height, self._num_tokens(plan)), plan, chunk))
            return out
        image = load_image(entry, f"media entry {index}")
        plan = self.plan(*image.size)
        return [(MediaBlock("image", image.width, image.height, self._num_tokens(plan)), plan, [image])]

    def _patchify(self, frames: list[Image.Image], plan: ResizePlan) -> torch.Tensor:
        """[t * rows * cols, 3, p, p]: each frame resized, padded black, normalised, cut to patches."""
        p = self.patch_size
        rows, cols = plan.grid
        mean = np.asarray(self.image_mean, dtype=np.float32)
        inv_std = 1.0 / np.asarray(self.image_std, dtype=np.float32)
        out = []
        for frame in frames:
            resized = frame.resize((plan.new_width, plan.new_height), resample=Image.Resampling.BICUBIC)
            canvas = np.zeros((rows * p, cols * p, 3), dtype=np.uint8)
            canvas[: plan.new_height, : plan.new_width] = np.asarray(resized)
            pixels = (canvas.astype(np.float32) / 255.0 - mean) * inv_std
            # (rows, p, cols, p, 3) -> (rows, cols, 3, p, p): raster order of patches, channels first
            grid = pixels.reshape(rows, p, cols, p, 3).transpose(0, 2, 4, 1, 3)
            out.append(torch.from_numpy(np.ascontiguousarray(grid)).reshape(rows * cols, 3, p, p))
        return torch.cat(out)


def load_image(ref: MediaRef | Image.Image, where: str = "image") -> Image.Image:
    """An RGB PIL image from a PIL image, a file path or a data URI; errors name `where`."""
    if isinstance(ref, Image.Image):
        return ref if ref.mode == "RGB" else ref.convert("RGB")
    if not isinstance(ref, str):
        raise TypeError(f"{where}: expected a file path, a data URI or a PIL image, got {type(ref).__name__}")
    try:
        if ref.startswith("data:"):
            return Image.open(io.BytesIO(base64.b64decode(ref.split(",", 1)[1]))).convert("RGB")
        return Image.open(Path(ref)).convert("RGB")
    except (OSError, ValueError) as err:
        raise ValueError(f"{where}: cannot read image {ref[:80]!r}: {err}") from err


def image_to_data_uri(image: Image.Image) -> MediaRef:
    """A PNG data URI: how a recipe that draws its images stores them in a Sample (JSON-safe)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
