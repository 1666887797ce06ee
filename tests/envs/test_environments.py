"""The RL environments played for real: shipped task families, real tools and sandboxes, the tiny K3
through the embedded engine. Scripted assistant turns (a family's own demonstration, or a wrong
answer) stand in for a trained policy where a test needs a particular turn; they are appended
exactly as an engine appends what it generated, and the environment acts on them."""

from __future__ import annotations

import json
import math
import random

import pytest

from data_recipes.agent_tasks import FAMILIES
from posttrain.data.chat import ChatRenderer
from posttrain.data.sample import Sample
from posttrain.engines import SamplingConfig
from posttrain.engines.testing import ScriptedTurns
from posttrain.envs.environments import (
    SUBMISSION_FEEDBACK,
    SUBMISSIONS,
    CodingEnvironment,
    Environment,
    EnvironmentConfig,
    GeneralEnvironment,
    HarnessConfig,
    PromptCountError,
    draw_in_turn,
    make_environment,
)
from posttrain.envs.sandbox import Sandbox
from posttrain.envs.tasks import TASK_FAMILIES, Episode, FinalState, TaskFamily
from posttrain.envs.tools import Tool


def sampling(renderer: ChatRenderer, max_tokens: int = 6) -> SamplingConfig:
    return SamplingConfig(
        max_tokens=max_tokens,
        stop_token_ids=(renderer.end_of_turn_id,),
        tool_call_token_ids=(renderer.tool_calls_end_id,),
        seed=0,
    )


def scripted(
    engine: ScriptedTurns, sample: Sample, renderer: ChatRenderer, message: dict, finish: str
) -> list[int]:
    """Make `message` the sample's next turn, as if the engine generated it; returns its ids."""
    ids = renderer.render_assistant(message)
    engine.script(sample, ids, finish)
    return ids


def write_file_turn(sample: Sample, content: str) -> dict:
    """An assistant turn that writes `content` to the file the agent task asks for."""
    call = {"path": sample.task["path"], "content": content}
    return {
        "role": "assistant",
        "reasoning_content": "Save it.",
        "content": "",
        "tool_calls": [
            {
                "id": "functions.write_file:0",
                "type": "function",
                "function": {"name": "write_file", "arguments": json.dumps(call)},
            }
        ],
    }


def first_turn(sample: Sample) -> dict:
    """The family's own first assistant turn for this prompt (its scripted demonstration)."""
    family = TASK_FAMILIES.get(sample.task["family"])()
    return next(family.demonstration(sample, Episode(family, sample, None)))


class PluginBugs(Environment):
    """A user's environment whose task families have the bugs a plug-in can have."""

    domain = "plugin-bugs"


@TASK_FAMILIES.register("plugin-bugs/verdict")
class Verdict(TaskFamily):
    """Its verify returns `verdict`, whatever a test sets it to."""

    name = "plugin-bugs/verdict"
    domain = "plugin-bugs"
    verdict: object = 1.0

    def make_toolset(self) -> dict:
        return {}

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        n = rng.randrange(10**6)
        return self.sample(f"{self.name}-{n}", effort, [{"role": "user", "content": f"Say {n}."}], {})

    def verify(self, sample: Sample, state: FinalState) -> float:
        return self.verdict  # the bug under test: anything a test sets

    def demonstration(self, sample: Sample, episode: Episode):
        yield episode.assistant("", content="ok")


@TASK_FAMILIES.register("plugin-bugs/prompt_dict")
class PromptDict(Verdict):
    name = "plugin-bugs/prompt_dict"

    def make_prompt(self, rng: random.Random, effort: str) -> Sample:
        return {"uid": "x", "messages": [{"role": "user", "content": "hi"}]}  # the bug: not a Sample


class Echo(Tool):
    name = "echo"
    description = "Echo the text."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    def execute(self, sandbox: Sandbox | None, text: str) -> str:
        return text


@TASK_FAMILIES.register("plugin-bugs/tool_key")
class ToolKey(Verdict):
    name = "plugin-bugs/tool_key"

    def make_toolset(self) -> dict:
        return {"echo_tool": Echo()}  # the bug: the prompt declares "echo", calls would say "echo_tool"


def test_a_toolset_keyed_otherwise_than_its_tools_names_is_an_error_naming_both(tmp_path, renderer):
    cfg = EnvironmentConfig(families=["plugin-bugs/tool_key"])
    with PluginBugs(renderer, cfg, sandbox_dir=tmp_path) as env:
        with pytest.raises(
            ValueError,
            match=r"task family plugin-bugs/tool_key: make_toolset offers tool 'echo' \(Echo\) under the "
            r"key 'echo_tool'; key it by its name",
        ):
            env.prompts("train", 1, seed=0)


@pytest.mark.parametrize("verdict", [5.0, -0.5, math.nan, None, "1.0"])
def test_a_verify_that_returns_no_reward_in_0_1_is_an_error_naming_the_family(
    tmp_path, renderer, tiny_k3_engine, monkeypatch, verdict
):
    monkeypatch.setattr(Verdict, "verdict", verdict)
    cfg = EnvironmentConfig(families=["plugin-bugs/verdict"])
    with PluginBugs(renderer, cfg, sandbox_dir=tmp_path) as env:
        sample = env.start(env.prompts("train", 1, seed=0)[0], uid="v/0", group="v", effort="high")
        engine = ScriptedTurns(tiny_k3_engine)
        scripted(engine, sample, renderer, {"role": "assistant", "content": "ok"}, "stop")
        with pytest.raises(ValueError) as error:
            env.play(engine, [sample], sampling(renderer))
    assert str(error.value) == (
        f"task family plugin-bugs/verdict: verify returned {verdict!r} for v/0; "
        "it must return a float in [0, 1]"
    )


def test_a_make_prompt_that_returns_no_sample_is_an_error_naming_the_family(tmp_path, renderer):
    cfg = EnvironmentConfig(families=["plugin-bugs/prompt_dict"])
    with PluginBugs(renderer, cfg, sandbox_dir=tmp_path) as env:
        with pytest.raises(
            TypeError, match=r"task family plugin-bugs/prompt_dict: make_prompt returned dict, not Sample"
        ):
            env.prompts("train", 1, seed=0)


def test_tool_calls_run_for_real_and_results_are_appended_never_rerendered(
    tmp_path, renderer, tiny_k3_engine
):
    cfg = EnvironmentConfig(families=["agent/order_total"], max_turns=2)
    with make_environment("agent", renderer, cfg, sandbox_dir=tmp_path) as env:
        prompt = env.prompts("train", 1, seed=3)[0]
        sample = env.start(prompt, uid="t/0", group="t", effort="high")
        assert sample.tokens == renderer.render_prompt(prompt.messages, prompt.tools, "high")
        engine = ScriptedTurns(tiny_k3_engine)
        turn = scripted(engine, sample, renderer, first_turn(sample), "tool_call")
        before = sample.tokens + turn
        env.play(engine, [sample], sampling(renderer))

    tool_messages = [m for m in sample.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_messages] == ["functions.search:0", "functions.search:1"]
    product = sample.task["values"]["product"]
    assert f"{product}: price" in tool_messages[0]["content"]  # the shipped catalog, searched for real
    appended = renderer.render_tool_results(tool_messages)
    assert sample.tokens[: len(before)] == before
    assert sample.tokens[len(before) : len(before) + len(appended)] == appended
    assert sample.loss_mask[len(before) : len(before) + len(appended)] == [0] * len(appended)
    # The engine sampled the second turn right after the appended assistant header.
    second = sample.response_length - len(turn) - len(appended)
    assert 1 <= second <= 6 and sample.loss_mask[-second:] == [1] * second
    assert sample.done and sample.reward == 0.0
    assert sample.finish_reason in ("stop", "length", "tool_call")


def test_a_call_sampled_without_an_id_ends_the_episode(tmp_path, renderer, tiny_k3_engine):
    """No tool message can answer a call without an id (the renderer refuses one), so the turn has
    no calls and the episode ends on it; a MOPD evaluation at temperature 1 crashed on this."""
    t = renderer.token_ids
    cfg = EnvironmentConfig(families=["agent/order_total"], max_turns=3)
    with make_environment("agent", renderer, cfg, sandbox_dir=tmp_path) as env:
        sample = env.start(env.prompts("train", 1, seed=3)[0], uid="n/0", group="n", effort="low")
        engine = ScriptedTurns(tiny_k3_engine)
        turn = [t["think_begin"], t["think_end"], t["tool_calls_begin"], t["tool_call_begin"]]
        turn += [t["tool_call_argument"], *renderer.encode('{"query": "x"}'), t["tool_call_end"]]
        engine.script(sample, turn + [t["tool_calls_end"]], "tool_call")
        env.play(engine, [sample], sampling(renderer))
    assert sample.done and sample.reward == 0.0
    assert [m["role"] for m in sample.messages][-1] == "assistant"
    assert "tool_calls" not in sample.messages[-1]


def test_agent_is_scored_on_the_sandbox_files_it_wrote(tmp_path, renderer, tiny_k3_engine):
    cfg = EnvironmentConfig(families=["agent/staff_office"], max_turns=1)
    with make_environment("agent", renderer, cfg, sandbox_dir=tmp_path) as env:
        prompts = env.prompts("train", 2, seed=0)
        samples = [env.start(p, uid=f"w/{i}", group=f"w{i}", effort="low") for i, p in enumerate(prompts)]
        right, wrong = samples
        engine = ScriptedTurns(tiny_k3_engine)
        for sample, content in ((right, right.task["answer"]), (wrong, "Atlantis")):
            scripted(engine, sample, renderer, write_file_turn(sample, content), "tool_call")
        env.play(engine, samples, sampling(renderer))
        assert env.sandboxes.lent == 0 and env.sandboxes.created == 2
    assert (right.reward, wrong.reward) == (1.0, 0.0)
    # max_turns 1: the write ended the episode, no tool result was appended to the tokens.
    assert right.tokens[-1] == renderer.tool_calls_end_id


def test_hidden_tests_never_reach_the_prompt(tmp_path, renderer):
    with make_environment("coding", renderer, EnvironmentConfig(), sandbox_dir=tmp_path) as env:
        prompts = env.prompts("eval", 12, seed=0)
        for prompt in prompts:
            text = renderer.decode(env.start(prompt, uid="h", group="h", effort="max").tokens)
            assert prompt.task["tests"]
            assert "assert" not in text


def test_coding_submissions_are_limited_and_failures_get_feedback_without_tests(
    tmp_path, renderer, tiny_k3_engine
):
    cfg = EnvironmentConfig(families=["coding/write_function"], max_submissions=2, max_turns=3)
    with make_environment("coding", renderer, cfg, sandbox_dir=tmp_path) as env:
        wrong, right = (
            env.start(p, uid=f"c/{i}", group=f"c{i}", effort="low")
            for i, p in enumerate(env.prompts("train", 2, seed=1))
        )
        name = wrong.task["function"]
        engine = ScriptedTurns(tiny_k3_engine)
        scripted(
            engine,
            wrong,
            renderer,
            {"role": "assistant", "content": f"```python\ndef {name}(x):\n    return None\n```"},
            "stop",
        )
        scripted(engine, right, renderer, first_turn(right), "stop")
        env.play(engine, [wrong, right], sampling(renderer))

    assert right.reward == 1.0 and right.metrics[SUBMISSIONS] == 1.0
    assert wrong.reward == 0.0 and wrong.metrics[SUBMISSIONS] == 2.0
    feedback = [m["content"] for m in wrong.messages if m["role"] == "user"][-1]
    assert feedback == SUBMISSION_FEEDBACK.format(left=1, s="")
    text = renderer.decode(wrong.tokens)
    assert feedback in text
    assert not any(test in text for test in wrong.task["tests"])


def test_harness_rotates_system_prompts_and_tool_sets_per_prompt(tmp_path, renderer):
    harness = HarnessConfig(system_prompts=["Be brief.", "Think, then act."], tool_sets=[[], ["read_file"]])
    cfg = EnvironmentConfig(harness=harness)
    with make_environment("agent", renderer, cfg, sandbox_dir=tmp_path) as env:
        prompts = env.prompts("train", 24, seed=0)
        again = env.prompts("train", 24, seed=0)
    assert [p.messages for p in prompts] == [p.messages for p in again]
    assert {p.messages[0]["content"] for p in prompts} == {"Be brief.", "Think, then act."}
    tool_sets = {tuple(t["function"]["name"] for t in p.tools) for p in prompts}
    assert tool_sets == {
        ("search", "calculator", "write_file"),
        ("search", "calculator", "write_file", "read_file"),
    }
    with pytest.raises(ValueError, match="unknown tool 'teleport'"):
        HarnessConfig(tool_sets=[["teleport"]])


def test_eval_prompts_are_excluded_from_training_prompts(tmp_path, renderer):
    with make_environment("general", renderer, EnvironmentConfig(), sandbox_dir=tmp_path) as env:
        held_out = env.prompts("eval", 20, seed=0)
        train = env.prompts("train", 40, seed=0, exclude=held_out)
    questions = {p.messages[-1]["content"] for p in held_out}
    assert not questions & {p.messages[-1]["content"] for p in train}
    # every shipped general family reaches training (40 prompts over a handful of families)
    general = {f for f in FAMILIES if f.startswith("general/")}
    assert general and {p.task["family"] for p in train} == general


def test_configuration_errors_name_the_fix(tmp_path, renderer):
    with pytest.raises(ValueError, match="only the coding environment"):
        make_environment("general", renderer, EnvironmentConfig(max_submissions=3), sandbox_dir=tmp_path)
    with pytest.raises(ValueError, match="add a `genrm:` block"):
        make_environment("general", renderer, EnvironmentConfig(reward="genrm"), sandbox_dir=tmp_path)
    with pytest.raises(ValueError, match="belongs to domain 'coding'"):
        make_environment(
            "agent", renderer, EnvironmentConfig(families=["coding/fix_function"]), sandbox_dir=tmp_path
        )


def test_an_unknown_family_names_the_nearest_and_the_domains_families_not_every_family():
    # Before: "(registered: agent/desks_per_floor, ..., general/visual_cost)", all 14 of 3 domains.
    agent = sorted(name for name, family in TASK_FAMILIES.items() if family.domain == "agent")
    with pytest.raises(ValueError) as error:
        make_environment("agent", None, EnvironmentConfig(families=["agent/order_cots"]))
    assert str(error.value) == (
        "agent: families: unknown task family 'agent/order_cots'; did you mean 'agent/order_cost'? "
        f"(the agent domain's: {', '.join(agent)})"
    )


def test_a_family_listed_twice_is_an_error_not_a_double_share_of_the_prompts():
    # Before: [lookup, ordering, lookup] drew 20 lookup prompts of 30, silently.
    with pytest.raises(ValueError, match=r"^general: families: general/lookup listed more than once; "):
        make_environment(
            "general",
            None,
            EnvironmentConfig(families=["general/lookup", "general/ordering", "general/lookup"]),
        )


def test_sandboxes_given_back_are_kept_for_the_next_batch(tmp_path, renderer, tiny_k3_engine):
    # More episodes hold a sandbox at once than the 32 a pool used to keep: the next batch (an
    # iteration after an evaluation, the after-evaluation after training) starts none of its own.
    cfg = EnvironmentConfig(families=["agent/staff_office"], max_turns=1)
    with make_environment("agent", renderer, cfg, sandbox_dir=tmp_path) as env:
        prompts = env.prompts("train", 20, seed=0)
        engine = ScriptedTurns(tiny_k3_engine)
        for batch in range(2):
            samples = [
                env.start(p, uid=f"b{batch}/{i}/{k}", group=f"b{batch}/{i}", effort="low")
                for i, p in enumerate(prompts)
                for k in range(2)
            ]
            for sample in samples:
                scripted(engine, sample, renderer, write_file_turn(sample, "Atlantis"), "tool_call")
            env.play(engine, samples, sampling(renderer))
            assert env.sandboxes.lent == 0 and env.sandboxes.created == 40
            assert all(s.done and s.reward == 0.0 for s in samples)


def test_asking_for_more_distinct_prompts_than_exist_names_the_key(tmp_path, renderer):
    # Before: "lower the prompt count", which named none of the stage file's several counts.
    cfg = EnvironmentConfig(families=["coding/fix_function"])
    with make_environment("coding", renderer, cfg, sandbox_dir=tmp_path) as env:
        with pytest.raises(ValueError, match=r"400 were asked for; lower rollout\.prompts to at most 165$"):
            env.prompts("train", 400, seed=0, key="rollout.prompts")  # the family has 165


def test_an_impossible_prompt_count_fails_once_new_prompts_stop_coming(tmp_path, renderer, monkeypatch):
    # Before: a count of a million drew 50 million prompts of a family that has three (minutes to
    # hours) before saying so; now it stops after a run of draws that brought no new question.
    draws = 0

    def three_questions(self: Verdict, rng: random.Random, effort: str) -> Sample:
        nonlocal draws
        draws += 1
        assert draws <= 3000, "still drawing long after the family ran out of questions"
        n = rng.randrange(3)
        return self.sample(f"{self.name}-{n}", effort, [{"role": "user", "content": f"Say {n}."}], {})

    monkeypatch.setattr(Verdict, "make_prompt", three_questions)
    cfg = EnvironmentConfig(families=["plugin-bugs/verdict"])
    with PluginBugs(renderer, cfg, sandbox_dir=tmp_path) as env:
        with pytest.raises(ValueError) as error:
            env.prompts("train", 10**6, seed=0, key="rollout.prompts")
        assert env.prompts("train", 3, seed=0, key="rollout.prompts")  # what the message offers
    assert str(error.value) == (
        "plugin-bugs: only 3 distinct train prompts could be drawn from ['plugin-bugs/verdict'] (the "
        "last 1000 draws brought no new one), 1000000 were asked for; lower rollout.prompts to at most 3"
    )


def test_the_prompt_source_built_alone_draws_what_the_environment_draws(tmp_path, renderer):
    """Reading a stage file makes the stage's draws through `Environment.prompt_source` (no
    renderer, no sandboxes): the same families, harness and prompts as the environment's own."""
    cfg = EnvironmentConfig(harness={"tool_sets": [[], ["shell"]]})
    source = CodingEnvironment.prompt_source(cfg)
    with make_environment("coding", renderer, cfg, sandbox_dir=tmp_path) as env:
        assert source.family_names == env.family_names
        held_out = env.prompts("eval", 12, seed=3)
        drawn = [env.prompts("eval", 12, seed=3), env.prompts("train", 20, seed=5, exclude=held_out)]
    alone = [source.prompts("eval", 12, seed=3), source.prompts("train", 20, seed=5, exclude=held_out)]
    assert [[p.messages for p in ps] for ps in alone] == [[p.messages for p in ps] for ps in drawn]
    assert [[p.tools for p in ps] for ps in alone] == [[p.tools for p in ps] for ps in drawn]

    class OwnDraws(CodingEnvironment):  # a plug-in environment with prompts of its own
        def prompts(self, *args, **kwargs):
            return []

    assert OwnDraws.prompt_source(cfg) is None  # its draws are not the base's: not checked ahead


def test_domains_drawn_in_turn_stop_at_the_first_whose_families_run_out(tmp_path, renderer):
    """Before: MOPD drew its domains one after another, so a count of 10^5 prompts a step made
    `plan` draw general's 3.2 million prompts (six minutes) before agent's families ran out. Drawn
    in turn, general draws one prompt for each of coding's, and coding's error ends the draw."""
    general = GeneralEnvironment.prompt_source(EnvironmentConfig())
    coding = CodingEnvironment.prompt_source(EnvironmentConfig(families=["coding/fix_function"]))
    drawn: list[Sample] = []

    def counted(draws):
        for prompt in draws:
            drawn.append(prompt)
            yield prompt

    with pytest.raises(PromptCountError) as caught:
        draw_in_turn(
            {
                "general": counted(general.draws("train", 10**6, 0, key="k")),
                "coding": coding.draws("train", 10**6, 0, key="k"),
            }
        )
    assert caught.value.split == "train" and caught.value.drawn == 165 and caught.value.count == 10**6
    assert len(drawn) == 166  # one per coding prompt, and the one of the round that ended it
    together = draw_in_turn({"general": general.draws("eval", 30, 2), "coding": coding.draws("eval", 20, 2)})
    assert {d: [p.messages for p in ps] for d, ps in together.items()} == {
        "general": [p.messages for p in general.prompts("eval", 30, 2)],
        "coding": [p.messages for p in coding.prompts("eval", 20, 2)],
    }  # the same prompts as drawn alone

    class OwnDraws(CodingEnvironment):  # a plug-in environment with prompts of its own
        def prompts(self, *args, **kwargs):
            return ["its own"]

    with OwnDraws(renderer, EnvironmentConfig(), sandbox_dir=tmp_path) as env:
        assert list(env.draws("train", 5, 0)) == ["its own"]
