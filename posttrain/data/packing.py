"""Packing rendered trajectories into fixed-length rows (SFT's batches).

Packed rows carry document boundaries as ``cu_seqlens`` (cumulative lengths, fla's varlen layout)
and positions that restart at 0 in each document, so the K3 model resets KDA state and keeps MLA
attention inside each document: a packed row trains exactly like its documents one by one, without
padding waste. Left-padded batches of trajectories (generation, RL and MOPD) are
posttrain.data.batch's.

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
