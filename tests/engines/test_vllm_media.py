"""The vLLM engines' handling of images without vLLM: what `MediaPrompts` sends for a rendered
trajectory, and the refusals (videos, blocks and images that disagree, a tokenizer without media
tokens, token-id-only engines). vLLM's side of the exchange is tests/engines/test_vllm_images.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from posttrain.data.chat import ChatRenderer, load_tokenizer
from posttrain.data.images import MoonViTImageProcessor, image_to_data_uri, load_image
from posttrain.engines.base import check_text_prompt
from posttrain.engines.testing import prompt_sample
from posttrain.engines.vllm_media import MediaPrompts, check_expanded
from posttrain.model.vision_config import load_vision_config
from posttrain.model.vision_model import IMAGE_PLACEHOLDER

REPO = Path(__file__).resolve().parents[2]
VISION_YAML = "stages/models/vision-tiny.yaml"


@pytest.fixture(scope="module")
def renderer():
    vision = load_vision_config(REPO / VISION_YAML, text_hidden_size=128)
    return ChatRenderer(load_tokenizer(media=True), MoonViTImageProcessor.from_vision_config(vision))


def _images(seed: int, sizes: list[tuple[int, int]]) -> list[str]:
    rng = np.random.default_rng(seed)
    return [
        image_to_data_uri(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))) for h, w in sizes
    ]


def _sample(renderer: ChatRenderer, images: list[str]):
    parts = [{"type": "text", "text": "Look:"}] + [{"type": "image"} for _ in images]
    tokens = renderer.render_prompt([{"role": "user", "content": parts}], media=renderer.media_blocks(images))
    sample = prompt_sample("s", tokens)
    sample.images = list(images)
    return sample


def test_each_media_block_becomes_the_placeholder_and_its_image_rides_beside_it(renderer):
    images = _images(0, [(112, 112), (50, 90)])
    sample = _sample(renderer, images)
    prompt = MediaPrompts(renderer.tokenizer).prompt(sample)

    placeholder = renderer.tokenizer.encode(IMAGE_PLACEHOLDER, add_special_tokens=False)
    ids = renderer.media_token_ids
    begin, end = ids["media_begin"], ids["media_end"]
    starts = [i for i, t in enumerate(sample.tokens) if t == begin]
    stops = [i for i, t in enumerate(sample.tokens) if t == end]
    expected = (
        sample.tokens[: starts[0]]
        + placeholder
        + sample.tokens[stops[0] + 1 : starts[1]]
        + placeholder
        + sample.tokens[stops[1] + 1 :]
    )
    assert prompt["prompt_token_ids"] == expected
    sent = prompt["multi_modal_data"]["image"]
    assert [np.asarray(i).tolist() for i in sent] == [np.asarray(load_image(r)).tolist() for r in images]


def test_a_text_sample_is_sent_as_its_tokens(renderer):
    sample = _sample(renderer, [])
    assert MediaPrompts(renderer.tokenizer).prompt(sample) == {"prompt_token_ids": sample.tokens}


def test_videos_and_disagreeing_media_are_refused_with_the_sample_named(renderer):
    media = MediaPrompts(renderer.tokenizer)
    sample = _sample(renderer, _images(1, [(40, 40)]))
    video = prompt_sample("v", sample.tokens)
    video.images = [[sample.images[0]] * 2]
    with pytest.raises(ValueError, match="sample v: media entry 0 is a video.*embedded engine"):
        media.prompt(video)
    extra = prompt_sample("x", sample.tokens)
    extra.images = sample.images * 2
    with pytest.raises(ValueError, match="sample x: 1 media blocks in its tokens but 2 images"):
        media.prompt(extra)
    cut = prompt_sample("c", sample.tokens[: sample.tokens.index(renderer.media_token_ids["media_end"])])
    cut.images = sample.images
    with pytest.raises(ValueError, match="sample c: the media block at token .* has no <\\|media_end\\|>"):
        media.prompt(cut)


def test_a_tokenizer_without_media_tokens_is_refused():
    with pytest.raises(ValueError, match="no <\\|media_begin\\|>.*load_tokenizer\\(media=True\\)"):
        MediaPrompts(load_tokenizer())


def test_check_expanded_names_the_first_differing_token():
    check_expanded("a", [1, 2, 3], [1, 2, 3])
    check_expanded("a", [1, 2, 3], None)  # no processed prompt reported: nothing to compare
    with pytest.raises(
        RuntimeError, match="sample a: vLLM expanded its prompt to 4 tokens.*has 3.*from token 1"
    ):
        check_expanded("a", [1, 2, 3], [1, 9, 9, 9])


@pytest.mark.parametrize("engine", ["vllm_server", "trl_vllm"])
def test_token_id_engines_refuse_images(renderer, engine):
    sample = _sample(renderer, _images(2, [(40, 40)]))
    with pytest.raises(
        ValueError, match=f"sample s: 1 media entries, but the {engine} engine sends token ids"
    ):
        check_text_prompt(sample, engine)
    check_text_prompt(_sample(renderer, []), engine)
