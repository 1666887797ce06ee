"""MoonViTImageProcessor: resize plans and token counts equal vLLM's Kimi processor's for many sizes,
the patch layout and padding, video chunks, and pixel values equal vLLM's own preprocessing."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from posttrain.data.images import MoonViTImageProcessor, image_to_data_uri, load_image

VLLM_PROCESSOR = "transformers_utils/processors/kimi_k25_vision_fused.py"


def vllm_function(name: str):
    """A resize function of vLLM's Kimi processor, compiled from the installed wheel's source (the
    module itself imports numba and vllm, seconds of start-up for two arithmetic functions)."""
    path = Path(importlib.util.find_spec("vllm").origin).parent / VLLM_PROCESSOR
    tree = ast.parse(path.read_text())
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("navit_resize")]
    namespace: dict = {"math": math}
    exec(compile(ast.Module(nodes, type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


SIZES = [(14, 14), (28, 28), (90, 50), (37, 100), (1000, 10), (13, 600), (640, 480), (4000, 3000), (7169, 30)]


@pytest.mark.parametrize("limit", [16384, 1024, 64])
def test_resize_plans_are_vllms(limit):
    navit = vllm_function("navit_resize_image")
    processor = MoonViTImageProcessor(in_patch_limit=limit, patch_limit_on_one_side=64)
    for width, height in [*SIZES, *[(w, h) for w in range(1, 400, 37) for h in range(3, 300, 41)]]:
        theirs = navit(width, height, 14, 2, limit, 64, None)
        plan = processor.plan(width, height)
        ours = {
            "num_tokens": plan.num_tokens,
            "new_width": plan.new_width,
            "new_height": plan.new_height,
            "pad_width": plan.pad_width,
            "pad_height": plan.pad_height,
            "sampled_nframes": 1,
        }
        assert ours == theirs, (width, height)


def test_video_chunk_plans_are_vllms():
    navit_video = vllm_function("navit_resize_video")
    processor = MoonViTImageProcessor(
        in_patch_limit=4096, in_patch_limit_each_frame=1024, in_patch_limit_video=2000
    )
    for width, height, frames in [(640, 480, 4), (640, 480, 1), (90, 50, 3), (2000, 100, 2)]:
        theirs = navit_video(width, height, frames, 1.0, math.inf, 14, 2, 1024, 512, 2000, None, None)
        plan = processor.video_chunk_plan(width, height, frames)
        assert (plan.new_width, plan.new_height, plan.pad_width, plan.pad_height, plan.num_tokens) == (
            theirs["new_width"],
            theirs["new_height"],
            theirs["pad_width"],
            theirs["pad_height"],
            theirs["num_tokens"],
        )


@pytest.mark.parametrize(
    ("size", "grid", "tokens"),
    [
        ((14, 14), (2, 2), 1),  # padded up to one 2 x 2 window
        ((28, 28), (2, 2), 1),
        ((90, 50), (4, 8), 8),  # rows x cols of patches; width 90 -> 112 px
        ((37, 100), (8, 4), 8),
        ((640, 480), (36, 46), 414),
    ],
)
def test_grid_patches_and_tokens_of_an_image(size, grid, tokens):
    batch = MoonViTImageProcessor()([_image(*size)])
    rows, cols = grid
    assert batch.grid_thws.tolist() == [[1, rows, cols]]
    assert batch.pixel_values.shape == (rows * cols, 3, 14, 14)
    assert batch.blocks[0][0].num_tokens == tokens == rows * cols // 4
    assert (batch.blocks[0][0].width, batch.blocks[0][0].height) == size


def test_a_large_image_is_shrunk_to_the_patch_budget():
    batch = MoonViTImageProcessor(in_patch_limit=256)([_image(4000, 3000)])
    t, rows, cols = batch.grid_thws[0].tolist()
    assert rows * cols <= 256 + 2 * (rows + cols)  # the budget, plus at most the padding
    assert rows % 2 == 0 and cols % 2 == 0 and cols > rows


def test_patch_layout_and_black_padding():
    image = _image(42, 20)  # 3 x 2 patches of pixels, padded to 4 x 2 (56 x 28)
    batch = MoonViTImageProcessor()([image])
    assert batch.grid_thws.tolist() == [[1, 2, 4]]
    pixels = (np.asarray(image, dtype=np.float32) / 255.0 - 0.5) / 0.5  # [20, 42, 3]
    canvas = np.full((28, 56, 3), -1.0, dtype=np.float32)  # black, normalised
    canvas[:20, :42] = pixels
    for r in range(2):
        for c in range(4):
            patch = torch.from_numpy(
                canvas[14 * r : 14 * r + 14, 14 * c : 14 * c + 14].transpose(2, 0, 1).copy()
            )
            torch.testing.assert_close(batch.pixel_values[r * 4 + c], patch, rtol=0, atol=1e-6)


def test_a_video_is_cut_into_chunks_of_four_frames():
    frames = [_image(40, 30, seed=i) for i in range(6)]
    batch = MoonViTImageProcessor()([frames, _image(28, 28)])
    assert batch.grid_thws.tolist() == [[4, 4, 4], [2, 4, 4], [1, 2, 2]]
    assert [[b.kind for b in entry] for entry in batch.blocks] == [["video_chunk", "video_chunk"], ["image"]]
    assert [b.num_tokens for entry in batch.blocks for b in entry] == [4, 4, 1]
    assert batch.pixel_values.shape[0] == 4 * 16 + 2 * 16 + 4
    # frame order is kept: the second chunk's first frame is frame 4
    alone = MoonViTImageProcessor()([frames[4]])
    assert torch.equal(batch.pixel_values[64:80], alone.pixel_values)


def test_references_load_and_bad_ones_are_named(tmp_path):
    image = _image(30, 20)
    path = tmp_path / "a.png"
    image.save(path)
    processor = MoonViTImageProcessor()
    from_path = processor([str(path)])
    from_uri = processor([image_to_data_uri(image)])
    assert torch.equal(from_path.pixel_values, processor([image]).pixel_values)
    assert torch.equal(from_uri.pixel_values, from_path.pixel_values)
    assert load_image(image.convert("L")).mode == "RGB"
    with pytest.raises(ValueError, match="media entry 1: cannot read image"):
        processor([str(path), str(tmp_path / "missing.png")])
    with pytest.raises(ValueError, match="media entry 0: video frames differ in size"):
        processor([[image, _image(20, 30)]])
    with pytest.raises(ValueError, match="media entry 0: a video needs at least one frame"):
        processor([[]])


# vLLM's processor imports numba; loaded into the test process it breaks every later in-process
# vLLM engine (vLLM's Triton dispatcher trips over llvmlite objects in sys.modules), so it runs in
# a process of its own and hands back its tensors.
THEIRS = """
import json, sys
import numpy as np, torch
from PIL import Image
from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor

def image(width, height, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))

theirs = KimiK25FusedVisionProcessor(media_proc_cfg=json.loads(sys.argv[1]))
frames = [image(40, 30, seed=i) for i in range(4)]
images = [image(90, 50), image(700, 300, seed=1), image(14, 14, seed=2)]
items = [*({"type": "image", "image": im} for im in images), {"type": "video_chunk", "video_chunk": frames}]
out = theirs.preprocess(items, return_tensors="pt")
counts = [theirs.media_tokens_calculator(item) for item in items]
saved = {"grid_thws": out["grid_thws"], "pixel_values": out["pixel_values"], "counts": counts}
torch.save(saved, sys.argv[2])
"""


@pytest.mark.vllm
def test_pixel_values_equal_vllms_kimi_processor(tmp_path):
    processor = MoonViTImageProcessor(in_patch_limit=512)
    result = tmp_path / "theirs.pt"
    done = subprocess.run(
        [sys.executable, "-c", THEIRS, json.dumps(processor.media_proc_cfg()), str(result)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(result)
    frames = [_image(40, 30, seed=i) for i in range(4)]
    images = [_image(90, 50), _image(700, 300, seed=1), _image(14, 14, seed=2)]
    ours = processor([*images, frames])
    assert torch.equal(theirs["grid_thws"], ours.grid_thws)
    torch.testing.assert_close(theirs["pixel_values"], ours.pixel_values, rtol=0, atol=1e-6)
    assert theirs["counts"] == [b.num_tokens for entry in ours.blocks for b in entry]
