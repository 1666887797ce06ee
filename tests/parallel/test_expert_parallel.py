"""Expert parallelism against the single-process model, in 2 and 4 gloo processes.

Every rank builds the same seeded tiny K3, runs the unsharded model on the whole batch (the
reference), then shards the routed experts (`shard_experts`) and runs its own rows of the batch.
Routing is uneven on purpose: the rows per rank differ and experts 6 and 7 get a selection bias of
-10, so they receive no token (at 4 ranks, rank 3 owns only them and receives nothing).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_support import TINY_YAML, batch, run_ranks, seeded_model
from torch.distributed.tensor import DTensor

from posttrain.model import load_model_config
from posttrain.model.balancing import update_router_bias
from posttrain.model.moe import KimiK3Experts, KimiK3MoEGate
from posttrain.parallel import (
    ShardedKimiK3Experts,
    expert_parallel_mesh,
    expert_parameters,
    shard_experts,
    sync_expert_gradients,
    sync_gradients,
)
from posttrain.parallel.fsdp import fully_shard_dense
from posttrain.qat import QATConfig, apply_qat
from posttrain.qat.apply import act_fake_quant, weight_fake_quant

FP32 = {"atol": 2e-5, "rtol": 1e-4}
RMS_TOL = 1e-5  # relative RMS error of a whole tensor: fp32 reduction-order noise is ~1e-7


def assert_rms_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """||actual - expected|| <= RMS_TOL * ||expected|| (fla's measure: one element of a large
    summed gradient may differ by more than an elementwise tolerance while the tensor agrees)."""
    err = float((actual - expected).norm())
    scale = max(float(expected.norm()), 1e-6)
    assert err <= RMS_TOL * scale, f"{what}: relative RMS error {err / scale:.2e} > {RMS_TOL:.0e}"


def rows_of(rank: int, world: int) -> slice:
    """Rank 0 takes two batch rows, every other rank one: ranks see different token counts."""
    start = 0 if rank == 0 else rank + 1
    return slice(start, start + (2 if rank == 0 else 1))


def summed_loss(model, ids, labels) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=ids).logits
    return logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def routed_experts(model) -> list[torch.nn.Module]:
    return [m.experts for m in model.modules() if hasattr(m, "experts")]


def check_model_forward_backward(rank: int, world: int) -> None:
    """Logits, every gradient and the next router biases of the sharded model equal the reference."""
    mesh = expert_parallel_mesh(world)
    ids, labels = batch(world)
    model = seeded_model()
    ref = copy.deepcopy(model)
    ref_logits, ref_loss = summed_loss(ref, ids, labels)
    ref_loss.backward()

    assert len(shard_experts(model, mesh["expert"].get_group())) == 3
    # QAT finds the sharded modules as it finds the unsharded ones (class name, hook attributes)
    assert apply_qat(model, QATConfig(scheme="k3")) == sorted(
        f"model.layers.{i}.block_sparse_moe.experts" for i in (1, 2, 3)
    )
    apply_qat(model, None)
    mine = rows_of(rank, world)
    logits, loss = summed_loss(model, ids[mine], labels[mine])
    loss.backward()
    torch.testing.assert_close(logits, ref_logits[mine], **FP32)

    experts = set(expert_parameters(model))
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        ref_grad = ref_params[name].grad
        if ref_grad is None:  # layer 0's first residual mix has nothing to mix yet
            assert p.grad is None, name
        elif p in experts:
            # The reverse all-to-all already brought every rank's contribution to the owner.
            local = slice(rank * (8 // world), (rank + 1) * (8 // world))
            assert_rms_close(p.grad, ref_grad[local], name)
        else:
            grad = p.grad.clone()
            dist.all_reduce(grad)
            assert_rms_close(grad, ref_grad, name)
    never_picked = 8 // world * rank >= 6
    if never_picked:  # this rank's experts got no row, so zero gradients (not missing ones)
        assert all(float(e.w1.grad.abs().max()) == 0.0 for e in routed_experts(model))

    # Quantile Balancing from the pooled histograms: the same new bias on every rank, and that of
    # the reference, which saw the whole batch in one histogram (a margin landing in the next bin
    # after an ulp of difference in the layers below moves a quantile by less than one bin).
    ref_gates = [m for m in ref.modules() if isinstance(m, KimiK3MoEGate)]
    widths = [g.balancer.bin_width for g in ref_gates]
    expected = []
    for g in ref_gates:
        quantiles = g.balancer.histogram_quantile(2 / 8)
        expected.append(quantiles - quantiles.mean())
    update_router_bias(model)
    gates = [m for m in model.modules() if isinstance(m, KimiK3MoEGate)]
    for gate, want, width in zip(gates, expected, widths, strict=True):
        everyone = [torch.empty(8) for _ in range(world)]
        dist.all_gather(everyone, gate.e_score_correction_bias)
        assert all(torch.equal(b, everyone[0]) for b in everyone)
        assert float((gate.e_score_correction_bias - want).abs().max()) <= width


def check_experts_with_qat(rank: int, world: int) -> None:
    """The experts module alone with MXFP4/MXFP8 fake quantisation: bitwise-identical inputs, so
    the quantised values and the straight-through gradients match the unsharded module."""
    mesh = expert_parallel_mesh(world)
    config = load_model_config(TINY_YAML)
    torch.manual_seed(2)
    full = KimiK3Experts(config, 32)
    with torch.no_grad():
        for w in (full.w1, full.w3, full.w2):
            w.normal_(0.0, 0.2)
    cfg = QATConfig(scheme="k3")
    full.weight_fake_quant, full.act_fake_quant = weight_fake_quant(cfg), act_fake_quant(cfg)
    sharded = ShardedKimiK3Experts(full, mesh["expert"].get_group())
    n = [5, 0, 7, 1]  # rank 1 has no token at all: it still joins both exchanges and their backward
    total = sum(n[:world])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(total, 32, generator=g, requires_grad=True)
    # two distinct experts per token out of 0..6 (1 and 5 favoured); no token picks expert 7
    favour = torch.tensor([1.0, 4.0, 1.0, 1.0, 1.0, 4.0, 1.0])
    topk_idx = torch.multinomial(favour.expand(total, 7), 2, generator=g)
    weight = torch.rand(total, 2, generator=g, requires_grad=True)
    ref_out = full(x, topk_idx, weight)
    probe = torch.randn(ref_out.shape, generator=g)
    (ref_out * probe).sum().backward()

    start = sum(n[:rank])
    mine = slice(start, start + n[rank])
    xl = x.detach()[mine].clone().requires_grad_(True)
    wl = weight.detach()[mine].clone().requires_grad_(True)
    out = sharded(xl, topk_idx[mine], wl)
    (out * probe[mine]).sum().backward()
    torch.testing.assert_close(out, ref_out[mine], **FP32)
    torch.testing.assert_close(xl.grad, x.grad[mine], **FP32)
    torch.testing.assert_close(wl.grad, weight.grad[mine], **FP32)
    local = slice(sharded.first_expert, sharded.first_expert + sharded.num_local_experts)
    for name in ("w1", "w3", "w2"):
        torch.testing.assert_close(getattr(sharded, name).grad, getattr(full, name).grad[local], **FP32)


def check_synced_gradients(rank: int, world: int, ep_size: int) -> None:
    """After `sync_gradients` every rank holds the gradient of the mean of the ranks' mean losses,
    i.e. that of single-process training on the whole batch (its experts' share of it for expert
    parameters); ep_size < world adds expert replicas, whose gradients are summed across groups."""
    mesh = expert_parallel_mesh(ep_size)
    ids, labels = batch(world)
    ids, labels = ids[:world], labels[:world]  # one row per rank: the mean of means is the global mean
    model = seeded_model()
    ref = copy.deepcopy(model)
    logits = ref(input_ids=ids).logits
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    shard_experts(model, mesh["expert"].get_group())
    logits = model(input_ids=ids[rank : rank + 1]).logits
    F.cross_entropy(logits.flatten(0, 1), labels[rank]).backward()
    sync_gradients(model, mesh)
    ep_rank = mesh["expert"].get_local_rank()
    per_rank = 8 // ep_size
    ref_params = dict(ref.named_parameters())
    experts = set(expert_parameters(model))
    for name, p in model.named_parameters():
        want = ref_params[name].grad
        if want is None:  # unused on every rank: left missing, so an optimizer skips it
            assert p.grad is None, name
            continue
        if p in experts:
            want = want[ep_rank * per_rank : (ep_rank + 1) * per_rank]
        assert_rms_close(p.grad, want, f"synced gradient of {name}")


def check_fsdp2_over_the_rest(rank: int, world: int) -> None:
    """FSDP2 over the dense part (experts left to EP): after `sync_expert_gradients`, FSDP's
    gradient shards and the expert gradients are those of one process on the whole batch."""
    mesh = expert_parallel_mesh(world)
    ids, labels = batch(world)
    ids, labels = ids[:world], labels[:world]
    model = seeded_model()
    ref = copy.deepcopy(model)
    logits = ref(input_ids=ids).logits
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    shard_experts(model, mesh["expert"].get_group())
    fully_shard_dense(model)
    logits = model(input_ids=ids[rank : rank + 1]).logits
    F.cross_entropy(logits.flatten(0, 1), labels[rank]).backward()
    sync_expert_gradients(model, mesh)
    experts = set(expert_parameters(model))
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = ref_params[name].grad
        if want is None:
            assert p.grad is None, name
        elif p in experts:
            assert_rms_close(p.grad, want[rank * (8 // world) : (rank + 1) * (8 // world)], name)
        else:
            assert isinstance(p, DTensor)  # sharded by FSDP2
            assert_rms_close(p.grad.full_tensor(), want, name)


def _worker(rank: int, world: int, workdir: str) -> None:
    check_model_forward_backward(rank, world)
    check_experts_with_qat(rank, world)
    check_synced_gradients(rank, world, ep_size=world)
    check_fsdp2_over_the_rest(rank, world)
    if world == 4:
        check_synced_gradients(rank, world, ep_size=2)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_one_process(world: int, tmp_path) -> None:
    run_ranks(_worker, world, tmp_path)
