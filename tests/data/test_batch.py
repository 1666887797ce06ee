"""posttrain.data.batch: left padding that lines every per-token field up with the tokens, and
micro-batches that are padded as if built alone; Sample's generated-token views."""

from __future__ import annotations

import torch

from posttrain.data.batch import TokenBatch, left_pad, left_pad_values, positions_from_mask
from posttrain.data.sample import Sample


def trajectory(uid: str, prompt: int, turns: list[tuple[int, bool]], version: int = 3) -> Sample:
    """A prompt of `prompt` tokens, then (count, generated) runs: generated ones with log-prob -0.5."""
    sample = Sample(uid=uid)
    sample.append(list(range(10, 10 + prompt)), generated=False)
    sample.prompt_length = prompt
    for count, generated in turns:
        logprobs = [-0.5] * count if generated else None
        sample.append([7] * count, generated=generated, logprobs=logprobs, version=version)
    return sample


def test_generated_mask_and_the_current_turn():
    sample = trajectory("a", 3, [(2, True), (1, False), (2, True)])
    assert sample.generated_mask == [0, 0, 0, 1, 1, 0, 1, 1]
    assert sample.num_generated == 4
    assert sample.trailing_generated == 2
    sample.append([1], generated=False)  # tool results: a new turn has not started
    assert sample.trailing_generated == 0
    sft_like = Sample(uid="b", tokens=[1, 2, 3], prompt_length=1, loss_mask=[1, 1, 0])
    assert sft_like.generated_mask == [0, 1, 0]  # a loss mask on the prompt is not generated


def test_every_field_is_left_padded_in_line_with_the_tokens():
    long, short = trajectory("a", 3, [(2, True), (1, False), (2, True)]), trajectory("b", 2, [(1, True)], 5)
    batch = TokenBatch.of([long, short], pad_id=0)
    assert batch.input_ids.tolist() == [long.tokens, [0] * 5 + short.tokens]
    assert batch.attention_mask.tolist() == [[1] * 8, [0] * 5 + [1] * 3]
    assert batch.position_ids.tolist() == [list(range(8)), [0] * 5 + [0, 1, 2]]
    assert batch.generated.tolist() == [[bool(m) for m in long.generated_mask], [False] * 7 + [True]]
    assert batch.behaviour_logprobs[1].tolist() == [0.0] * 7 + [-0.5]
    assert batch.versions.tolist() == [[0, 0, 0, 3, 3, 0, 3, 3], [0] * 7 + [5]]
    assert TokenBatch.targets(batch.generated).shape == (2, 7)


def test_a_micro_batch_is_padded_as_if_built_alone():
    samples = [
        trajectory("a", 6, [(3, True)]),
        trajectory("b", 2, [(1, True)]),
        trajectory("c", 3, [(1, True)]),
    ]
    whole = TokenBatch.of(samples, pad_id=1)
    part, alone = whole.rows(1, 3), TokenBatch.of(samples[1:], pad_id=1)
    assert part.lengths == alone.lengths == (3, 4)
    for got, expected in zip(part.tensors(), alone.tensors(), strict=True):
        assert torch.equal(got, expected)


def test_the_padding_helpers():
    ids, mask = left_pad([[5, 6], [7]], pad_id=9)
    assert ids.tolist() == [[5, 6], [9, 7]] and mask.tolist() == [[1, 1], [0, 1]]
    assert positions_from_mask(mask).tolist() == [[0, 1], [0, 0]]
    assert left_pad_values([[1.5], []], 3, fill=-1.0).tolist() == [[-1.0, -1.0, 1.5], [-1.0, -1.0, -1.0]]
