"""Greedy K3 decoding from pre-allocated caches, one decode step captured as a CUDA graph.

transformers' generate with `KimiK3Cache` grows the MLA latent cache by concatenation, builds the
attention mask from host-side lengths and launches every kernel of every layer from Python for each
token: at batch 32 a K3 decode step is launch-bound. Here every cache is a fixed buffer allocated
once for (batch, max_len): KDA's conv and recurrent state, MLA's latent and shared key part over
max_len positions, the key padding mask, and the next write position as a device scalar. A decode
step reads the last token from a buffer, runs the layers (KDA's recurrent step, MLA over all
max_len positions with the positions not yet written masked out), writes the greedy token and
advances the position, all on the device, so it has no host sync and is captured once and
replayed per token (`graph=True`, CUDA only). The prefill is the model's own forward; its cache is
copied into the buffers. With `graph=False` the same step runs eagerly (the CPU tests use that).

The routed experts must run their grouped-GEMM path to be capturable (bf16 weights on sm90+:
the per-expert path reads the expert counts on the host). Greedy only, every row produces exactly
`max_new_tokens` (no stop on EOS); the tokens equal the uncached greedy decode up to float
rounding (tests/engines/test_cuda_graph_decode.py).
"""

from __future__ import annotations

import torch

from posttrain.model import KimiK3ForCausalLM
from posttrain.model.cache import KimiK3Cache
from posttrain.model.modeling_kimi_k3 import ForwardContext


class _Slots(list):
    """One fixed buffer per layer: assigning a new value copies it in, so a captured graph keeps
    reading and writing the same memory (what the layers do with KimiK3Cache's lists)."""

    def __setitem__(self, index, value) -> None:
        super().__getitem__(index).copy_(value)


class StaticK3Cache:
    """The part of KimiK3Cache's interface the layers use, over buffers for `batch` rows and
    `max_len` positions. `pos` (a 0-d device long) is the position the next token is written to."""

    def __init__(self, model: KimiK3ForCausalLM, batch: int, max_len: int) -> None:
        config = model.config
        param = next(model.parameters())
        device, dtype = param.device, param.dtype
        lac = config.linear_attn_config
        H, K, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
        conv, rec, lat, key = [], [], [], []
        for layer in model.model.layers:
            kda = layer.is_kda
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
        self.conv_states, self.recurrent_states = _Slots(conv), _Slots(rec)
        self.latents, self.key_shared = lat, key
        self.key_mask = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self.batch, self.max_len = batch, max_len

    def buffers(self) -> list[torch.Tensor]:
        states = (self.conv_states, self.recurrent_states, self.latents, self.key_shared)
        return [t for ts in states for t in ts if t is not None] + [self.key_mask, self.pos]

    def update_latent(
        self, layer_idx: int, latent: torch.Tensor, key_shared: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's latent [B, 1, R] and key part [B, 1, P] at `pos`; return all positions."""
        at = self.pos.view(1)
        self.latents[layer_idx].index_copy_(1, at, latent)
        self.key_shared[layer_idx].index_copy_(1, at, key_shared)
        return self.latents[layer_idx], self.key_shared[layer_idx]

    def load(self, cache: KimiK3Cache) -> None:
        """Copy a prefill's cache (S positions) in and point `pos` after it."""
        S = cache.get_seq_length()
        if cache.batch_size != self.batch or S >= self.max_len:
            raise ValueError(
                f"StaticK3Cache: a prefill of {cache.batch_size} rows x {S} positions does not fit "
                f"{self.batch} rows x {self.max_len} positions (max_len must exceed prompt + new tokens)"
            )
        for buf in self.buffers():
            buf.zero_()
        for i in range(len(self.latents)):
            if self.conv_states[i] is not None:
                self.conv_states[i] = cache.conv_states[i]
                self.recurrent_states[i] = cache.recurrent_states[i]
            else:
                self.latents[i][:, :S].copy_(cache.latents[i])
                self.key_shared[i][:, :S].copy_(cache.key_shared[i])
        self.key_mask[:, :S].copy_(cache.key_mask)
        self.pos.fill_(S)


class CudaGraphK3Decoder:
    """Greedy decoding of `batch` rows of prompt + new tokens <= max_len - 1, reusable across calls.

    Build it once (allocates the buffers; with `graph=True` warms the step up and captures it),
    then call `generate` per batch of prompts.
    """

    def __init__(
        self, model: KimiK3ForCausalLM, batch: int, max_len: int, max_new_tokens: int, graph: bool = True
    ) -> None:
        if model.training:
            raise ValueError("CudaGraphK3Decoder: put the model in eval mode (model.eval()) first")
        self.model = model
        self.cache = StaticK3Cache(model, batch, max_len)
        device = self.cache.pos.device
        self.max_new_tokens = max_new_tokens
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.out = torch.zeros(batch, max_new_tokens + 1, dtype=torch.long, device=device)
        self.step_idx = torch.zeros((), dtype=torch.long, device=device)
        self.positions = torch.arange(max_len, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        if graph:
            self._capture()

    @torch.no_grad()
    def _step(self) -> None:
        """One token for every row, on the device only: the body the graph captures."""
        c, model = self.cache, self.model.model
        c.key_mask.index_fill_(1, c.pos.view(1), 1)
        mla_mask = None
        if model.has_mla:
            seen = (self.positions <= c.pos)[None, :] & c.key_mask.bool()
            mla_mask = seen[:, None, None, :]
        ctx = ForwardContext(token_mask=None, cu_seqlens=None, mla_mask=mla_mask, cache=c)
        state: tuple[torch.Tensor, ...] = (model.embed_tokens(self.ids),)
        for layer in model.layers:
            state = layer(ctx, *state)
        logits = self.model.lm_head(model.final_hidden(state)[:, -1])
        self.ids.copy_(logits.argmax(-1, keepdim=True))
        self.out.index_copy_(1, self.step_idx.view(1), self.ids)
        c.pos.add_(1)
        self.step_idx.add_(1)

    def _capture(self) -> None:
        # Warm-up runs compile and autotune every kernel (a capture must not); they scribble on the
        # buffers, which `generate` overwrites before any replay.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.cache.pos.zero_()
                self.step_idx.zero_()
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.cache.pos.zero_()
        self.step_idx.zero_()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [batch, S] (LEFT padded, attention_mask 1/0) -> [batch, max_new_tokens] greedy."""
        if input_ids.shape[0] != self.cache.batch:
            raise ValueError(
                f"generate: {input_ids.shape[0]} rows, the decoder was built for {self.cache.batch}"
            )
        if input_ids.shape[1] + self.max_new_tokens > self.cache.max_len:
            raise ValueError(
                f"generate: prompt {input_ids.shape[1]} + {self.max_new_tokens} new tokens exceeds "
                f"max_len {self.cache.max_len}"
            )
        prefill = KimiK3Cache(self.model.config)
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, past_key_values=prefill, use_cache=True
        )
        self.cache.load(prefill)
        self.ids.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
        self.out[:, :1].copy_(self.ids)
        self.step_idx.fill_(1)
        for _ in range(self.max_new_tokens - 1):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()
        return self.out[:, : self.max_new_tokens].clone()
