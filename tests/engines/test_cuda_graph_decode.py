"""The pre-allocated-cache decoder (posttrain/engines/cuda_graph_decode.py), greedy and fixed
length, against the uncached greedy decode: the model's full forward over prompt + tokens so far,
argmax of the last position.
CPU: the step run eagerly over the static buffers, fp32, tokens equal. GPU (`gpu` marker): the
step captured as a CUDA graph, bf16 grouped experts; tokens equal the eager static step and are
as near the fp32 argmax as the bf16 uncached greedy's."""

from __future__ import annotations

import pytest
import torch

from posttrain.engines import SamplingConfig
from posttrain.engines.cuda_graph_decode import CudaGraphK3Decoder
from posttrain.engines.testing import tiny_k3

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NEW = 10
GREEDY = SamplingConfig(max_tokens=NEW, temperature=0)


def _prompts(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 9 positions, the last one left-padded by 4."""
    ids = torch.randint(3, 2048, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def _model(device: str, dtype: torch.dtype):
    model = tiny_k3(seed=3, init_scale=4.0).eval()
    with torch.no_grad():  # non-uniform attention-residual mixes exercise the block schedule
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(0.0, 0.5)
    return model.to(device=device, dtype=dtype)


@torch.no_grad()
def _uncached_logits(model, ids, mask, new_tokens) -> torch.Tensor:
    """Logits [B, NEW, V] the uncached model gives at each generated position for these tokens."""
    seq = torch.cat([ids, new_tokens], dim=1)
    full = torch.cat([mask, torch.ones_like(new_tokens)], dim=1)
    logits = model(input_ids=seq, attention_mask=full, use_cache=False).logits.float()
    return logits[:, ids.shape[1] - 1 : -1]


@torch.no_grad()
def _uncached_greedy(model, ids, mask) -> torch.Tensor:
    seq, full = ids, mask
    for _ in range(NEW):
        nxt = (
            model(input_ids=seq, attention_mask=full, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        )
        seq, full = torch.cat([seq, nxt], 1), torch.cat([full, torch.ones_like(nxt)], 1)
    return seq[:, ids.shape[1] :]


def test_static_step_equals_uncached_greedy_on_cpu() -> None:
    model = _model("cpu", torch.float32)
    ids, mask = _prompts("cpu")
    # a batch of 4 for 3 rows: the spare row rides along inactive
    decoder = CudaGraphK3Decoder(model, batch=4, max_len=ids.shape[1] + NEW + 1, sampling=GREEDY, graph=False)
    tokens = decoder.greedy(ids, mask, NEW)
    assert torch.equal(tokens, _uncached_greedy(model, ids, mask))
    # reusable: a second call with other prompts starts from clean buffers
    ids2 = torch.roll(ids, 1, dims=1).masked_fill(mask == 0, 0)
    assert torch.equal(decoder.greedy(ids2, mask, NEW), _uncached_greedy(model, ids2, mask))


def test_bad_sizes_are_clear_errors() -> None:
    model = _model("cpu", torch.float32)
    ids, mask = _prompts("cpu")
    decoder = CudaGraphK3Decoder(model, batch=3, max_len=ids.shape[1] + 2, sampling=GREEDY, graph=False)
    with pytest.raises(ValueError, match="need max_len > 19"):
        decoder.greedy(ids, mask, NEW)
    with pytest.raises(ValueError, match="does not fit 2 rows"):
        CudaGraphK3Decoder(model, batch=2, max_len=40, sampling=GREEDY, graph=False).greedy(ids, mask, 2)
    sampled = CudaGraphK3Decoder(
        model, batch=3, max_len=40, sampling=SamplingConfig(max_tokens=4), graph=False
    )
    with pytest.raises(ValueError, match="temperature 0"):
        sampled.greedy(ids, mask, 2)
    with pytest.raises(ValueError, match="eval mode"):
        CudaGraphK3Decoder(model.train(), batch=3, max_len=40, sampling=GREEDY, graph=False)


@pytest.mark.gpu
@gpu
def test_captured_step_equals_uncached_greedy_on_gpu() -> None:
    """Captured == eager static step, bit for bit. Against the uncached decode the bar is bf16's
    own: this sharp (init_scale 4) model has positions where bf16 noise picks a token 1.4-3.7
    logits off the fp32 argmax (a fp32 twin of the same weights), and which of the two bf16 paths
    lands on such a token moves with any kernel change (on the H200 the uncached greedy took the
    3.7 one at row 2, step 5 when this test was written; on 9a275de the decoder did, the uncached
    one the next-best). So no mean gap, which one such flip decides: the decoder's tokens must be
    the fp32 argmax, and far from it, about as often as the bf16 uncached greedy's (a wrong mask
    or cache diverges after a step and is off at most positions)."""
    model = _model("cuda", torch.bfloat16)
    twin = _model("cuda", torch.float32)
    twin.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    ids, mask = _prompts("cuda")
    max_len = ids.shape[1] + NEW + 1
    graphed = CudaGraphK3Decoder(model, batch=3, max_len=max_len, sampling=GREEDY, graph=True)
    assert graphed.graph is not None
    tokens = graphed.greedy(ids, mask, NEW)
    eager = CudaGraphK3Decoder(model, batch=3, max_len=max_len, sampling=GREEDY, graph=False)
    assert torch.equal(tokens, eager.greedy(ids, mask, NEW))

    def gaps(chosen_tokens: torch.Tensor) -> torch.Tensor:
        logits = _uncached_logits(twin, ids, mask, chosen_tokens)
        chosen = logits.gather(-1, chosen_tokens[..., None]).squeeze(-1)
        return logits.max(-1).values - chosen  # 0 where the token is the fp32 argmax

    ours, reference = gaps(tokens), gaps(_uncached_greedy(model, ids, mask))
    message = f"decoder gaps {ours}, uncached bf16 {reference}"
    assert (ours == 0).float().mean() >= (reference == 0).float().mean() - 0.1, message
    assert (ours > 0.5).float().mean() <= (reference > 0.5).float().mean() + 0.1, message
