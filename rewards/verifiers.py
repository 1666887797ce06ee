"""Deterministic verifiers: normalised exact-answer match for reasoning questions, and hidden
unit tests with a limited number of submissions for coding tasks (K3 spec section 2.2).

Hidden tests live in the verifier, never in anything the policy reads: a submission's feedback
says how many tests passed, not which or what they assert.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple

from posttrain.data.sample import Sample
from posttrain.rewards_registry import REWARDS


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


_ANSWER_LINE = re.compile(r"answer\s*\**\s*[:：]\s*\**\s*(.+)", re.IGNORECASE)


def extract_answer(text: str) -> str:
    """The final answer in a completion: the last \\boxed{...}; else what follows the last
    "Answer:" (also "Final answer:", "**Answer:**") on its line; else the whole text."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    matches = [m.group(1) for line in text.splitlines() if (m := _ANSWER_LINE.search(line))]
    return matches[-1] if matches else text


_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(,\d{3})+(\.\d+)?$")
_FRAC = re.compile(r"^([-+]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")


def normalize_answer(text: str) -> str:
    """Case, whitespace, surrounding $...$ and \\text{...}, trailing period and thousands
    separators removed: "  The $\\text{Paris}$. " -> "the paris"; "1,000" -> "1000"."""
    s = text.strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\,", "").replace("\\!", "").replace("\\ ", " ")
    s = s.strip().strip("$").strip()
    s = s.rstrip(".").strip()
    s = re.sub(r"\s+", " ", s).lower()
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    return s


def parse_number(text: str) -> Fraction | None:
    """An exact number from a normalised answer: integers, decimals, a/b and \\frac{a}{b}."""
    s = text.replace(" ", "")
    frac = _FRAC.match(s)
    if frac:
        s = f"{frac.group(1)}{frac.group(2)}/{frac.group(3)}"
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(prediction: str, reference: str) -> bool:
    """Normalised equality; numbers compare by exact value ("3.50" == "7/2" == "\\frac{7}{2}")."""
    a, b = normalize_answer(prediction), normalize_answer(reference)
    if a == b:
        return True
    x, y = parse_number(a), parse_number(b)
    return x is not None and y is not None and x == y


@REWARDS.register("exact_match")
def exact_match_reward(completion: str, reference: str | Sequence[str]) -> float:
    """1.0 if the answer extracted from `completion` matches the reference (or any of several
    accepted references), else 0.0."""
    references = [reference] if isinstance(reference, str) else list(reference)
    if not references:
        raise ValueError("exact_match_reward needs at least one reference answer")
    answer = extract_answer(completion)
    return 1.0 if any(answers_match(answer, r) for r in references) else 0.0


def exact_match_sample(sample: Sample, answer_key: str = "answer") -> float:
    """exact_match_reward of a trajectory's last assistant message against sample.task[answer_key]."""
    if answer_key not in sample.task:
        raise ValueError(f"sample {sample.uid}: task has no {answer_key!r} (keys: {sorted(sample.task)})")
    answers = [m for m in sample.messages if m.get("role") == "assistant"]
    completion = str(answers[-1].get("content") or "") if answers else ""
    return exact_match_reward(completion, sample.task[answer_key])


class TestRunResult(NamedTuple):
    """passed/total hidden tests; detail: the runner's own log, for the operator only."""

    __test__ = False  # a result record, not a pytest class

    passed: int
    total: int
    detail: str


TestRunner = Callable[[str, Sequence[str]], TestRunResult]


class Submission(NamedTuple):
    """accepted: the tests ran (False once attempts are exhausted); reward: passed / total (0 when
    refused); feedback: what the policy may be shown."""

    accepted: bool
    attempt: int
    passed: int
    total: int
    reward: float
    feedback: str


@REWARDS.register("unit_tests")
class UnitTestVerifier:
    """One episode's hidden unit tests behind a submission counter.

    runner(code, hidden_tests) runs the tests (in a sandbox, or `python_subprocess_runner`);
    at most `max_attempts` submissions are run, later ones are refused without running. The
    episode's reward is its last accepted submission's (the final state), 0 if none.
    """

    def __init__(self, hidden_tests: Sequence[str], runner: TestRunner, max_attempts: int) -> None:
        if not hidden_tests:
            raise ValueError("UnitTestVerifier needs at least one hidden test")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self._hidden_tests = tuple(hidden_tests)
        self._runner = runner
        self.max_attempts = max_attempts
        self.attempts = 0
        self.last: Submission | None = None

    def __repr__(self) -> str:
        tests, used = len(self._hidden_tests), f"{self.attempts}/{self.max_attempts}"
        return f"UnitTestVerifier({tests} hidden tests, {used} attempts)"

    def submit(self, code: str) -> Submission:
        if self.attempts >= self.max_attempts:
            return Submission(
                False,
                self.attempts,
                0,
                len(self._hidden_tests),
                0.0,
                f"submission refused: all {self.max_attempts} attempts used",
            )
        self.attempts += 1
        result = self._runner(code, self._hidden_tests)
        if result.total != len(self._hidden_tests):
            raise RuntimeError(
                f"test runner reported {result.total} tests for {len(self._hidden_tests)} hidden tests"
            )
        left = self.max_attempts - self.attempts
        self.last = Submission(
            True,
            self.attempts,
            result.passed,
            result.total,
            result.passed / result.total,
            f"{result.passed}/{result.total} hidden tests passed; {left} attempts left",
        )
        return self.last

    @property
    def reward(self) -> float:
        return 0.0 if self.last is None else self.last.reward


# The report line starts with a nonce read from stdin before the solution runs, so a solution that
# prints a fake report and exits early is not believed.
_HARNESS = """
import json, sys
def main(nonce):
    source = open(sys.argv[1]).read()
    tests = json.load(open(sys.argv[2]))
    passed, failures = 0, []
    try:
        namespace = {"__name__": "solution"}
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException as err:
        return nonce + json.dumps({"passed": 0, "failures": ["solution: " + type(err).__name__]})
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"hidden_test_{i}", "exec"), dict(namespace))
            passed += 1
        except BaseException as err:
            failures.append(f"test {i}: {type(err).__name__}")
    return nonce + json.dumps({"passed": passed, "failures": failures})
report = main(sys.stdin.readline().strip())
sys.stdout.flush()
print(report)
"""


def python_subprocess_runner(timeout_s: float = 10.0, python: str = sys.executable) -> TestRunner:
    """A runner that executes the code, then each hidden test (Python statements, e.g. asserts)
    in a fresh copy of its namespace, in one isolated subprocess (`python -I`). A timeout, a crash
    or a missing report counts as 0 passed. It isolates the process, not the machine, and code
    running in the same interpreter can still inspect the harness: untrusted code at scale goes
    through the sandbox's runner with the verifier outside the sandbox."""

    def run(code: str, tests: Sequence[str]) -> TestRunResult:
        with tempfile.TemporaryDirectory(prefix="unit-tests-") as tmp:
            solution, suite, harness = (
                Path(tmp, "solution.py"),
                Path(tmp, "tests.json"),
                Path(tmp, "harness.py"),
            )
            solution.write_text(code)
            suite.write_text(json.dumps(list(tests)))
            harness.write_text(_HARNESS)
            nonce = secrets.token_hex(16)
            try:
                proc = subprocess.run(
                    [python, "-I", str(harness), str(solution), str(suite)],
                    cwd=tmp,
                    input=nonce + "\n",
                    capture_output=True,
                    text=True,
                    timeout=timeout_s,
                )
            except subprocess.TimeoutExpired:
                return TestRunResult(0, len(tests), f"timed out after {timeout_s} s")
        lines = [line for line in proc.stdout.splitlines() if line.startswith(nonce)]
        if not lines:
            return TestRunResult(0, len(tests), f"no report (exit {proc.returncode}): {proc.stderr[-500:]}")
        report = json.loads(lines[-1][len(nonce) :])
        passed = min(max(int(report["passed"]), 0), len(tests))
        return TestRunResult(passed, len(tests), "; ".join(report["failures"]))

    return run
