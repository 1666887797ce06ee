"""Expert parallelism for K3's routed experts: each rank of an EP group holds E/R of them.

Full K3 cannot gather a layer's 896 experts on one GPU (docs/scaling.md, section 4), so the experts
stay where they live and the tokens travel. `ShardedKimiK3Experts` replaces a block's
`KimiK3Experts` (`shard_experts`): it keeps experts [r*E/R, (r+1)*E/R) of rank r as the same three
3-D parameters (`w1`, `w3` [E/R, I, D], `w2` [E/R, D, I]), and its forward takes the same arguments
and returns the same value as the unsharded module on the tokens of this rank:

1. the latent token vectors (D = routed_expert_hidden_size, 3584 at full size), one row per
   (token, choice), sorted by expert, go by all-to-all to the rank that owns the expert;
2. that rank runs its experts (SiTU-GLU) on the rows it received from every rank;
3. the outputs go back by the reverse all-to-all, and the source rank weights them with the
   router's mixture weights and sums each token's k choices.

The mixture weights never leave their rank, so the router's gradient is computed where the router
is. The backward of each exchange is the reverse exchange (`AllToAll`), so the gradient of a local
expert is the sum over every rank's tokens: expert gradients need no all-reduce within the EP group,
only across groups that hold the same experts (`sync_gradients`). QAT hooks mean what they mean on
the unsharded module: `weight_fake_quant` on each local 3-D weight (MX blocks run along the last
dim, so quantising a slice of experts equals slicing the quantised tensor) and `act_fake_quant` on
the rows before they are sent (blocks run along each row, so it is the same as quantising on
arrival) and on the SiTU output entering w2.

Not here: MoonEP's duplication of overloaded experts into fixed-size buffers (each rank receives
whatever the router sends it), and grouped GEMMs (the local experts run one matmul each, as
`KimiK3Experts` does on CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from posttrain.model.mlp import glu_activation
from posttrain.model.moe import KimiK3Experts
from posttrain.parallel.all_to_all import AllToAll, all_to_all_rows, exchange_counts

EXPERT_DIM = "expert"
REPLICA_DIM = "expert_replica"


def expert_parallel_mesh(ep_size: int, device_type: str = "cpu") -> DeviceMesh:
    """A 2-D mesh (expert_replica, expert) over the whole world: ranks g*ep_size ... (g+1)*ep_size-1
    split the experts between them (one EP group), and the ranks at the same position of different
    groups hold the same experts (they all-reduce those experts' gradients)."""
    world = dist.get_world_size()
    if ep_size < 1 or world % ep_size:
        raise ValueError(
            f"expert parallelism: ep_size={ep_size} must divide the world size {world}; "
            f"pick a divisor of {world}"
        )
    shape = (world // ep_size, ep_size)
    return init_device_mesh(device_type, shape, mesh_dim_names=(REPLICA_DIM, EXPERT_DIM))


class ShardedKimiK3Experts(nn.Module):
    """This rank's share of a block's routed experts; forward(x [N, D], topk_idx [N, k],
    topk_weight [N, k]) -> [N, D], equal to `KimiK3Experts` on the same arguments.

    A collective: every rank of the group must call forward (and backward) the same number of
    times, also with N = 0 tokens. Built from the full module by `shard_experts`; a full module on
    the meta device gives meta shards, to be materialised (`to_empty`) and loaded.
    """

    def __init__(self, experts: KimiK3Experts, group: ProcessGroup) -> None:
        super().__init__()
        self.config = experts.config
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        self.num_experts = experts.num_experts
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"expert parallelism: {self.num_experts} experts do not split evenly over {self.ep_size} "
                "ranks; choose an EP size that divides config.num_experts"
            )
        self.num_local_experts = self.num_experts // self.ep_size
        self.first_expert = self.ep_rank * self.num_local_experts
        local = slice(self.first_expert, self.first_expert + self.num_local_experts)
        self.w1 = nn.Parameter(experts.w1.detach()[local].clone())
        self.w3 = nn.Parameter(experts.w3.detach()[local].clone())
        self.w2 = nn.Parameter(experts.w2.detach()[local].clone())
        self.weight_fake_quant = experts.weight_fake_quant
        self.act_fake_quant = experts.act_fake_quant

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        wq = self.weight_fake_quant or (lambda w: w)
        aq = self.act_fake_quant or (lambda a: a)
        x = aq(x)
        k = topk_idx.shape[1]
        flat_expert = topk_idx.flatten()
        order = flat_expert.argsort(stable=True)  # (token, choice) rows by expert: by owner rank too
        token = order // k
        sorted_expert = flat_expert[order]
        send_counts = torch.bincount(sorted_expert // self.num_local_experts, minlength=self.ep_size)
        recv_counts = exchange_counts(send_counts, self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        local_expert = all_to_all_rows(sorted_expert % self.num_local_experts, recv, send, self.group)
        rows = AllToAll.apply(x[token], recv, send, self.group)
        # The master weights stay float32; under FSDP2's bf16 policy the rows arrive in bf16 and the
        # (fake-quantised) weights are cast to them, as FSDP2 casts the parameters it manages.
        w1, w3, w2 = (wq(w).to(rows.dtype) for w in (self.w1, self.w3, self.w2))
        y = self._run_local_experts(rows, local_expert, w1, w3, w2, aq)
        back = AllToAll.apply(y, send, recv, self.group)
        back = back * topk_weight.flatten()[order][:, None].to(x.dtype)
        # One index_add over expert-sorted rows: each token sums its choices in expert order, as the
        # unsharded module does.
        return torch.zeros_like(x).index_add(0, token, back)

    def _run_local_experts(self, rows, local_expert, w1, w3, w2, aq) -> torch.Tensor:
        """rows [M, D] received from every rank, local_expert [M] -> expert outputs [M, D], same order.

        Every local expert runs, also on zero rows, so the output always depends on `rows` and the
        backward reaches the dispatch exchange on every rank (a rank left out would hang the others).
        """
        perm = local_expert.argsort(stable=True)
        counts = torch.bincount(local_expert, minlength=self.num_local_experts).tolist()
        xs = rows[perm]
        # unbind: one backward node stacks the local weight gradients (w1[e] would add a zero-filled
        # full-size gradient per expert).
        w1s, w3s, w2s = w1.unbind(0), w3.unbind(0), w2.unbind(0)
        outs, start = [], 0
        for e, n in enumerate(counts):
            xe = xs[start : start + n]
            h = aq(glu_activation(self.config, xe @ w1s[e].t(), xe @ w3s[e].t()))
            outs.append(h @ w2s[e].t())
            start += n
        ys = torch.cat(outs)
        return torch.empty_like(ys).index_copy(0, perm, ys)


def shard_experts(model: nn.Module, group: ProcessGroup) -> list[str]:
    """Replace every `KimiK3Experts` in the model by this rank's `ShardedKimiK3Experts` over
    `group` (the block's forward is unchanged: it calls `self.experts` with the same arguments).
    Returns the qualified names of the replaced modules, sorted."""
    replaced = []
    for name, module in list(model.named_modules()):
        experts = getattr(module, "experts", None)
        if isinstance(experts, KimiK3Experts):
            module.experts = ShardedKimiK3Experts(experts, group)
            replaced.append(f"{name}.experts" if name else "experts")
    if not replaced:
        raise ValueError(f"shard_experts: {type(model).__name__} has no KimiK3Experts module to shard")
    return sorted(replaced)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that live on one rank of an EP group only (the sharded experts), in module
    order (the same on every rank, so flat buffers line up across ranks)."""
    return [p for m in model.modules() if isinstance(m, ShardedKimiK3Experts) for p in m.parameters()]


@torch.no_grad()
def sync_gradients(model: nn.Module, mesh: DeviceMesh) -> None:
    """Turn each rank's gradients into those of the mean of all ranks' losses (plain data parallel
    with expert parallelism inside; under FSDP2, which averages the dense half itself, call
    `sync_expert_gradients` alone).

    Dense parameters: summed over the world (one all-reduce of one flat buffer), then divided by the
    world size; expert parameters: `sync_expert_gradients`. A parameter that has a gradient on some
    rank only gets a zero gradient on the others, so every rank sends buffers of the same size; one
    that has none on any rank (unused by the model) keeps None, so the optimizer skips it as it
    would on one process. Every rank holds the same module structure, so parameters are matched by
    position.
    """
    world = dist.get_world_size()
    experts = set(expert_parameters(model))
    params = [p for p in model.parameters() if p.requires_grad]
    # on the parameters' device: NCCL reduces CUDA tensors only
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX)
    params = [p for p, used in zip(params, has_grad.tolist(), strict=True) if used]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    _sum_then_divide([p.grad for p in params if p not in experts], dist.group.WORLD, world)
    sync_expert_gradients(model, mesh)


@torch.no_grad()
def sync_expert_gradients(model: nn.Module, mesh: DeviceMesh) -> None:
    """Expert gradients of the mean of all ranks' losses: the exchange's backward already summed
    them over the EP group, so only the ranks holding the same experts (the mesh's expert_replica
    dim) sum them, and all are divided by the world size. Every local expert runs on every forward,
    so every rank has these gradients after a backward."""
    replicas = mesh[REPLICA_DIM]
    grads = [p.grad for p in expert_parameters(model) if p.grad is not None]
    _sum_then_divide(grads, replicas.get_group() if replicas.size() > 1 else None, dist.get_world_size())


def _sum_then_divide(grads: list[torch.Tensor], group: ProcessGroup | None, world: int) -> None:
    """Sum grads over group (None: nothing to sum) as one flat buffer, divide by world, write back."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat.div_(world)
    start = 0
    for g in grads:
        g.copy_(flat[start : start + g.numel()].view_as(g))
        start += g.numel()
