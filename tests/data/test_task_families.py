"""Task families: prompts carry hidden verification data that never reaches the prompt, verifiers
reject wrong final states, tools really run (calculator, documents, sandboxed files and Python)."""

from __future__ import annotations

import json
import random
import re

import pytest

import data_recipes  # noqa: F401  (registers the shipped families and the calculator tool)
from data_recipes.agent_tasks import FAMILIES
from data_recipes.agent_tasks.tools import calculate
from posttrain.data.sample import DOMAINS, EFFORTS
from posttrain.envs.tasks import TASK_FAMILIES, Episode, FinalState


def test_every_shipped_family_is_registered_and_covers_the_domains():
    assert set(FAMILIES) <= set(TASK_FAMILIES)
    assert {TASK_FAMILIES.get(name).domain for name in FAMILIES} == set(DOMAINS)


@pytest.mark.parametrize("name", FAMILIES)
def test_prompt_contract_and_hidden_data(name):
    family = TASK_FAMILIES.get(name)()
    for index, effort in enumerate(EFFORTS):
        sample = family.make_prompt(random.Random(f"contract:{index}"), effort)
        assert (sample.domain, sample.effort, sample.task["family"]) == (family.domain, effort, name)
        assert [m["role"] for m in sample.messages] == ["system", "user"]
        assert sample.tools == family.tools and sample.tokens == []
        prompt = json.dumps(sample.messages)
        for test in sample.task.get("tests", []):
            assert test not in prompt
        if "path" in sample.task:
            assert f"{sample.task['answer']}." not in prompt and f" {sample.task['answer']} " not in prompt
    again = family.make_prompt(random.Random("contract:0"), "low")
    assert again == family.make_prompt(random.Random("contract:0"), "low")


@pytest.mark.parametrize("name", FAMILIES)
def test_wrong_final_states_score_zero(name):
    family = TASK_FAMILIES.get(name)()
    sample = family.make_prompt(random.Random("wrong"), "high")
    assert family.verify(sample, FinalState(answer="I do not know.")) == 0.0
    if "path" in sample.task:
        assert family.verify(sample, FinalState(files={sample.task["path"]: "0"})) == 0.0
        right = FinalState(files={sample.task["path"]: sample.task["answer"] + "\n"})
        assert family.verify(sample, right) == 1.0
    elif "answer" in sample.task:
        assert family.verify(sample, FinalState(answer=f" {sample.task['answer'].upper()}.")) == 1.0


def test_coding_verifier_runs_hidden_tests_in_a_sandbox():
    family = TASK_FAMILIES.get("coding/write_function")()
    sample = next(
        s
        for s in (family.make_prompt(random.Random(f"scale:{i}"), "low") for i in range(200))
        if s.task["function"] == "scale"
    )
    k, c = sample.task["values"]["k"], sample.task["values"]["c"]
    right = f"```python\ndef scale(x):\n    return {k} * x + {c}\n```"
    assert family.verify(sample, FinalState(answer=right)) == 1.0
    assert family.verify(sample, FinalState(answer=right.replace("+", "-"))) == 0.0
    assert family.verify(sample, FinalState(answer="```python\nraise SystemExit(0)\n```")) == 0.0
    assert (
        family.verify(sample, FinalState(answer=right.replace("```python\n", "").replace("```", ""))) == 1.0
    )


def test_calculator_is_exact_and_refuses_code():
    assert calculate("17*23+5") == "396"
    assert calculate("84/4") == "21"
    assert calculate("1/3") == "0.333333"
    assert calculate("2**64") == str(2**64)
    assert calculate("-(3 - 10) % 4") == "3"
    for bad, message in (
        ("__import__('os').system('true')", "only numbers"),
        ("1/0", "division by zero"),
        ("2**1000", "exponent"),
        ("3 +", "cannot parse"),
    ):
        with pytest.raises(ValueError, match=message):
            calculate(bad)


def test_episode_runs_tools_and_reports_errors_as_results():
    family = TASK_FAMILIES.get("agent/staff_office")()
    sample = family.make_prompt(random.Random("episode"), "high")
    with family.open_sandbox() as sandbox:
        episode = Episode(family, sample, sandbox)
        turn = episode.assistant(
            "try things",
            calls=[
                ("search", {"query": "Dana Ruiz"}),
                ("teleport", {}),
                ("write_file", {"path": "../escape.txt", "content": "x"}),
                ("write_file", {"path": "notes/a.txt", "content": "Oslo"}),
            ],
        )
        turn["tool_calls"].append(
            {
                "id": "functions.search:4",
                "type": "function",
                "function": {"name": "search", "arguments": "{bad"},
            }
        )
        results = [m["content"] for m in episode.step(turn)]
        assert results[0] == "staff.txt: Dana Ruiz works in the Logistics team at the Oslo office."
        assert results[1].startswith("error: unknown tool 'teleport'")
        assert results[2].startswith("error:")
        assert results[3] == "wrote 4 characters to notes/a.txt"
        assert results[4].startswith("error: arguments are not valid JSON")
        assert episode.results() == results
        assert [m["tool_call_id"] for m in episode.messages[-5:]] == [
            f"functions.{n}:{i}"
            for i, n in enumerate(["search", "teleport", "write_file", "write_file", "search"])
        ]
        assert not episode.done
        episode.step(episode.assistant("done", content="Oslo"))
        state = episode.final_state()
    assert episode.done and state.files == {"notes/a.txt": "Oslo"}
    assert state.answer == "Oslo" and state.tool_calls == 5
    with pytest.raises(RuntimeError, match="already ended"):
        episode.step({"role": "assistant", "content": "more"})


def test_a_resumed_episode_continues_the_call_numbering():
    family = TASK_FAMILIES.get("general/arithmetic")()
    sample = family.make_prompt(random.Random("resume"), "low")
    with family.open_sandbox() as sandbox:
        assert sandbox is None
        first = Episode(family, sample, sandbox)
        first.step(first.assistant("compute", calls=[("calculator", {"expression": "1+1"})]))
        sample.messages = first.messages
        resumed = Episode(family, sample, sandbox)
    call = resumed.assistant("again", calls=[("calculator", {"expression": "2+2"})])["tool_calls"][0]
    assert call["id"] == "functions.calculator:1"


def test_lookup_answer_is_the_asked_persons_fact_and_max_thinking_restates_it():
    family = TASK_FAMILIES.get("general/lookup")()
    for index in range(20):
        sample = family.make_prompt(random.Random(f"lookup:{index}"), "max")
        question = sample.messages[1]["content"]
        people, values, asked = sample.task["people"], sample.task["values"], sample.task["asked"]
        assert len(set(values)) == len(values) and asked in people  # one right answer, no tie
        assert sample.task["answer"] == values[people.index(asked)]
        assert asked in question.split(".")[-1]  # the question names the person asked about
        for name, value in zip(people, values, strict=True):
            assert name in question and value in question
        thinking = family.demonstrate(sample)[2]["reasoning_content"]
        assert thinking.count(asked) >= 3  # the plan, the restated facts, the conclusion
    low = family.demonstrate(family.make_prompt(random.Random("lookup:0"), "low"))[2]["reasoning_content"]
    assert low.startswith("The question asks for") and len(low) < len(thinking)


@pytest.mark.parametrize("name", ["agent/order_cost", "general/unit_cost", "general/unit_convert"])
def test_route_choice_families_demonstrate_two_routes_that_part_at_one_token(name):
    # The choice RL can select (issue #21): the calculator, or the product stated in the thinking,
    # drawn from the uid at every effort; both demonstrations verify (generate_trajectory raises on
    # one that does not), and the thinking is the same text up to the expression.
    from data_recipes.agent_tasks.generate import generate_trajectory

    assert name in FAMILIES and not TASK_FAMILIES.get(name).opt_in  # in the default run
    calculator = 0
    for index in range(60):
        record = generate_trajectory(name, index)
        calls = [c["function"]["name"] for m in record["messages"] for c in m.get("tool_calls") or []]
        thoughts = " ".join(m.get("reasoning_content") or "" for m in record["messages"])
        if "calculator" in calls:
            calculator += 1
            assert re.search(r"I compute \d+\*\d+ with the calculator\.", thoughts), thoughts
        else:
            q, price, product = map(int, re.search(r"I compute (\d+)\*(\d+) = (\d+)\.", thoughts).groups())
            assert q * price == product
        tools = [c for c in calls if c != "search"]  # order_cost looks the price up first
        routes = ([["calculator", "write_file"], ["write_file"]], [["calculator"], []])
        assert tools in routes[0 if name.startswith("agent") else 1]
    assert 0.35 <= calculator / 60 <= 0.65  # CALCULATOR_ROUTE_SHARE 0.5: both routes well sampled


def test_arithmetic_demonstrates_two_routes_that_part_after_the_expression():
    # general's second route choice (issue #21): one calculator call, or the result stated in the
    # thinking; the thinkings are the same text up to the expression. As unit_cost's, the calculator
    # route answers at low effort right after the result, with no thinking (the low budget).
    from data_recipes.agent_tasks.generate import generate_trajectory

    calculator = 0
    for index in range(60):
        record = generate_trajectory("general/arithmetic", index)
        messages, expression, answer = (
            record["messages"],
            record["task"]["expression"],
            record["task"]["answer"],
        )
        plan = messages[2]["reasoning_content"]
        if messages[2].get("tool_calls"):
            calculator += 1
            assert plan.startswith(f"The answer is {expression}; I will use the calculator.")
            assert messages[-1]["content"] == answer
            reading = messages[-1].get("reasoning_content") or ""
            assert (reading == "") == (record["effort"] == "low")
        else:
            assert plan.startswith(f"The answer is {expression} = {answer}.")
            assert messages[2]["content"] == answer and len(messages) == 3
    assert 0.35 <= calculator / 60 <= 0.65  # CALCULATOR_ROUTE_SHARE 0.5: both routes well sampled


def test_unit_cost_low_effort_calculator_route_answers_without_restating_the_result():
    # The low budget (b0 x 0.4 late in the run) sits a few tokens under a calculator episode that
    # restates the result, so the low specialist kept the failing mental route (bench/RESULTS.md):
    # at low effort the answer follows the calculator's result with no thinking; above low the
    # thinking still reads the result back.
    from data_recipes.agent_tasks.common import takes_tool_route

    family = TASK_FAMILIES.get("general/unit_cost")()
    rng = random.Random("unit_cost-low")
    for effort in ("low", "high", "max"):
        prompts = (family.make_prompt(rng, effort) for _ in range(50))
        sample = next(s for s in prompts if takes_tool_route(s.uid))
        final = family.demonstrate(sample)[-1]
        assert final["content"] == sample.task["answer"]
        reading = final.get("reasoning_content") or ""
        if effort == "low":
            assert reading == ""
        else:
            assert reading.startswith(f"The calculator gives {sample.task['answer']}.")


@pytest.mark.parametrize("name", ["coding/crate_cost", "coding/unit_convert", "coding/arithmetic"])
def test_coding_route_families_demonstrate_two_routes_and_their_tests_reject_a_wrong_product(name):
    # The coding route choices (issue #21): the code computes the product, or the thinking states
    # it and the code returns that number; both demonstrations verify (demonstrate raises on one
    # that does not), the two plans part where the stated one writes " = ", and a mistaken number
    # fails the hidden tests.
    from data_recipes.agent_tasks.generate import generate_trajectory, sft_prompt

    family = TASK_FAMILIES.get(name)()
    assert name in FAMILIES and not family.opt_in and family.domain == "coding"  # in the default run
    multiplies = 0
    for index in range(60):
        record = generate_trajectory(name, index)
        plan = record["messages"][2]["reasoning_content"]
        answer = record["messages"][-1]["content"]
        v = record["task"]["values"]
        expression = {
            "coding/crate_cost": f"{v.get('q')}*{v.get('p')}",
            "coding/unit_convert": f"{v.get('q')}*{v.get('factor')}",
            "coding/arithmetic": f"{v.get('a')}*{v.get('b')}+{v.get('c')}",
        }[name]
        total = eval(expression)  # the question's numbers (a*b+c, of the task's own values)
        code_route = re.search(rf"{re.escape(expression)} \w+; the code (multiplies|computes it)\.", plan)
        returned = re.search(r"return (.*)\n", answer).group(1)
        if code_route:
            multiplies += 1
            assert returned == ("n * " if "(n)" in answer else "") + expression.replace("*", " * ").replace(
                "+", " + "
            )
        else:
            assert f"{expression} = {total} " in plan
            assert returned == (f"n * {total}" if "(n)" in answer else str(total))
        sample = sft_prompt(name, index)
        wrong = answer.replace(f"return {returned}", f"return {returned} + 10")
        assert family.verify(sample, FinalState(answer=answer)) == 1.0
        assert family.verify(sample, FinalState(answer=wrong)) == 0.0
    assert 0.35 <= multiplies / 60 <= 0.65  # CALCULATOR_ROUTE_SHARE 0.5: both routes well sampled
