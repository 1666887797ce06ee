"""The MOPD reward: the teacher's log-probability of the token the student sampled, minus the
student's own, clipped (K3 spec section 2.3), and the reverse KL it estimates.

It is dense, on-policy reverse KL: summed over a student trajectory its expectation is
-KL(pi_student || pi_teacher). Only the sampled token is scored (top-k logit distillation gave no
clear gain in K3), and the reward is a constant to the optimiser: no gradient reaches the student
through it (stop-gradient), nor the teacher, which is not trained. A pure tensor function of the
engine, not a reward plug-in: the `mopd` stage kind is defined by it.
"""

from __future__ import annotations

import torch


def mopd_token_rewards(
    teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, mask: torch.Tensor, r_max: float
) -> torch.Tensor:
    """r_t = clip(stopgrad(log pi_teacher(y_t) - log pi_student(y_t)), -r_max, r_max) where mask
    is 1, and 0 elsewhere.

    Args:
        teacher_logprobs: [B, T] the teacher's log-prob of each token given its prefix (prefill of
            prompt + student tokens; the teacher for the prompt's (domain, effort)).
        student_logprobs: [B, T] the student's log-prob of the same tokens at temperature 1.
        mask: [B, T] 1 on student-sampled tokens; prompt, tool-result and padding tokens are 0 and
            get reward 0 whatever the log-probs hold there (a teacher's first position may be -inf
            or NaN: it is never read).
        r_max: clip bound R_max > 0.
    Returns:
        [B, T] rewards, detached (no grad_fn).
    Raises:
        ValueError if a sampled token has a NaN log-prob: a trajectory is never trained on
        without a valid teacher score.
    """
    if teacher_logprobs.shape != student_logprobs.shape or mask.shape != teacher_logprobs.shape:
        raise ValueError(
            f"teacher_logprobs, student_logprobs and mask must share a shape; got "
            f"{tuple(teacher_logprobs.shape)}, {tuple(student_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if not r_max > 0:
        raise ValueError(f"r_max must be > 0, got {r_max}")
    mask = mask.bool()
    delta = teacher_logprobs.detach() - student_logprobs.detach()
    for side, logprobs, cause in (
        ("student", student_logprobs, "the student diverged (lower train.lr or raise train.warmup_steps)"),
        ("teacher", teacher_logprobs, "its teacher's engine returned them (check that teacher's checkpoint)"),
    ):
        bad = torch.isnan(logprobs.detach()) & mask
        if bad.any():
            where = torch.nonzero(bad).tolist()
            raise ValueError(
                f"{side} log-probs are NaN at [row, position] {where[:8]} of sampled tokens: {cause}"
            )
    if torch.isnan(delta[mask]).any():  # -inf on both sides: a token neither model can produce
        where = torch.nonzero(torch.isnan(delta) & mask).tolist()
        raise ValueError(f"teacher and student log-probs are both -inf at [row, position] {where[:8]}")
    rewards = delta.clamp(-r_max, r_max)
    return torch.where(mask, rewards, torch.zeros_like(rewards))


def reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """The MOPD evaluation metric: mean over student-sampled tokens of
    log pi_student - log pi_teacher, an unbiased estimate of the per-token KL(pi_student ||
    pi_teacher) on the student's own samples. 0.0 for an empty mask."""
    mask = mask.bool()
    if not mask.any():
        return 0.0
    return float((student_logprobs.detach() - teacher_logprobs.detach())[mask].double().mean())


def exact_reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """Per position, KL(pi_student(. | context) || pi_teacher(. | context)) from the two full
    next-token log-distributions [..., vocab]: sum_v p_student(v) (log p_student(v) - log p_teacher(v)),
    the expectation over the student's next token of what reverse_kl averages one draw of. Same
    quantity, none of the sampled token's variance (the log-ratios are heavy-tailed)."""
    student, teacher = student_logprobs.detach().double(), teacher_logprobs.detach().double()
    p = student.exp()
    terms = torch.where(p > 0, p * (student - teacher), torch.zeros_like(p))
    return terms.sum(-1)


def token_mean_standard_error(episode_sums: torch.Tensor, episode_tokens: torch.Tensor) -> float:
    """Standard error of a token mean sum(S_e) / sum(N_e) over episodes e, with S_e the sum of
    episode e's per-token values (log-ratios, per-position KLs) and N_e its token count.

    Tokens of one episode are not independent (they share its context), so the episodes are the
    units: the cluster-robust (delta-method) error of a ratio estimator,
    sqrt(n / (n - 1) * sum_e (S_e - m N_e)^2) / sum_e N_e with m the token mean. What it says:
    a kl before/after difference smaller than about twice the errors is not a measured change.
    Needs at least two episodes and one token (ValueError otherwise)."""
    sums, tokens = episode_sums.detach().double(), episode_tokens.detach().double()
    n, total = sums.numel(), float(tokens.sum())
    if n < 2 or total <= 0:
        raise ValueError(f"a standard error needs at least 2 episodes and 1 token; got {n} and {total:g}")
    mean = float(sums.sum()) / total
    return float(((sums - mean * tokens) ** 2).sum() * n / (n - 1)) ** 0.5 / total


def paired_change_standard_error(
    sums_before: torch.Tensor,
    tokens_before: torch.Tensor,
    sums_after: torch.Tensor,
    tokens_after: torch.Tensor,
) -> float:
    """Standard error of the change of a token mean, sum(S'_e) / sum(N'_e) - sum(S_e) / sum(N_e),
    when the same episodes e (same prompt, same uid, hence the same sampling noise) were played
    before (S_e, N_e) and after (S'_e, N'_e) training.

    The delta-method error of a difference of two ratio estimators with the episodes as units,
    sqrt(n / (n - 1) * sum_e w_e^2) with w_e = (S'_e - m' N'_e) / sum N' - (S_e - m N_e) / sum N
    (m, m' the two token means). Pairing cancels what an episode's two plays share: the prompt, and
    the sampled tokens for as long as the two policies pick the same ones; so where training moved
    the student little it is well below the two separate errors combined, and the change is
    measured only where it exceeds about twice this. With nothing before (all S_e = 0) it is
    token_mean_standard_error of the after episodes. Needs at least two episodes and a token on
    each side (ValueError otherwise)."""
    before = sums_before.detach().double(), tokens_before.detach().double()
    after = sums_after.detach().double(), tokens_after.detach().double()
    n = before[0].numel()
    if not all(t.numel() == n for t in (*before, *after)):
        raise ValueError(
            "paired episodes: the before and after sums and token counts must have one entry each"
        )
    if n < 2 or float(before[1].sum()) <= 0 or float(after[1].sum()) <= 0:
        raise ValueError(f"a standard error needs at least 2 episodes and 1 token on each side; got {n}")

    def residual(sums: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        total = tokens.sum()
        return (sums - sums.sum() / total * tokens) / total

    w = residual(*after) - residual(*before)
    return float((w**2).sum() * n / (n - 1)) ** 0.5
