"""Packing rendered trajectories into fixed-length rows, and padded batches.

Packed rows carry document boundaries as ``cu_seqlens`` (cumulative lengths, fla's varlen layout)
and positions that restart at 0 in each document, so the K3 model resets KDA state and keeps MLA
attention inside each document: a packed row trains exactly like its documents one by one, without
padding waste. Padded batches serve generation (left padding, prompts end aligned) and training
without packing (right padding).

Label convention is Hugging Face's: ``labels`` align with ``input_ids`` and the model shifts them;
-100 marks tokens that are not targets (loss mask 0, padding, and each document's first token, which
no earlier token of the same document predicts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass
class PackedRow:
    """One packed row; documents first, then padding as a final pseudo-document.

    input_ids, labels, position_ids: LongTensor [1, L]; loss_mask: LongTensor [1, L] (1 = trained);
    cu_seqlens: LongTensor [N+1], 0 ... L, covering padding too; num_documents: real documents
    (the first num_documents segments of cu_seqlens); document_indices: which input each one was.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    num_documents: int
    document_indices: list[int]


def pack_documents(
    documents: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int
) -> list[PackedRow]:
    """Pack (ids, loss_mask) documents into rows of exactly `seq_len` tokens, first fit in input order
    (deterministic: the same documents give the same rows). A document longer than `seq_len` is an
    error; filter with `max_length` when loading."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index, (ids, mask) in enumerate(documents):
        if len(ids) != len(mask):
            raise ValueError(f"document {index}: {len(ids)} ids but {len(mask)} loss-mask entries")
        if not ids:
            raise ValueError(f"document {index} is empty")
        if len(ids) > seq_len:
            raise ValueError(
                f"document {index} has {len(ids)} tokens > seq_len {seq_len}; raise seq_len or load with "
                f"max_length <= {seq_len} so it is skipped as too_long"
            )
        target = next((b for b, free in enumerate(room) if free >= len(ids)), None)
        if target is None:
            bins.append([])
            room.append(seq_len)
            target = len(bins) - 1
        bins[target].append(index)
        room[target] -= len(ids)
    return [_pack_row([documents[i] for i in members], members, seq_len, pad_id) for members in bins]


def _pack_row(
    documents: list[tuple[list[int], list[int]]], members: list[int], seq_len: int, pad_id: int
) -> PackedRow:
    ids: list[int] = []
    labels: list[int] = []
    mask: list[int] = []
    positions: list[int] = []
    boundaries = [0]
    for doc_ids, doc_mask in documents:
        ids += doc_ids
        mask += doc_mask
        labels += [IGNORE_INDEX] + [
            t if m else IGNORE_INDEX for t, m in zip(doc_ids[1:], doc_mask[1:], strict=True)
        ]
        positions += range(len(doc_ids))
        boundaries.append(len(ids))
    padding = seq_len - len(ids)
    if padding:
        ids += [pad_id] * padding
        labels += [IGNORE_INDEX] * padding
        mask += [0] * padding
        positions += range(padding)
        boundaries.append(seq_len)
    mask = [m if label != IGNORE_INDEX else 0 for m, label in zip(mask, labels, strict=True)]
    return PackedRow(
        input_ids=torch.tensor([ids], dtype=torch.long),
        labels=torch.tensor([labels], dtype=torch.long),
        loss_mask=torch.tensor([mask], dtype=torch.long),
        position_ids=torch.tensor([positions], dtype=torch.long),
        cu_seqlens=torch.tensor(boundaries, dtype=torch.long),
        num_documents=len(documents),
        document_indices=list(members),
    )


def pad_batch(
    sequences: list[list[int]],
    pad_id: int,
    side: str = "right",
    loss_masks: list[list[int]] | None = None,
    pad_to_multiple_of: int = 1,
) -> dict[str, torch.Tensor]:
    """Pad to one length. Returns input_ids and attention_mask [B, T] (1 on real tokens) and
    position_ids [B, T] counting real tokens only (0 on padding); with `loss_masks`, also labels
    (-100 on padding and untrained tokens). side="left" for generation, "right" for training."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    if not sequences:
        raise ValueError("pad_batch needs at least one sequence")
    if loss_masks is not None and [len(m) for m in loss_masks] != [len(s) for s in sequences]:
        raise ValueError("every loss mask must have its sequence's length")
    longest = max(len(s) for s in sequences)
    length = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    rows = {"input_ids": [], "attention_mask": [], "position_ids": [], "labels": []}
    for index, ids in enumerate(sequences):
        gap = length - len(ids)
        labels = [IGNORE_INDEX] * len(ids)
        if loss_masks is not None:
            labels = [t if m else IGNORE_INDEX for t, m in zip(ids, loss_masks[index], strict=True)]
        real = {"input_ids": ids, "attention_mask": [1] * len(ids), "position_ids": list(range(len(ids)))}
        real["labels"] = labels
        fill = {"input_ids": pad_id, "attention_mask": 0, "position_ids": 0, "labels": IGNORE_INDEX}
        for key, values in real.items():
            rows[key].append([fill[key]] * gap + values if side == "left" else values + [fill[key]] * gap)
    batch = {key: torch.tensor(value, dtype=torch.long) for key, value in rows.items()}
    if loss_masks is None:
        del batch["labels"]
    return batch
