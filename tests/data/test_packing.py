"""Packing and padding: row arithmetic (boundaries, position resets, labels), and the K3 model giving
the same per-document loss on a packed row as on each document alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain.data.packing import IGNORE_INDEX, pack_documents
from posttrain.engines.testing import tiny_k3


def _doc(start: int, length: int, trained_from: int) -> tuple[list[int], list[int]]:
    ids = list(range(start, start + length))
    return ids, [0] * trained_from + [1] * (length - trained_from)


def test_first_fit_rows_boundaries_positions_and_labels():
    docs = [_doc(100, 5, 2), _doc(200, 3, 1), _doc(300, 7, 3), _doc(400, 2, 1)]
    rows = pack_documents(docs, seq_len=10, pad_id=0)
    assert [row.document_indices for row in rows] == [[0, 1, 3], [2]]

    full, padded = rows
    assert full.input_ids.tolist() == [[100, 101, 102, 103, 104, 200, 201, 202, 400, 401]]
    assert full.cu_seqlens.tolist() == [0, 5, 8, 10] and full.num_documents == 3
    assert full.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1]]
    no = IGNORE_INDEX
    assert full.labels.tolist() == [[no, no, 102, 103, 104, no, 201, 202, no, 401]]
    assert full.loss_mask.tolist() == [[0, 0, 1, 1, 1, 0, 1, 1, 0, 1]]

    assert padded.input_ids.tolist() == [[300, 301, 302, 303, 304, 305, 306, 0, 0, 0]]
    assert padded.cu_seqlens.tolist() == [0, 7, 10] and padded.num_documents == 1
    assert padded.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 0, 1, 2]]
    assert padded.labels.tolist() == [[no, no, no, 303, 304, 305, 306, no, no, no]]
    for row in rows:
        assert row.input_ids.shape == row.labels.shape == row.position_ids.shape == (1, 10)
        assert row.cu_seqlens.dtype == torch.long


def test_a_document_trained_from_its_first_token_is_not_a_target_there():
    (row,) = pack_documents([_doc(7, 3, 0), _doc(9, 2, 0)], seq_len=5, pad_id=0)
    assert row.labels.tolist() == [[IGNORE_INDEX, 8, 9, IGNORE_INDEX, 10]]
    assert row.loss_mask.tolist() == [[0, 1, 1, 0, 1]]


def test_packing_errors_say_what_to_change():
    with pytest.raises(ValueError, match="document 1 has 12 tokens > seq_len 10; .*max_length <= 10"):
        pack_documents([_doc(0, 3, 1), _doc(0, 12, 1)], seq_len=10, pad_id=0)
    with pytest.raises(ValueError, match="document 0: 3 ids but 2 loss-mask entries"):
        pack_documents([([1, 2, 3], [0, 1])], seq_len=10, pad_id=0)


def _document_losses(logits: torch.Tensor, labels: torch.Tensor, bounds: list[int]) -> list[torch.Tensor]:
    """Summed next-token cross entropy of each document [start, end) of one row."""
    losses = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        losses.append(
            F.cross_entropy(
                logits[0, start : end - 1],
                labels[0, start + 1 : end],
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
        )
    return losses


def test_packed_and_unpacked_forward_give_the_same_document_losses(renderer, shipped):
    model = tiny_k3(0).eval()
    documents = [renderer.render(r["messages"], r["tools"], r["effort"]) for r in shipped[::80]]
    (row,) = pack_documents(
        documents, seq_len=sum(len(ids) for ids, _ in documents) + 9, pad_id=renderer.pad_id
    )
    assert row.num_documents == len(documents) >= 4
    with torch.no_grad():
        packed = model(input_ids=row.input_ids, cu_seqlens=row.cu_seqlens, labels=row.labels)
        packed_losses = _document_losses(packed.logits, row.labels, row.cu_seqlens.tolist())
        for (ids, mask), packed_loss in zip(documents, packed_losses, strict=False):
            labels = torch.tensor([[t if m else IGNORE_INDEX for t, m in zip(ids, mask, strict=True)]])
            logits = model(input_ids=torch.tensor([ids])).logits
            (alone_loss,) = _document_losses(logits, labels, [0, len(ids)])
            torch.testing.assert_close(packed_loss, alone_loss, rtol=1e-4, atol=1e-4)
    targets = (row.labels[0, 1:] != IGNORE_INDEX).sum()
    torch.testing.assert_close(packed.loss, torch.stack(packed_losses).sum() / targets, rtol=1e-5, atol=1e-5)
