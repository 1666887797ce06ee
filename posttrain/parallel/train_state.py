"""The trainers' `TrainState` for a stage run in several processes with expert parallelism.

`ShardedTrainState.create` splits the routed experts over the EP groups (`shard_experts`), puts
FSDP2 over the rest when the stage sets `accelerate.fsdp` (`fully_shard_dense`, bf16 compute under
`accelerate.mixed_precision: bf16`) and otherwise all-reduces the dense gradients itself. accelerate
still runs the processes (gloo on CPU, NCCL on GPUs), the gradient-accumulation scaling and the
loss reduction, but it does not wrap the model: its DDP or FSDP wrapper would average the expert
gradients over ranks that hold different experts.

What changes against `TrainState`, and why:
- the optimizer step first brings the expert gradients to the mean over the world
  (`sync_expert_gradients`; the dense half too without FSDP2: `sync_gradients`), and clips by the
  norm of the whole model's gradient (`global_grad_norm`): each rank holds a different part of it;
- checkpoints: every rank writes its shards through DCP (`save_sharded`) and its RNG state into a
  staging directory, which rank 0 then moves into the stage's `CheckpointManager` checkpoint (hashed
  and renamed into place with the scheduler and the trainer's `extra` as on one process), so the
  atomicity and the damaged-checkpoint fallback are the manager's own; a resume needs the same world
  and EP sizes (checked, with the fix in the message);
- the final model is the gather-free export (`export_released_sharded`).

Quantile Balancing uses its histogram path at every world size here, also on one process, so a run
with `parallel:` balances the same way whatever the number of processes (one process is the
reference the multi-process runs are tested against).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from posttrain.checkpoint import Checkpoint, capture_rng_state, restore_rng_state
from posttrain.files import remove_tree
from posttrain.model.balancing import QuantileBalancer, update_router_bias
from posttrain.parallel.checkpoint import export_released_sharded, load_sharded, save_sharded
from posttrain.parallel.config import ParallelConfig
from posttrain.parallel.expert import (
    EXPERT_DIM,
    expert_parallel_mesh,
    expert_parameters,
    shard_experts,
    sync_expert_gradients,
    sync_gradients,
)
from posttrain.parallel.fsdp import fully_shard_dense
from posttrain.stages import StageContext
from posttrain.trainers.common import (
    AccelerateConfig,
    OptimConfig,
    TrainState,
    build_accelerator,
    build_optimizer,
    build_scheduler,
)

SHARDS = "sharded"  # the checkpoint's subdirectory holding the DCP files and per-rank RNG states


def use_histogram_balancing(model: nn.Module) -> None:
    """Every gate's Quantile Balancing on its histogram path (pooled across ranks by all-reduce)."""
    for module in model.modules():
        balancer = getattr(module, "balancer", None)
        if isinstance(balancer, QuantileBalancer):
            balancer.mode = "histogram"


def check_parallel_config(accelerate: AccelerateConfig, where: str) -> None:
    """What `parallel:` cannot run with, as errors naming the key and the fix."""
    if accelerate.deepspeed_config:
        raise ValueError(
            f"{where}: parallel: runs FSDP2 (accelerate.fsdp), not DeepSpeed; "
            "remove accelerate.deepspeed_config"
        )
    if accelerate.mixed_precision == "fp16":
        raise ValueError(f"{where}: parallel: supports accelerate.mixed_precision no or bf16, not fp16")
    fsdp = accelerate.fsdp
    if fsdp is None:
        if accelerate.mixed_precision != "no":
            raise ValueError(
                f"{where}: parallel: with accelerate.mixed_precision {accelerate.mixed_precision} needs "
                "accelerate.fsdp (bf16 compute is FSDP2's MixedPrecisionPolicy); add `fsdp: {}`"
            )
        return
    if fsdp.version != 2 or fsdp.cpu_offload or fsdp.wrap_classes != ["KimiK3DecoderLayer"]:
        raise ValueError(
            f"{where}: parallel: applies FSDP2 per KimiK3DecoderLayer itself; set accelerate.fsdp.version 2, "
            "cpu_offload false and leave wrap_classes at its default"
        )


@torch.no_grad()
def global_grad_norm(model: nn.Module, mesh: DeviceMesh) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, the same on every rank: FSDP2's dense shards summed
    over the world, the expert gradients over the EP group (each expert lives on one rank of it;
    the groups hold equal copies), plain dense gradients as they are (already all-reduced)."""
    experts = set(expert_parameters(model))
    grads = [(p, p.grad) for p in model.parameters() if p.grad is not None]
    sharded = sum(float(g.to_local().double().square().sum()) for p, g in grads if isinstance(g, DTensor))
    local = sum(float(g.double().square().sum()) for p, g in grads if p in experts)
    replicated = sum(
        float(g.double().square().sum()) for p, g in grads if p not in experts and not isinstance(g, DTensor)
    )
    device = next(model.parameters()).device  # NCCL reduces CUDA tensors only
    sums = torch.tensor([sharded, local], dtype=torch.float64, device=device)
    dist.all_reduce(sums[:1])
    dist.all_reduce(sums[1:], group=mesh[EXPERT_DIM].get_group())
    return torch.tensor(math.sqrt(float(sums.sum()) + replicated), dtype=torch.float32)


@torch.no_grad()
def clip_gradients(model: nn.Module, max_norm: float, total: torch.Tensor) -> None:
    """torch.nn.utils.clip_grad_norm_'s scaling with a norm computed elsewhere."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))


class ShardedTrainState(TrainState):
    """TrainState over an expert-parallel (and, with accelerate.fsdp, FSDP2) model; see the module
    docstring. Built by `create` only when the world has more than one process."""

    def __init__(self, *args: Any, mesh: DeviceMesh, fsdp: bool, parallel: ParallelConfig) -> None:
        super().__init__(*args)
        self.mesh = mesh
        self.fsdp = fsdp
        self.parallel = parallel

    @classmethod
    def create(  # type: ignore[override]
        cls,
        ctx: StageContext,
        model: nn.Module,
        optim: OptimConfig,
        accelerate: AccelerateConfig,
        parallel: ParallelConfig,
        total_steps: int,
        grad_accum: int = 1,
    ) -> TrainState:
        """A plain `TrainState` on one process (histogram balancing), this class on several."""
        check_parallel_config(accelerate, f"stage {ctx.stage_id}")
        use_histogram_balancing(model)
        # The model is not handed to accelerate (module docstring): no plugin, no autocast.
        plain = accelerate.model_copy(update={"fsdp": None, "mixed_precision": "no"})
        accelerator = build_accelerator(plain, grad_accum, ctx.log)
        world = accelerator.num_processes
        if world == 1:
            latest = ctx.checkpoints.latest_step()
            if latest is not None and (ctx.checkpoints.directory / f"step-{latest}" / SHARDS).is_dir():
                raise ValueError(
                    f"stage {ctx.stage_id}: checkpoint step {latest} is sharded over several processes "
                    "and this run has one; resume with the same number of processes and "
                    "parallel.expert_parallel (or restart the stage)"
                )
            if parallel.expert_parallel > 1:
                # as on several processes, the split must divide the world: unchecked, one process
                # trained every expert and the key meant nothing
                raise ValueError(
                    f"stage {ctx.stage_id}: parallel.expert_parallel is {parallel.expert_parallel} but the "
                    f"stage runs as one process; start it under `torchrun --nproc-per-node "
                    f"{parallel.expert_parallel}` (docs/scaling.md) or set parallel.expert_parallel: 1"
                )
            if accelerate.mixed_precision != "no" or accelerate.fsdp is not None:
                ctx.log.warning("parallel: one process: accelerate.fsdp and mixed precision not applied")
            return TrainState.create(ctx, model, optim, plain, total_steps, grad_accum)
        # accelerate does not prepare (so does not move) this model
        model.to(accelerator.device)
        mesh = expert_parallel_mesh(parallel.expert_parallel, accelerator.device.type)
        shard_experts(model, mesh[EXPERT_DIM].get_group())
        fsdp = accelerate.fsdp
        if fsdp is not None:
            if fsdp.activation_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            policy = None
            if accelerate.mixed_precision == "bf16":
                policy = MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, parallel.reduce_dtype)
                )
            fully_shard_dense(
                model,
                accelerator.device.type,
                mp_policy=policy,
                reshard_after_forward=fsdp.reshard_after_forward,
            )
        optimizer = build_optimizer(model, optim, fused=accelerator.device.type == "cuda")
        scheduler = build_scheduler(optimizer, optim, total_steps, ctx.log)
        ctx.log.info(
            "parallel: %d processes, experts split over %d, %s",
            world,
            parallel.expert_parallel,
            "FSDP2 over the rest" if fsdp is not None else "dense gradients all-reduced",
        )
        return cls(
            ctx,
            model,
            optimizer,
            scheduler,
            accelerator,
            optim.grad_clip,
            mesh=mesh,
            fsdp=fsdp is not None,
            parallel=parallel,
        )

    @property
    def unwrapped(self) -> nn.Module:
        return self.model

    def optimizer_step(self, step: int) -> dict[str, float]:
        if self.fsdp:
            sync_expert_gradients(self.model, self.mesh)
        else:
            sync_gradients(self.model, self.mesh)
        lr = self.lr
        norm = global_grad_norm(self.model, self.mesh)
        self.check_finite(norm, step, "the gradient norm", agreed=True)
        if self.grad_clip is not None:
            clip_gradients(self.model, self.grad_clip, norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(norm), "lr": lr, **update_router_bias(self.model)}

    def _layout(self) -> dict[str, int]:
        return {"world": dist.get_world_size(), "expert_parallel": self.parallel.expert_parallel}

    def save_checkpoint(self, step: int, extra: dict[str, Any] | None = None) -> Path | None:
        """A collective: every rank writes its shards, rank 0 commits the checkpoint (none, on every
        rank, when the stage keeps no checkpoints)."""
        manager = self.ctx.checkpoints
        if manager.keep == 0:
            return None
        staging = manager.directory / f".shards-step-{step}"
        if dist.get_rank() == 0:
            remove_tree(staging)  # left by a kill during an earlier attempt at this step
        dist.barrier()
        save_sharded(staging / "model", self.model, self.optimizer, self.mesh)
        torch.save(capture_rng_state(), staging / f"rng-rank{dist.get_rank()}.pt")
        dist.barrier()
        path = manager.directory / f"step-{step}"
        if dist.get_rank() == 0:
            path = manager.save(
                step,
                scheduler=self.scheduler,
                extra={**(extra or {}), "parallel": self._layout()},
                rng=False,
                write_files=lambda tmp: os.rename(staging, tmp / SHARDS),
            )
        dist.barrier()
        return path

    def restore(self) -> Checkpoint | None:
        """Every rank reads the newest intact checkpoint (the same one: rank 0 wrote it before the
        barrier that ended its save) and its own shards and RNG state."""
        dist.barrier()
        checkpoint = self.ctx.checkpoints.load(scheduler=self.scheduler, restore_rng=False)
        if checkpoint is None:
            return None
        saved = checkpoint.extra.get("parallel")
        if saved != self._layout():
            raise ValueError(
                f"stage {self.ctx.stage_id}: checkpoint {checkpoint.path} was written by {saved}, this run "
                f"is {self._layout()}; resume with the same number of processes and parallel.expert_parallel "
                "(or restart the stage)"
            )
        load_sharded(checkpoint.path / SHARDS / "model", self.model, self.optimizer, self.mesh)
        rng = checkpoint.path / SHARDS / f"rng-rank{dist.get_rank()}.pt"
        restore_rng_state(torch.load(rng, weights_only=True))
        return checkpoint

    def save_model(self, tokenizer: Any, output_dir: Path, stop_token_ids: list[int]) -> None:
        export_released_sharded(self.model, output_dir, self.mesh, tokenizer, stop_token_ids)
