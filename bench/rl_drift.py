"""One RL iteration's real batch, several optimizer steps on it, and what each does to the greedy
policy (issue #21: does AdamW's per-coordinate normalisation move the greedy policy by noise?).

Runs an rl stage in this process (posttrain.testing.StageRunner, the body of a finished stage's
stage.json, the SFT model of its run dir) up to iteration `--step`'s batch, then from the SFT
weights and a fresh optimizer each time:

- adam:          the stage's own policy_step (AdamW, `updates_per_iteration` steps, real advantages)
- adam-shuffled: the same with the batch's advantages permuted over its trajectories (no reward
                 signal, the same magnitudes)
- adam-eps=E:    AdamW with eps E
- sgd x c:       one step of -c * grad (the first update's gradient), for several c

and for each reports the update's norm, the change of the policy-gradient surrogate on the batch
(J = sum_i A_i sum_t log pi(y_it) / tokens: the signal the step was meant to follow) and the damage
to the greedy policy, teacher-forced on the SFT model's own greedy held-out episodes: the mean
drop in log-prob of their generated tokens and the share of those tokens that are no longer the
argmax (a greedy episode changes at its first such token). Also, for the adam update: its cosine
with -grad and the share of its squared norm in the coordinates outside those that hold 99% of
the gradient's squared norm.

    python bench/rl_drift.py --stage-json RUN/rl-agent-max/stage.json --sft RUN/sft/model \
        --budget-cache RUN/budget_cache --out OUT

With --shuffled-run it instead runs the whole stage (every iteration, then the held-out eval) with
each iteration's advantages permuted over its trajectories (torch.randperm seeded 1000 + step):
the signal-free control. `--set key=value` changes the stage body (e.g. `kl_to_init=1.0`,
`train.lr=1e-4`); the stage's eval.json lands in OUT/run/<stage>/.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from posttrain.algos import group_advantages
from posttrain.data.batch import TokenBatch
from posttrain.envs import env_eval
from posttrain.model.vision_model import media_inputs
from posttrain.rewards.budget import trajectory_rewards
from posttrain.testing import StageRunner
from posttrain.trainers import rl
from posttrain.trainers.policy_step import policy_step, target_logprobs


class Done(Exception):
    pass


def greedy_stats(model: torch.nn.Module, batch: TokenBatch, reference: torch.Tensor | None) -> dict:
    """log-probs of the greedy episodes' generated tokens and whether each is still the argmax."""
    with torch.no_grad():
        ids = batch.input_ids
        logits = model(
            input_ids=ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            **media_inputs(model, batch.images),
        ).logits.float()[:, :-1]
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        argmax_ok = logits.argmax(-1) == ids[:, 1:]
    mask = TokenBatch.targets(batch.generated).bool()
    out = {"logp": logp, "mask": mask, "argmax_ok": argmax_ok}
    if reference is not None:
        drop = (reference["logp"] - logp)[mask]
        out["stats"] = {
            "greedy_logp_drop": float(drop.mean()),
            "greedy_argmax_lost": float((reference["argmax_ok"] & ~argmax_ok)[mask].float().mean()),
            "greedy_episodes_changed": float(
                ((reference["argmax_ok"] & ~argmax_ok) & mask).any(-1).float().mean()
            ),
        }
    return out


def surrogate(model, batch: TokenBatch, adv: torch.Tensor, temperature: float) -> float:
    with torch.no_grad():
        logp = target_logprobs(model, batch, temperature)
    mask = TokenBatch.targets(batch.generated)
    return float((logp * mask * adv[:, None]).sum() / mask.sum())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stage-json", type=Path, required=True)
    parser.add_argument("--sft", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-cache", type=Path, help="b0 cache of the run (default: a cold start)")
    parser.add_argument("--step", type=int, default=1, help="the iteration whose batch is used (1: SFT's)")
    parser.add_argument("--eps", type=float, nargs="*", default=[1e-6, 1e-5, 1e-4])
    parser.add_argument("--lr-scale", type=float, nargs="*", default=[0.2, 0.5])
    parser.add_argument("--sgd", type=float, nargs="*", default=[1.0, 3.0, 10.0, 30.0, 100.0])
    parser.add_argument("--shuffled-run", action="store_true", help="the whole stage on shuffled advantages")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="stage body overrides")
    args = parser.parse_args()
    meta = json.loads(args.stage_json.read_text())["stage"]
    body = meta["body"]
    for item in args.set:
        key, value = item.split("=", 1)
        *path, last = key.split(".")
        node = body
        for part in path:
            node = node.setdefault(part, {})
        node[last] = json.loads(value)
    stage_id = args.stage_json.parent.name
    if not args.shuffled_run:
        body["train"]["steps"] = args.step
    if args.budget_cache is not None:
        body["budget"]["cache_dir"] = str(args.budget_cache.resolve())
    args.out.mkdir(parents=True, exist_ok=True)
    captured: dict = {}

    original_rows = env_eval.episode_rows

    def capture_rows(samples):
        captured.setdefault("eval_samples", list(samples))
        return original_rows(samples)

    env_eval.episode_rows = capture_rows
    original_train_step = rl._train_step

    def analysed_train_step(state, engine, samples, budgets, cfg, domain, step, renderer, *rest):
        if step < args.step:
            return original_train_step(state, engine, samples, budgets, cfg, domain, step, renderer, *rest)
        analyse(state, samples, budgets, cfg, domain, step, renderer, captured, args.out, args)
        raise Done

    current = {"step": 0}
    original_advantages = rl.group_advantages

    def shuffled_advantages(*a, **k):
        adv = original_advantages(*a, **k)
        generator = torch.Generator().manual_seed(1000 + current["step"])
        return adv[torch.randperm(len(adv), generator=generator)]

    def stepped_train_step(state, engine, samples, budgets, cfg, domain, step, renderer, *rest):
        current["step"] = step
        return original_train_step(state, engine, samples, budgets, cfg, domain, step, renderer, *rest)

    if args.shuffled_run:
        rl.group_advantages = shuffled_advantages
        rl._train_step = stepped_train_step
    else:
        rl._train_step = analysed_train_step
    runner = StageRunner()
    run_dir = args.out / "run"
    ctx = runner.context(
        "rl",
        run_dir,
        body,
        stage_id=stage_id,
        inputs={"sft": args.sft.resolve()},
        matrix={"domain": body["domain"], "effort": body["effort"]},
    )
    try:
        runner.run(ctx)
    except Done:
        pass
    if args.shuffled_run:
        report = json.loads((ctx.stage_dir / "eval.json").read_text())
        print(json.dumps({k: report[k] for k in ("accuracy", "accuracy_change", "accuracy_change_se")}))
        return
    print(json.dumps(json.loads((args.out / "drift.json").read_text()), indent=1))


def analyse(state, samples, budgets, cfg, domain, step, renderer, captured, out: Path, args) -> None:
    model = state.unwrapped
    scored, rewards, metrics = trajectory_rewards(
        samples, budgets, cfg.budget.for_domain(domain), step, cfg.train.steps, renderer
    )
    groups = [s.group for s in scored]
    adv = group_advantages(
        rewards, groups, scale_by_std=cfg.advantages.scale_by_std, leave_one_out=cfg.advantages.leave_one_out
    )
    report: dict = {"step": step, **rl.signal_stats(rewards, groups, adv), "trajectories": len(scored)}
    report["reward_mean"] = float(rewards.mean())
    shuffled = adv[torch.randperm(len(adv), generator=torch.Generator().manual_seed(1000 + step))]
    eval_batch = TokenBatch.of(captured["eval_samples"], renderer.pad_id)
    train_batch = TokenBatch.of(scored, renderer.pad_id)
    report["eval_episodes"] = len(captured["eval_samples"])
    report["eval_generated_tokens"] = int(eval_batch.generated.sum())
    start_weights = copy.deepcopy(model.state_dict())
    params = [p for p in model.parameters() if p.requires_grad]
    reference = greedy_stats(model, eval_batch, None)
    report["sft_argmax_agreement"] = float(reference["argmax_ok"][reference["mask"]].float().mean())
    width = max(len(s.tokens) for s in scored)
    temperature = cfg.rollout.temperature
    j0 = surrogate(model, train_batch, adv, temperature)

    def reset(lr_eps: float | None = None, lr_scale: float = 1.0) -> None:
        model.load_state_dict(start_weights)
        state.optimizer.state = defaultdict(dict)
        for group in state.optimizer.param_groups:
            group["eps"] = cfg.train.eps if lr_eps is None else lr_eps
            group["lr"] = cfg.train.lr * lr_scale
        state.scheduler.base_lrs = [cfg.train.lr * lr_scale for _ in state.optimizer.param_groups]

    def measure(name: str) -> dict:
        delta = torch.cat([(p.detach() - start_weights_param[i]).flatten() for i, p in enumerate(params)])
        row = {
            "update_norm": float(delta.norm()),
            "surrogate_gain": surrogate(model, train_batch, adv, temperature) - j0,
            **greedy_stats(model, eval_batch, reference)["stats"],
        }
        print(name, {k: round(v, 5) for k, v in row.items()}, flush=True)
        sys.stdout.flush()
        return row, delta

    start_weights_param = [p.detach().clone() for p in params]

    def adam(advantages: torch.Tensor, eps: float | None = None, lr_scale: float = 1.0) -> dict:
        reset(eps, lr_scale)
        m = policy_step(
            state,
            scored,
            advantages[:, None].expand(-1, width),
            step=step,
            loss=cfg.loss,
            micro_batch_size=cfg.train.micro_batch_size,
            pad_id=renderer.pad_id,
            temperature=temperature,
            updates=cfg.train.updates_per_iteration,
        )
        return m

    rows: dict = {}
    # The first update's gradient at the SFT weights, real advantages.
    reset()
    batch = TokenBatch.of(scored, renderer.pad_id)
    total = max(int(batch.generated.sum()), 1)
    from posttrain.trainers.policy_step import micro_batch_loss

    config = cfg.loss.model_copy(update={"reduction": "sum"})
    advantages = adv[:, None].expand(-1, width)
    for start in range(0, len(scored), cfg.train.micro_batch_size):
        stop = min(start + cfg.train.micro_batch_size, len(scored))
        chunk = batch.rows(start, stop)
        loss, _ = micro_batch_loss(
            model, chunk, advantages[start:stop, -chunk.width :], config=config, temperature=temperature
        )
        (loss.loss / total).backward()
    grad = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad.detach()).flatten() for p in params])
    state.optimizer.zero_grad(set_to_none=True)
    report["params"] = grad.numel()
    report["grad_norm"] = float(grad.norm())
    g2 = grad.square()
    order = torch.sort(g2, descending=True).values
    cum = order.cumsum(0) / order.sum()
    for share in (0.5, 0.9, 0.99):
        report[f"coords_holding_{int(share * 100)}pct_grad_sq"] = (
            float((cum < share).sum() + 1) / grad.numel()
        )
    top99 = g2 >= order[int((cum < 0.99).sum())]
    report["grad_rms"] = float(grad.square().mean().sqrt())
    report["grad_abs_median"] = float(grad.abs().median())

    reset()
    for start in range(0, len(scored), cfg.train.micro_batch_size):
        stop = min(start + cfg.train.micro_batch_size, len(scored))
        chunk = batch.rows(start, stop)
        loss, _ = micro_batch_loss(
            model,
            chunk,
            shuffled[:, None].expand(-1, width)[start:stop, -chunk.width :],
            config=config,
            temperature=temperature,
        )
        (loss.loss / total).backward()
    grad_s = torch.cat(
        [(torch.zeros_like(p) if p.grad is None else p.grad.detach()).flatten() for p in params]
    )
    state.optimizer.zero_grad(set_to_none=True)
    report["grad_norm_shuffled"] = float(grad_s.norm())
    report["cos_grad_real_vs_shuffled"] = float(grad @ grad_s / (grad.norm() * grad_s.norm()))
    report["coords_abs_grad_over_1e-4"] = float((grad.abs() > 1e-4).float().mean())
    report["coords_abs_grad_over_1e-6"] = float((grad.abs() > 1e-6).float().mean())
    m = adam(adv)
    rows["adam"], delta = measure("adam")
    rows["adam"]["grad_norm_logged"] = m.get("grad_norm", float("nan"))
    report["adam_cos_minus_grad"] = float(-(delta @ grad) / (delta.norm() * grad.norm()))
    report["adam_update_sq_share_outside_top99_grad"] = float(
        delta[~top99].square().sum() / delta.square().sum()
    )
    report["adam_update_abs_over_lr_median"] = float(delta.abs().median() / cfg.train.lr)
    adam(shuffled)
    rows["adam-shuffled"], delta_s = measure("adam-shuffled")
    report["cos_adam_real_vs_shuffled"] = float(delta @ delta_s / (delta.norm() * delta_s.norm()))
    for scale in args.lr_scale:
        adam(adv, lr_scale=scale)
        rows[f"adam-lr x{scale:g}"], _ = measure(f"adam-lr x{scale:g}")
    for eps in args.eps:
        adam(shuffled, eps)
        rows[f"adam-shuffled-eps={eps:g}"], _ = measure(f"adam-shuffled-eps={eps:g}")
    for eps in args.eps:
        adam(adv, eps)
        rows[f"adam-eps={eps:g}"], _ = measure(f"adam-eps={eps:g}")
    for c in args.sgd:
        reset()
        with torch.no_grad():
            offset = 0
            for p in params:
                n = p.numel()
                p.add_(grad[offset : offset + n].view_as(p), alpha=-c)
                offset += n
        rows[f"sgd x{c:g}"], _ = measure(f"sgd x{c:g}")
    report["variants"] = rows
    (out / "drift.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
