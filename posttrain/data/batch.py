"""Samples -> the aligned tensors a forward and a per-token loss read: the one place that pads.

Every batched forward over trajectories (the RL and MOPD policy step, the embedded engine's
prefill and scoring) left-pads them the same way, so a row's last token is in the last column
and its KV cache, positions and targets line up across rows. A `TokenBatch` holds the token ids
and every per-token field of `Sample` the step needs, each [B, T] and aligned with the tokens;
the loss reads targets, positions 1..T-1 (token t is predicted from tokens[:t]), through
`TokenBatch.targets`. `rows` takes a micro-batch and trims the padding columns no row of it
needs, so a micro-batch is padded to its own longest row as if it had been built alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from posttrain.data.images import MediaItem
from posttrain.data.sample import Sample


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (input_ids [B, T], attention_mask [B, T]) with LEFT padding."""
    width = max(len(seq) for seq in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(list(seq), dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    return ids, mask


def left_pad_values(
    rows: Sequence[Sequence[float]], width: int, dtype: torch.dtype = torch.float32, fill: float = 0.0
) -> torch.Tensor:
    """Per-token value lists (each aligned with its sample's tokens) -> [B, width], left-padded
    with `fill`, so they line up with `left_pad`'s ids."""
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for row, values in enumerate(rows):
        if values:
            out[row, width - len(values) :] = torch.tensor(list(values), dtype=dtype)
    return out


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that ignore left padding (rotary models need them; K3 accepts and ignores them)."""
    return (mask.cumsum(dim=-1) - 1).clamp(min=0)


@dataclass(frozen=True)
class TokenBatch:
    """Left-padded trajectories, every tensor [B, T] and aligned with the tokens.

    input_ids / attention_mask: the forward's inputs (pad_id and 0 on padding).
    generated: bool, 1 on tokens the policy generated (`Sample.generated_mask`): what is trained.
    behaviour_logprobs: float32, the rollout engine's log-prob of each generated token (0 elsewhere).
    versions: long, the policy version that generated each token (0 on others).
    lengths: each row's token count.
    images: each row's `Sample.images` (the media whose visual tokens its `<|media_pad|>` runs are).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    generated: torch.Tensor
    behaviour_logprobs: torch.Tensor
    versions: torch.Tensor
    lengths: tuple[int, ...]
    images: tuple[list[MediaItem], ...] = ()

    @classmethod
    def of(cls, samples: Sequence[Sample], pad_id: int) -> TokenBatch:
        if not samples:
            raise ValueError("TokenBatch.of needs at least one sample")
        ids, mask = left_pad([s.tokens for s in samples], pad_id)
        width = ids.shape[1]
        return cls(
            input_ids=ids,
            attention_mask=mask,
            generated=left_pad_values([s.generated_mask for s in samples], width, torch.bool),
            behaviour_logprobs=left_pad_values([s.rollout_logprobs for s in samples], width),
            versions=left_pad_values(
                [[max(v, 0) for v in s.policy_version] for s in samples], width, torch.long
            ),
            lengths=tuple(len(s.tokens) for s in samples),
            images=tuple(s.images for s in samples),
        )

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    @property
    def position_ids(self) -> torch.Tensor:
        return positions_from_mask(self.attention_mask)

    def rows(self, start: int, stop: int) -> TokenBatch:
        """Rows start..stop-1 with the leading columns that are padding in all of them dropped."""
        lengths = self.lengths[start:stop]
        keep = slice(self.width - max(lengths), None)
        return TokenBatch(
            *(t[start:stop, keep] for t in self.tensors()),
            lengths=lengths,
            images=self.images[start:stop],
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.attention_mask, self.generated, self.behaviour_logprobs, self.versions)

    @staticmethod
    def targets(values: torch.Tensor) -> torch.Tensor:
        """[B, T] aligned with the tokens -> [B, T - 1] aligned with the predicted tokens."""
        return values[:, 1:]
