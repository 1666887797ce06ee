"""The embedded engine: rollouts and scoring with the training model itself, in this process.

On a CPU machine (and in tests) there is no faster K3 server, and sampling from the very module the
trainer optimises guarantees the numbers match training: the same forward runs, so QAT fake
quantisation (hooks on the routed experts) is active exactly when training has it on. It is the
reference the vLLM backends are checked against.

Decoding is batched over rows of different lengths with LEFT padding plus an attention mask; the
model's cache (KimiK3Cache: KDA recurrent + conv state, MLA latent KV) is extended one token per
step and finished rows are dropped with `batch_select_indices`. Each sampled token's randomness
comes from its own generator seeded by (seed, uid, position), so batch composition, pausing and
resuming never change which token a row draws. Any causal LM with that cache protocol works
(tests also run a transformers Llama through it for the cross-backend comparison with vLLM).

Cache reuse (K3 only): an agent episode calls generate once per turn and a partial rollout resumes
where it paused, each time with every earlier token unchanged. Re-prefilling the whole trajectory
each call costs O(turns^2) tokens, so the engine keeps each sample's one-row cache when it leaves
decoding (keyed by uid, least recently used dropped past `max_cached_samples`) and the next call
prefills only the tokens appended since. A kept cache is used only when the sample's tokens extend
exactly the tokens it consumed and it was computed under the same policy (policy_version, the
parameters' and buffers' in-place version counters, the recorded QAT config); otherwise the row
is prefilled in full. Tokens and the random stream are unchanged by reuse; log-probs differ from a
full prefill only by float rounding (the KDA state is built chunk by chunk instead of in one pass).
Rows continuing a kept cache are never padded (left padding between cached and new tokens would
feed zeros, not the cached inputs, to KDA's short convolution): rows of equal suffix length share
a forward (`suffix_prefill_plan`), then all rows decode as one batch.

Images (a KimiK3ForConditionalGeneration): a row prefilled from its first token passes its
`Sample.images` to the forward, which merges their visual tokens at the `<|media_pad|>` runs; a kept
cache holds them as it holds every other consumed token, so a later turn prefills only its new
text. A row whose new tokens hold media of their own is prefilled in full with all its images.
The policy never writes `<|media_pad|>`: it is left out of the draw (a turn of it would be a media
run without a media item); the recorded raw log-probs are the model's own, and the distribution
sampled from differs from it only by that one token's probability mass.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.data.batch import left_pad, positions_from_mask
from posttrain.data.sample import Sample
from posttrain.engines.base import (
    ENGINES,
    Engine,
    PauseWhen,
    SamplingConfig,
    WeightsSource,
    check_prompt,
    tokens_already_generated,
)
from posttrain.engines.cuda_graph_decode import CudaGraphK3Decoder, autocast_to
from posttrain.engines.sampling import draw_tokens, gumbel_noise, stream_key, without_token
from posttrain.model import KimiK3ForCausalLM
from posttrain.model.cache import KimiK3Cache
from posttrain.model.vision_model import load_pretrained, media_inputs
from posttrain.qat.apply import QAT_CONFIG_KEY


def cache_row(cache: KimiK3Cache, row: int, config: object) -> KimiK3Cache:
    """A one-row copy of `row` of a batched cache with its padding positions left out.

    Copies rather than views, so a kept row does not hold the whole batch's tensors alive.
    """
    real = cache.key_mask[row].nonzero().squeeze(1)
    out = KimiK3Cache(config)
    for source, target in (
        (cache.conv_states, out.conv_states),
        (cache.recurrent_states, out.recurrent_states),
    ):
        for layer, state in enumerate(source):
            if state is not None:
                target[layer] = state[row : row + 1].clone()
    for source, target in ((cache.latents, out.latents), (cache.key_shared, out.key_shared)):
        for layer, state in enumerate(source):
            if state is not None:
                target[layer] = state[row : row + 1].index_select(1, real.to(state.device))
    out.key_mask = torch.ones(1, real.numel(), dtype=torch.long, device=cache.key_mask.device)
    return out


def stack_caches(caches: list[KimiK3Cache], config: object) -> KimiK3Cache:
    """Rows of several caches as one batch; MLA positions are LEFT padded to the longest (key_mask 0
    marks the padding). KDA states have no length and are concatenated as they are."""
    width = max(cache.get_seq_length() for cache in caches)
    out = KimiK3Cache(config)

    def left_padded(tensor: torch.Tensor, length: int) -> torch.Tensor:
        # [b, S, ...] -> [b, width, ...]: F.pad's pairs run from the last dim backwards
        return F.pad(tensor, (0, 0) * (tensor.dim() - 2) + (width - length, 0))

    for layer in range(out.num_layers):
        for name in ("conv_states", "recurrent_states"):
            states = [getattr(cache, name)[layer] for cache in caches]
            if states[0] is not None:
                getattr(out, name)[layer] = torch.cat(states)
        for name in ("latents", "key_shared"):
            states = [getattr(cache, name)[layer] for cache in caches]
            if states[0] is not None:
                getattr(out, name)[layer] = torch.cat(
                    [left_padded(state, c.get_seq_length()) for state, c in zip(states, caches, strict=True)]
                )
    out.key_mask = torch.cat([left_padded(cache.key_mask, cache.get_seq_length()) for cache in caches])
    return out


def suffix_prefill_plan(lengths: list[int]) -> list[tuple[int, list[int]]]:
    """Forwards that feed row r exactly its next lengths[r] tokens, in order: (width, rows), every
    row of a forward taking `width` tokens, so none is padded.

    Padding between a row's cached and new tokens would feed zeros, not the cached inputs, to KDA's
    short convolution, hence the equal widths. Of two plans the one with fewer forwards: one per
    distinct length, or one per binary digit (rows whose length has that digit set), which needs
    at most bit_length(max length) forwards however varied the lengths.
    """
    by_length = [(n, [r for r, m in enumerate(lengths) if m == n]) for n in sorted(set(lengths))]
    digits = max(lengths, default=0).bit_length()
    by_digit = [(1 << d, [r for r, m in enumerate(lengths) if m >> d & 1]) for d in reversed(range(digits))]
    by_digit = [(width, rows) for width, rows in by_digit if rows]
    return by_length if len(by_length) <= len(by_digit) else by_digit


@dataclass
class KeptCache:
    """One sample's cache between generate calls."""

    tokens: list[int]  # the tokens the cache has consumed: all of the sample's but the last sampled
    policy: Hashable  # the policy it was computed under (EmbeddedEngine._policy_key)
    cache: KimiK3Cache  # one row, no padding


@dataclass
class CacheReuseStats:
    """How generate prefilled its rows since the engine was built (what the cache saved)."""

    reused: int = 0  # rows that continued a kept cache
    prefilled: int = 0  # rows prefilled from their first token
    stale: int = 0  # kept caches dropped: other weights, or the sample's tokens no longer extend them
    evicted: int = 0  # kept caches dropped by the max_cached_samples cap
    prefill_tokens: int = 0  # tokens run through prefill forwards (padding not counted)


@ENGINES.register("embedded")
class EmbeddedEngine(Engine):
    """Generate and score with an in-process causal LM (our KimiK3ForCausalLM by default).

    EmbeddedEngine(model, *, max_batch_size=64, pad_token_id=None, max_cached_samples=256,
                   decode="auto", autocast_dtype=None, sync_every=16)
      model: the module to sample from (shared with the trainer when in the same process).
      pad_token_id: id used for left padding (masked out; default config.pad_token_id or 0).
      max_cached_samples: samples whose cache is kept between generate calls (least recently
        used dropped first); 0 turns reuse off. Only a KimiK3Cache is kept. Memory per sample:
        every KDA layer's fp32 state and conv window plus every MLA layer's latent and shared key
        per token (docs/engines.md gives the arithmetic).
      decode: "dynamic" grows the cache per token and drops finished rows (any causal LM);
        "static" decodes a K3 from pre-allocated caches (CudaGraphK3Decoder), its step run
        eagerly; "graph" the same with the step captured as a CUDA graph (CUDA only); "auto" is
        "graph" for a K3 on a CUDA sm90+ GPU in bf16 (weights or autocast_dtype), "dynamic"
        otherwise. All draw the same tokens for the same seed up to float rounding.
      autocast_dtype: run every forward under torch.autocast with this dtype (bf16 on a GPU,
        what the trainer's forward runs under with accelerate's mixed_precision bf16); None: the
        parameters' dtype.
      sync_every: static decoding reads the rows back (finished rows, pause_when) every this
        many tokens; the dynamic loop checks after every token.
    `cache_stats` counts reused and fully prefilled rows, stale and evicted caches, prefill tokens.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_batch_size: int = 64,
        pad_token_id: int | None = None,
        max_cached_samples: int = 256,
        decode: Literal["auto", "dynamic", "static", "graph"] = "auto",
        autocast_dtype: torch.dtype | None = None,
        sync_every: int = 16,
    ) -> None:
        if max_cached_samples < 0:
            raise ValueError(f"max_cached_samples must be >= 0 (0 = no reuse), got {max_cached_samples}")
        if decode not in ("auto", "dynamic", "static", "graph"):
            raise ValueError(f"decode must be 'auto', 'dynamic', 'static' or 'graph', got {decode!r}")
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        # a multimodal model decodes with its text model (the images are all in the prefill)
        text_model = getattr(model, "language_model", model)
        if decode in ("static", "graph") and not isinstance(text_model, KimiK3ForCausalLM):
            raise ValueError(f"decode {decode!r} needs a K3 (KimiK3ForCausalLM), got {type(model).__name__}")
        self.decode, self.autocast_dtype, self.sync_every = decode, autocast_dtype, sync_every
        self._text_model = text_model
        self._decoders: OrderedDict[Hashable, CudaGraphK3Decoder] = OrderedDict()
        self.model = model
        self.max_batch_size = max_batch_size
        config_pad = getattr(getattr(model, "config", None), "pad_token_id", None)
        self.pad_token_id = pad_token_id if pad_token_id is not None else (config_pad or 0)
        self.policy_version = 0
        self.max_cached_samples = max_cached_samples
        self.cache_stats = CacheReuseStats()
        self._kept: OrderedDict[str, KeptCache] = OrderedDict()
        config = getattr(model, "config", None)
        # a multimodal model's cache is its text model's
        self._cache_config = getattr(config, "text_config", config)
        vision = isinstance(getattr(model, "vision_tower", None), nn.Module)
        self._media_pad: int | None = config.media_placeholder_token_id if vision else None

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: object) -> EmbeddedEngine:
        """Load a checkpoint directory (K3, multimodal K3 or any transformers causal LM) in float32."""
        return cls(load_pretrained(path), **kwargs)

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, cache: object | None, media: Sequence[Sample] = ()
    ) -> tuple[torch.Tensor, object]:
        """Run the model on new tokens `ids` [B, t] with the mask of all positions; (the last
        position's logits [B, V] in float32 on the host, cache). media: the rows' samples when `ids`
        are their whole tokens (their images are merged)."""
        positions = positions_from_mask(mask)[:, -ids.shape[1] :]
        device = self._device
        with self._autocast():
            out = self.model(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                position_ids=positions.to(device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,  # only the last position is sampled from
                **media_inputs(self.model, [sample.images for sample in media]),
            )
        return out.logits[:, -1].float().cpu(), out.past_key_values

    def _autocast(self) -> contextlib.AbstractContextManager:
        return autocast_to(self._device, self.autocast_dtype)

    # -- cache reuse --------------------------------------------------------------------------
    def _policy_key(self) -> Hashable:
        """What a kept cache must have been computed under: the policy version, every parameter's
        and buffer's in-place version counter (a trainer sharing the module steps the optimizer
        without calling update_weights) and the QAT config apply_qat records."""
        counters = tuple(t._version for t in (*self.model.parameters(), *self.model.buffers()))
        qat = repr(getattr(getattr(self.model, "config", None), QAT_CONFIG_KEY, None))
        return self.policy_version, counters, qat

    def _take_kept(self, sample: Sample, policy: Hashable) -> KeptCache | None:
        """The sample's kept cache when it is valid for its tokens now (removed from the store:
        the caller extends it); None means a full prefill."""
        kept = self._kept.pop(sample.uid, None)
        if kept is None:
            return None
        n = len(kept.tokens)
        new_media = self._media_pad is not None and self._media_pad in sample.tokens[n:]
        if kept.policy != policy or len(sample.tokens) <= n or sample.tokens[:n] != kept.tokens or new_media:
            self.cache_stats.stale += 1
            return None
        return kept

    def _keep(self, sample: Sample, cache: object, row: int, policy: Hashable) -> None:
        """Store row `row` of `cache` for the sample; it has consumed all tokens but the last."""
        if self.max_cached_samples == 0 or not isinstance(cache, KimiK3Cache):
            return
        self._kept[sample.uid] = KeptCache(
            sample.tokens[:-1], policy, cache_row(cache, row, self._cache_config)
        )
        self._kept.move_to_end(sample.uid)
        while len(self._kept) > self.max_cached_samples:
            self._kept.popitem(last=False)
            self.cache_stats.evicted += 1

    def clear_cache(self) -> None:
        """Drop every kept cache (the next call prefills each sample in full)."""
        self._kept.clear()

    def close(self) -> None:
        self.clear_cache()
        self._decoders.clear()

    def _prefill(
        self, batch: list[Sample], policy: Hashable
    ) -> tuple[list[Sample], torch.Tensor, object, torch.Tensor]:
        """Run the tokens of `batch` the model has not seen; returns (rows, last logits [B, V],
        cache, mask [B, S] of every cached position), rows reordered as they were prefilled.

        Rows without a valid kept cache are prefilled together from their first token (LEFT
        padded). Rows continuing a kept cache feed their new tokens in the forwards of
        `suffix_prefill_plan`, which never pads; then every row's cache joins one decoding batch.
        """
        fresh: list[Sample] = []
        continuing: list[Sample] = []
        caches: list[KimiK3Cache] = []  # each continuing row's one-row cache, as far as it is fed
        suffixes: list[list[int]] = []  # each continuing row's tokens the cache has not consumed
        for sample in batch:
            kept = self._take_kept(sample, policy)
            if kept is None:
                fresh.append(sample)
            else:
                continuing.append(sample)
                caches.append(kept.cache)
                suffixes.append(sample.tokens[len(kept.tokens) :])
        stats = self.cache_stats
        # (rows, cache of those rows, their last logits [rows, V]) in prefill order
        blocks: list[tuple[list[Sample], object, torch.Tensor]] = []
        if fresh:
            ids, fresh_mask = left_pad([sample.tokens for sample in fresh], self.pad_token_id)
            out, cache = self._forward(ids, fresh_mask, None, fresh)
            blocks.append((fresh, cache, out))
            stats.prefilled += len(fresh)
            stats.prefill_tokens += int(fresh_mask.sum())
        stats.reused += len(continuing)
        fed = [0] * len(continuing)
        for width, members in suffix_prefill_plan([len(suffix) for suffix in suffixes]):
            cache = stack_caches([caches[i] for i in members], self._cache_config)
            ids = torch.tensor([suffixes[i][fed[i] : fed[i] + width] for i in members], dtype=torch.long)
            mask = torch.cat([cache.key_mask.cpu(), torch.ones_like(ids)], dim=1)
            out, cache = self._forward(ids, mask, cache)
            stats.prefill_tokens += ids.numel()
            for i in members:
                fed[i] += width
            done = [fed[i] == len(suffixes[i]) for i in members]
            if all(done):
                blocks.append(([continuing[i] for i in members], cache, out))
                continue
            for row, i in enumerate(members):
                caches[i] = cache_row(cache, row, self._cache_config)
                if done[row]:
                    blocks.append(([continuing[i]], caches[i], out[row : row + 1]))
        rows = [sample for block_rows, _, _ in blocks for sample in block_rows]
        logits = torch.cat([block_logits for _, _, block_logits in blocks])
        if not continuing:  # the one path for models without a KimiK3Cache
            return rows, logits, blocks[0][1], fresh_mask
        if len(blocks) == 1:
            cache = blocks[0][1]
        else:
            cache = stack_caches([block_cache for _, block_cache, _ in blocks], self._cache_config)
        return rows, logits, cache, cache.key_mask.cpu()

    # -- generate ---------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self, samples: list[Sample], sampling: SamplingConfig, pause_when: PauseWhen | None = None
    ) -> list[Sample]:
        budgets = {}
        for sample in samples:
            check_prompt(sample)
            budgets[id(sample)] = sampling.max_tokens - tokens_already_generated(sample)
            sample.finish_reason = None
        todo = []
        for sample in samples:
            if budgets[id(sample)] <= 0:
                sample.finish_reason = "length"
            else:
                todo.append(sample)
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(todo), self.max_batch_size):
                batch = todo[start : start + self.max_batch_size]
                if pause_when is not None and pause_when(samples):
                    for sample in todo[start:]:
                        sample.finish_reason = "paused"
                    break
                if self._generate_batch(batch, budgets, sampling, pause_when, samples):
                    for sample in todo[start + len(batch) :]:
                        sample.finish_reason = "paused"
                    break
        finally:
            self.model.train(was_training)
        return samples

    def _generate_batch(
        self,
        batch: list[Sample],
        budgets: dict[int, int],
        sampling: SamplingConfig,
        pause_when: PauseWhen | None,
        samples: list[Sample],
    ) -> bool:
        """Decode `batch` until every row finishes; True when pause_when stopped it. Each row's
        cache is kept as the row leaves decoding (finished or paused)."""
        policy = self._policy_key()
        rows, logits, cache, mask = self._prefill(batch, policy)
        if self._static(cache):
            return self._decode_static(rows, logits, cache, budgets, sampling, pause_when, samples, policy)
        while True:
            noise = None
            if sampling.temperature > 0:
                streams = torch.tensor([stream_key(sampling.seed, s.uid) for s in rows], dtype=torch.long)
                positions = torch.tensor([len(s.tokens) for s in rows], dtype=torch.long)
                noise = gumbel_noise(streams, positions, logits.shape[-1])
            tokens, logprobs = self._draw(logits, sampling, noise)
            keep = []
            for row, sample in enumerate(rows):
                token = int(tokens[row])
                sample.append(
                    [token], generated=True, logprobs=[float(logprobs[row])], version=self.policy_version
                )
                budgets[id(sample)] -= 1
                reason = sampling.finish_reason_for(token)
                if reason is None and budgets[id(sample)] <= 0:
                    reason = "length"
                if reason is None:
                    keep.append(row)
                else:
                    sample.finish_reason = reason
                    self._keep(sample, cache, row, policy)
            if not keep:
                return False
            if pause_when is not None and pause_when(samples):
                for row in keep:
                    rows[row].finish_reason = "paused"
                    self._keep(rows[row], cache, row, policy)
                return True
            if len(keep) < len(rows):
                index = torch.tensor(keep, dtype=torch.long)
                cache.batch_select_indices(index.to(self._device))
                mask = mask.index_select(0, index)
                tokens = tokens.index_select(0, index)
                rows = [rows[row] for row in keep]
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long)], dim=1)
            logits, cache = self._forward(tokens[:, None], mask, cache)

    def _draw(
        self, logits: torch.Tensor, sampling: SamplingConfig, noise: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draw, with `<|media_pad|>` out of it for a multimodal model."""
        return draw_tokens(logits, without_token(logits, self._media_pad), sampling, noise)

    # -- static decoding ----------------------------------------------------------------------
    def _static(self, cache: object) -> bool:
        if self.decode == "dynamic" or not isinstance(cache, KimiK3Cache):
            return False
        return self.decode != "auto" or self._graph()

    def _graph(self) -> bool:
        """Whether static decoding captures its step ("graph", or "auto" for a K3 on CUDA)."""
        if self.decode == "auto":
            # capturable only with the routed experts as bf16 grouped GEMMs (sm90+; the per-expert
            # path reads the expert counts on the host)
            device = self._device
            bf16 = torch.bfloat16 in (self.autocast_dtype, next(self.model.parameters()).dtype)
            return (
                device.type == "cuda"
                and isinstance(self._text_model, KimiK3ForCausalLM)
                and bf16
                and torch.cuda.get_device_capability(device)[0] >= 9
            )
        if self.decode == "graph" and self._device.type != "cuda":
            raise ValueError(f"decode 'graph' captures CUDA graphs; the model is on {self._device}")
        return self.decode == "graph"

    def _decoder(self, rows: int, length: int, sampling: SamplingConfig) -> CudaGraphK3Decoder:
        """A decoder for `rows` rows of `length` positions, built once per (power-of-two batch and
        length, sampling shape) and kept (the two most recently used): building captures a graph."""
        batch = min(1 << (rows - 1).bit_length(), max(self.max_batch_size, rows))
        max_len = max(256, 1 << length.bit_length())
        shape = (
            sampling.temperature,
            sampling.top_k,
            sampling.top_p,
            sampling.logprobs,
            sampling.stop_token_ids,
            sampling.tool_call_token_ids,
        )
        qat = repr(getattr(getattr(self.model, "config", None), QAT_CONFIG_KEY, None))
        key = (batch, max_len, shape, qat)
        if key not in self._decoders:
            while len(self._decoders) >= 2:
                self._decoders.popitem(last=False)
            self._decoders[key] = CudaGraphK3Decoder(
                self._text_model,
                batch,
                max_len,
                sampling,
                pad_token_id=self.pad_token_id,
                banned_token_id=self._media_pad,
                autocast_dtype=self.autocast_dtype,
                graph=self._graph(),
            )
        self._decoders.move_to_end(key)
        return self._decoders[key]

    def _decode_static(
        self,
        rows: list[Sample],
        logits: torch.Tensor,
        cache: KimiK3Cache,
        budgets: dict[int, int],
        sampling: SamplingConfig,
        pause_when: PauseWhen | None,
        samples: list[Sample],
        policy: Hashable,
    ) -> bool:
        """_generate_batch's decode from pre-allocated caches: the rows are read back every
        `sync_every` tokens (their tokens appended, finished rows' caches kept), then pause_when
        is asked."""
        row_budgets = [budgets[id(sample)] for sample in rows]
        decoder = self._decoder(len(rows), cache.get_seq_length() + max(row_budgets) + 1, sampling)
        decoder.start(
            cache,
            logits,
            [stream_key(sampling.seed, sample.uid) for sample in rows],
            [len(sample.tokens) for sample in rows],
            row_budgets,
        )
        appended = [0] * len(rows)
        while True:
            tokens, logprobs, generated, reasons = decoder.read()
            view = None
            for row, sample in enumerate(rows):
                if generated[row] > appended[row]:
                    new = slice(appended[row], generated[row])
                    sample.append(
                        tokens[row, new].tolist(),
                        generated=True,
                        logprobs=logprobs[row, new].tolist(),
                        version=self.policy_version,
                    )
                    budgets[id(sample)] -= generated[row] - appended[row]
                    appended[row] = generated[row]
                    if reasons[row] is not None:
                        sample.finish_reason = reasons[row]
                        view = view or decoder.cache.as_cache()
                        self._keep(sample, view, row, policy)
            running = [row for row, reason in enumerate(reasons[: len(rows)]) if reason is None]
            if not running:
                return False
            if pause_when is not None and pause_when(samples):
                view = view or decoder.cache.as_cache()
                for row in running:
                    rows[row].finish_reason = "paused"
                    self._keep(rows[row], view, row, policy)
                return True
            decoder.run(self.sync_every)

    # -- score ------------------------------------------------------------------------------
    def score(self, samples: list[Sample]) -> list[list[float]]:
        scores: list[list[float]] = [[] for _ in samples]
        for i, logprobs in self._next_token_logprobs(samples):
            tokens = torch.tensor(samples[i].tokens[1:], device=logprobs.device)
            scores[i] = [0.0] + logprobs.gather(-1, tokens[:, None]).squeeze(-1).tolist()
        return scores

    def next_token_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Per sample, the full next-token log-distribution [len(tokens) - 1, vocab] (row t is
        log p(. | tokens[: t + 1])) on the host: what an exact KL needs where `score`'s log-prob
        of the actual token gives only a one-sample estimate. A backend-specific extra, not part
        of Engine."""
        out: list[torch.Tensor] = [torch.empty(0) for _ in samples]
        for i, logprobs in self._next_token_logprobs(samples):
            out[i] = logprobs.cpu()
        return out

    def _next_token_logprobs(self, samples: list[Sample]) -> Iterator[tuple[int, torch.Tensor]]:
        """(index, [n - 1, vocab] log-softmax on the model's device) per sample, one left-padded
        forward per batch of similar lengths, in eval mode (score picks its tokens there, so only
        those leave a GPU)."""
        for sample in samples:
            check_prompt(sample)
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].tokens))
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(order), self.max_batch_size):
                chunk = order[start : start + self.max_batch_size]
                ids, mask = left_pad([samples[i].tokens for i in chunk], self.pad_token_id)
                positions = positions_from_mask(mask)
                device = self._device
                with torch.no_grad(), self._autocast():
                    logits = self.model(
                        input_ids=ids.to(device),
                        attention_mask=mask.to(device),
                        position_ids=positions.to(device),
                        use_cache=False,
                        **media_inputs(self.model, [samples[i].images for i in chunk]),
                    ).logits
                logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
                for row, i in enumerate(chunk):
                    n = len(samples[i].tokens)
                    yield i, logprobs[row, ids.shape[1] - n :]
        finally:
            self.model.train(was_training)

    # -- weights ----------------------------------------------------------------------------
    def update_weights(self, weights: WeightsSource) -> None:
        """Load a state dict (this model's parameter names) or a checkpoint directory written by
        save_pretrained; bumps policy_version.

        A directory goes through the model class's own from_pretrained, so checkpoint-format
        conversions (K3 writes routed experts one by one, the module holds them batched) apply.
        Missing keys are allowed only for tied parameters (e.g. lm_head sharing the embedding);
        anything else missing or unexpected is an error naming the keys.
        """
        state = dict(weights) if isinstance(weights, Mapping) else self._read_checkpoint(Path(weights))
        result = self.model.load_state_dict(state, strict=False)
        self.clear_cache()  # even when the check below fails: some weights may have been replaced
        own = self.model.state_dict()
        loaded_storage = {own[name].data_ptr() for name in state if name in own}
        missing = [name for name in result.missing_keys if own[name].data_ptr() not in loaded_storage]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"update_weights: state dict does not match {type(self.model).__name__}: "
                f"missing {missing[:10]}, unexpected {result.unexpected_keys[:10]} (first 10 of each)"
            )
        self.policy_version += 1

    def _read_checkpoint(self, path: Path) -> dict[str, torch.Tensor]:
        if not path.is_dir() or not (path / "config.json").exists():
            raise FileNotFoundError(
                f"{path} is not a checkpoint directory (config.json + safetensors); pass a directory "
                "written by save_pretrained, or a state dict"
            )
        dtype = next(self.model.parameters()).dtype
        return type(self.model).from_pretrained(str(path), dtype=dtype).state_dict()
