"""K3 decoding from pre-allocated caches with one decode step captured as a CUDA graph: the embedded
engine's decode loop on a GPU.

transformers' generate with `KimiK3Cache` (and the engine's own dynamic loop) grows the MLA latent
cache by concatenation, builds the attention mask from host-side lengths, drops finished rows and
reads every sampled token back to the host, launching every kernel of every layer from Python for
each token: at batch 32 a K3 decode step is launch-bound. Here every cache is a fixed buffer
allocated once for (batch, max_len): KDA's conv and recurrent state, MLA's latent and shared key
part over max_len positions, the key padding mask, and the next write position as a device scalar.
A decode step feeds each row its last token, runs the layers (KDA's recurrent step, MLA over all
max_len positions with the positions not yet written masked out), draws the next token, records it
with its log-prob and advances, all on the device, so it has no host sync and is captured once and
replayed per token (`graph=True`, CUDA only). With `graph=False` the same step runs eagerly (the
CPU tests use that).

Rows finish on the device: a stop or tool-call id, or the row's budget, marks it inactive. An
inactive row's KDA states are frozen (the cache's slots keep the old value for it) and its new MLA
positions are masked, so when the host reads it back it holds exactly the tokens it consumed, all
of the row's tokens but its last sampled one: the cache the engine keeps for the next turn. The
draw is `posttrain.engines.sampling`'s, the one every embedded path uses, so tokens equal the
dynamic loop's for the same (seed, uid, position) up to float rounding.

The routed experts must run their grouped-GEMM path to be capturable (bf16 on sm90+, by autocast
or bf16 weights: the per-expert path reads the expert counts on the host). Tests:
tests/engines/test_cuda_graph_decode.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from posttrain.engines.base import SamplingConfig
from posttrain.engines.sampling import draw_tokens, gumbel_noise, without_token
from posttrain.model import KimiK3ForCausalLM
from posttrain.model.cache import KimiK3Cache
from posttrain.model.modeling_kimi_k3 import ForwardContext

# the device's finish codes, in `FINISH_REASONS` order after 0 (still running)
FINISH_REASONS = (None, "stop", "tool_call", "length")


def autocast_to(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """torch.autocast to `dtype` on `device` (a no-op for None), with uncached casts: a cached cast
    would be captured once and replayed stale after the weights change in place; uncached, every
    forward (and every graph replay) casts from the weights' current values."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False)


class _Slots(list):
    """One fixed buffer per layer: assigning a new value copies it in for the active rows only, so a
    captured graph keeps reading and writing the same memory (what the layers do with
    KimiK3Cache's lists) and a finished row's state stays what it was when it finished."""

    def __init__(self, buffers: list[torch.Tensor | None], active: torch.Tensor) -> None:
        super().__init__(buffers)
        self.active = active

    def __setitem__(self, index, value) -> None:
        buf = super().__getitem__(index)
        keep = self.active.view(-1, *([1] * (buf.dim() - 1)))
        buf.copy_(torch.where(keep, value.to(buf.dtype), buf))


class StaticK3Cache:
    """The part of KimiK3Cache's interface the layers use, over buffers for `batch` rows and
    `max_len` positions. `pos` (a 0-d device long) is the position the next token is written to;
    `active` [batch] bool marks the rows still decoding."""

    def __init__(self, config, batch: int, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        lac = config.linear_attn_config
        H, K, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
        self.config = config
        self.active = torch.zeros(batch, dtype=torch.bool, device=device)
        conv, rec, lat, key = [], [], [], []
        for i in range(config.num_hidden_layers):
            kda = config.is_kda_layer(i)
            conv.append(torch.zeros(batch, 3 * H * K, W - 1, device=device, dtype=dtype) if kda else None)
            rec.append(torch.zeros(batch, H, K, K, device=device, dtype=torch.float32) if kda else None)
            lat.append(
                None if kda else torch.zeros(batch, max_len, config.kv_lora_rank, device=device, dtype=dtype)
            )
            key.append(
                None
                if kda
                else torch.zeros(batch, max_len, config.qk_rope_head_dim, device=device, dtype=dtype)
            )
        self.conv_states, self.recurrent_states = _Slots(conv, self.active), _Slots(rec, self.active)
        self.latents, self.key_shared = lat, key
        self.key_mask = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self.batch, self.max_len = batch, max_len

    def update_latent(
        self, layer_idx: int, latent: torch.Tensor, key_shared: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's latent [B, 1, R] and key part [B, 1, P] at `pos`; return all positions."""
        at = self.pos.view(1)
        self.latents[layer_idx].index_copy_(1, at, latent.to(self.latents[layer_idx].dtype))
        self.key_shared[layer_idx].index_copy_(1, at, key_shared.to(self.key_shared[layer_idx].dtype))
        return self.latents[layer_idx], self.key_shared[layer_idx]

    def load(self, cache: KimiK3Cache) -> None:
        """Copy a prefill's cache (n <= batch rows, S positions) into the first n rows, mark them
        active (the others inactive, all padding) and point `pos` after it."""
        n, S = cache.batch_size, cache.get_seq_length()
        if n > self.batch or S >= self.max_len:
            raise ValueError(
                f"StaticK3Cache: a prefill of {n} rows x {S} positions does not fit {self.batch} rows "
                f"x {self.max_len} positions (max_len must exceed prompt + new tokens)"
            )
        states = (self.conv_states, self.recurrent_states, self.latents, self.key_shared)
        for buf in [t for ts in states for t in ts if t is not None] + [self.key_mask]:
            buf.zero_()
        for i in range(len(self.latents)):
            if self.conv_states[i] is not None:
                list.__getitem__(self.conv_states, i)[:n].copy_(cache.conv_states[i])
                list.__getitem__(self.recurrent_states, i)[:n].copy_(cache.recurrent_states[i])
            else:
                self.latents[i][:n, :S].copy_(cache.latents[i])
                self.key_shared[i][:n, :S].copy_(cache.key_shared[i])
        self.key_mask[:n, :S].copy_(cache.key_mask)
        self.active.zero_()
        self.active[:n] = True
        self.pos.fill_(S)

    def as_cache(self) -> KimiK3Cache:
        """A KimiK3Cache over the buffers' first `pos` positions (views, no copy; a finished row's
        padding and the positions after it are key_mask 0), for `cache_row`."""
        S = int(self.pos)
        out = KimiK3Cache(self.config)
        out.conv_states = list(self.conv_states)
        out.recurrent_states = list(self.recurrent_states)
        out.latents = [None if t is None else t[:, :S] for t in self.latents]
        out.key_shared = [None if t is None else t[:, :S] for t in self.key_shared]
        out.key_mask = self.key_mask[:, :S]
        return out


class CudaGraphK3Decoder:
    """Decoding of up to `batch` rows under one SamplingConfig shape, reusable across calls.

    Build it once per (batch, max_len, sampling): it allocates the buffers and, with `graph=True`,
    warms the step up and captures it. Per batch of rows: `start` (a prefill's cache and last
    logits, each row's random stream, position and budget) draws every row's first token; `run(n)`
    takes n decode steps; `read` returns what the rows generated so far and which have finished.
    `sampling.seed` and `max_tokens` are not baked in (the stream keys and the budgets are per
    call); temperature, top-k, top-p, log-prob mode and the stop ids are.
    """

    def __init__(
        self,
        model: KimiK3ForCausalLM,
        batch: int,
        max_len: int,
        sampling: SamplingConfig,
        *,
        pad_token_id: int = 0,
        banned_token_id: int | None = None,
        autocast_dtype: torch.dtype | None = None,
        graph: bool = True,
    ) -> None:
        if model.training:
            raise ValueError("CudaGraphK3Decoder: put the model in eval mode (model.eval()) first")
        self.model = model
        param = next(model.parameters())
        device = param.device
        self.autocast_dtype = autocast_dtype
        self.cache = StaticK3Cache(model.config, batch, max_len, device, autocast_dtype or param.dtype)
        self.sampling = sampling
        self.pad_token_id = pad_token_id
        self.banned_token_id = banned_token_id
        self.stops = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=device)
        self.tool_calls = torch.tensor(sampling.tool_call_token_ids, dtype=torch.long, device=device)
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.tokens = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(batch, max_len, dtype=torch.float32, device=device)
        self.step_idx = torch.zeros((), dtype=torch.long, device=device)
        self.streams = torch.zeros(batch, dtype=torch.long, device=device)
        self.draw_positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.budgets = torch.zeros(batch, dtype=torch.long, device=device)
        self.generated = torch.zeros(batch, dtype=torch.long, device=device)
        self.reasons = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.arange(max_len, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        if graph:
            self._capture()

    def _advance(self, logits: torch.Tensor) -> None:
        """Draw every active row's next token from `logits` [B, V], record it and its log-prob at
        `step_idx`, and finish the rows it ends (stop / tool-call id, or the budget spent)."""
        logits = logits.float()
        noise = None
        if self.sampling.temperature > 0:
            noise = gumbel_noise(self.streams, self.draw_positions, logits.shape[-1])
        allowed = without_token(logits, self.banned_token_id)
        tokens, logprobs = draw_tokens(logits, allowed, self.sampling, noise)
        active = self.cache.active
        tokens = torch.where(active, tokens, self.pad_token_id)
        at = self.step_idx.view(1)
        self.tokens.index_copy_(1, at, tokens[:, None])
        self.logprobs.index_copy_(1, at, torch.where(active, logprobs, 0.0)[:, None])
        self.generated.add_(active.long())
        self.budgets.sub_(active.long())
        reason = torch.where(self.budgets <= 0, 3, 0)
        reason = torch.where(torch.isin(tokens, self.stops), 1, reason)
        reason = torch.where(torch.isin(tokens, self.tool_calls), 2, reason)
        self.reasons.copy_(torch.where(active, reason, self.reasons))
        active.logical_and_(reason == 0)
        self.ids.copy_(tokens[:, None])
        self.draw_positions.add_(1)
        self.step_idx.add_(1)

    @torch.no_grad()
    def _step(self) -> None:
        """One token for every row, on the device only: the body the graph captures."""
        c, model = self.cache, self.model.model
        # the position this step writes is real for the active rows only
        c.key_mask.index_copy_(1, c.pos.view(1), c.active.long()[:, None])
        mla_mask = None
        if model.has_mla:
            # every query may see its own position (as build_mla_mask allows), so a row without
            # real keys (a spare row of the batch) gets finite, ignored outputs rather than NaN
            here = self.positions == c.pos
            seen = ((self.positions <= c.pos)[None, :] & c.key_mask.bool()) | here[None, :]
            mla_mask = seen[:, None, None, :]
        ctx = ForwardContext(token_mask=None, cu_seqlens=None, mla_mask=mla_mask, cache=c)
        with autocast_to(self.cache.pos.device, self.autocast_dtype):
            state: tuple[torch.Tensor, ...] = (model.embed_tokens(self.ids),)
            for layer in model.layers:
                state = layer(ctx, *state)
            logits = self.model.lm_head(model.final_hidden(state)[:, -1])
        c.pos.add_(1)
        self._advance(logits)

    def _capture(self) -> None:
        # Warm-up runs compile and autotune every kernel (a capture must not); they scribble on the
        # buffers, which `start` overwrites before any replay.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._reset_counters()
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self._reset_counters()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()

    def _reset_counters(self) -> None:
        self.cache.pos.zero_()
        self.step_idx.zero_()
        self.cache.active.fill_(True)
        self.budgets.fill_(self.cache.max_len)

    @torch.no_grad()
    def start(
        self,
        cache: KimiK3Cache,
        last_logits: torch.Tensor,
        streams: Sequence[int],
        positions: Sequence[int],
        budgets: Sequence[int],
    ) -> None:
        """Begin decoding the prefill's rows: `cache` (n rows), `last_logits` [n, V] (the prefill's
        last position), per row its random stream key, the position of its next token (the draw's
        key) and how many tokens it may generate (>= 1). Draws every row's first token."""
        n = len(budgets)
        need = cache.get_seq_length() + max(budgets)
        if need >= self.cache.max_len:
            raise ValueError(
                f"CudaGraphK3Decoder.start: {cache.get_seq_length()} cached positions + {max(budgets)} "
                f"new tokens need max_len > {need}, the decoder has {self.cache.max_len}"
            )
        if min(budgets) < 1:
            raise ValueError(f"CudaGraphK3Decoder.start: every row needs a budget >= 1, got {list(budgets)}")
        self.cache.load(cache)
        device = self.cache.pos.device
        for buf, values in (
            (self.streams, streams),
            (self.draw_positions, positions),
            (self.budgets, budgets),
        ):
            buf.zero_()
            buf[:n] = torch.tensor(list(values), dtype=torch.long, device=device)
        for buf in (self.generated, self.reasons, self.tokens, self.logprobs, self.step_idx, self.ids):
            buf.zero_()
        logits = torch.zeros(self.cache.batch, last_logits.shape[-1], device=device)
        logits[:n] = last_logits.to(device)
        self._advance(logits)

    @torch.no_grad()
    def run(self, steps: int) -> None:
        """Take `steps` decode steps (finished rows ride along, frozen). No host sync."""
        steps = min(steps, self.cache.max_len - 1 - int(self.step_idx))
        for _ in range(steps):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()

    def read(self) -> tuple[torch.Tensor, torch.Tensor, list[int], list[str | None]]:
        """(tokens [B, steps], log-probs [B, steps], tokens generated per row, finish reason per
        row or None while it runs), on the host. Row r's tokens are tokens[r, :generated[r]]."""
        steps = int(self.step_idx)
        generated = self.generated.tolist()
        reasons = [FINISH_REASONS[code] for code in self.reasons.tolist()]
        return self.tokens[:, :steps].cpu(), self.logprobs[:, :steps].cpu(), generated, reasons

    @torch.no_grad()
    def greedy(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, new: int) -> torch.Tensor:
        """input_ids [n, S] (LEFT padded, attention_mask 1/0) -> [n, new] tokens, every row exactly
        `new` (no stops: the benchmark's and the tests' fixed-length decode). Needs a decoder built
        with a greedy, stop-free SamplingConfig."""
        if self.sampling.temperature != 0 or self.sampling.all_stop_token_ids:
            raise ValueError(
                "CudaGraphK3Decoder.greedy: build the decoder with temperature 0 and no stop ids"
            )
        prefill = KimiK3Cache(self.model.config)
        with autocast_to(self.cache.pos.device, self.autocast_dtype):
            out = self.model(
                input_ids=input_ids, attention_mask=attention_mask, past_key_values=prefill, use_cache=True
            )
        n = input_ids.shape[0]
        self.start(prefill, out.logits[:, -1], [0] * n, [0] * n, [new] * n)
        self.run(new - 1)
        return self.tokens[:n, :new].clone()
