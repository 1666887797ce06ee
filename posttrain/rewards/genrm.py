"""A generative reward model (GenRM): a judge model, served by any engine, grades a candidate
answer against a rubric where no verifier exists (K3 spec section 2.2).

Two length caps keep it honest. The candidate is cut at `max_candidate_tokens` before the judge
sees it, and a candidate over the cap loses `over_cap_penalty` (default 1.0, the whole score
range), so padding an answer never wins: beyond the cap the judge sees nothing more, and the
penalty puts any over-cap candidate at or below every candidate within the cap. The judge's own
output is capped at `max_judge_tokens`. The score is read from one fixed format on the judge's
last line, "Score: N/<score_max>"; a judgement without it is counted and returned as None, never
silently scored 0.

The `rl` stage builds the judge from its `genrm:` block (`GenRMConfig`, this module) with
`stage_judge`, and environments with `reward: genrm` call its `score_samples`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from pydantic import BaseModel, ConfigDict, Field

from posttrain.data.chat import ChatRenderer, load_tokenizer, model_tokenizer_dir
from posttrain.data.sample import Sample
from posttrain.engines import EmbeddedEngine, SamplingConfig

if TYPE_CHECKING:
    from posttrain.stages import StageContext


class GenRMConfig(BaseModel):
    """The `genrm:` block of an `rl` stage file: the judge model and how it grades."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rubric: str = Field(min_length=1, description="what a good answer is, in the judge's words")
    max_candidate_tokens: int = Field(
        1024, gt=0, description="the candidate is cut to this many tokens before the judge sees it"
    )
    max_judge_tokens: int = Field(512, gt=0, description="cap on the judge's own output")
    score_max: int = Field(10, gt=0, description='N in the judge\'s last line "Score: N/score_max"')
    over_cap_penalty: float = Field(
        1.0,
        ge=0.0,
        description="subtracted from the [0, 1] score of a candidate over max_candidate_tokens "
        "(>= 1: any over-cap candidate scores <= 0)",
    )
    judge: str = Field("sft", description="the judge model: a need's stage id or a model dir")


class TextTokenizer(Protocol):
    """The part of a Hugging Face tokenizer GenRM uses."""

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *args: Any, **kwargs: Any) -> str: ...


class JudgeEngine(Protocol):
    """Any engine of posttrain.engines: generate appends the judge's tokens to each sample."""

    def generate(self, samples: list[Sample], sampling: Any) -> list[Sample]: ...


class CappedCandidate(NamedTuple):
    """text: what the judge sees; num_tokens: the full candidate's length; over_cap: it was cut."""

    text: str
    num_tokens: int
    over_cap: bool


class Judgement(NamedTuple):
    """reward: score / score_max minus the over-cap penalty, None when unparsable; score: the
    judge's N (None when unparsable); judge_text: the judge's (capped) output, for logs."""

    reward: float | None
    score: int | None
    over_cap: bool
    candidate_tokens: int
    judge_text: str


def cap_candidate(text: str, tokenizer: TextTokenizer, max_tokens: int) -> CappedCandidate:
    """Cut `text` to its first `max_tokens` tokens."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return CappedCandidate(text, len(ids), False)
    return CappedCandidate(tokenizer.decode(ids[:max_tokens]), len(ids), True)


def build_judge_messages(
    config: GenRMConfig, question: str, candidate: CappedCandidate
) -> list[dict[str, str]]:
    """The judge's conversation: the rubric and the output format as system message, the question
    and the (capped) candidate as user message."""
    system = (
        "You grade a candidate answer to a question.\n\n"
        f"Rubric:\n{config.rubric}\n\n"
        "Judge correctness and usefulness only. Length earns nothing: give no credit for extra text, "
        f"repetition or padding. Candidates are limited to {config.max_candidate_tokens} tokens; a "
        "candidate cut at that limit is marked [TRUNCATED].\n"
        f"End with a last line of exactly this form: Score: N/{config.score_max}, "
        f"with N an integer from 0 to {config.score_max}."
    )
    marker = "\n[TRUNCATED]" if candidate.over_cap else ""
    user = f"Question:\n{question}\n\nCandidate answer:\n<candidate>\n{candidate.text}\n</candidate>{marker}"
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


_SCORE_LINE = re.compile(r"^\s*score\s*:\s*(\d+)\s*/\s*(\d+)\s*$", re.IGNORECASE)


def parse_judge_score(text: str, score_max: int) -> int | None:
    """N from a last non-empty line "Score: N/score_max" with 0 <= N <= score_max; else None."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    match = _SCORE_LINE.match(lines[-1])
    if match is None or int(match.group(2)) != score_max:
        return None
    score = int(match.group(1))
    return score if score <= score_max else None


class GenRM:
    """Scores (question, candidate) pairs with a judge engine.

    Args:
        judge: an engine (embedded or vLLM) serving the judge model.
        tokenizer: the judge's tokenizer (candidate capping and decoding the judgement).
        config: GenRMConfig.
        render_prompt: messages -> prompt token ids ending with the assistant header (the judge's
            chat renderer, e.g. ChatRenderer.render_prompt with no tools).
        sampling: the engine's SamplingConfig; its max_tokens must not exceed max_judge_tokens.
        decode_output: judge output ids -> text to parse (default: tokenizer.decode without special
            tokens; pass the renderer's parse_assistant content to drop a thinking judge's reasoning).

    `counts` tallies judged, unparsable and over_cap across calls, for the metrics log.
    """

    def __init__(
        self,
        judge: JudgeEngine,
        tokenizer: TextTokenizer,
        config: GenRMConfig,
        *,
        render_prompt: Callable[[list[dict[str, str]]], list[int]],
        sampling: Any,
        decode_output: Callable[[list[int]], str] | None = None,
    ) -> None:
        max_tokens = getattr(sampling, "max_tokens", None)
        if max_tokens is None or max_tokens > config.max_judge_tokens:
            raise ValueError(
                f"GenRM sampling.max_tokens is {max_tokens}; set it to at most max_judge_tokens "
                f"({config.max_judge_tokens}) so the judge's output is capped"
            )
        self.judge = judge
        self.tokenizer = tokenizer
        self.config = config
        self.render_prompt = render_prompt
        self.sampling = sampling
        self.decode_output = decode_output or (lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        self.counts: Counter[str] = Counter()
        self._calls = 0

    def score(self, questions: Sequence[str], candidates: Sequence[str]) -> list[Judgement]:
        """One judgement per (question, candidate), in order; one batched generate call."""
        if len(questions) != len(candidates):
            raise ValueError(f"{len(questions)} questions but {len(candidates)} candidates")
        capped = [cap_candidate(c, self.tokenizer, self.config.max_candidate_tokens) for c in candidates]
        prompts = []
        for i, (question, candidate) in enumerate(zip(questions, capped, strict=True)):
            ids = self.render_prompt(build_judge_messages(self.config, question, candidate))
            prompt = Sample(uid=f"genrm-{self._calls}-{i}")
            prompt.append(ids, generated=False)
            prompt.prompt_length = len(ids)
            prompts.append(prompt)
        self._calls += 1
        judged = self.judge.generate(prompts, self.sampling)
        if len(judged) != len(prompts):
            raise RuntimeError(f"judge engine returned {len(judged)} samples for {len(prompts)} prompts")
        results = []
        for sample, candidate in zip(judged, capped, strict=True):
            output = sample.tokens[sample.prompt_length :][: self.config.max_judge_tokens]
            text = self.decode_output(output)
            score = parse_judge_score(text, self.config.score_max)
            self.counts["judged"] += 1
            self.counts["over_cap"] += candidate.over_cap
            if score is None:
                self.counts["unparsable"] += 1
                reward = None
            else:
                penalty = self.config.over_cap_penalty if candidate.over_cap else 0.0
                reward = score / self.config.score_max - penalty
            results.append(Judgement(reward, score, candidate.over_cap, candidate.num_tokens, text))
        return results

    def score_samples(self, samples: Sequence[Sample]) -> list[Judgement]:
        """Judge trajectories: the question is the first user message, the candidate the last
        assistant message's content (its reasoning is not judged)."""
        questions, candidates = [], []
        for s in samples:
            users = [m for m in s.messages if m.get("role") == "user"]
            answers = [m for m in s.messages if m.get("role") == "assistant"]
            if not users or not answers:
                raise ValueError(f"sample {s.uid} needs a user message and an assistant answer to be judged")
            questions.append(str(users[0].get("content") or ""))
            candidates.append(str(answers[-1].get("content") or ""))
        return self.score(questions, candidates)


def stage_judge(cfg: GenRMConfig, ctx: StageContext) -> GenRM:
    """The judge of an `rl` stage: an embedded engine serving `cfg.judge` (a need of the stage or a
    model dir), greedy, output capped at max_judge_tokens, reasoning dropped before parsing."""
    path = ctx.inputs.get(cfg.judge) or Path(cfg.judge)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"stage {ctx.stage_id}: genrm.judge {cfg.judge!r} is neither a need of this stage nor a model dir"
        )
    tokenizer = load_tokenizer(model_tokenizer_dir(path))
    renderer = ChatRenderer(tokenizer)
    engine = EmbeddedEngine.from_pretrained(path, pad_token_id=renderer.pad_id)
    sampling = SamplingConfig(
        max_tokens=cfg.max_judge_tokens,
        temperature=0.0,
        stop_token_ids=(renderer.end_of_turn_id,),
        tool_call_token_ids=(renderer.tool_calls_end_id,),
    )
    return GenRM(
        engine,
        tokenizer,
        cfg,
        render_prompt=renderer.render_prompt,
        sampling=sampling,
        decode_output=lambda ids: renderer.parse_assistant(ids)["content"],
    )
