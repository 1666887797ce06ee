"""The one policy-gradient step: RL and MOPD differ only in the advantages they hand it.

slime's shape: a rollout returns fully scored Samples, the algorithm turns their scores into
per-token advantages (RL: group-relative outcome advantages broadcast over each trajectory's
tokens; MOPD: the discounted return of the teacher log-ratio rewards, posttrain.algos.mopd_reward),
and this step does the rest the same way for both: left-pad the trajectories once
(posttrain.data.batch.TokenBatch), per micro-batch recompute log pi_theta of the generated tokens at
the sampling temperature, apply the per-token policy loss (posttrain.algos.policy_loss) against the
behaviour log-probs, backpropagate the micro-batch's share of the token sum, and take one
optimizer step per update (PPO epochs: the clip is measured against the policy before the first).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from posttrain.algos import mismatch_stats, policy_loss, staleness_stats
from posttrain.algos.policy_loss import PolicyLoss, PolicyLossConfig
from posttrain.data.batch import TokenBatch
from posttrain.data.sample import Sample
from posttrain.model.vision_model import media_inputs
from posttrain.trainers.common import TrainState


def target_logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float = 1.0) -> torch.Tensor:
    """[B, T - 1] log pi(token t | tokens[:t]) at `temperature` of every generated target, with
    gradient (the rows' images merged, as the engine prefilled); 0 where no row has a generated
    target yet. Only the trailing columns from the first generated target of any row are projected
    to the vocabulary (`logits_to_keep`): with left padding the prompts end before them, and their
    logits (most of a short-answer batch's positions; [B, T, vocab] in float32 at K3's 163k
    vocabulary) would only be masked out."""
    device = next(model.parameters()).device
    ids = batch.input_ids.to(device)
    generated = TokenBatch.targets(batch.generated).bool().any(0).nonzero()
    width = ids.shape[1] - 1
    first = int(generated[0]) if len(generated) else width - 1  # >= 1 column kept
    logits = model(
        input_ids=ids,
        attention_mask=batch.attention_mask.to(device),
        position_ids=batch.position_ids.to(device),
        logits_to_keep=width - first + 1,  # positions first..T-1; the last one predicts nothing
        **media_inputs(model, batch.images),
    ).logits.float()
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    logp = logp.gather(-1, ids[:, first + 1 :, None]).squeeze(-1)
    return torch.nn.functional.pad(logp, (first, 0))


def micro_batch_loss(
    model: torch.nn.Module,
    batch: TokenBatch,
    advantages: torch.Tensor,
    *,
    config: PolicyLossConfig,
    temperature: float = 1.0,
    token_weights: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
) -> tuple[PolicyLoss, torch.Tensor]:
    """The per-token policy loss of one micro-batch and its log pi_theta [B, T - 1].

    advantages / token_weights: [B, T] aligned with batch's tokens. old_logp: [B, T - 1] pi_prox
    (None: this forward's, detached: one update per batch). The loss's stats also hold the
    train/rollout mismatch (posttrain.algos.mismatch_stats)."""
    logp = target_logprobs(model, batch, temperature)
    device = logp.device
    mask = TokenBatch.targets(batch.generated)
    behaviour = TokenBatch.targets(batch.behaviour_logprobs)
    out = policy_loss(
        logp,
        behaviour.to(device),
        TokenBatch.targets(advantages).to(device),
        mask.to(device),
        old_logp=old_logp,
        token_weights=None if token_weights is None else TokenBatch.targets(token_weights).to(device),
        config=config,
    )
    out.stats.update(mismatch_stats(logp.detach().cpu(), behaviour, mask, config.tis_cap))
    return out, logp


def policy_step(
    state: TrainState,
    samples: Sequence[Sample],
    advantages: torch.Tensor,
    *,
    step: int,
    loss: PolicyLossConfig,
    micro_batch_size: int,
    pad_id: int,
    temperature: float = 1.0,
    updates: int = 1,
    sample_weights: torch.Tensor | None = None,
    policy_version: int = 0,
    reference: torch.nn.Module | None = None,
    reference_coef: float = 0.0,
) -> dict[str, float]:
    """`updates` optimizer steps of the per-token policy loss over `samples`.

    advantages: [N, T] aligned with TokenBatch.of(samples, pad_id) (left-padded, per token; a
      trajectory advantage is its value repeated); only generated tokens are read.
    sample_weights: [N] a weight on each trajectory's token losses (None: 1).
    reference, reference_coef: a frozen model (RL: the init model) and beta_ref: every generated
      token's loss gains beta_ref * (log pi_theta - log pi_ref)^2 / 2, the k2 estimator of
      KL(pi_theta || pi_ref) (`reference_kl`), logged as kl_ref. It is the only force on the
      trajectories of groups without reward variance (advantage 0), which otherwise drift freely.
    The loss is the sum over generated tokens divided once by the batch's generated-token count:
    the token mean, whatever the micro-batching. Returns the optimizer's metrics, loss, the policy
    loss's stats, train/rollout mismatch and staleness (token-weighted means over micro-batches and
    updates; maxima for *_max), trained_tokens, and the step's throughput: train_tokens (the real,
    unpadded tokens through the policy's forward and backward, once per update), train_s (the whole
    step, padding to optimizer; the frozen reference's forward is timed but not counted) and
    train_tokens_per_s.
    """
    started = time.perf_counter()
    batch = TokenBatch.of(samples, pad_id)
    if advantages.shape != batch.input_ids.shape:
        raise ValueError(
            f"policy_step: advantages {tuple(advantages.shape)}, batch {tuple(batch.input_ids.shape)}"
        )
    config = loss.model_copy(update={"reduction": "sum"})
    total = max(int(batch.generated.sum()), 1)
    weights = None if sample_weights is None else sample_weights[:, None].expand_as(advantages)
    proximal: list[torch.Tensor] = []  # pi_prox per micro-batch: the policy before the first update
    references: list[torch.Tensor] = []  # log pi_ref per micro-batch, computed once
    metrics: dict[str, float] = {"loss": 0.0}
    for update in range(updates):
        for index, start in enumerate(range(0, len(samples), micro_batch_size)):
            stop = min(start + micro_batch_size, len(samples))
            chunk = batch.rows(start, stop)
            width = chunk.width
            out, logp = micro_batch_loss(
                state.model,
                chunk,
                advantages[start:stop, -width:],
                config=config,
                temperature=temperature,
                token_weights=None if weights is None else weights[start:stop, -width:],
                old_logp=proximal[index] if update else None,
            )
            if update == 0:
                proximal.append(logp.detach())
            mask = TokenBatch.targets(chunk.generated)
            stats = {**out.stats, **staleness_stats(TokenBatch.targets(chunk.versions), policy_version, mask)}
            loss_sum = out.loss
            if reference is not None and reference_coef > 0:
                if update == 0:
                    with torch.no_grad():
                        references.append(target_logprobs(reference, chunk, temperature).detach())
                gen = mask.to(logp.device).bool()
                kl = reference_kl(logp, references[index], gen)
                loss_sum = loss_sum + reference_coef * kl.sum()
                stats["kl_ref"] = float(kl.detach().sum() / gen.sum().clamp(min=1))
            uids = ", ".join(s.uid for s in samples[start : start + 4])
            state.check_finite(loss_sum, step, detail=f" (trajectories {uids} ...)")
            state.backward(loss_sum / total)
            metrics["loss"] += float(loss_sum.detach()) / total / updates
            _accumulate(metrics, stats, float(out.num_tokens) / total / updates)
        metrics.update(state.optimizer_step(step))
    metrics["trained_tokens"] = float(batch.generated.sum())
    metrics["train_tokens"] = float(batch.attention_mask.sum()) * updates
    device = next(state.model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the optimizer's queued kernels are part of the step's time
    metrics["train_s"] = time.perf_counter() - started
    metrics["train_tokens_per_s"] = metrics["train_tokens"] / metrics["train_s"]
    return metrics


def reference_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token k2 estimate of KL(pi_theta || pi_ref) on tokens sampled from (about) pi_theta:
    d^2 / 2 with d = log pi_theta - log pi_ref; 0 with zero slope at pi_theta = pi_ref, gradient
    d * d log pi_theta. Not k3 (exp(-d) - 1 + d): one iteration at lr 5e-4 can move a sampled
    token's log-prob by 6-22 nats (log_ratio_abs_max of the seed-0 agent runs), where k3's
    exp(6) = 400 gives one token the whole gradient (grad norm 112 seen). Masked tokens give 0."""
    d = torch.where(mask, logp - ref_logp.to(logp.dtype), torch.zeros_like(logp))
    return 0.5 * d**2


def _accumulate(metrics: dict[str, float], new: dict[str, float], weight: float) -> None:
    """Token-weighted means across micro-batches and updates; maxima for *_max; num_tokens left out."""
    for key, value in new.items():
        if key == "num_tokens":
            continue
        if key.endswith("_max"):
            metrics[key] = max(metrics.get(key, 0.0), value)
        else:
            metrics[key] = metrics.get(key, 0.0) + weight * value
