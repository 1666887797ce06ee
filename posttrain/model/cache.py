"""KimiK3Cache: what K3 carries from one forward to the next while decoding.

KDA layers keep a fixed-size state per row: the last `short_conv_kernel_size - 1` conv inputs
([B, 3 * H * K, W - 1], q/k/v channels concatenated) and the recurrent state ([B, H, K, V], float32).
MLA layers keep what grows with length, in compressed form: the normalised kv latent
([B, S, kv_lora_rank]) and the shared key part ([B, S, qk_rope_head_dim]). The cache also keeps the
padding mask of every cached position, so a caller may pass either the full or only the new part
of `attention_mask`. `select` drops finished rows (every tensor is indexed along the batch axis);
transformers' generate uses it for beam reordering too.

It subclasses transformers' `Cache` so `generate` accepts it; the per-layer-object machinery of that
class is not used (no `layers`), hence the methods overridden below.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from posttrain.model.configuration_kimi_k3 import KimiK3Config


class KimiK3Cache(Cache):
    """Per-layer KDA conv + recurrent state and MLA latent KV for a batch of rows."""

    is_compileable = False

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__(layers=[])
        L = config.num_hidden_layers
        self.num_layers = L
        self.conv_states: list[torch.Tensor | None] = [None] * L
        self.recurrent_states: list[torch.Tensor | None] = [None] * L
        self.latents: list[torch.Tensor | None] = [None] * L
        self.key_shared: list[torch.Tensor | None] = [None] * L
        self.key_mask: torch.Tensor | None = None  # [B, S] 1 real / 0 padding, every cached position

    def __len__(self) -> int:
        return self.num_layers

    def __repr__(self) -> str:
        return f"KimiK3Cache(layers={self.num_layers}, seen={self.get_seq_length()}, batch={self.batch_size})"

    # -- what the model calls ------------------------------------------------------------------

    def update_latent(
        self, layer_idx: int, latent: torch.Tensor, key_shared: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this forward's MLA latent [B, T, R] and shared key part [B, T, P]; return all."""
        if self.latents[layer_idx] is not None:
            latent = torch.cat([self.latents[layer_idx], latent], dim=1)
            key_shared = torch.cat([self.key_shared[layer_idx], key_shared], dim=1)
        self.latents[layer_idx], self.key_shared[layer_idx] = latent, key_shared
        return latent, key_shared

    def extend_key_mask(self, new_mask: torch.Tensor) -> torch.Tensor:
        """Append the padding mask [B, T] of the new tokens; return the mask of all positions [B, S]."""
        new_mask = new_mask.long()
        self.key_mask = new_mask if self.key_mask is None else torch.cat([self.key_mask, new_mask], dim=1)
        return self.key_mask

    # -- transformers Cache interface ----------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions processed so far (padding included)."""
        return 0 if self.key_mask is None else int(self.key_mask.shape[1])

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return -1 if self.key_mask is None else int(self.key_mask.shape[0])

    @property
    def is_croppable(self) -> bool:
        # KDA folds every token into its state; dropping tokens would need the state from before them.
        return False

    @property
    def is_initialized(self) -> bool:
        return self.key_mask is not None

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.key_mask is not None

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def select(self, batch_indices: torch.Tensor | list[int]) -> KimiK3Cache:
        """Keep only rows `batch_indices` (in that order), in place; returns self."""
        idx = torch.as_tensor(batch_indices, dtype=torch.long)
        for states in (self.conv_states, self.recurrent_states, self.latents, self.key_shared):
            for i, t in enumerate(states):
                if t is not None:
                    states[i] = t.index_select(0, idx.to(t.device))
        if self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, idx.to(self.key_mask.device))
        return self

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        n = self.batch_size
        if n > 0:
            self.select(torch.arange(n).repeat_interleave(repeats))

    def reset(self) -> None:
        for states in (self.conv_states, self.recurrent_states, self.latents, self.key_shared):
            states[:] = [None] * self.num_layers
        self.key_mask = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "KimiK3Cache cannot drop tokens: KDA has folded them into its recurrent state; keep a copy "
            "of the cache (copy.deepcopy) from before the tokens instead"
        )
