"""The one rollout/scoring interface every backend implements, and the sampling rules they share.

RL samples trajectories and MOPD prefills teacher log-probs; both talk to an `Engine` and never
to a backend directly, so swapping the embedded K3 engine for vLLM (in-process, a server, or a
TRL fleet) is a config change. What must be identical across backends lives here: the sampling
config, how stop tokens map to finish reasons, how much of `max_tokens` a resumed sample has
already spent, and the per-(seed, uid, position) random stream that makes a paused-and-resumed
trajectory equal to an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from posttrain.data.sample import Sample
from posttrain.registry import Registry

PauseWhen = Callable[[list[Sample]], bool]
WeightsSource = Mapping[str, torch.Tensor] | str | Path
LogprobsMode = Literal["raw", "processed"]


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How to sample one assistant turn.

    max_tokens: tokens generated in the current assistant turn at most; a paused or aborted
      sample counts the tokens it already generated in this turn (the trailing generated run).
    temperature: 0 means greedy (top_p / top_k are then irrelevant).
    top_p / top_k: nucleus and top-k truncation (1.0 / 0 = off).
    stop_token_ids: end the turn with finish_reason "stop" (end-of-turn ids).
    tool_call_token_ids: end the turn with finish_reason "tool_call" (tool-calls-end ids); the
      environment runs the tools and appends their results before the next turn.
    seed: base seed of the per-(seed, uid, position) random stream.
    logprobs: "raw" records the model's log-prob of each sampled token at temperature 1 (what
      `Engine.score` returns and what the trainer recomputes); "processed" records the log-prob
      under the distribution actually sampled from (temperature, top-k, top-p applied). Greedy
      records the model's log-prob in both modes.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    tool_call_token_ids: tuple[int, ...] = ()
    seed: int = 0
    logprobs: LogprobsMode = "raw"
    _all_stops: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "tool_call_token_ids", tuple(int(t) for t in self.tool_call_token_ids))
        if self.max_tokens < 1:
            raise ValueError(f"SamplingConfig.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.logprobs not in ("raw", "processed"):
            raise ValueError(f"SamplingConfig.logprobs must be 'raw' or 'processed', got {self.logprobs!r}")
        both = set(self.stop_token_ids) & set(self.tool_call_token_ids)
        if both:
            raise ValueError(
                f"token ids {sorted(both)} are in both stop_token_ids and tool_call_token_ids; "
                "an id ends a turn either as 'stop' or as 'tool_call'"
            )
        object.__setattr__(self, "_all_stops", frozenset(self.stop_token_ids + self.tool_call_token_ids))

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        return self._all_stops

    @property
    def is_plain(self) -> bool:
        """True when raw and processed log-probs are the same numbers: sampling from the unmodified
        model distribution, or greedy (which records the model's log-prob in both modes)."""
        return self.temperature == 0.0 or (self.temperature == 1.0 and self.top_p == 1.0 and self.top_k == 0)

    def finish_reason_for(self, token_id: int) -> Literal["stop", "tool_call"] | None:
        if token_id in self.tool_call_token_ids:
            return "tool_call"
        if token_id in self.stop_token_ids:
            return "stop"
        return None


class EngineError(RuntimeError):
    """A backend failed for some samples; `failed_uids` names them (never silently dropped)."""

    def __init__(self, message: str, failed_uids: list[str]) -> None:
        super().__init__(f"{message}; failed samples: {failed_uids}")
        self.failed_uids = failed_uids


class Engine(ABC):
    """Rollout + scoring over one policy.

    generate(samples, sampling, pause_when=None) -> the same Sample objects, each extended by
      `sample.append(ids, generated=True, logprobs=..., version=engine.policy_version)` and given a
      finish_reason in {"stop", "length", "tool_call", "paused"}. A "paused" sample passed again
      continues from its tokens. pause_when(samples) is checked between decoding steps.
    score(samples) -> per-token log-probs aligned with sample.tokens (index 0 -> 0.0), temperature 1.
    update_weights(state_dict or path) loads new policy weights and bumps policy_version.
    """

    policy_version: int = 0

    @abstractmethod
    def generate(
        self, samples: list[Sample], sampling: SamplingConfig, pause_when: PauseWhen | None = None
    ) -> list[Sample]: ...

    @abstractmethod
    def score(self, samples: list[Sample]) -> list[list[float]]: ...

    @abstractmethod
    def update_weights(self, weights: WeightsSource) -> None: ...

    def close(self) -> None:  # noqa: B027  (a deliberate no-op default: most backends hold nothing)
        """Release processes and memory the backend holds."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


ENGINES: Registry[type[Engine]] = Registry("engine")


def check_prompt(sample: Sample) -> None:
    """Reject a sample an engine cannot continue, naming it and the fix."""
    if not sample.tokens:
        raise ValueError(
            f"sample {sample.uid}: no tokens; render the prompt (ChatRenderer.render_prompt) first"
        )
    sample.check()


def check_text_prompt(sample: Sample, engine: str) -> None:
    """Reject a sample with images on an engine that sends token ids only (the images would be
    dropped and the model would read `<|media_pad|>` tokens as text)."""
    if sample.images:
        raise ValueError(
            f"sample {sample.uid}: {len(sample.images)} media entries, but the {engine} engine sends token "
            "ids only; play a multimodal policy with engine `vllm` (in-process) or `embedded`"
        )


def tokens_already_generated(sample: Sample) -> int:
    """Tokens this turn already produced: the trailing generated run of a paused (or aborted)
    sample, else 0.

    A fresh turn (after a prompt or tool results, which are not generated) starts at 0; a paused
    sample, or one a failed server left unfinished, resumes with its budget partly spent, so
    pause/resume and retries honour the same max_tokens.
    """
    return sample.trailing_generated if sample.finish_reason in ("paused", "aborted") else 0


def sampling_key(seed: int, uid: str, position: int) -> int:
    """63-bit seed of the random draw for the token at `position` of trajectory `uid`.

    Hashing (not `seed + position`) keeps streams of different uids and seeds unrelated.
    """
    digest = hashlib.blake2b(f"{seed}\x1f{uid}\x1f{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def score_from_prompt_logprobs(tokens: list[int], prompt_logprobs: list[float | None]) -> list[float]:
    """Align a backend's per-position prompt log-probs with `tokens` (first position -> 0.0)."""
    if len(prompt_logprobs) != len(tokens):
        raise ValueError(f"backend returned {len(prompt_logprobs)} prompt logprobs for {len(tokens)} tokens")
    out = [0.0]
    for position, value in enumerate(prompt_logprobs[1:], start=1):
        if value is None or math.isnan(value):
            raise ValueError(
                f"backend returned no logprob for token {tokens[position]} at position {position}"
            )
        out.append(float(value))
    return out
