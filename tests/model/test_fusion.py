"""The compiled elementwise regions (`compile_regions`, posttrain/ops/fusion.py) against their
eager twins on the CPU (inductor compiles for the CPU too): forward values and gradients of each
region on odd shapes, and a whole tiny K3's loss and gradients with padding."""

from __future__ import annotations

import functools

import pytest
import torch

import posttrain.model.kda as kda_layer
from posttrain.model import KimiK3Config, KimiK3ForCausalLM
from posttrain.model.kda import conv_qkv, gated_rms_norm
from posttrain.model.mlp import rms_norm
from posttrain.ops.attn_res import attn_res_mix, naive_attn_res
from posttrain.ops.attn_res.fused import mix_by_sources
from posttrain.ops.fusion import compiled, use_compiled
from posttrain.ops.kda import chunk_kda, kda_gate


def _grads(fn, *inputs):
    """fn's outputs and the gradients of a random projection of them w.r.t. the float inputs."""
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(1)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [x.grad for x in leaves if x.requires_grad]


def _assert_twins(fn, inputs, atol=1e-5):
    eager_out, eager_grads = _grads(fn, *inputs)
    fused_out, fused_grads = _grads(compiled(fn), *inputs)
    for a, b in zip(eager_out + eager_grads, fused_out + fused_grads, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(b.float(), a.float(), atol=atol, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norms_match_eager(dtype) -> None:
    torch.manual_seed(0)
    x = (torch.randn(3, 5, 37) * 3).to(dtype)
    w = torch.randn(37)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    _assert_twins(lambda x, w: rms_norm(x, w, 1e-5), (x, w), atol)
    gate = torch.randn(3, 5, 37).to(dtype)
    _assert_twins(lambda o, g, w: gated_rms_norm(o, g, w, 1e-5), (x, gate, w), atol)


@pytest.mark.parametrize("with_state", [False, True])
def test_conv_qkv_matches_eager(with_state) -> None:
    torch.manual_seed(0)
    B, T, H, K, W = 2, 7, 3, 5, 4
    qkv = torch.randn(B, T, 3 * H * K)
    weight = torch.randn(3 * H * K, W)
    state = torch.randn(B, 3 * H * K, W - 1) if with_state else None
    pos = None if with_state else torch.tensor([0, 1, 2, 0, 1, 0, 1])  # three packed documents
    inputs = (qkv, weight) if state is None else (qkv, weight, state)

    def fn(qkv, weight, state=None):
        return conv_qkv(qkv, weight, state, pos, H)

    _assert_twins(fn, inputs)


def test_kda_gate_matches_eager() -> None:
    torch.manual_seed(0)
    f, A_log, dt_bias = torch.randn(2, 9, 3 * 6), torch.randn(3), torch.randn(3 * 6)
    _assert_twins(lambda f, a, d: kda_gate(f, a, d, -5.0), (f, A_log, dt_bias))


@pytest.mark.parametrize("num_sources", [2, 3, 5])
def test_attn_res_mix_compiled_matches_naive(num_sources) -> None:
    torch.manual_seed(num_sources)
    sources = tuple(torch.randn(2, 7, 33) * (i + 1) for i in range(num_sources))
    w, q = torch.randn(33), torch.randn(33)

    def naive(w, q, *s):
        return naive_attn_res(s, w, q, 1e-5)

    def fused(w, q, *s):
        return attn_res_mix(s, w, q, 1e-5, compile_regions=True)

    naive_out, naive_grads = _grads(naive, w, q, *sources)
    fused_out, fused_grads = _grads(fused, w, q, *sources)
    for a, b in zip(naive_out + naive_grads, fused_out + fused_grads, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    # the eager form of the compiled region is the same function
    torch.testing.assert_close(mix_by_sources(sources, w, q, 1e-5), naive_out[0], atol=1e-5, rtol=1e-4)


def test_default_compiles_cuda_training_only() -> None:
    x = torch.zeros(1)
    assert not use_compiled(None, x)
    if torch.cuda.is_available():
        assert use_compiled(None, x.cuda())
        with torch.no_grad():
            assert not use_compiled(None, x.cuda())
    assert use_compiled(True, x) and not use_compiled(False, x)


def test_bad_setting_is_a_clear_error(tiny_config: KimiK3Config) -> None:
    with pytest.raises(ValueError, match="compile_regions='yes'"):
        KimiK3Config(**{**tiny_config.to_dict(), "compile_regions": "yes"})


_ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize(
    ("device", "kda_backend"),
    [
        ("cpu", "auto"),
        pytest.param("cuda", "torch", marks=_ON_GPU),
        pytest.param("cuda", "auto", marks=_ON_GPU),
    ],
)
def test_tiny_model_compiled_matches_eager(
    tiny_config: KimiK3Config, device: str, kda_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole model with every region compiled: same loss and gradients, left padding included.
    On CUDA the regions are inductor's Triton kernels; KDA runs our torch chunk path ("torch", the
    same float32 arithmetic as on the CPU, held to the elementwise tolerance) or fla's kernel ("auto").
    fla's KDA kernels run their float32 `tl.dot`s at Triton's default precision (TF32 on Hopper) and
    magnify the regions' last-bit differences in the backward: on an H200 up to 1.4e-3 of a
    parameter's largest gradient (embed_tokens elements 1.3e-3 apart at 1.16) against 8.5e-5 with the
    torch path, so that case is held per parameter to a fraction of its largest gradient."""
    if kda_backend != "auto":
        monkeypatch.setattr(kda_layer, "chunk_kda", functools.partial(chunk_kda, backend=kda_backend))
    losses, grads = [], []
    for setting in (False, True):
        config = KimiK3Config(**{**tiny_config.to_dict(), "compile_regions": setting})
        torch.manual_seed(0)
        model = KimiK3ForCausalLM(config).to(device).train()
        with torch.no_grad():  # non-zero queries: a uniform mix would hide schedule errors
            for name, p in model.named_parameters():
                if name.endswith("res_proj.weight"):
                    p.normal_()
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, config.vocab_size, (2, 11), generator=gen).to(device)
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        if device == "cuda" and kda_backend == "auto":
            scale = grads[0][name].abs().max().clamp_min(1e-6)
            gap = ((grads[1][name] - grads[0][name]).abs().max() / scale).item()
            assert gap < 5e-3, f"{name}: largest gradient difference {gap:.2e} of the largest gradient"
            continue
        atol = 1e-5 if device == "cpu" else 1e-4  # inductor's reduction orders on CUDA
        torch.testing.assert_close(
            grads[1][name], grads[0][name], atol=atol, rtol=1e-3, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_norms_feeding_matmuls_give_autocast_dtype_and_same_loss(tiny_config: KimiK3Config) -> None:
    """Under autocast the sublayer input norms return bf16: the same values every consumer's matmul
    cast to, so the loss is unchanged; gradients differ only by the bf16 sum of the consumers'."""
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(tiny_config).train()
    ids = torch.randint(3, tiny_config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    norms = [
        m for layer in model.model.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    assert all(n.feeds_matmuls for n in norms) and not model.model.norm.feeds_matmuls
    results = []
    for feeds in (False, True):
        for n in norms:
            n.feeds_matmuls = feeds
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            assert norms[0](torch.ones(2, tiny_config.hidden_size)).dtype == (
                torch.bfloat16 if feeds else torch.float32
            )
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append(
            (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        )
    (loss_fp32, grads_fp32), (loss_bf16, grads_bf16) = results
    assert torch.equal(loss_bf16, loss_fp32)
    for name, grad in grads_fp32.items():
        scale = grad.abs().max().clamp_min(1e-6)
        assert (grads_bf16[name] - grad).abs().max() / scale < 0.05, name


def test_router_logits_stay_float32_under_autocast(tiny_config: KimiK3Config) -> None:
    """The MoE gate's matmul runs in float32 under autocast too (vLLM's GateLinear does)."""
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(tiny_config).eval()
    gate = model.model.layers[-1].block_sparse_moe.gate
    x = torch.randn(13, tiny_config.hidden_size)
    idx, weight = gate(x)
    with torch.autocast("cpu", torch.bfloat16):
        idx_ac, weight_ac = gate(x)
    assert weight_ac.dtype == torch.float32
    assert torch.equal(idx_ac, idx) and torch.equal(weight_ac, weight)
