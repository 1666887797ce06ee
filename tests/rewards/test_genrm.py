"""GenRM: judge prompt, both length caps, score parsing, and unparsable judgements counted.

The tokenizer is a real byte-level BPE trained here in milliseconds. The judges are fakes that
inject faults a real judge can have: a bias for length, rambling past its output cap, a broken
score line.
"""

import re
from dataclasses import dataclass

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from posttrain.data.sample import Sample
from posttrain.rewards.genrm import GenRM, GenRMConfig, build_judge_messages, cap_candidate, parse_judge_score

CONCISE = "The answer is 42, because six times seven is 42."
FILLER = " Furthermore, it is worth noting at considerable length that this matters a great deal."


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([CONCISE, FILLER, "Score: 7/10", "Question: Candidate answer:"] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe)


@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 0.0


def render(tokenizer):
    return lambda messages: tokenizer.encode(
        "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>", add_special_tokens=False
    )


class FakeLengthBiasedJudge:
    """The fault a length cap exists for: scores one point per two words of candidate it can see."""

    def __init__(self, tokenizer, suffix: str = ""):
        self.tokenizer = tokenizer
        self.suffix = suffix
        self.seen: list[str] = []

    def generate(self, samples, sampling):
        for s in samples:
            prompt = self.tokenizer.decode(s.tokens)
            visible = re.search(r"<candidate>\n(.*)\n</candidate>", prompt, re.S).group(1)
            self.seen.append(visible)
            words = min(len(visible.split()) // 2, 10)
            out = self.tokenizer.encode(
                f"Looks long, so good.\nScore: {words}/10{self.suffix}", add_special_tokens=False
            )
            s.append(out[: sampling.max_tokens], generated=True, version=0)
            s.finish_reason = "stop"
        return samples


class FakeRamblingJudge:
    """Writes far past its output cap and only then gives a score."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, samples, sampling):
        for s in samples:
            s.append(
                self.tokenizer.encode(FILLER * 20 + "\nScore: 9/10", add_special_tokens=False), generated=True
            )
            s.finish_reason = "length"
        return samples


def make(tokenizer, judge, cap=16, judge_cap=64, penalty=1.0):
    cfg = GenRMConfig(
        rubric="Correct and concise.",
        max_candidate_tokens=cap,
        max_judge_tokens=judge_cap,
        over_cap_penalty=penalty,
    )
    return GenRM(
        judge, tokenizer, cfg, render_prompt=render(tokenizer), sampling=Sampling(max_tokens=judge_cap)
    )


def test_padded_candidate_containing_the_concise_one_does_not_outscore_it(tokenizer):
    concise_tokens = len(tokenizer.encode(CONCISE, add_special_tokens=False))
    judge = FakeLengthBiasedJudge(tokenizer)
    rm = make(tokenizer, judge, cap=concise_tokens + 4)
    padded = CONCISE + FILLER * 3
    concise_j, padded_j = rm.score(["What is 6 x 7?"] * 2, [CONCISE, padded])
    assert not concise_j.over_cap and padded_j.over_cap
    assert padded_j.candidate_tokens > concise_tokens + 4
    # the biased judge does prefer the longer text it sees, but the cap's penalty outweighs that
    assert padded_j.score > concise_j.score
    assert padded_j.reward <= concise_j.reward
    assert concise_j.reward == pytest.approx(concise_j.score / 10)


def test_text_past_the_cap_is_never_seen_so_more_padding_earns_nothing(tokenizer):
    judge = FakeLengthBiasedJudge(tokenizer)
    rm = make(tokenizer, judge, cap=12, penalty=0.0)
    a, b = rm.score(["q", "q"], [CONCISE + FILLER, CONCISE + FILLER * 10])
    assert judge.seen[0] == judge.seen[1]
    assert len(tokenizer.encode(judge.seen[0], add_special_tokens=False)) <= 12
    assert a.reward == b.reward and a.over_cap and b.over_cap


def test_judge_output_is_capped_and_a_cut_judgement_is_unparsable_not_zero(tokenizer):
    rm = make(tokenizer, FakeRamblingJudge(tokenizer), judge_cap=32)
    (j,) = rm.score(["q"], [CONCISE])
    assert j.reward is None and j.score is None
    assert len(tokenizer.encode(j.judge_text, add_special_tokens=False)) <= 32
    assert rm.counts["unparsable"] == 1 and rm.counts["judged"] == 1


def test_broken_score_lines_are_counted_and_excluded(tokenizer):
    rm = make(tokenizer, FakeLengthBiasedJudge(tokenizer, suffix="\nThanks!"), cap=64)
    results = rm.score(["q", "q"], [CONCISE, "42"])
    assert [r.reward for r in results] == [None, None]
    assert rm.counts["unparsable"] == 2
    good = make(tokenizer, FakeLengthBiasedJudge(tokenizer), cap=64)
    assert [r.reward for r in good.score(["q"], ["forty two"])] == [pytest.approx(0.1)]
    assert good.counts["unparsable"] == 0


@pytest.mark.parametrize(
    "text,expected",
    [
        ("fine\nScore: 7/10", 7),
        ("Score: 0/10\n\n", 0),
        ("  score : 10 / 10 ", 10),
        ("Score: 7/10\nmore text", None),
        ("Score: 11/10", None),
        ("Score: 7/5", None),
        ("Score: seven/10", None),
        ("Score: 7.5/10", None),
        ("", None),
    ],
)
def test_parse_judge_score(text, expected):
    assert parse_judge_score(text, 10) == expected


def test_judge_prompt_holds_rubric_question_and_marks_truncation(tokenizer):
    cfg = GenRMConfig(rubric="Cite the theorem.", max_candidate_tokens=5)
    capped = cap_candidate(CONCISE, tokenizer, 5)
    assert capped.over_cap and capped.num_tokens == len(tokenizer.encode(CONCISE, add_special_tokens=False))
    assert CONCISE.startswith(capped.text) and capped.text != CONCISE
    system, user = build_judge_messages(cfg, "Why 42?", capped)
    assert "Cite the theorem." in system["content"] and "Score: N/10" in system["content"]
    assert "Why 42?" in user["content"] and user["content"].endswith("[TRUNCATED]")
    whole = cap_candidate("42", tokenizer, 5)
    assert whole == ("42", len(tokenizer.encode("42", add_special_tokens=False)), False)


def test_sampling_must_cap_the_judge_output(tokenizer):
    cfg = GenRMConfig(rubric="r", max_judge_tokens=64)
    with pytest.raises(ValueError, match="max_tokens is 512; set it to at most max_judge_tokens \\(64\\)"):
        GenRM(
            FakeRamblingJudge(tokenizer),
            tokenizer,
            cfg,
            render_prompt=render(tokenizer),
            sampling=Sampling(512),
        )


def test_score_samples_reads_question_and_final_answer(tokenizer):
    judge = FakeLengthBiasedJudge(tokenizer)
    rm = make(tokenizer, judge, cap=64)
    s = Sample(
        uid="t",
        messages=[
            {"role": "user", "content": "What is 6 x 7?"},
            {"role": "assistant", "content": "Let me think", "tool_calls": []},
            {"role": "assistant", "content": "42 exactly"},
        ],
    )
    (j,) = rm.score_samples([s])
    assert judge.seen == ["42 exactly"] and j.score == 1
    with pytest.raises(ValueError, match="sample t2 needs a user message"):
        rm.score_samples([Sample(uid="t2")])
