"""KDA's fast paths against the spec `naive_recurrent_kda`: forward and every gradient, on odd
shapes (T = 1, 37, 100; K != V; D = 60), with and without an initial state, packed documents, and
gates from K3's bounded `kda_gate` so the chunk path runs at the edge of its -5 bound."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from posttrain.ops.kda import chunk_kda, fused_recurrent_kda, kda_gate, naive_recurrent_kda

FAST_PATHS = [chunk_kda, fused_recurrent_kda]
NAMES = ["q", "k", "v", "g", "beta", "initial_state"]


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """RMS error relative to the reference's RMS; the 1e-2 floor keeps exact zeros (dg of the first
    token with a zero state) from turning float rounding into an infinite ratio."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt().clamp_min(1e-2)).item()


def make_inputs(
    B: int, T: int, H: int, K: int, V: int, seed: int, dtype: torch.dtype = torch.float32, lower_bound=-5.0
) -> dict[str, torch.Tensor]:
    """Leaf tensors; f is scaled so many gates saturate at lower_bound."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    f = 4 * torch.randn(B, T, H * K, generator=gen)
    g = kda_gate(f, torch.randn(H, generator=gen), torch.randn(H * K, generator=gen), lower_bound)
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen)
    inputs = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta.to(dtype), initial_state=h0)
    return {name: x.requires_grad_() for name, x in inputs.items()}


def run_with_grads(fn, inputs: dict[str, torch.Tensor], seed: int = 1, **kwargs) -> dict[str, torch.Tensor]:
    """Outputs, final state and the gradients of a random projection of both."""
    args = {name: inputs[name] for name in NAMES[:5]}
    o, final_state = fn(**args, initial_state=inputs.get("initial_state"), output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    loss = (o.float() * torch.randn(o.shape, generator=gen)).sum()
    loss = loss + (final_state * torch.randn(final_state.shape, generator=gen)).sum()
    leaves = [x for x in inputs.values()]
    grads = torch.autograd.grad(loss, leaves)
    return {"o": o, "final_state": final_state} | {f"d{n}": g for n, g in zip(inputs, grads, strict=True)}


@pytest.mark.parametrize("fn", FAST_PATHS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(("T", "K", "V"), [(1, 32, 24), (37, 32, 24), (100, 60, 36), (100, 48, 48)])
@pytest.mark.parametrize("with_initial_state", [True, False])
def test_matches_naive_forward_and_grads(fn, T, K, V, with_initial_state):
    inputs = make_inputs(B=2, T=T, H=2, K=K, V=V, seed=T + K)
    if not with_initial_state:
        inputs.pop("initial_state")
    expected = run_with_grads(naive_recurrent_kda, inputs)
    actual = run_with_grads(fn, inputs)
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name].shape == expected[name].shape, name
        assert actual[name].dtype == expected[name].dtype, name
        assert rel_rms(actual[name], expected[name]) < 1e-5, name


@pytest.mark.parametrize("fn", FAST_PATHS, ids=lambda f: f.__name__)
def test_bf16_inputs_match_naive_and_keep_dtypes(fn):
    inputs = make_inputs(B=1, T=45, H=2, K=32, V=24, seed=3, dtype=torch.bfloat16)
    expected = run_with_grads(naive_recurrent_kda, inputs)
    actual = run_with_grads(fn, inputs)
    assert actual["o"].dtype == torch.bfloat16
    assert actual["final_state"].dtype == torch.float32
    assert actual["dq"].dtype == torch.bfloat16
    for name in expected:
        assert rel_rms(actual[name], expected[name]) < 1e-2, name


@pytest.mark.parametrize("fn", [naive_recurrent_kda, *FAST_PATHS], ids=lambda f: f.__name__)
def test_final_state_only_when_asked(fn):
    inputs = make_inputs(B=1, T=5, H=1, K=8, V=4, seed=0)
    o, final_state = fn(*(inputs[n] for n in NAMES[:5]))
    assert o.shape == (1, 5, 1, 4)
    assert final_state is None


@pytest.mark.parametrize("fn", FAST_PATHS, ids=lambda f: f.__name__)
def test_packed_documents_equal_separate_calls(fn):
    """State restarts at each boundary of cu_seqlens: outputs, final states and all gradients equal
    separate naive calls per document (lengths: tile-straddling, empty, single token)."""
    bounds = [0, 21, 21, 22, 70, 87]
    N, T = len(bounds) - 1, bounds[-1]
    inputs = make_inputs(B=1, T=T, H=2, K=32, V=24, seed=5)
    inputs["initial_state"] = torch.randn(N, 2, 32, 24).requires_grad_()
    actual = run_with_grads(fn, inputs, cu_seqlens=torch.tensor(bounds))

    gen = torch.Generator().manual_seed(1)
    o_weight = torch.randn(actual["o"].shape, generator=gen)
    state_weight = torch.randn(actual["final_state"].shape, generator=gen)
    loss = 0.0
    for n, (start, end) in enumerate(itertools.pairwise(bounds)):
        doc = {name: inputs[name][:, start:end] for name in NAMES[:5]}
        o, final_state = naive_recurrent_kda(
            **doc, initial_state=inputs["initial_state"][n : n + 1], output_final_state=True
        )
        if end > start:
            assert rel_rms(actual["o"][:, start:end], o) < 1e-5, f"document {n}"
        assert rel_rms(actual["final_state"][n : n + 1], final_state) < 1e-5, f"document {n}"
        loss = loss + (o * o_weight[:, start:end]).sum() + (final_state * state_weight[n : n + 1]).sum()
    expected_grads = torch.autograd.grad(loss, list(inputs.values()))
    for name, expected in zip(inputs, expected_grads, strict=True):
        assert rel_rms(actual[f"d{name}"], expected) < 1e-5, name


def test_prefill_then_decode_equals_one_pass():
    """The cached-generation pattern: chunk_kda over a prompt, then fused_recurrent_kda one token at
    a time from its final state, gives the outputs and state of one pass over everything."""
    inputs = make_inputs(B=2, T=23, H=2, K=32, V=24, seed=17)
    args = [inputs[n].detach() for n in NAMES[:5]]
    o_full, state_full = naive_recurrent_kda(*args, output_final_state=True)
    outputs, state = [], None
    o, state = chunk_kda(*(x[:, :20] for x in args), output_final_state=True)
    outputs.append(o)
    for t in range(20, 23):
        o, state = fused_recurrent_kda(
            *(x[:, t : t + 1] for x in args), initial_state=state, output_final_state=True
        )
        outputs.append(o)
    assert rel_rms(torch.cat(outputs, 1), o_full) < 1e-5
    assert rel_rms(state, state_full) < 1e-5


def test_chunk_outputs_are_causal():
    """A prefix gives the prefix's outputs: later tokens in the same tile leak nothing."""
    inputs = make_inputs(B=1, T=40, H=2, K=16, V=16, seed=7)
    args = [inputs[n].detach() for n in NAMES[:5]]
    o_full, _ = chunk_kda(*args)
    o_prefix, _ = chunk_kda(*(x[:, :21] for x in args))
    torch.testing.assert_close(o_prefix, o_full[:, :21], rtol=0, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_chunk_size_does_not_change_results(chunk_size):
    inputs = make_inputs(B=1, T=37, H=2, K=16, V=12, seed=11)
    expected = run_with_grads(naive_recurrent_kda, inputs)
    actual = run_with_grads(chunk_kda, inputs, chunk_size=chunk_size)
    for name in expected:
        assert rel_rms(actual[name], expected[name]) < 1e-5, name


def test_chunk_handles_gates_steeper_than_k3_bound():
    """g down to -12 per token: the tile shrinks so its cumulative decay stays above -80."""
    inputs = make_inputs(B=1, T=50, H=2, K=16, V=12, seed=13, lower_bound=-12.0)
    assert inputs["g"].min() < -11
    expected = run_with_grads(naive_recurrent_kda, inputs)
    actual = run_with_grads(chunk_kda, inputs)
    for name in expected:
        assert rel_rms(actual[name], expected[name]) < 1e-5, name


def test_chunk_rejects_unbounded_gate():
    inputs = make_inputs(B=1, T=4, H=1, K=8, V=4, seed=0)
    g = inputs["g"].detach().clone()
    g[0, 2, 0, 3] = -100.0
    with pytest.raises(ValueError, match="kda_gate"):
        chunk_kda(inputs["q"], inputs["k"], inputs["v"], g, inputs["beta"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(k=torch.zeros(1, 4, 1, 7)), "k must have q's shape"),
        (dict(v=torch.zeros(1, 3, 1, 4)), "v must be"),
        (dict(g=torch.zeros(1, 4, 1, 4)), "g must be"),
        (dict(beta=torch.zeros(1, 4)), "beta must be"),
        (dict(initial_state=torch.zeros(1, 1, 4, 8)), "initial_state must be"),
        (dict(cu_seqlens=torch.tensor([0, 3])), "cu_seqlens must rise from 0 to T=4"),
    ],
)
@pytest.mark.parametrize("fn", FAST_PATHS, ids=lambda f: f.__name__)
def test_bad_layouts_raise_clear_errors(fn, change, message):
    args = dict(q=torch.zeros(1, 4, 1, 8), k=torch.zeros(1, 4, 1, 8), v=torch.zeros(1, 4, 1, 4))
    args |= dict(g=torch.zeros(1, 4, 1, 8), beta=torch.zeros(1, 4, 1))
    with pytest.raises(ValueError, match=message):
        fn(**(args | change))


def test_cu_seqlens_needs_one_packed_row():
    inputs = make_inputs(B=2, T=4, H=1, K=8, V=4, seed=0)
    with pytest.raises(ValueError, match="B == 1"):
        chunk_kda(*(inputs[n] for n in NAMES[:5]), cu_seqlens=torch.tensor([0, 2, 4]))


def test_fla_backend_on_cpu_says_what_it_needs():
    inputs = make_inputs(B=1, T=4, H=1, K=8, V=4, seed=0)
    with pytest.raises(ImportError, match="flash-linear-attention"):
        chunk_kda(*(inputs[n] for n in NAMES[:5]), backend="fla")


def test_kda_gate_formula_shape_and_bound():
    gen = torch.Generator().manual_seed(0)
    B, T, H, K = 2, 3, 4, 5
    f = 10 * torch.randn(B, T, H * K, generator=gen)
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    g = kda_gate(f, A_log, dt_bias, lower_bound=-5.0)
    assert g.shape == (B, T, H, K)
    assert g.dtype == torch.float32
    for h in range(H):
        for c in range(K):
            x = f[..., h * K + c] + dt_bias[h * K + c]
            expected = -5.0 / (1 + torch.exp(-A_log[h].exp() * x))
            torch.testing.assert_close(g[..., h, c], expected)
    assert g.min() >= -5.0 and g.max() <= 0.0
    assert g.min() < -4.9  # the bound is reached, so chunk tests above exercise it


def test_kda_gate_gradients_match_the_formulas_in_every_input():
    """d g / d(f, A_log, dt_bias) against the hand-derived derivative of
    g = lb * sigmoid(a * x), a = exp(A_log), x = f + dt_bias: dg/dx = lb * s(1 - s) * a and
    dg/dA_log = lb * s(1 - s) * a * x, summed over what each input feeds."""
    gen = torch.Generator().manual_seed(1)
    B, T, H, K, lb = 2, 3, 2, 3, -5.0
    f = (3 * torch.randn(B, T, H * K, generator=gen)).requires_grad_()
    A_log = torch.randn(H, generator=gen).requires_grad_()
    dt_bias = torch.randn(H * K, generator=gen).requires_grad_()
    grad_out = torch.randn(B, T, H, K, generator=gen)
    kda_gate(f, A_log, dt_bias, lower_bound=lb).backward(grad_out)
    x = (f.detach() + dt_bias.detach()).double().unflatten(-1, (H, K))
    a = A_log.detach().double().exp()[:, None]
    s = torch.sigmoid(a * x)
    dg_dx = grad_out.double() * lb * s * (1 - s) * a
    torch.testing.assert_close(f.grad.double(), dg_dx.flatten(-2), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dt_bias.grad.double(), dg_dx.sum((0, 1)).flatten(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(A_log.grad.double(), (dg_dx * x).sum((0, 1, 3)), rtol=1e-4, atol=1e-5)


def test_kda_gate_rejects_width_not_divisible_by_heads():
    with pytest.raises(ValueError, match="multiple of H=3"):
        kda_gate(torch.zeros(2, 10), torch.zeros(3), torch.zeros(10))
