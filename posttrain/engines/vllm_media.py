"""Images through vLLM: a trajectory's expanded media blocks as vLLM's K3 takes them.

Our trajectories hold each image as the block the renderer writes,
`<|media_begin|>image WxH<|media_content|>` + N x `<|media_pad|>` + `<|media_end|>` (N from the
image's size), and the embedded engine merges the visual tokens at the pads. vLLM's
`KimiK3ForConditionalGeneration` refuses such a prompt ("Failed to apply prompt replacement"): its
multimodal processor wants the image placeholder text `<|kimi_image_placeholder|>` where each image
goes, with the image itself in `multi_modal_data`, and writes the block itself. So each block is
collapsed to the placeholder's token ids and the image is sent beside it; vLLM's expansion must
then give back exactly the trajectory's tokens, which `check_expanded` verifies on every request
(a mismatch, such as a checkpoint whose preprocessor_config.json sizes images differently from
the renderer, would misalign every log-prob after the image). Videos are refused: this engine
sends images only.
"""

from __future__ import annotations

from typing import Any

from posttrain.data.chat_media import MEDIA_TOKENS
from posttrain.data.images import load_image
from posttrain.data.sample import Sample
from posttrain.model.vision_model import IMAGE_PLACEHOLDER


class MediaPrompts:
    """Turns Samples into vLLM prompt dicts (`prompt_token_ids`, and `multi_modal_data` for a sample
    with images) with the token ids of `tokenizer` (the served checkpoint's)."""

    def __init__(self, tokenizer: Any) -> None:
        ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in MEDIA_TOKENS.items()}
        unknown = [MEDIA_TOKENS[name] for name, i in ids.items() if i is None or i == tokenizer.unk_token_id]
        if unknown:
            raise ValueError(
                f"the served tokenizer has no {', '.join(unknown)}: a multimodal checkpoint's tokenizer "
                "holds the media tokens (posttrain saves it with load_tokenizer(media=True))"
            )
        self.begin, self.end = ids["media_begin"], ids["media_end"]
        self.placeholder = list(tokenizer.encode(IMAGE_PLACEHOLDER, add_special_tokens=False))

    def prompt(self, sample: Sample) -> dict[str, Any]:
        """vLLM's prompt for `sample`'s tokens: its token ids as they are when it has no images;
        else each media block collapsed to the placeholder and the images in `multi_modal_data`."""
        if not sample.images:
            return {"prompt_token_ids": list(sample.tokens)}
        for index, entry in enumerate(sample.images):
            if not isinstance(entry, str):
                raise ValueError(
                    f"sample {sample.uid}: media entry {index} is a video ({len(entry)} frames); the vLLM "
                    "engine sends images only: use the embedded engine for video"
                )
        collapsed: list[int] = []
        blocks = 0
        position = 0
        tokens = sample.tokens
        while position < len(tokens):
            if tokens[position] != self.begin:
                collapsed.append(tokens[position])
                position += 1
                continue
            try:
                end = tokens.index(self.end, position)
            except ValueError:
                raise ValueError(
                    f"sample {sample.uid}: the media block at token {position} has no <|media_end|>"
                ) from None
            collapsed.extend(self.placeholder)
            blocks += 1
            position = end + 1
        if blocks != len(sample.images):
            raise ValueError(
                f"sample {sample.uid}: {blocks} media blocks in its tokens but {len(sample.images)} images "
                "in sample.images; they must agree one to one, in order"
            )
        images = [load_image(ref, f"sample {sample.uid} image {i}") for i, ref in enumerate(sample.images)]
        return {"prompt_token_ids": collapsed, "multi_modal_data": {"image": images}}


def check_expanded(uid: str, expected: list[int], processed: list[int] | None) -> None:
    """Raise when vLLM's processed prompt (`processed`, the token ids its model ran) is not the
    trajectory's (`expected`): for a sample with images vLLM wrote the media blocks itself
    (`MediaPrompts`), and any difference would misalign every log-prob after it."""
    if processed is None or list(processed) == list(expected):
        return
    first = next(
        (i for i, (a, b) in enumerate(zip(processed, expected, strict=False)) if a != b),
        min(len(processed), len(expected)),
    )
    raise RuntimeError(
        f"sample {uid}: vLLM expanded its prompt to {len(processed)} tokens, the trajectory has "
        f"{len(expected)}; they differ from token {first}. vLLM's image processor (the checkpoint's "
        "preprocessor_config.json) and the renderer's (posttrain.data.images) must size every image alike"
    )
