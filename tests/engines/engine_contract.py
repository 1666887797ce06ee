"""Checks of the `Engine` contract that every backend's tests make (embedded, vLLM in-process, vLLM
server, TRL client): one wording of each check, so the backends are held to the same thing. A module
of its own (not conftest) so test files can import it by a name no other test directory uses."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from posttrain.data.sample import Sample
from posttrain.engines import Engine, SamplingConfig
from posttrain.engines.testing import reference_logprobs

FINISH_IDS = {"stop": "stop_token_ids", "tool_call": "tool_call_token_ids"}


def assert_scores_match(
    model: torch.nn.Module, samples: Sequence[Sample], scores: Sequence[Sequence[float]], atol: float = 1e-4
) -> None:
    """Each sample's score is `model`'s log p(token_t | tokens_<t) of each of its tokens, within `atol`."""
    for sample, score in zip(samples, scores, strict=True):
        torch.testing.assert_close(
            torch.tensor(score), reference_logprobs(model, sample.tokens), atol=atol, rtol=0
        )


def assert_response_logprobs(
    sample: Sample, expected: Sequence[float] | torch.Tensor, atol: float = 1e-4
) -> None:
    """The rollout log-probs after the prompt equal `expected`'s, a list aligned with
    `sample.tokens`, within `atol`."""
    start = sample.prompt_length
    torch.testing.assert_close(
        torch.tensor(sample.rollout_logprobs[start:]),
        torch.as_tensor(expected, dtype=torch.float32)[start:],
        atol=atol,
        rtol=0,
    )


def assert_token_ends_turn(
    engine: Engine, prompt: Callable[[], Sample], position: int, reasons: Sequence[str]
) -> Sample:
    """Greedy 6-token generation from `prompt()`, then again with the token it drew at `position` as
    a stop id ("stop") and as a tool-call id ("tool_call"): each turn ends at the first occurrence of
    that token, the token kept, with that finish reason. Returns the free generation."""
    free = engine.generate([prompt()], SamplingConfig(max_tokens=6, temperature=0.0))[0]
    generated = free.tokens[free.prompt_length :]
    target = generated[position]
    cut = generated.index(target) + 1
    for reason in reasons:
        sampling = SamplingConfig(max_tokens=6, temperature=0.0, **{FINISH_IDS[reason]: (target,)})
        ended = engine.generate([prompt()], sampling)[0]
        assert ended.finish_reason == reason and ended.tokens[ended.prompt_length :] == generated[:cut]
    return free
