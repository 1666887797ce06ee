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
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from posttrain.data.sample import Sample
from posttrain.engines.base import (
    ENGINES,
    Engine,
    PauseWhen,
    SamplingConfig,
    WeightsSource,
    check_prompt,
    sampling_key,
    tokens_already_generated,
)


def gumbel_noise(seed: int, uid: str, positions: list[int], vocab_size: int) -> torch.Tensor:
    """[len(positions), V] Gumbel(0, 1) noise, one independent stream per (seed, uid, position)."""
    rows = []
    for position in positions:
        generator = torch.Generator().manual_seed(sampling_key(seed, uid, position))
        uniform = torch.rand(vocab_size, generator=generator, dtype=torch.float64)
        rows.append(-torch.log(-torch.log(uniform.clamp(min=1e-300))))
    return torch.stack(rows).float()


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


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (input_ids [B, T], attention_mask [B, T]) with LEFT padding."""
    width = max(len(seq) for seq in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    return ids, mask


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that ignore left padding (rotary models need them; K3 accepts and ignores them)."""
    return (mask.cumsum(dim=-1) - 1).clamp(min=0)


@ENGINES.register("embedded")
class EmbeddedEngine(Engine):
    """Generate and score with an in-process causal LM (our KimiK3ForCausalLM by default).

    EmbeddedEngine(model, *, max_batch_size=64, pad_token_id=None)
      model: the module to sample from (shared with the trainer when in the same process).
      pad_token_id: id used for left padding (masked out; default config.pad_token_id or 0).
    """

    def __init__(
        self, model: nn.Module, *, max_batch_size: int = 64, pad_token_id: int | None = None
    ) -> None:
        self.model = model
        self.max_batch_size = max_batch_size
        config_pad = getattr(getattr(model, "config", None), "pad_token_id", None)
        self.pad_token_id = pad_token_id if pad_token_id is not None else (config_pad or 0)
        self.policy_version = 0

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: object) -> EmbeddedEngine:
        """Load a checkpoint directory (K3 or any transformers causal LM) in float32."""
        from transformers import AutoModelForCausalLM

        import posttrain.model  # noqa: F401  (registers kimi_k3 with AutoModelForCausalLM)

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        return cls(model, **kwargs)

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, cache: object | None
    ) -> tuple[torch.Tensor, object]:
        """Run the model on new tokens `ids` [B, t] with the mask of all positions; (logits, cache)."""
        positions = positions_from_mask(mask)[:, -ids.shape[1] :]
        device = self._device
        out = self.model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            past_key_values=cache,
            use_cache=True,
        )
        return out.logits.float().cpu(), out.past_key_values

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
        """Decode `batch` until every row finishes; True when pause_when stopped it."""
        ids, mask = left_pad([sample.tokens for sample in batch], self.pad_token_id)
        logits, cache = self._forward(ids, mask, None)
        logits = logits[:, -1]
        rows = list(batch)
        while True:
            noise = None
            if sampling.temperature > 0:
                noise = torch.cat(
                    [gumbel_noise(sampling.seed, s.uid, [len(s.tokens)], logits.shape[-1]) for s in rows]
                )
            tokens, logprobs = sample_tokens(logits, sampling, noise)
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
            if not keep:
                return False
            if pause_when is not None and pause_when(samples):
                for row in keep:
                    rows[row].finish_reason = "paused"
                return True
            if len(keep) < len(rows):
                index = torch.tensor(keep, dtype=torch.long)
                cache.batch_select_indices(index.to(self._device))
                mask = mask.index_select(0, index)
                tokens = tokens.index_select(0, index)
                rows = [rows[row] for row in keep]
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long)], dim=1)
            logits, cache = self._forward(tokens[:, None], mask, cache)
            logits = logits[:, -1]

    # -- score ------------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, samples: list[Sample]) -> list[list[float]]:
        for sample in samples:
            check_prompt(sample)
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].tokens))
        scores: list[list[float]] = [[] for _ in samples]
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(order), self.max_batch_size):
                chunk = order[start : start + self.max_batch_size]
                ids, mask = left_pad([samples[i].tokens for i in chunk], self.pad_token_id)
                positions = positions_from_mask(mask)
                device = self._device
                logits = (
                    self.model(
                        input_ids=ids.to(device),
                        attention_mask=mask.to(device),
                        position_ids=positions.to(device),
                        use_cache=False,
                    )
                    .logits.float()
                    .cpu()
                )
                logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
                for row, i in enumerate(chunk):
                    n = len(samples[i].tokens)
                    scores[i] = [0.0] + logprobs[row, ids.shape[1] - n :].tolist()
        finally:
            self.model.train(was_training)
        return scores

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
