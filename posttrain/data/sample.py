"""The one record that flows data recipe -> renderer -> engine -> rewards -> trainer.

Every stage reads and writes `Sample`; no stage invents its own dict. Per-token fields are aligned
with `tokens` (the whole rendered sequence: prompt, generated tokens and any tool-result tokens the
environment appended), so masks and log-probs never need re-indexing between stages.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

EFFORTS: tuple[str, ...] = ("low", "high", "max")
DOMAINS: tuple[str, ...] = ("general", "agent", "coding")

FinishReason = Literal["stop", "length", "tool_call", "paused", "aborted"]


@dataclass
class Sample:
    """One prompt and, once sampled, one trajectory.

    Identity and task
      uid: unique id of this trajectory (prompt id + sample index).
      group: id of the prompt group (the n samples of one prompt share it; advantages are
        group-relative).
      domain / effort: the teacher route and the reasoning-effort conditioning input.
      messages: OpenAI-style conversation so far (system/user/assistant/tool), including the
        assistant turns generated and the tool results appended by the environment.
      tools: JSON schemas of the tools offered in this episode.
      task: the environment's private data (reference answer, hidden tests, ...). Never rendered
        into the prompt.
      images: the media of `messages`, in the order of their image / video content parts: an
        image is a file path or a data URI, a short video a list of them (its frames).

    Tokens (all per-token lists have len(tokens))
      tokens: rendered token ids of the whole trajectory.
      prompt_length: number of leading tokens that are prompt (never trained).
      loss_mask: 1 where the token was produced by the policy (or, in SFT, is an assistant token).
      rollout_logprobs: behaviour log-prob of each generated token at sampling time (0.0 elsewhere).
      policy_version: policy version that produced each generated token (-1 elsewhere).

    Generation state
      finish_reason: why generation stopped, None while never generated; "paused" means the
        sample is queued as a partial rollout and resumes from `tokens` (and `sandbox_snapshot`).
      done: the episode ended (answered, out of turns or submissions); set by the episode loop
        (posttrain.envs.environments.play_episodes), which never plays a done sample again.
      sandbox_snapshot: directory of the environment's snapshot for a paused agent trajectory.

    Scores
      reward: scalar outcome reward (verifier / GenRM / budget), None until scored.
      teacher_logprobs: teacher's log-prob of each token (MOPD prefill), aligned with tokens.
      metrics: free-form numbers for logging (usage tokens, verifier details, retries).
    """

    uid: str
    domain: str = "general"
    effort: str = "high"
    group: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    task: dict[str, Any] = field(default_factory=dict)
    images: list[str | list[str]] = field(default_factory=list)

    tokens: list[int] = field(default_factory=list)
    prompt_length: int = 0
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    policy_version: list[int] = field(default_factory=list)

    finish_reason: FinishReason | None = None
    done: bool = False
    sandbox_snapshot: str | None = None

    reward: float | None = None
    teacher_logprobs: list[float] | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def response_length(self) -> int:
        """Tokens after the prompt (generated plus environment-appended)."""
        return len(self.tokens) - self.prompt_length

    @property
    def generated_mask(self) -> list[int]:
        """Per token, 1 where the policy generated it: loss_mask after the prompt (tool results
        and feedback the environment appended are 0). What RL and MOPD train on."""
        return [0] * self.prompt_length + self.loss_mask[self.prompt_length :]

    @property
    def num_generated(self) -> int:
        """Policy-generated tokens (tool results excluded): a trajectory's response length."""
        return sum(self.loss_mask[self.prompt_length :])

    @property
    def trailing_generated(self) -> int:
        """Length of the trailing run of generated tokens: the current assistant turn so far."""
        count = 0
        for position in range(len(self.tokens) - 1, self.prompt_length - 1, -1):
            if not self.loss_mask[position]:
                break
            count += 1
        return count

    def append(
        self, token_ids: list[int], *, generated: bool, logprobs: list[float] | None = None, version: int = -1
    ) -> None:
        """Extend the trajectory, keeping every per-token list aligned with `tokens`."""
        n = len(token_ids)
        if logprobs is not None and len(logprobs) != n:
            raise ValueError(f"sample {self.uid}: {n} tokens but {len(logprobs)} logprobs")
        self.tokens.extend(token_ids)
        self.loss_mask.extend([1 if generated else 0] * n)
        self.rollout_logprobs.extend(logprobs if logprobs is not None else [0.0] * n)
        self.policy_version.extend([version if generated else -1] * n)

    def check(self) -> None:
        """Raise if per-token fields are misaligned (a bug, never user input)."""
        n = len(self.tokens)
        for name in ("loss_mask", "rollout_logprobs", "policy_version"):
            if len(getattr(self, name)) != n:
                count = len(getattr(self, name))
                raise ValueError(f"sample {self.uid}: {name} has {count} entries, tokens {n}")
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            count = len(self.teacher_logprobs)
            raise ValueError(f"sample {self.uid}: teacher_logprobs has {count} entries, tokens {n}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown Sample fields {sorted(unknown)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> Sample:
        return cls.from_dict(json.loads(line))
