"""Media parts in K3 chat: the renderer writes vLLM's media block for each image and video chunk,
its Jinja twin gives the same ids and loss mask, media tokens are never trained on, and counts
that disagree are errors. Sample carries the media."""

from __future__ import annotations

import numpy as np
import pytest
from jinja2.exceptions import TemplateError
from PIL import Image

from posttrain.data.chat import ChatRenderer, load_tokenizer
from posttrain.data.chat_media import MEDIA_TOKENS, with_media_blocks
from posttrain.data.images import MediaBlock, MoonViTImageProcessor, image_to_data_uri
from posttrain.data.sample import Sample


@pytest.fixture(scope="module")
def media_renderer() -> ChatRenderer:
    return ChatRenderer(load_tokenizer(media=True))


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _media() -> list:
    return [_image(90, 50), [_image(40, 30, seed=i) for i in range(6)], _image(28, 28, seed=9)]


def _messages() -> list[dict]:
    return [
        {"role": "system", "content": [{"type": "text", "text": "Look carefully."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "How many squares "},
                {"type": "text", "text": "in "},
                {"type": "image"},
                {"type": "text", "text": " and how many frames here"},
                {"type": "video"},
                {"type": "text", "text": "?"},
            ],
        },
        {
            "role": "assistant",
            "reasoning_content": "",
            "content": "",
            "tool_calls": [{"id": "functions.crop:0", "function": {"name": "crop", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "functions.crop:0", "content": [{"type": "image"}]},
        {"role": "assistant", "reasoning_content": "three, six", "content": "3 and 6"},
    ]


def test_media_tokens_are_added_after_the_shipped_ones(media_renderer):
    vocab = media_renderer.tokenizer.get_vocab()
    assert [vocab[token] for token in MEDIA_TOKENS.values()] == [2048, 2049, 2050, 2051]
    assert len(load_tokenizer()) == 2048  # the text-only tokenizer is unchanged


def test_blocks_are_vllms_layout_and_never_trained_on(media_renderer):
    processor = MoonViTImageProcessor()
    blocks = processor.blocks(_media())
    assert [[(b.kind, b.num_tokens) for b in entry] for entry in blocks] == [
        [("image", 8)],
        [("video_chunk", 4), ("video_chunk", 4)],
        [("image", 1)],
    ]
    ids, mask = media_renderer.render(_messages(), media=blocks)
    t = media_renderer.media_token_ids
    pads = [i for i, token in enumerate(ids) if token == t["media_pad"]]
    assert len(pads) == 8 + 4 + 4 + 1
    assert all(mask[i] == 0 for i in pads)
    # the image's block: <|media_begin|>image 90x50<|media_content|> 8 pads <|media_end|>
    begin = ids.index(t["media_begin"])
    header = media_renderer.encode("image 90x50")
    expected = [t["media_begin"], *header, t["media_content"], *[t["media_pad"]] * 8, t["media_end"]]
    assert ids[begin : begin + len(expected)] == expected
    assert media_renderer.decode(ids).count("<|media_begin|>video_chunk 40x30<|media_content|>") == 2
    # every media token sits in a prompt span; the assistant turns are trained as without media
    media_ids = set(t.values())
    assert all(m == 0 for token, m in zip(ids, mask, strict=True) if token in media_ids)
    text_only = [{**m, "content": "x"} if isinstance(m.get("content"), list) else m for m in _messages()]
    _, text_mask = media_renderer.render(text_only)
    assert sum(mask) == sum(text_mask)


def test_the_jinja_twin_gives_the_same_ids_and_mask(media_renderer):
    blocks = MoonViTImageProcessor().blocks(_media())
    ids, mask = media_renderer.render(_messages(), effort="high", media=blocks)
    out = media_renderer.tokenizer.apply_chat_template(
        with_media_blocks(_messages(), blocks),
        effort="high",
        tokenize=True,
        return_assistant_tokens_mask=True,
    )
    assert out["input_ids"] == ids
    assert out["assistant_masks"] == mask
    prompt = media_renderer.render_prompt(_messages()[:2], media=blocks[:2])
    got = media_renderer.tokenizer.apply_chat_template(
        with_media_blocks(_messages()[:2], blocks[:2]), add_generation_prompt=True, return_dict=False
    )
    assert got == prompt


def test_the_exact_prefix_rule_holds_with_media(media_renderer):
    messages, blocks = _messages(), MoonViTImageProcessor().blocks(_media())
    full, _ = media_renderer.render(messages, media=blocks)
    prompt = media_renderer.render_prompt(messages[:2], media=blocks[:2])
    call = media_renderer.render_assistant(messages[2])
    tool = media_renderer.render_tool_results(messages[3:4], media=blocks[2:])
    pieces = prompt + call + tool
    assert full[: len(pieces)] == pieces
    assert full[len(pieces) :] == media_renderer.render_assistant(messages[4])


def test_counts_and_kinds_must_agree(media_renderer):
    blocks = MoonViTImageProcessor().blocks(_media())
    with pytest.raises(ValueError, match=r"message 3: its image part has no media entry left \(2 given\)"):
        media_renderer.render(_messages(), media=blocks[:2])
    with pytest.raises(ValueError, match="4 media entries were given but the messages have 3 media parts"):
        media_renderer.render(_messages(), media=[*blocks, blocks[0]])
    with pytest.raises(ValueError, match="message 1: video part 1 got media blocks"):
        media_renderer.render(_messages(), media=[blocks[0], blocks[0], blocks[2]])
    with pytest.raises(ValueError, match=r"message 1: its image part has no media entry left \(0 given\)"):
        media_renderer.render(_messages())
    with pytest.raises(ValueError, match="message 0: assistant content is text"):
        media_renderer.render([{"role": "assistant", "content": [{"type": "image"}]}], media=blocks[:1])
    with pytest.raises(ValueError, match="unknown content part type 'audio'"):
        media_renderer.render([{"role": "user", "content": [{"type": "audio"}]}])
    with pytest.raises(TemplateError, match="pass the messages through with_media_blocks"):
        media_renderer.tokenizer.apply_chat_template(_messages(), tokenize=False)


def test_a_text_tokenizer_is_told_how_to_get_media_tokens(renderer):
    block = MediaBlock("image", 28, 28, 1)
    with pytest.raises(ValueError, match=r"load_tokenizer\(path, media=True\)"):
        renderer.render([{"role": "user", "content": [{"type": "image"}]}], media=[[block]])


def test_sample_carries_images_and_videos():
    image = image_to_data_uri(_image(28, 28))
    sample = Sample(uid="v0", messages=_messages(), images=[image, [image, image], image])
    again = Sample.from_json(sample.to_json())
    assert again.images == sample.images and again.messages == sample.messages
    assert Sample(uid="t").images == []
    blocks = MoonViTImageProcessor().blocks(again.images)
    assert [len(entry) for entry in blocks] == [1, 1, 1]  # a two-frame video is one chunk
