"""Verifiers: answer extraction and normalisation, and hidden unit tests behind an attempt limit,
run by a real subprocess runner."""

import pytest

from posttrain.data.sample import Sample
from rewards.verifiers import (
    TestRunResult,
    UnitTestVerifier,
    answers_match,
    exact_match_reward,
    exact_match_sample,
    extract_answer,
    normalize_answer,
    python_subprocess_runner,
)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so x = 3, hence \\boxed{\\frac{1}{2}} and \\boxed{7}", "7"),
        ("\\boxed{\\text{a}^{2}}", "\\text{a}^{2}"),
        ("Reasoning...\nAnswer: Paris\n", "Paris"),
        ("answer: 1\nFinal answer: 2", "2"),
        ("**Answer:** 12", "12"),
        ("42", "42"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("  The   Eiffel\tTower. ", "the eiffel tower"),
        ("$\\text{Paris}$", "paris"),
        ("1,000,000", "1000000"),
        ("1, 2, 3", "1, 2, 3"),
        ("12\\,345", "12345"),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    "a,b,same",
    [
        ("3.50", "7/2", True),
        ("\\frac{7}{2}", "3.5", True),
        ("-0.25", "-1/4", True),
        ("1,000", "1000", True),
        ("PARIS", "paris.", True),
        ("0.333", "1/3", False),
        ("12", "21", False),
        ("1/0", "1/0", True),
        ("1/0", "2/0", False),
    ],
)
def test_answers_match(a, b, same):
    assert answers_match(a, b) is same


def test_exact_match_reward_and_sample():
    assert exact_match_reward("work...\nAnswer: 1,024", "1024") == 1.0
    assert exact_match_reward("\\boxed{0.5}", ["1/3", "1/2"]) == 1.0
    assert exact_match_reward("Answer: 5", "6") == 0.0
    with pytest.raises(ValueError, match="at least one reference"):
        exact_match_reward("5", [])
    s = Sample(
        uid="q1",
        task={"answer": "42"},
        messages=[{"role": "user", "content": "6*7?"}, {"role": "assistant", "content": "\\boxed{42}"}],
    )
    assert exact_match_sample(s) == 1.0
    assert exact_match_sample(Sample(uid="q2", task={"answer": "1"})) == 0.0
    with pytest.raises(ValueError, match="sample q3: task has no 'answer'"):
        exact_match_sample(Sample(uid="q3"))


HIDDEN = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]


def test_hidden_tests_run_in_a_subprocess_and_attempts_are_limited():
    verifier = UnitTestVerifier(HIDDEN, python_subprocess_runner(timeout_s=20), max_attempts=2)
    first = verifier.submit("def add(a, b):\n    return a + b if isinstance(a, int) else None\n")
    assert (first.accepted, first.attempt, first.passed, first.total) == (True, 1, 2, 3)
    assert (
        first.reward == pytest.approx(2 / 3) and first.feedback == "2/3 hidden tests passed; 1 attempts left"
    )
    second = verifier.submit("def add(a, b):\n    return a + b\n")
    assert (second.passed, second.reward) == (3, 1.0)
    third = verifier.submit("def add(a, b):\n    return a + b\n")
    assert not third.accepted and third.reward == 0.0 and "refused" in third.feedback
    assert verifier.attempts == 2 and verifier.reward == 1.0
    for sub in (first, second, third):
        assert not any(test in sub.feedback or "add(" in sub.feedback for test in HIDDEN)
    assert "assert" not in repr(verifier)


def test_runner_counts_crashes_and_forged_reports_as_failures():
    run = python_subprocess_runner(timeout_s=20)
    assert run("raise SystemExit(3)", HIDDEN).passed == 0
    assert run("def add(a, b): return a + b\nimport os\nos._exit(0)\n", HIDDEN).passed == 0
    forged = 'print(\'{"passed": 99, "failures": []}\')\ndef add(a, b): return None\n'
    assert run(forged, HIDDEN) == TestRunResult(
        0, 3, "test 0: AssertionError; test 1: AssertionError; test 2: AssertionError"
    )


def test_runner_timeout():
    run = python_subprocess_runner(timeout_s=1.0)
    result = run("while True:\n    pass\n", HIDDEN)
    assert result.passed == 0 and "timed out" in result.detail


def test_verifier_argument_errors():
    run = python_subprocess_runner()
    with pytest.raises(ValueError, match="at least one hidden test"):
        UnitTestVerifier([], run, 1)
    with pytest.raises(ValueError, match="max_attempts must be >= 1"):
        UnitTestVerifier(HIDDEN, run, 0)
