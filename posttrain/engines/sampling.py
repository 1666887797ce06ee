"""The embedded engine's draw: per-(seed, uid, position) Gumbel noise computed on the device, top-k /
top-p truncation and Gumbel-max sampling, shared by its dynamic loop and its captured decode step.

The noise is a counter-based hash (splitmix64 over the row's stream key, the token's position and
the vocabulary index), not a stateful generator: it needs no host round trip, so a CUDA graph can
draw it, and a token's draw depends only on (seed, uid, position), never on batch composition,
pausing, resuming or the device. One stream key per (seed, uid) comes from the host
(`stream_key`); the position enters on the device.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F

from posttrain.engines.base import SamplingConfig

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64's increment, as a signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def stream_key(seed: int, uid: str) -> int:
    """63-bit key of trajectory `uid`'s random stream under `seed` (hashing keeps the streams of
    different uids and seeds unrelated)."""
    digest = hashlib.blake2b(f"{seed}\x1f{uid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: mask the sign's copies off)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser over int64 (multiplication wraps modulo 2**64 as in C)."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def gumbel_noise(streams: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] Gumbel(0, 1) noise for rows with stream keys `streams` [B] drawing the token at
    `positions` [B] (int64, on the device the noise is wanted on)."""
    row = _mix64(streams ^ _mix64(positions * _GOLDEN + _GOLDEN))
    vocab = torch.arange(1, vocab_size + 1, dtype=torch.long, device=streams.device)
    bits = _mix64(row[:, None] + vocab[None, :] * _GOLDEN)
    # the top 53 bits as a uniform in (0, 1), in float64 so the tail of the Gumbel is not cut short
    uniform = (_shift_right(bits, 11).double() + 0.5) * 2.0**-53
    return (-torch.log(-torch.log(uniform))).float()


def truncate_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """[B, V] logits with tokens outside top-k / the top-p nucleus set to -inf.

    The nucleus keeps the smallest set of most likely tokens whose probability reaches top_p
    (the most likely token always stays).
    """
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingConfig, noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of `logits` [B, V] (float32). Returns (tokens [B], logprobs [B]).

    Gumbel-max over the processed log-probs is an exact draw from the processed distribution and
    turns the per-row noise into the token deterministically. Log-probs are "raw" (temperature 1,
    untruncated) or "processed" per `sampling.logprobs`; greedy (temperature 0, no noise needed)
    records the model's log-prob in both modes, as vLLM does.
    """
    raw = torch.log_softmax(logits, dim=-1)
    if sampling.temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, raw.gather(-1, tokens[:, None]).squeeze(-1)
    processed_all = torch.log_softmax(
        truncate_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p), dim=-1
    )
    assert noise is not None
    tokens = (processed_all + noise).argmax(dim=-1)
    chosen_processed = processed_all.gather(-1, tokens[:, None]).squeeze(-1)
    chosen_raw = raw.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, chosen_raw if sampling.logprobs == "raw" else chosen_processed


def without_token(logits: torch.Tensor, token_id: int | None) -> torch.Tensor:
    """`logits` with `token_id`'s column at -inf (a copy), or `logits` itself when there is none:
    the `allowed` argument of draw_tokens for a policy that may not write that token."""
    if token_id is None:
        return logits
    banned = logits.clone()
    banned[:, token_id] = float("-inf")
    return banned


def draw_tokens(
    logits: torch.Tensor, allowed: torch.Tensor, sampling: SamplingConfig, noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """sample_tokens from `allowed` (the logits with tokens the policy may not write at -inf, or
    `logits` itself); raw and greedy log-probs stay the model's own (`logits`), what the trainer's
    forward recomputes."""
    tokens, logprobs = sample_tokens(allowed, sampling, noise)
    if allowed is not logits and (sampling.logprobs == "raw" or sampling.temperature == 0):
        logprobs = F.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs
