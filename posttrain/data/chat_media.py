"""Media parts in K3 chat: the media tokens, and how a render hands its media blocks to the parts.

`ChatRenderer` (chat.py) renders a media part of a message as its `MediaBlock`s (from
`posttrain.data.images.MoonViTImageProcessor.blocks`); `MediaCursor` gives each media part its
entry in order and checks the counts; `with_media_blocks` writes the blocks into the parts for the
Jinja twin, which cannot size an image itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from posttrain.data.images import MediaBlock

# The released K3 tokenizer's media tokens, as vLLM's Kimi processor writes an image:
# <|media_begin|>image WxH<|media_content|><|media_pad|>...<|media_end|>. Added only by
# load_tokenizer(media=True), so the text-only tokenizer and its ids stay as shipped.
MEDIA_TOKENS: dict[str, str] = {
    "media_begin": "<|media_begin|>",
    "media_content": "<|media_content|>",
    "media_end": "<|media_end|>",
    "media_pad": "<|media_pad|>",
}
MEDIA_PART_TYPES: tuple[str, ...] = ("image", "video")


class MediaCursor:
    """Hands out a render's media entries to its media parts in order, and checks the counts."""

    def __init__(self, media: Sequence[Sequence[MediaBlock]] | None) -> None:
        self.media = list(media or [])
        self.used = 0

    def take(self, kind: str, index: int) -> Sequence[MediaBlock]:
        if self.used == len(self.media):
            raise ValueError(
                f"message {index}: its {kind} part has no media entry left ({len(self.media)} given); "
                "pass media=processor.blocks(sample.images)"
            )
        blocks = self.media[self.used]
        self.used += 1
        expected = "image" if kind == "image" else "video_chunk"
        if (
            not blocks
            or any(block.kind != expected for block in blocks)
            or (kind == "image" and len(blocks) != 1)
        ):
            raise ValueError(
                f"message {index}: {kind} part {self.used - 1} got media blocks {list(blocks)}; the order of "
                "media parts and of sample.images must agree (an image is one entry, a video a frame list)"
            )
        return blocks

    def check_used(self) -> None:
        if self.used != len(self.media):
            raise ValueError(
                f"{len(self.media)} media entries were given but the messages have {self.used} media parts"
            )


def with_media_blocks(
    messages: list[dict[str, Any]], media: Sequence[Sequence[MediaBlock]]
) -> list[dict[str, Any]]:
    """Copies of `messages` whose media parts carry their blocks (``part["blocks"]``): the form the
    Jinja template renders, since it cannot size images itself."""
    entries = iter(media)
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [
                {**part, "blocks": [block.as_dict() for block in next(entries)]}
                if part.get("type") in MEDIA_PART_TYPES
                else part
                for part in content
            ]
        out.append({**message, "content": content})
    return out
